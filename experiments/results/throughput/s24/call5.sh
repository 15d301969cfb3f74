#!/bin/bash
# Ready for a lent nvidia-h200 (bash call5_not_run.sh <commit>, with OUT set; about 8 minutes):
# the private kernel with a producer warpgroup (`private_producer`, variant 13: two frames a
# program, each in its own warpgroup, a third issuing both frames' K/V copies from the lane
# table). Built and lowered in session 24, never run: a deadlock shows as the first timeout.
# (1) every CHECK_SHAPES entry with it (XLA, NaN/inf in unattended slots), then alone against
#     the default at B=1024 P=1K MHA with 9 and 65 tokens a row, B=32 P=1K, B=256 P=16K S=1,
#     B=32 P=2K; (2) the CodeLlama-7B decode grid with it (no-attention step in the same call).
# If it pays and checks, make it the default (tree_attention.MosaicGpuConfig).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call5; mkdir -p $R/check
timeout 280 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/check --attend_only \
  --check_shapes all --shapes 8,13,10,0,4 --variants 13,0 --capacity=128 > $R/check/check.txt 2>&1
echo "check rc=$?"
tar czf $OUT/call5.tgz -C $OUT call5
timeout 200 python3 -m experiments.throughput --preset=codellama_7b --impls=mosaic_gpu \
  --profile_kernels=16 --new_tokens=128 --modes=no_attention,tree --max_decode_s=0.4 \
  --batches=1024,32 --prefixes=1024,16384 --deadline_s=185 \
  --mosaic_gpu_knobs=private_producer=true --workdir=$R/grid > $R/grid.log 2>&1
echo "grid rc=$?"
tar czf $OUT/call5.tgz -C $OUT call5 && rm -rf $R
