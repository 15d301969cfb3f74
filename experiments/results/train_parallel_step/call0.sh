#!/bin/bash
# Session 42, call 0. One nvidia-h200: bash call0.sh <commit>, with OUT set (about 5 minutes).
# Compiled checks after this session's changes: the GRPO loss and gradients on the kernels, then
# through `grpo.data_parallel` on a one-device mesh (the kernels inside the shard_map); the
# prefill and tree prefill on the kernels (segment groups now sized by their slots,
# `Segment.kv_capacity`), and the differentiable tree attention.
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/call0; mkdir -p $R; LOG=$R/log.txt
timeout 540 python3 -m pytest -q -p no:cacheprovider -x \
  "tests/test_mosaic_gpu_training.py::TestTrainingKernels" \
  -k "grpo_step_impl or prefill_attention_impl or tree_prefill_impl or differentiable_matches_xla" \
  2>&1 | tail -25 >> $LOG
echo "pytest rc=${PIPESTATUS[0]}" | tee -a $LOG
tail -8 $LOG
