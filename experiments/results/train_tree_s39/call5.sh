#!/bin/bash
# Session 39, call 5. One nvidia-h200: bash call5.sh <commit>, with OUT set (about 5 minutes).
# The rollout-tree benchmark again (call 1's four points, all three variants), after the tree
# VJP's backward reads the forward's output behind an optimization barrier (call 4: XLA had
# fused the forward's path merge into the backward's rowsum(dO * O), recomputing it).
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call5; mkdir -p $R; LOG=$R/log.txt
timeout 400 python3 -m experiments.train_tree_bench --nosmoke --workdir=$R/train_tree_bench \
  2>&1 | grep -v "^[IW]1" >> $LOG
echo "train_tree_bench rc=${PIPESTATUS[0]}" | tee -a $LOG
grep -E "^\||rc=" $LOG | cut -c1-300
