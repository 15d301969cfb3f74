#!/bin/bash
# Session 40, call 1. One nvidia-h200: bash call1.sh <commit>, with OUT set (about 8 minutes).
# A uniform tree's attention on slices of the buffer, all levels one custom VJP (`prefill_vjp`,
# now the prefill's too):
# 1. the compiled kernel tests of the tree prefill (on slices and walked), the prefill and GRPO;
# 2. CUPTI breakdowns, on slices against walked, at the smallest and the largest point;
# 3. train_bench at the point, the prefill now through the levels VJP (no change meant).
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call1; mkdir -p $R; LOG=$R/log.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider \
  tests/test_mosaic_gpu_training.py::TestTrainingKernels -k \
  "tree_prefill_impl or prefill_attention_impl or grpo or differentiable_matches" 2>&1 \
  | tail -5 >> $LOG
echo "tests rc=${PIPESTATUS[0]}" | tee -a $LOG
timeout 200 python3 experiments/results/train_tree_s39/breakdown.py $R/breakdown.jsonl \
  tree_mosaic_gpu 1024:4:256:16:256 tree_walked_mosaic_gpu 1024:4:256:16:256 \
  prefill_mosaic_gpu 1024:4:256:16:256 tree_mosaic_gpu 8192:8:1024:64:1024 \
  tree_walked_mosaic_gpu 8192:8:1024:64:1024 2>&1 | grep -v "^[IW]1" >> $LOG
echo "breakdown rc=${PIPESTATUS[0]}" | tee -a $LOG
timeout 170 python3 -m experiments.train_bench --nosmoke --points=64:8192:1024 --step_points= \
  --impls=per_seq_cudnn,shared_mosaic_gpu --workdir=$R/train_bench 2>&1 \
  | grep -v "^[IW]1" >> $LOG
echo "train_bench rc=${PIPESTATUS[0]}" | tee -a $LOG
grep -E "^\||rc=|total|passed|failed" $LOG | cut -c1-250
