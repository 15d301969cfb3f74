#!/bin/bash
# Session 41, call 3. One nvidia-h200: bash call3.sh <commit>, with OUT set (about 7 minutes).
# After the plans' change (a uniform tree on slices resolves its kernels without walked plans
# or index arrays: `prefill_vjp.LevelsPlan`):
# 1. the compiled tests of the tree prefill (on slices and walked), the prefill and GRPO;
# 2. train_bench at issue 15's point (64:8192:1024): session 38 measured 65.4 ms, session 40
#    67.8 ms with the same kernel calls; one more run of the same program.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call3; mkdir -p $R; LOG=$R/log.txt
timeout 250 python3 -m pytest -q -p no:cacheprovider \
  tests/test_mosaic_gpu_training.py::TestTrainingKernels -k \
  "tree_prefill_impl or prefill_attention_impl or grpo" 2>&1 | tail -5 >> $LOG
echo "tests rc=${PIPESTATUS[0]}" | tee -a $LOG
timeout 190 python3 -m experiments.train_bench --nosmoke --points=64:8192:1024 --step_points= \
  --impls=per_seq_cudnn,shared_mosaic_gpu --workdir=$R/train_bench 2>&1 \
  | grep -v "^[IW]1" >> $LOG
echo "train_bench rc=${PIPESTATUS[0]}" | tee -a $LOG
grep -E "^\||rc=|passed|failed" $LOG | cut -c1-250
