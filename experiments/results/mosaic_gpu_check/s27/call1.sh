#!/bin/bash
# One nvidia-h200 (bash call1.sh <commit>, with OUT set; about 9 minutes), session 27 call 1:
# (1) every CHECK_SHAPES entry with the private kernel reading its lane-table plans a step
#     ahead (`private_plan_ahead`, variant 13; XLA, NaN/inf in unattended slots), then kernels
#     alone: 13 and the default (0) at B=1024 P=1K 9
#     and 65 tokens a row (32/32), B=256 P=16K S=1 and B=32 P=2K (32/8);
# (2) the CodeLlama-7B decode grid (B=1024/32, P=1K/16K) with plans read ahead.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call1; mkdir -p $R/check
timeout 310 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/check --attend_only \
  --check_shapes all --shapes 8,0,13,4 --variants 13,0 --capacity=128 > $R/check/check.txt 2>&1
echo "check rc=$?"
tar czf $OUT/call1.tgz -C $OUT call1
timeout 220 python3 -m experiments.throughput --preset=codellama_7b --impls=mosaic_gpu \
  --profile_kernels=16 --new_tokens=128 --modes=no_attention,tree --max_decode_s=0.4 \
  --batches=1024,32 --prefixes=1024,16384 --deadline_s=200 \
  --mosaic_gpu_knobs=private_plan_ahead=true --workdir=$R/grid > $R/grid.log 2>&1
echo "grid rc=$?"
tar czf $OUT/call1.tgz -C $OUT call1 && rm -rf $R
