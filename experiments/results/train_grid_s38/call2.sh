#!/bin/bash
# Session 38, call 2 (on the machine call 1 left warm). bash call2.sh <commit>, with OUT set.
# The other 11 points of issue 15's grid (call1.sh ran 16), same settings.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call2; mkdir -p $R; LOG=$R/log.txt
P=8:1024:256,16:1024:256,64:1024:256,8:4096:256,16:4096:256,64:4096:256,8:8192:256
P=$P,16:8192:256,8:4096:2048,8:8192:2048,16:8192:2048
timeout 400 python3 -m experiments.train_bench --nosmoke --points=$P --step_points= \
  --impls=per_seq_cudnn,shared_mosaic_gpu --workdir=$R/train_bench 2>&1 | grep -v "^[IW]1" >> $LOG
echo "train_bench rc=${PIPESTATUS[0]}" | tee -a $LOG
rm -f $R/*/time.png
grep -E "^\|" $LOG | cut -c1-300
