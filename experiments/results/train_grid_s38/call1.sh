#!/bin/bash
# Session 38, call 1. One nvidia-h200: bash call1.sh <commit>, with OUT set (about 8 minutes).
# Issue 15's grid at today's default (random cotangents since session 37, the completions'
# dQ in place since session 38): 16 of its 27 points, forward + backward of all attention,
# shared Mosaic GPU kernels against per-sequence cuDNN. call2.sh runs the other 11.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call1; mkdir -p $R; LOG=$R/log.txt
P=8:1024:1024,8:1024:2048,16:1024:1024,16:1024:2048,64:1024:1024,64:1024:2048,64:8192:1024
P=$P,8:4096:1024,16:4096:1024,64:4096:1024,8:8192:1024,16:8192:1024,16:4096:2048,64:4096:2048
P=$P,64:8192:256,64:8192:2048
timeout 540 python3 -m experiments.train_bench --nosmoke --points=$P --step_points= \
  --impls=per_seq_cudnn,shared_mosaic_gpu --workdir=$R/train_bench 2>&1 | grep -v "^[IW]1" >> $LOG
echo "train_bench rc=${PIPESTATUS[0]}" | tee -a $LOG
rm -f $R/*/time.png
grep -E "^\|" $LOG | cut -c1-300
