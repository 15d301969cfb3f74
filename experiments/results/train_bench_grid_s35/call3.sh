#!/bin/bash
# Session 35, call 3. One nvidia-h200 (bash call3.sh <commit>, with OUT set; about 5 minutes).
# Call 2 found the shared path slower than per-sequence cuDNN at a 1K prompt with completions of
# 1K-2K. One cause: the shared segment's fused dK/dV kernel has one program per kv tile and kv
# head (1K tokens x 8 kv heads = 64 programs on 132 multiprocessors). Now it splits the query
# rows into parts there (`TrainingKernelConfig.row_parts`, None: `schedule.row_parts`, 2 at 1K).
# (1) the compiled training-kernel tests: the backward cases and the new row-parts cases;
# (2) the P=1K points of the grid again, shared_mosaic_gpu (2 parts chosen) against cuDNN.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call3; mkdir -p $R
timeout 200 python3 -m pytest tests/test_mosaic_gpu_training.py -q -p no:cacheprovider --tb=short \
  -k "not Interpret and not interpret and (test_backward or row_parts or dkv_reduced)" \
  > $R/pytest_training.txt 2>&1
echo "pytest rc=$?"; tail -6 $R/pytest_training.txt
P=8:1024:256,8:1024:1024,8:1024:2048,16:1024:256,16:1024:1024,16:1024:2048,64:1024:256
P=$P,64:1024:1024,64:1024:2048
timeout 300 python3 -m experiments.train_bench --nosmoke --points=$P --step_points= \
  --impls=per_seq_cudnn,shared_mosaic_gpu --workdir=$R/train_bench > $R/train_bench.txt 2>&1
echo "train_bench rc=$?"; grep '^|' $R/train_bench/table.md
