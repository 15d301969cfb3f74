#!/bin/bash
# One nvidia-h200 (bash call4.sh <commit>, with OUT set; about 7 minutes), session 24 call 4:
# every CHECK_SHAPES entry with the explicit-barrier private kernel (variant 12: XLA, NaN/inf in
# unattended slots); kernels alone at B=1024 P=1K MHA, B=256 P=16K S=1 and B=32 P=2K: the default
# (no page-table staging with the lane table, new), 7 (staged, the s23 default) and 12; then
# the compiled tests of q by row and the private knobs.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
R=$OUT/call4; mkdir -p $R/check
timeout 270 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/check --attend_only \
  --check_shapes all --shapes 8,0,4 --variants 12,0,7 --capacity=128 > $R/check/check.txt 2>&1
echo "check rc=$?"
tar czf $OUT/call4.tgz -C $OUT call4
timeout 100 python3 -m pytest -q tests/test_mosaic_gpu_kernels.py \
  -k "not Interpret and (q_read or knobs_change_nothing)" -p no:cacheprovider > $R/pytest_hopper.txt 2>&1
echo "pytest rc=$?"
tar czf $OUT/call4.tgz -C $OUT call4 && rm -rf $R
