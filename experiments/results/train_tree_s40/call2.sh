#!/bin/bash
# Session 40, call 2. One nvidia-h200: bash call2.sh <commit>, with OUT set (about 8 minutes).
# The rollout-tree benchmark at session 39's four points: the tree on slices of the buffer
# (`tree_mosaic_gpu`, these trees are uniform) and walked level by level
# (`tree_walked_mosaic_gpu`, the path of a tree that is not), against one-level sharing and cuDNN.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call2; mkdir -p $R; LOG=$R/log.txt
timeout 560 python3 -m experiments.train_tree_bench --nosmoke --workdir=$R/train_tree_bench \
  2>&1 | grep -v "^[IW]1" >> $LOG
echo "train_tree_bench rc=${PIPESTATUS[0]}" | tee -a $LOG
grep -E "^\||rc=" $LOG | cut -c1-300
