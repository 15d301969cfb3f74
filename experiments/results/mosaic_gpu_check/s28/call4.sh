#!/bin/bash
# One nvidia-h200 (bash call4.sh <commit>, with OUT set; about 6 minutes), session 28 call 4:
# the overlap in FlashAttention-3's order (acc rescaled under the QK^T wgmma):
# (1) the compiled tests of the schedules; (2) ptxas's report (serialized wgmma?);
# (3) four CHECK_SHAPES entries with it (variant 13), then kernels alone, 13, the default (0)
#     and 14 (no turns): B=256 P=16K S=1 32/8, B=1024 P=16K 8 tokens 32/32.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call4; mkdir -p $R/check /tmp/ptxas
timeout 100 python3 -m pytest tests/test_mosaic_gpu_kernels.py -q -p no:cacheprovider --tb=short \
  -k "TestMosaicGpuKernels and not Interpret and shared_schedules" > $R/pytest.txt 2>&1
tail -4 $R/pytest.txt; grep -m3 "Mismatch\|Max abs\|Max rel" $R/pytest.txt
MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=/tmp/ptxas timeout 60 python3 \
  experiments/results/mosaic_gpu_check/s27/ptxas.py shared_overlap=true > $R/ptxas.txt 2>&1
echo "ptxas rc=$?"; grep -h "registers\|spill\|C7513" /tmp/ptxas/shared*.ptxas | sort | uniq -c
timeout 240 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/check --attend_only \
  --check_shapes 1,2,6,7 --shapes 0,5 --variants 13,0,14 --capacity=128 > $R/check/check.txt 2>&1
echo "check rc=$?"; grep '^|' $R/check/check.txt; grep -c '"error"' $R/check/results.jsonl
