#!/bin/bash
# Ready for a lent nvidia-h200-x2 (bash call4_not_run.sh <commit>, with OUT set; about 9 minutes):
# the TP grid points issue 11 names that have not run yet: CodeLlama-13B at B=256 (tree, paged,
# no attention; P=1K and 16K) at TP=1 and TP=2, and CodeLlama-34B at B=32 at TP=1 and TP=2.
# Afterwards: python -m experiments.tp_scaling --tp1=... --tp2=... per pair (scaling.md/.png).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; tar czf $OUT/r.tgz -C $OUT r; }
TP="python3 -m experiments.throughput --impls=mosaic_gpu --max_decode_s=0.4 --profile_kernels=24 --tp_reduce_dtype=bfloat16"
G13="--preset=codellama_13b --new_tokens=64 --modes=no_attention,tree,paged --batches=256 --prefixes=16384,1024"
G34="--preset=codellama_34b --new_tokens=64 --modes=no_attention,tree --batches=32 --prefixes=16384,1024"
timeout 140 $TP $G13 --mesh=tp:1 --deadline_s=125 --workdir=$R/13b_b256_tp1 > $R/13b_b256_tp1.log 2>&1
el "13b tp1 rc=$?"
timeout 140 $TP $G13 --mesh=tp:2 --deadline_s=125 --workdir=$R/13b_b256_tp2 > $R/13b_b256_tp2.log 2>&1
el "13b tp2 rc=$?"
timeout 120 $TP $G34 --mesh=tp:1 --deadline_s=105 --workdir=$R/34b_b32_tp1 > $R/34b_b32_tp1.log 2>&1
el "34b tp1 rc=$?"
timeout 120 $TP $G34 --mesh=tp:2 --deadline_s=105 --workdir=$R/34b_b32_tp2 > $R/34b_b32_tp2.log 2>&1
el "34b tp2 rc=$?"
el done
rm -rf $R
