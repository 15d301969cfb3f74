#!/bin/bash
# One nvidia-h200 (bash call.sh <commit>, with OUT set; about 5 minutes): after the producer
# warpgroup's removal from the private kernel, every CHECK_SHAPES entry against XLA (and NaN/inf
# in unattended slots), the default timed at B=256 P=16K S=1 32/8 and B=1024 P=1K 9 tokens
# 32/32 (against s24/call5's 130.6 and 158.0 µs), then the compiled private-kernel tests.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
R=$OUT/s26; mkdir -p $R/check
timeout 170 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/check --attend_only \
  --check_shapes all --shapes 0,8 --variants 0 --capacity=128 > $R/check/check.txt 2>&1
echo "check rc=$?"
timeout 130 python3 -m pytest tests/test_mosaic_gpu_kernels.py -q -x -p no:cacheprovider \
  -k "TestMosaicGpuKernels and not Interpret and private" > $R/pytest_hopper.txt 2>&1
echo "pytest rc=$?"
tar czf $OUT/s26.tgz -C $OUT s26 && rm -rf $R
