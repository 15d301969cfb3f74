#!/bin/bash
# One nvidia-h200 (bash call3.sh <commit>, with OUT set; about 5 minutes), session 24 call 3:
# the compiled (Hopper) Mosaic GPU kernel tests, which CI skips (q read by row among them),
# then every CHECK_SHAPES entry at the default (B=99 MHA folded again; MHA T=2 and T=128 read
# by row) and the S=128 target alone.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
R=$OUT/call3; mkdir -p $R/check
timeout 200 python3 -m pytest -q -x tests/test_mosaic_gpu_kernels.py -k "not Interpret" \
  -p no:cacheprovider > $R/pytest_hopper.txt 2>&1
echo "pytest rc=$?"
tar czf $OUT/call3.tgz -C $OUT call3
timeout 150 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/check --attend_only \
  --check_shapes all --shapes 3 --variants 0 --capacity=128 > $R/check/check.txt 2>&1
echo "check rc=$?"
tar czf $OUT/call3.tgz -C $OUT call3 && rm -rf $R
