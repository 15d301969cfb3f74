#!/bin/bash
# Session 39, call 1. One nvidia-h200: bash call1.sh <commit>, with OUT set (about 9 minutes).
# 1. The compiled tree-prefill and tree-VJP tests (three levels, a group of two segments).
# 2. The rollout-tree benchmark at its four H200 points: tree prefill on the kernels against
#    one-level sharing (prefill, the prompt copied per branch) and per-sequence cuDNN.
# 3. loop_probe.py: the tree VJP's segment groups one launch each against one per segment
#    (its 100 s limit cut it after the batched run: call2.sh runs it again).
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call1; mkdir -p $R; LOG=$R/log.txt
D=experiments/results/train_tree_s39
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_mosaic_gpu_training.py \
  -k "TestTrainingKernels and not Interpret and (tree_prefill or differentiable_matches or scattered)" \
  2>&1 | tail -4 >> $LOG
echo "tests rc=${PIPESTATUS[0]}" | tee -a $LOG
timeout 330 python3 -m experiments.train_tree_bench --nosmoke --workdir=$R/train_tree_bench \
  2>&1 | grep -v "^[IW]1" >> $LOG
echo "train_tree_bench rc=${PIPESTATUS[0]}" | tee -a $LOG
timeout 100 python3 $D/loop_probe.py $R/loop_probe.jsonl 4096:8:1024:64:512 2>&1 \
  | grep -v "^[IW]1" | tail -4 >> $LOG
echo "loop_probe rc=${PIPESTATUS[0]}" | tee -a $LOG
grep -E "^\||passed|failed|rc=|tree_mosaic" $LOG | cut -c1-300
