#!/bin/bash
# Session 36, call 4 (on the machine call 3 left warm). bash call4.sh <commit>, with OUT set.
# The rest of issue 15's grid (calls 2 and 3 ran 16 of its 27 points). The code of call 2 (session 35's call 2 ran them with the
# kernels of 94d2584: no row parts, every step masked, one causal tile a program, the tree
# path's gathers and scatters), against cuDNN.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call4; mkdir -p $R; LOG=$R/log.txt
P=8:1024:256,16:1024:256,64:1024:256,8:4096:256,16:4096:256,64:4096:256,8:8192:256
P=$P,16:8192:256,8:4096:2048,8:8192:2048,16:8192:2048
timeout 245 python3 -m experiments.train_bench --nosmoke --points=$P --step_points= \
  --impls=per_seq_cudnn,shared_mosaic_gpu --workdir=$R/train_bench 2>&1 | grep -v "^[IW]1" >> $LOG
echo "train_bench rc=${PIPESTATUS[0]}" | tee -a $LOG
grep -E "^\|" $LOG | cut -c1-300
