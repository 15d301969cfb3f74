#!/bin/bash
# Session 45, call 2 (never run as is: session 46 ran a shorter one in `../s46/call2.sh`). One nvidia-h200 (bash call2.sh
# <commit>, with OUT set; about 7 minutes). The CodeLlama-7B decode step at B=1024 (P=1K, where
# the private kernel is about 96 µs of 131 a layer, and P=16K), every kernel of a step profiled:
# the default against token lanes (`--mosaic_gpu_knobs=private_token_lanes=true`), alternated.
# Issue 10's targets: attention <= 2x its floor at P=1K (3.09x in s44), <= 1.3x at P=16K.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call2; mkdir -p $R
i=1
for knobs in "" private_token_lanes=true "" private_token_lanes=true; do
  timeout 130 python3 -m experiments.throughput --preset=codellama_7b --impls=mosaic_gpu \
    --profile_kernels=16 --new_tokens=128 --modes=no_attention,tree --max_decode_s=0.4 \
    --batches=1024 --prefixes=1024,16384 --deadline_s=110 --mosaic_gpu_knobs="$knobs" \
    --workdir=$R/grid$i > $R/grid$i.log 2>&1
  echo "grid$i knobs=[$knobs] rc=$?"; grep '^|' $R/grid$i/table.md | cut -c1-260; tail -2 $R/grid$i.log
  i=$((i + 1))
done
