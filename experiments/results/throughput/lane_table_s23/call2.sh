#!/bin/bash
# One nvidia-h200 (bash call.sh <commit>, with OUT set; about 2 minutes): the CodeLlama-7B decode
# step with the private kernel's plans from a lane table (--mosaic_gpu_knobs=
# private_lane_table=true). The walk's leg of the A/B is call 1 of session 23
# (call1.sh), whose table leg stopped on a config error since fixed.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/lane_table; mkdir -p $R
timeout 130 python3 -m experiments.throughput --preset=codellama_7b --impls=mosaic_gpu \
  --profile_kernels=12 --new_tokens=128 --modes=no_attention,tree --max_decode_s=0.4 \
  --batches=1024,32 --prefixes=1024,16384 --deadline_s=110 \
  --mosaic_gpu_knobs=private_lane_table=true --workdir=$R/table > $R/table.log 2>&1
echo "lane table rc=$?"
tar czf $OUT/lane_table.tgz -C $OUT lane_table && rm -rf $R
