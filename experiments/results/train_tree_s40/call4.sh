#!/bin/bash
# Session 40, call 4. One nvidia-h200: bash call4.sh <commit>, with OUT set (about 4 minutes).
# Call 3's step point finished no variant in 330 s; a smaller point, the tree first, each
# variant logged as it ends.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call4; mkdir -p $R; LOG=$R/log.txt
timeout 220 python3 -m experiments.train_tree_step --nosmoke --points=2048:4:512:16:512 \
  --impls=tree_mosaic_gpu,prompt_shared_mosaic_gpu,per_seq_cudnn --repeats=2 \
  --workdir=$R/train_tree_step 2>&1 | grep -v "^W1" >> $LOG
echo "train_tree_step rc=${PIPESTATUS[0]}" | tee -a $LOG
grep -E "^\||rc=|Error|error| s$" $LOG | cut -c1-300
