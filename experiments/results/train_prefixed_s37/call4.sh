#!/bin/bash
# Session 37, call 4. One nvidia-h200: bash call4.sh <commit>, with OUT set (about 3 minutes).
# Whether a traced pipeline length slows the training kernels' steps (static_grid_probe.py).
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
R=$OUT/call4; mkdir -p $R; LOG=$R/log.txt
timeout 400 python3 experiments/results/train_prefixed_s37/static_grid_probe.py 2>&1 \
  | grep -v "^[IW]1" >> $LOG
echo "probe rc=${PIPESTATUS[0]}" | tee -a $LOG
grep -E "grid|rc=|Error" $LOG | cut -c1-300
