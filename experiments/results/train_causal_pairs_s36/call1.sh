#!/bin/bash
# Session 36, call 1. One nvidia-h200: bash call1.sh <commit>, with OUT set (about 8 minutes).
# Causal forward and dQ programs now run two query tiles each (`pair_causal_tiles`, tile p then
# tile n - 1 - p), so every program streams about n + 1 kv blocks; False is the old one tile a
# program, longest first. In priority order, each step with its own limit:
# (1) the compiled tests of the causal kernels and of the pairing (bitwise the unpaired);
# (2) prefill_attention's fwd + bwd kernel times per launch (CUPTI) at the losing points of
#     session 35 (G=16 P=1K T=2K, G=64 P=1K T=1K) and the point, paired against not,
#     and against mask_all_steps=true (session 35's change, never timed apart);
# (3) train_bench at the P=1K points where sharing lost, and at 64:8192:1024, against cuDNN.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call1; mkdir -p $R; LOG=$R/log.txt
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv >> $LOG
timeout 150 python3 -m pytest tests/test_mosaic_gpu_training.py -q -p no:cacheprovider --tb=short \
  -k "TestTrainingKernels and not Interpret and (causal or paired)" >> $LOG 2>&1
echo "pytest rc=$?" | tee -a $LOG
timeout 200 python3 pallas_kernels/mosaic_gpu/check_training.py --out $R/breakdown \
  --breakdown=16:1024:2048,64:1024:1024,64:8192:1024 \
  --configs=';pair_causal_tiles=false;mask_all_steps=true' 2>&1 | grep -v "^[IW]1" >> $LOG
echo "breakdown rc=${PIPESTATUS[0]}" | tee -a $LOG
P=8:1024:1024,8:1024:2048,16:1024:1024,16:1024:2048,64:1024:1024,64:1024:2048,64:8192:1024
timeout 200 python3 -m experiments.train_bench --nosmoke --points=$P --step_points= \
  --impls=per_seq_cudnn,shared_mosaic_gpu --workdir=$R/train_bench 2>&1 | grep -v "^[IW]1" >> $LOG
echo "train_bench rc=${PIPESTATUS[0]}" | tee -a $LOG
grep -E "passed|failed|prefill fwd|launches|== config|^\|" $LOG | cut -c1-400
