#!/bin/bash
# Session 41, call 1. One nvidia-h200: bash call1.sh <commit>, with OUT set (about 8 minutes).
# The rollout-tree GRPO step that session 40's call 3 did not finish: first a smaller point,
# then session 40's point, the tree first, each variant logged as it ends with its first
# call's time (compile and one run).
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call1; mkdir -p $R; LOG=$R/log.txt
step() {  # step <name> <seconds> <flags...>
  local name=$1 limit=$2; shift 2
  timeout $limit python3 -m experiments.train_tree_step --nosmoke --repeats=2 \
    --impls=tree_mosaic_gpu,prompt_shared_mosaic_gpu,per_seq_cudnn \
    --workdir=$R/$name "$@" 2>&1 | grep -v "^W1" >> $LOG
  echo "$name rc=${PIPESTATUS[0]}" | tee -a $LOG
}
step small 200 --points=2048:4:512:16:512
step s40_point 290 --points=4096:4:1024:32:1024
grep -E "^\||rc=|Error|error|first call| s$" $LOG | cut -c1-300
