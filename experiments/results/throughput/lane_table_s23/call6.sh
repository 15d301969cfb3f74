#!/bin/bash
# One nvidia-h200 (bash call6.sh <commit>, with OUT set; about 4 minutes), session 23 call 6: the
# lane table's order (whole chunks first, partial chunks last: fewer steps zero V rows) against
# the walk, alone at the decode step's MHA shapes (8, 9 and 65 private tokens a row) and at
# B=256 S=1 / S=128 (32/8), then the CodeLlama-7B decode step as in call 2.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call6; mkdir -p $R
timeout 150 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R --attend_only \
  --shapes 8,13,7,0,3 --variants 0,11 --capacity=128 > $R/check.txt 2>&1
echo "check rc=$?"
tar czf $OUT/call6.tgz -C $OUT call6
timeout 125 python3 -m experiments.throughput --preset=codellama_7b --impls=mosaic_gpu \
  --profile_kernels=12 --new_tokens=128 --modes=no_attention,tree --max_decode_s=0.4 \
  --batches=1024,32 --prefixes=1024,16384 --deadline_s=105 --workdir=$R/step > $R/step.log 2>&1
echo "step rc=$?"
tar czf $OUT/call6.tgz -C $OUT call6 && rm -rf $R
