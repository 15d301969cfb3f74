#!/bin/bash
# One nvidia-h200 (bash call3.sh <commit>, with OUT set; about 7 minutes), session 29 call 3:
# the shared kernel's steps, now that it reserves no reduction scratch (2 KiB): 192 kv tokens
# a step (variant 14) and three 128-token slots in flight (15).
# (1) ptxas's report at block_kv=192 (registers, spills); (2) every CHECK_SHAPES entry with 14
# (against XLA, NaN/inf in unattended slots); (3) kernels alone, 14, 15 and the default (0):
# B=256 P=16K S=1 32/8, B=1024 P=16K S=1 32/8, B=1024 P=16K S=8 32/32.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call3; mkdir -p $R/check $R/time /tmp/ptxas
MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=/tmp/ptxas timeout 90 python3 \
  experiments/results/mosaic_gpu_check/s27/ptxas.py block_kv=192 > $R/ptxas.txt 2>&1
echo "ptxas rc=$?"; cp /tmp/ptxas/shared*.ptxas $R/ 2>/dev/null
grep -h "registers\|spill" /tmp/ptxas/shared*.ptxas | sort | uniq -c
timeout 170 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/check --attend_only \
  --check_shapes all --shapes '' --variants 14 --capacity=128 > $R/check/check.txt 2>&1
echo "check rc=$?"; grep -c '"error"' $R/check/results.jsonl
grep -o '"shape": \[[^]]*\].\{0,40\}\|"out_rel_l2": [^,]*\|"garbage_bitwise_equal": [a-z]*\|"nan": [a-z]*' \
  $R/check/results.jsonl | paste -sd' ' | fold -w 3000 | head -c 3000; echo
timeout 300 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/time --attend_only \
  --shapes 0,1,5 --variants 14,15,0 --capacity=128 > $R/time/time.txt 2>&1
echo "time rc=$?"; grep '^|' $R/time/time.txt
