#!/bin/bash
# Session 36, call 3 (on the machine call 2 left warm). bash call3.sh <commit>, with OUT set.
# The code of call 2 at the grid's 4K and 8K points (session 35's call 2 ran them with the
# kernels of 94d2584: no row parts, every step masked, one causal tile a program, the tree
# path's gathers and scatters), against cuDNN.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call3; mkdir -p $R; LOG=$R/log.txt
P=8:4096:1024,16:4096:1024,64:4096:1024,8:8192:1024,16:8192:1024,16:4096:2048,64:4096:2048
P=$P,64:8192:256,64:8192:2048
timeout 280 python3 -m experiments.train_bench --nosmoke --points=$P --step_points= \
  --impls=per_seq_cudnn,shared_mosaic_gpu --workdir=$R/train_bench 2>&1 | grep -v "^[IW]1" >> $LOG
echo "train_bench rc=${PIPESTATUS[0]}" | tee -a $LOG
grep -E "^\|" $LOG | cut -c1-300
