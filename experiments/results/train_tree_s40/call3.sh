#!/bin/bash
# Session 40, call 3. One nvidia-h200: bash call3.sh <commit>, with OUT set (about 9 minutes).
# The rollout-tree GRPO step (llama3_8b's shapes at 2 layers, a 32K vocabulary, bf16): every
# node through the layers once (tree prefill on the kernels), against one-level sharing (the
# prompt once, each leaf's branch and own tokens its completion) and per-sequence cuDNN. Then
# call 1's compiled tests, cut there by their 200 s limit: the tree prefill and the prefill.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call3; mkdir -p $R; LOG=$R/log.txt
timeout 330 python3 -m experiments.train_tree_step --nosmoke --workdir=$R/train_tree_step \
  2>&1 | grep -v "^[IW]1" >> $LOG
echo "train_tree_step rc=${PIPESTATUS[0]}" | tee -a $LOG
timeout 235 python3 -m pytest -q -p no:cacheprovider \
  tests/test_mosaic_gpu_training.py::TestTrainingKernels -k \
  "tree_prefill_impl or prefill_attention_impl" 2>&1 | tail -5 >> $LOG
echo "tests rc=${PIPESTATUS[0]}" | tee -a $LOG
grep -E "^\||rc=|Error|error|passed|failed" $LOG | cut -c1-300
