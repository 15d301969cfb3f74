#!/bin/bash
# Session 35, call 3. One nvidia-h200 (bash call3.sh <commit>, with OUT set; at most 6 minutes:
# the session's device time was nearly spent, so each step has a short limit, in priority order).
# Call 2 found the shared path slower than per-sequence cuDNN at a 1K prompt with completions of
# 1K-2K. Two changes since:
# - the shared segment's fused dK/dV kernel splits its query rows into parts when its programs
#   are too few (`TrainingKernelConfig.row_parts`; a 1K prompt at 8 kv heads: 64 programs on
#   132 multiprocessors, so 2 parts);
# - the training kernels mask only the steps whose block holds an invisible pair
#   (`mask_all_steps=False`; True is the old every-step mask).
# (1) the compiled tests of the two changes and of the fused backward;
# (2) the P=1K points of the grid again and the point, shared_mosaic_gpu against cuDNN;
# (3) each kernel alone at the benchmark shapes, new default against mask_all_steps=true
#     (`check_training.py --configs`, checked against the references first).
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call3; mkdir -p $R
timeout 90 python3 -m pytest tests/test_mosaic_gpu_training.py -q -p no:cacheprovider --tb=short \
  -k "TestTrainingKernels and not Interpret and (row_parts or unmasked or test_backward)" \
  > $R/pytest_training.txt 2>&1
echo "pytest rc=$?"; tail -6 $R/pytest_training.txt
P=8:1024:256,8:1024:1024,8:1024:2048,16:1024:256,16:1024:1024,16:1024:2048,64:1024:256
P=$P,64:1024:1024,64:1024:2048,64:8192:1024
timeout 150 python3 -m experiments.train_bench --nosmoke --points=$P --step_points= \
  --impls=per_seq_cudnn,shared_mosaic_gpu --workdir=$R/train_bench > $R/train_bench.txt 2>&1
echo "train_bench rc=$?"; grep '^|' $R/train_bench/table.md
timeout 100 python3 pallas_kernels/mosaic_gpu/check_training.py --out $R/kernels \
  --configs=';mask_all_steps=true' > $R/kernels.txt 2>&1
echo "kernels rc=$?"; grep -v "^I1\|^W1" $R/kernels.txt | tail -30
