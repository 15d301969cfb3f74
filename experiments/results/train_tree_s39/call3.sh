#!/bin/bash
# Session 39, call 3. One nvidia-h200: bash call3.sh <commit>, with OUT set (about 5 minutes).
# merge_probe.py: the tree VJP's path merges as reductions over D (today) against unrolled
# into elementwise ops, device time and kernel breakdown, at the largest and smallest points.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call3; mkdir -p $R; LOG=$R/log.txt
D=experiments/results/train_tree_s39
timeout 420 python3 $D/merge_probe.py $R/merge_probe.jsonl 8192:8:1024:64:1024 \
  1024:4:256:16:256 2>&1 | grep -v "^[IW]1" >> $LOG
echo "merge_probe rc=${PIPESTATUS[0]}" | tee -a $LOG
cat $LOG | cut -c1-400
