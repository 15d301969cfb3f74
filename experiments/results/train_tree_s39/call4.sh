#!/bin/bash
# Session 39, call 4. One nvidia-h200: bash call4.sh <commit>, with OUT set (about 2 minutes).
# fusion_dump.py: the optimized HLO of the slow gather-reduce fusion (calls 2 and 3: 5.4 ms of
# 92 at 8192:8:1024:64:1024, 0.34 of 2.0 ms at 1024:4:256:16:256), at the small point.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
R=$OUT/call4; mkdir -p $R; LOG=$R/log.txt
D=experiments/results/train_tree_s39
XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text" timeout 200 python3 \
  $D/fusion_dump.py /tmp/dump 1024:4:256:16:256 input_gather_reduce_fusion 2>&1 \
  | grep -v "^[IW]1" >> $LOG
echo "fusion_dump rc=${PIPESTATUS[0]}" | tee -a $LOG
cut -c1-600 $LOG | head -120
