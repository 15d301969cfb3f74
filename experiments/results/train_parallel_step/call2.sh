#!/bin/bash
# Session 42, call 2. One nvidia-h200: bash call2.sh <commit>, with OUT set (about 2 minutes).
# The compiled GRPO test again after data_parallel's shard_map became manual over dp only
# (`axis_names`): the kernels inside it on a one-device mesh.
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/call2; mkdir -p $R; LOG=$R/log.txt
echo "commit $1" > $LOG
timeout 400 python3 -m pytest -q -p no:cacheprovider \
  "tests/test_mosaic_gpu_training.py::TestTrainingKernels::test_grpo_step_impl" \
  2>&1 | tail -15 >> $LOG
echo "pytest rc=${PIPESTATUS[0]}" | tee -a $LOG
tail -6 $LOG
