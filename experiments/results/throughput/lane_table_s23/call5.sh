#!/bin/bash
# One nvidia-h200 (bash call5.sh <commit>, with OUT set; about 2 minutes), session 23 call 5: the
# private kernel with its lane table (the default) under the in-kernel profiler at the decode
# step's MHA shape (B=1024, P=1K, 9 private tokens a row), and the paged CHECK_SHAPES that
# call 3 could not build.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
R=$OUT/call5; mkdir -p $R
timeout 200 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R --attend_only \
  --check_shapes 0,5 --shapes 8 --capacity=128 --variants 0 --profile > $R/check.txt 2>&1
echo "check rc=$?"
rm -rf $R/profile/*/*.json 2>/dev/null
tar czf $OUT/call5.tgz -C $OUT call5 && rm -rf $R
