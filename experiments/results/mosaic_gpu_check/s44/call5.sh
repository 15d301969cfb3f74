#!/bin/bash
# Session 44, call 5. One nvidia-h200 (bash call5.sh <commit>, with OUT set; up to 8 minutes).
# Every compiled test of the tree-attention kernels (TestMosaicGpuKernels on the GPU: each case
# through `attend`, which now takes its lane table from `for_step`), and the compiled conformance
# suite; call 1's selection hit its limit while compiling.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call5; mkdir -p $R
timeout 330 python3 -m pytest tests/test_mosaic_gpu_kernels.py -q -p no:cacheprovider --tb=short \
  -k "TestMosaicGpuKernels and not Interpret" > $R/pytest_kernels.txt 2>&1
echo "kernels rc=$?"; tail -4 $R/pytest_kernels.txt
timeout 130 python3 -m pytest tests/test_mosaic_gpu_conformance.py -q -p no:cacheprovider --tb=short \
  -k "not interpret and not Interpret" > $R/pytest_conformance.txt 2>&1
echo "conformance rc=$?"; tail -4 $R/pytest_conformance.txt
