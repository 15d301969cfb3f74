#!/bin/bash
# One nvidia-h200 (bash call2.sh <commit>, with OUT set; about 8 minutes), session 24 call 2:
# (1) every CHECK_SHAPES entry checked with the explicit-barrier private kernel (variant 12:
#     XLA, NaN/inf in unattended slots); then kernels alone, variants 12 (explicit barriers),
#     0 (default: G = 1 queries read by row) and 13 (q folded, before), at B=1024 P=1K 9 tokens
#     a row (MHA) and the 32/8 targets (B=256 P=16K S=1, B=32 P=2K, S=128);
# (2) the CodeLlama-7B decode grid (B=1024/32, P=1K/16K) with q read by row and the
#     explicit-barrier private kernel.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call2; mkdir -p $R/check
timeout 270 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/check --attend_only \
  --check_shapes all --shapes 8,0,4,3 --variants 12,0,13 --capacity=128 > $R/check/check.txt 2>&1
echo "check rc=$?"
tar czf $OUT/call2.tgz -C $OUT call2
timeout 200 python3 -m experiments.throughput --preset=codellama_7b --impls=mosaic_gpu \
  --profile_kernels=16 --new_tokens=128 --modes=no_attention,tree --max_decode_s=0.4 \
  --batches=1024,32 --prefixes=1024,16384 --deadline_s=185 \
  --mosaic_gpu_knobs=private_explicit_barriers=true --workdir=$R/grid > $R/grid.log 2>&1
echo "grid rc=$?"
tar czf $OUT/call2.tgz -C $OUT call2 && rm -rf $R
