#!/bin/bash
# Session 37, call 2. One nvidia-h200: bash call2.sh <commit>, with OUT set (about 2 minutes).
# Call 1: the prefixed forward took 20.0 ms at 64:8192:1024 against 14.6 + 1.6 for the segment
# and causal launches it replaces (per step 2.35 against 1.83 us). Suspects: the paired tiles'
# switch code in every step, the prefix's V zeroing. Unpaired, against the old path unpaired.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call2; mkdir -p $R; LOG=$R/log.txt
timeout 150 python3 pallas_kernels/mosaic_gpu/check_training.py --out $R/breakdown \
  --breakdown=16:1024:2048,64:8192:1024 \
  --configs='pair_causal_tiles=false;prefixed_forward=false,pair_causal_tiles=false' 2>&1 \
  | grep -v "^[IW]1" >> $LOG
echo "breakdown rc=${PIPESTATUS[0]}" | tee -a $LOG
grep -E "prefill fwd|launches|== config" $LOG | cut -c1-400
