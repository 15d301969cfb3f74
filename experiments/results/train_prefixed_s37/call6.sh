#!/bin/bash
# Session 37, call 6: written in session 37, run in session 38 (as call6_not_run.sh, renamed
# after, at 21514b8). One nvidia-h200: bash call6.sh <commit>, with OUT set (about 7 minutes).
# `TrainingKernelConfig.prefill_dq_in_place` (off until timed): the completions' causal dQ
# kernel writes float32 (staged in the finished tile's Q and dO buffers, a RefUnion), and the
# shared prompt's fused dK/dV kernel reduce-adds its dQ onto it, in place of a zeroed float32
# buffer, a bf16 causal dQ and an XLA sum (call 1's HLO: 0.16 + 0.24 ms at G=16, P=1K, T=2K).
# (1) the compiled tests of the float32 dQ, dq_init and the prefill path with it;
# (2) per launch (CUPTI), in place against summed;
# (3) train_bench, in place against summed, against cuDNN.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call6; mkdir -p $R; LOG=$R/log.txt
timeout 150 python3 -m pytest tests/test_mosaic_gpu_training.py -q -p no:cacheprovider --tb=short \
  -k "TestTrainingKernels and not Interpret and (dq_in_float32 or prefill_attention_impl)" \
  >> $LOG 2>&1
echo "pytest rc=$?" | tee -a $LOG
timeout 150 python3 pallas_kernels/mosaic_gpu/check_training.py --out $R/breakdown \
  --breakdown=16:1024:2048,64:1024:2048,64:8192:1024 \
  --configs=';prefill_dq_in_place=true' 2>&1 | grep -v "^[IW]1" >> $LOG
echo "breakdown rc=${PIPESTATUS[0]}" | tee -a $LOG
P=16:1024:2048,64:1024:2048,64:8192:1024
timeout 120 python3 -m experiments.train_bench --nosmoke --points=$P --step_points= \
  --impls=per_seq_cudnn,shared_mosaic_gpu --workdir=$R/summed 2>&1 | grep -v "^[IW]1" >> $LOG
echo "train_bench summed rc=${PIPESTATUS[0]}" | tee -a $LOG
timeout 90 python3 -m experiments.train_bench --nosmoke --points=$P --step_points= \
  --impls=shared_mosaic_gpu --training_kernel_knobs=prefill_dq_in_place=true \
  --workdir=$R/in_place 2>&1 | grep -v "^[IW]1" >> $LOG
echo "train_bench in_place rc=${PIPESTATUS[0]}" | tee -a $LOG
rm -f $R/*/time.png $R/*/README.md  # 8 files come back at most
grep -E "passed|failed|prefill fwd|launches|== config|^\|" $LOG | cut -c1-400
