#!/bin/bash
# Session 41, call 4. One nvidia-h200: bash call4.sh <commit>, with OUT set (about 5 minutes).
# A walked tree (one not uniform, or any tree on XLA) now runs all its levels in one custom
# VJP with one float32 dK/dV buffer (`training_plan.attend_levels_differentiable`), as the
# uniform tree on slices does; session 40 walked one VJP a level. The walked tree against the
# tree on slices at the smallest and the largest point of train_tree_bench (session 40:
# walked 1.64 and 88.0 ms, on slices 1.28 and 83.9 ms), then the compiled tree prefill tests.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call4; mkdir -p $R; LOG=$R/log.txt
timeout 170 python3 -m experiments.train_tree_bench --nosmoke \
  --points=1024:4:256:16:256,8192:8:1024:64:1024 \
  --impls=tree_mosaic_gpu,tree_walked_mosaic_gpu --workdir=$R/train_tree_bench \
  2>&1 | grep -v "^[IW]1" >> $LOG
echo "train_tree_bench rc=${PIPESTATUS[0]}" | tee -a $LOG
timeout 140 python3 -m pytest -q -p no:cacheprovider \
  tests/test_mosaic_gpu_training.py::TestTrainingKernels -k "tree_prefill_impl" 2>&1 \
  | tail -5 >> $LOG
echo "tests rc=${PIPESTATUS[0]}" | tee -a $LOG
grep -E "^\||rc=|passed|failed" $LOG | cut -c1-250
