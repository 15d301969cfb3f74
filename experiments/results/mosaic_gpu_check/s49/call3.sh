#!/bin/bash
# Session 49, call 3 (nvidia-h100-x1, warm): what call 1's timeouts cut: MHA at 9 tokens a row
# (shape 8) with chunk and token lanes, and token runs (variant 22) at 32/8, 128 tokens a row.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call3; mkdir -p $R
timeout 170 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/mha9 --attend_only \
  --shapes 8 --variants 0,20 --capacity=128 > $R/mha9.txt 2>&1; echo rc=$?
timeout 170 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/gqa_runs --attend_only \
  --shapes 16 --variants 22 --check_shapes 2 > $R/gqa_runs.txt 2>&1; echo rc=$?
