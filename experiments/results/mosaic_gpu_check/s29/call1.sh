#!/bin/bash
# Session 29, call 1 (session 28 left it as s28/call5_not_run.sh, removed once run). One nvidia-h200 (bash call1.sh
# <commit>, with OUT set; about 7 minutes): q read in place at G = 2, 4, 8
# (`q_by_row_groups`, variant 13 of check_on_device.py):
# (1) the compiled by-row tests (bitwise the fold, G = 1, 2, 4, 8, T = 1, 2);
# (2) every CHECK_SHAPES entry with 13 (XLA, NaN/inf in unattended slots);
# (3) kernels alone, 13 against the default (0): B=256 P=16K S=1, B=1024 P=16K S=1,
#     B=256 P=16K S=128, B=32 P=2K (all 32/8: the kernel targets).
# If 13 is no slower anywhere, make q_by_row_groups the default.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call1; mkdir -p $R/check
timeout 150 python3 -m pytest tests/test_mosaic_gpu_kernels.py -q -p no:cacheprovider --tb=short \
  -k "TestMosaicGpuKernels and not Interpret and q_read_by_row" > $R/pytest.txt 2>&1
tail -4 $R/pytest.txt
timeout 380 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/check --attend_only \
  --check_shapes all --shapes 0,1,3,4 --variants 13,0 --capacity=128 > $R/check/check.txt 2>&1
echo "check rc=$?"; grep '^|' $R/check/check.txt; grep -c '"error"' $R/check/results.jsonl
