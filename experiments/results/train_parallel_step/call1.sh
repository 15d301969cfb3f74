#!/bin/bash
# Session 42, call 1. One nvidia-h200-x2: bash call1.sh <commit>, with OUT set (about 8 minutes).
# The GRPO step on two H200s, data parallel (`make_train_step(mesh=)`) and tensor parallel (the
# model on a tp mesh), against one H200 on the same batch: issue 15's step point (G = 32
# samples of an 8K prompt, 1K tokens each), two prompts in all, then a 4K-prompt point with four.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1 NCCL_NVLS_ENABLE=0
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call1; mkdir -p $R; LOG=$R/log.txt
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a $LOG
timeout 330 python3 -m experiments.train_parallel_step --nosmoke --points=32:8192:1024 \
  --workdir=$R/p8k 2>&1 | grep -v "^W1" >> $LOG
echo "p8k rc=${PIPESTATUS[0]}" | tee -a $LOG
timeout 220 python3 -m experiments.train_parallel_step --nosmoke --points=16:4096:1024 \
  --prompts_per_device=2 --workdir=$R/p4k 2>&1 | grep -v "^W1" >> $LOG
echo "p4k rc=${PIPESTATUS[0]}" | tee -a $LOG
rm -f $R/p4k/README.md  # at most 8 files come back; its table.md holds the same table
grep -E "^\||rc=|Error|error|first step" $LOG | cut -c1-300
