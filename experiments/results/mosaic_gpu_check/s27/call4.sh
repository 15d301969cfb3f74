#!/bin/bash
# One nvidia-h200 (bash call4.sh <commit>, with OUT set; about 5 minutes), session 27 call 4:
# (1) ptxas's report of the kernels with the private kernel holding fewer registers through its
#     steps (`private_lean_registers`: the score tile's column index rebuilt per step, the first
#     merge window loaded after the steps), at the two shapes of call 3;
# (2) every CHECK_SHAPES entry with it (variant 13 at this commit), then kernels alone, 13 and
#     the default at B=1024 P=1K 9 and 65 tokens a row (32/32) and B=256 P=16K S=1 (32/8).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call4; mkdir -p $R/dump $R/check
MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=$R/dump timeout 100 python3 \
  experiments/results/mosaic_gpu_check/s27/ptxas.py private_lean_registers=true > $R/ptxas.txt 2>&1
echo "ptxas rc=$?"; rm -f $R/dump/*.mlir-passes.log $R/dump/*.ptx
grep -h "Used\|spill" $R/dump/*.ptxas
timeout 280 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/check --attend_only \
  --check_shapes all --shapes 8,13,0 --variants 13,0 --capacity=128 > $R/check/check.txt 2>&1
echo "check rc=$?"
tar czf $OUT/call4.tgz -C $OUT call4 && rm -rf $R
