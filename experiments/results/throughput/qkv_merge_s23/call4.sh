#!/bin/bash
# One nvidia-h200 (bash call4.sh <commit>, with OUT set; about 2 minutes), session 23 call 4: the
# CodeLlama-7B decode step with q's and kv's products kept apart (kv asked for in float32), as
# ../lane_table_s23/call.sh ran it before (same knobs: the lane table is now the default).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/qkv; mkdir -p $R
timeout 130 python3 -m experiments.throughput --preset=codellama_7b --impls=mosaic_gpu \
  --profile_kernels=12 --new_tokens=128 --modes=no_attention,tree --max_decode_s=0.4 \
  --batches=1024,32 --prefixes=1024,16384 --deadline_s=110 --workdir=$R/split > $R/split.log 2>&1
echo "qkv split rc=$?"
tar czf $OUT/qkv.tgz -C $OUT qkv && rm -rf $R
