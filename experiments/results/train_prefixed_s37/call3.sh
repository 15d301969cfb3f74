#!/bin/bash
# Session 37, call 3. One nvidia-h200: bash call3.sh <commit>, with OUT set (about 8 minutes).
# Since call 2 (f185f8c):
# - the prefixed forward no longer zeroes V rows past the prompt in its steps (a pl.when in
#   every step); the wrapper zeroes them, one pass over V;
# - call 1's compiled prefixed tests failed on the test's own sizes (T = 192 and a row start of
#   320 are no multiples of the compiled 128-token blocks; now 384 and 384);
# - train_bench and the breakdown pass random cotangents in: call 1's HLO showed the ones_like
#   cotangent written out twice for the shared path (once per kernel shape reading it).
# In priority order, each step with its own limit:
# (1) the compiled tests of the prefixed kernel and the prefill path;
# (2) per launch (CUPTI): prefixed paired (default), unpaired, and the old three-call forward;
# (3) train_bench at the P=1K points and 64:8192:1024, against cuDNN.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call3; mkdir -p $R; LOG=$R/log.txt
timeout 150 python3 -m pytest tests/test_mosaic_gpu_training.py -q -p no:cacheprovider --tb=short \
  -k "TestTrainingKernels and not Interpret and (prefixed or prefill_attention_impl)" >> $LOG 2>&1
echo "pytest rc=$?" | tee -a $LOG
timeout 170 python3 pallas_kernels/mosaic_gpu/check_training.py --out $R/breakdown \
  --breakdown=16:1024:2048,64:1024:1024,64:8192:1024 \
  --configs=';pair_causal_tiles=false;prefixed_forward=false' 2>&1 | grep -v "^[IW]1" >> $LOG
echo "breakdown rc=${PIPESTATUS[0]}" | tee -a $LOG
P=8:1024:1024,8:1024:2048,16:1024:1024,16:1024:2048,64:1024:1024,64:1024:2048,64:8192:1024
timeout 200 python3 -m experiments.train_bench --nosmoke --points=$P --step_points= \
  --impls=per_seq_cudnn,shared_mosaic_gpu --workdir=$R/train_bench 2>&1 | grep -v "^[IW]1" >> $LOG
echo "train_bench rc=${PIPESTATUS[0]}" | tee -a $LOG
grep -E "passed|failed|FAILED|Error|prefill fwd|launches|== config|^\|" $LOG | cut -c1-400
