#!/bin/bash
# Session 49, call 2 (nvidia-h100-x1, warm after call 1): the compiled token-lane and token-run
# tests, which call 1's pytest had no time left for.
export PYTHONPATH=. JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
mkdir -p $OUT
timeout 400 python3 -m pytest tests/test_mosaic_gpu_kernels.py -q -p no:cacheprovider --tb=short -rA \
  -k "not Interpret and (token_lanes or token_runs)" > $OUT/pytest.txt 2>&1
echo rc=$?; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/pytest.txt | tail -40
