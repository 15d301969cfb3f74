#!/bin/bash
# Session 41, call 2. One nvidia-h200: bash call2.sh <commit>, with OUT set (about 7 minutes).
# The rollout-tree GRPO step at issue 15's step point (G = 32 samples of an 8K prompt, 1K
# completion tokens each), the completions branching 4 ways after 512 tokens: 8192:4:512:32:512.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call2; mkdir -p $R; LOG=$R/log.txt
timeout 540 python3 -m experiments.train_tree_step --nosmoke --repeats=2 \
  --impls=tree_mosaic_gpu,prompt_shared_mosaic_gpu,per_seq_cudnn \
  --points=8192:4:512:32:512 --workdir=$R/p8k 2>&1 | grep -v "^W1" >> $LOG
echo "p8k rc=${PIPESTATUS[0]}" | tee -a $LOG
grep -E "^\||rc=|Error|error|first call| s$" $LOG | cut -c1-300
