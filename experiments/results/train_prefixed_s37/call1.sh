#!/bin/bash
# Session 37, call 1. One nvidia-h200: bash call1.sh <commit>, with OUT set (about 9 minutes).
# The prefill's completions now attend their prompt and themselves in one forward launch
# (`prefixed_causal_forward`, reading the K/V buffer in place; `prefixed_forward=False` is
# session 36's segment launch + causal launch + XLA merge). In priority order, each step with
# its own limit:
# (1) the compiled tests of the new kernel and of the prefill / GRPO paths that use it;
# (2) prefill_attention's fwd + bwd per launch (CUPTI), prefixed against not, at G=16 P=1K
#     T=2K (a point where sharing lost), G=64 P=1K T=1K and the 64:8192:1024;
# (3) train_bench at the P=1K points and 64:8192:1024, against cuDNN;
# (4) the optimized HLO at 16:1024:2048 (the XLA fusions between the kernels).
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call1; mkdir -p $R; LOG=$R/log.txt
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv >> $LOG
timeout 170 python3 -m pytest tests/test_mosaic_gpu_training.py -q -p no:cacheprovider --tb=short \
  -k "TestTrainingKernels and not Interpret and (prefixed or prefill_attention_impl or grpo_step or causal_forward)" \
  >> $LOG 2>&1
echo "pytest rc=$?" | tee -a $LOG
timeout 150 python3 pallas_kernels/mosaic_gpu/check_training.py --out $R/breakdown \
  --breakdown=16:1024:2048,64:1024:1024,64:8192:1024 \
  --configs=';prefixed_forward=false' 2>&1 | grep -v "^[IW]1" >> $LOG
echo "breakdown rc=${PIPESTATUS[0]}" | tee -a $LOG
P=8:1024:1024,8:1024:2048,16:1024:1024,16:1024:2048,64:1024:1024,64:1024:2048,64:8192:1024
timeout 200 python3 -m experiments.train_bench --nosmoke --points=$P --step_points= \
  --impls=per_seq_cudnn,shared_mosaic_gpu --workdir=$R/train_bench 2>&1 | grep -v "^[IW]1" >> $LOG
echo "train_bench rc=${PIPESTATUS[0]}" | tee -a $LOG
mkdir -p /tmp/hlo && timeout 60 python3 experiments/results/train_prefixed_s37/dump_glue.py \
  /tmp/hlo 16:1024:2048 >> $LOG 2>&1
tar czf $R/hlo.tgz -C /tmp hlo; echo "hlo rc=$?" | tee -a $LOG
grep -E "passed|failed|prefill fwd|launches|== config|^\|" $LOG | cut -c1-400
