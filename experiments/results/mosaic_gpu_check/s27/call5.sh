#!/bin/bash
# One nvidia-h200 (bash call5.sh <commit>, with OUT set; about 7 minutes), session 27 call 5:
# the CodeLlama-7B decode grid (B=1024/32, P=1K/16K) at the final default (lane-table plans
# read a step ahead), repeating call 1's with the knob gone; then the compiled (Hopper)
# private-kernel tests.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call5; mkdir -p $R
timeout 220 python3 -m experiments.throughput --preset=codellama_7b --impls=mosaic_gpu \
  --profile_kernels=16 --new_tokens=128 --modes=no_attention,tree --max_decode_s=0.4 \
  --batches=1024,32 --prefixes=1024,16384 --deadline_s=200 --workdir=$R/grid > $R/grid.log 2>&1
echo "grid rc=$?"
tar czf $OUT/call5.tgz -C $OUT call5
timeout 150 python3 -m pytest tests/test_mosaic_gpu_kernels.py -q -x -p no:cacheprovider \
  -k "TestMosaicGpuKernels and not Interpret and private" > $R/pytest_hopper.txt 2>&1
echo "pytest rc=$?"; tail -3 $R/pytest_hopper.txt
tar czf $OUT/call5.tgz -C $OUT call5 && rm -rf $R
