#!/bin/bash
# Session 39, call 2. One nvidia-h200: bash call2.sh <commit>, with OUT set (about 6 minutes).
# 1. breakdown.py: CUPTI kernel times of one forward + backward, tree against prefill, at the
#    smallest point (where the tree lost, 0.72x) and the largest.
# 2. loop_probe.py (cut short in call 1): segment groups one launch each, against per segment.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call2; mkdir -p $R; LOG=$R/log.txt
D=experiments/results/train_tree_s39
timeout 240 python3 $D/breakdown.py $R/breakdown.jsonl tree_mosaic_gpu 1024:4:256:16:256 \
  prefill_mosaic_gpu 1024:4:256:16:256 tree_mosaic_gpu 8192:8:1024:64:1024 \
  prefill_mosaic_gpu 8192:8:1024:64:1024 2>&1 | grep -v "^[IW]1" >> $LOG
echo "breakdown rc=${PIPESTATUS[0]}" | tee -a $LOG
timeout 200 python3 $D/loop_probe.py $R/loop_probe.jsonl 4096:8:1024:64:512 2>&1 \
  | grep -v "^[IW]1" | tail -4 >> $LOG
echo "loop_probe rc=${PIPESTATUS[0]}" | tee -a $LOG
cat $LOG | cut -c1-250
