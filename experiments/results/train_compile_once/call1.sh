#!/bin/bash
# Session 42, call 1 (one nvidia-h200): bash call1.sh <commit>, with OUT set (about 5 minutes).
# A GRPO loop over four batches of one shape (llama3_8b at 2 layers, 32K vocabulary, bf16, the
# Mosaic GPU kernels; 2 prompts of 4K slots, 16 completions of 512 each) whose prompt lengths
# change: segments sized by their slot (one compile) against sized by their length (before).
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
R=$OUT/call1; mkdir -p $R; LOG=$R/log.txt
echo "commit $1" > $LOG
timeout 540 python3 experiments/results/train_compile_once/probe.py --nosmoke \
  --out=$R/results.jsonl 2>&1 | grep -v "^W1" | grep -E "^\{|Error|error" >> $LOG
echo "probe rc=${PIPESTATUS[0]}" | tee -a $LOG
cut -c1-220 $LOG
