#!/bin/bash
# Session 37, call 3. One nvidia-h200: bash call3.sh <commit>, with OUT set (about 5 minutes).
# Since call 2 (f185f8c): the prefixed forward no longer zeroes V rows past the prompt in its
# steps (a pl.when in every step); the wrapper zeroes them, one pass over V. Call 1's compiled
# prefixed tests failed on the test's own sizes (T = 192 and a row start of 320 are no multiples
# of the compiled 128-token blocks; now 384 and 384), and its pytest hit the limit.
# (1) the compiled tests of the prefixed kernel and the prefill path;
# (2) per launch (CUPTI): prefixed paired (default), unpaired, and the old three-call forward.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call3; mkdir -p $R; LOG=$R/log.txt
timeout 200 python3 -m pytest tests/test_mosaic_gpu_training.py -q -p no:cacheprovider --tb=short \
  -k "TestTrainingKernels and not Interpret and (prefixed or prefill_attention_impl)" >> $LOG 2>&1
echo "pytest rc=$?" | tee -a $LOG
timeout 200 python3 pallas_kernels/mosaic_gpu/check_training.py --out $R/breakdown \
  --breakdown=16:1024:2048,64:1024:1024,64:8192:1024 \
  --configs=';pair_causal_tiles=false;prefixed_forward=false' 2>&1 | grep -v "^[IW]1" >> $LOG
echo "breakdown rc=${PIPESTATUS[0]}" | tee -a $LOG
grep -E "passed|failed|prefill fwd|launches|== config" $LOG | cut -c1-400
