#!/bin/bash
# Session 37, call 5. One nvidia-h200: bash call5.sh <commit>, with OUT set (about 3 minutes).
# The prefixed forward is taken out again (calls 1-3: 16% slower at the 8K prompt, within noise
# at 1K; call 4: not the traced pipeline length). The kernels are session 36's; train_bench now
# passes random cotangents in. Its numbers at the points where sharing was at parity with cuDNN,
# and at the point.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call5; mkdir -p $R; LOG=$R/log.txt
timeout 170 python3 -m experiments.train_bench --nosmoke \
  --points=16:1024:2048,64:1024:2048,64:1024:1024,64:8192:1024 --step_points= \
  --impls=per_seq_cudnn,shared_mosaic_gpu --workdir=$R/train_bench 2>&1 | grep -v "^[IW]1" >> $LOG
echo "train_bench rc=${PIPESTATUS[0]}" | tee -a $LOG
grep -E "^\|" $LOG | cut -c1-300
