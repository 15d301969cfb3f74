#!/bin/bash
# Session 53, one nvidia-h200 (`needs_h200`: the B=1024 step does not fit an H100), OUT set:
# bash call1.sh <commit> [seconds, 585]. The CodeLlama-7B decode step at B=1024, every kernel of one step
# profiled, three runs in one call (session 52's unrun call1.sh with the new default):
#   grid1: the default (one q/k/v weight a layer since session 53; XLA's rematerialization pass
#          off over a cache since session 51), P=1K and 16K: issue 10's targets;
#   grid2: wq and wkv apart (`--fuse_qkv=false`, the default before), P=1K;
#   grid3: apart and the pass on again (`--compiler_options`, the program of session 50), P=1K.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call1; mkdir -p $R
run() {  # grid number, seconds, prefixes, extra flags
  timeout $2 python3 -m experiments.throughput --preset=codellama_7b --impls=mosaic_gpu \
    --profile_kernels=64 --new_tokens=128 --modes=no_attention,tree --max_decode_s=0.4 \
    --batches=1024 --prefixes=$3 --deadline_s=$(($2 - 20)) "${@:4}" \
    --workdir=$R/grid$1 > $R/grid$1.log 2>&1
  echo "grid$1 [${*:4}] rc=$?"
  python3 -m experiments.throughput --summary=$R/grid$1/throughput.jsonl --summary_kernels=5
}
T=${2:-585}
run 1 $((T * 2 / 5)) 1024,16384
run 2 $(((T - SECONDS) / 2)) 1024 --fuse_qkv=false
run 3 $((T - SECONDS)) 1024 --fuse_qkv=false --compiler_options='{"xla_disable_hlo_passes": ""}'
