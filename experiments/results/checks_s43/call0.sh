#!/bin/bash
# Session 43, call 0. One nvidia-h200: bash call0.sh <commit>, with OUT set (about 5 minutes).
# Compiled checks after this session's changes to the training plans (a walked level's plan
# built from the kernels already resolved, `training_plan.plan_resolved`) and to placement
# (`sharding_rules.named_sharding`): the GRPO loss and gradients on the kernels and through
# `data_parallel` on a one-device mesh; the prefill and the tree prefill on the kernels (the
# non-uniform tree walks its levels); the differentiable tree attention.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=${1:-unknown}
R=$OUT/call0; mkdir -p $R; LOG=$R/log.txt
echo "commit $HYDRAJAX_GIT_COMMIT" > $LOG
nvidia-smi --query-gpu=name --format=csv,noheader >> $LOG
timeout 540 python3 -m pytest -q -p no:cacheprovider -x -rs \
  "tests/test_mosaic_gpu_training.py::TestTrainingKernels" \
  -k "grpo_step_impl or prefill_attention_impl or tree_prefill_impl or differentiable_matches_xla" \
  2>&1 | tail -25 >> $LOG
echo "pytest rc=${PIPESTATUS[0]}" | tee -a $LOG
tail -8 $LOG
