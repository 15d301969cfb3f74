#!/bin/bash
# One nvidia-h200 (bash call5.sh <commit>, with OUT set; about 4 minutes), session 29 call 5:
# FlashAttention-3's intra-warpgroup overlap again, now with one-sided turns (variant 16,
# shared_overlap): (1) kernels alone against the default (0) at B=256 and B=1024, P=16K, S=1,
# 32/8 (each checked against XLA and with NaN/inf in unattended slots first); (2) the
# compiled schedule test (unaligned, one-block and empty segments, against the default).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
R=$OUT/call5; mkdir -p $R/time
timeout 170 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/time --attend_only \
  --shapes 0,1 --variants 16,0 > $R/time/time.txt 2>&1
echo "time rc=$?"; grep '^|' $R/time/time.txt | grep -v xla
grep -o '"impl": "[^"]*", "\(out_rel_l2\|bitwise_equal\)": [^,]*\|"shared_segment_kernel_mosaic_gpu_kernel": [0-9.]*' \
  $R/time/results.jsonl
timeout 80 python3 -m pytest tests/test_mosaic_gpu_kernels.py -q -p no:cacheprovider --tb=line \
  -k "TestMosaicGpuKernels and not Interpret and shared_schedules" 2>&1 | tail -6
