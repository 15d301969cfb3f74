#!/bin/bash
# One nvidia-h200 (bash call3.sh <commit>, with OUT set; about 6 minutes), session 28 call 3:
# (1) the compiled tests of the shared kernel's schedules (tolerances: lse 1e-6 relative, out
#     one bf16 ulp); (2) every CHECK_SHAPES entry with the overlap (`shared_overlap`,
#     variant 13; XLA, NaN/inf in unattended slots), then kernels alone, 13 against the default
#     (0): B=256 P=16K S=1 32/8, B=1024 P=16K 8 tokens 32/32, B=32 P=2K 32/8.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call3; mkdir -p $R/check
timeout 100 python3 -m pytest tests/test_mosaic_gpu_kernels.py -q -p no:cacheprovider --tb=line \
  -k "TestMosaicGpuKernels and not Interpret and shared_schedules" 2>&1 | tail -8 | tee $R/pytest.txt
timeout 330 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/check --attend_only \
  --check_shapes all --shapes 0,5,4 --variants 13,0 --capacity=128 > $R/check/check.txt 2>&1
echo "check rc=$?"; grep '^|' $R/check/check.txt; grep -c '"error"' $R/check/results.jsonl
