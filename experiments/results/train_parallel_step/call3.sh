#!/bin/bash
# Session 42, call 3. One nvidia-h200: bash call3.sh <commit>, with OUT set (about 3 minutes).
# The --nosmoke point of train_parallel_step on one H200: its one-device variant (2 prompts of
# 8K, 32 completions of 1K each, llama3_8b at 2 layers, the kernels); dp2 and tp2 are recorded
# as needing two devices. Checks the H200 path that call1.sh (two GPUs) will take.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
R=$OUT/call3; mkdir -p $R; LOG=$R/log.txt
timeout 400 python3 -m experiments.train_parallel_step --nosmoke --points=32:8192:1024 \
  --workdir=$R/p8k 2>&1 | grep -v "^W1" >> $LOG
echo "p8k rc=${PIPESTATUS[0]}" | tee -a $LOG
grep -E "^\||rc=|Error|error|first step" $LOG | cut -c1-300
