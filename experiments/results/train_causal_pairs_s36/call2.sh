#!/bin/bash
# Session 36, call 2. One nvidia-h200: bash call2.sh <commit>, with OUT set (about 9 minutes).
# Since call 1 (84de4f5):
# - the dK/dV kernel masks every step again by default (`mask_all_steps_dkv=True`): call 1
#   timed the 8K prompt's fused dK/dV at 38.8 ms masking every step, 42.9-44.9 ms with session
#   35's unmasked branch; the forward and dQ kernels keep the branch;
# - `attend_prefill` on the Mosaic GPU kernels calls them on slices of the buffer
#   (`hydrajax/training/prefill_vjp.py`): no gathers, dump-row pads or scatters around them
#   (call 1: 1.85 of 9.69 ms at G=16, P=1K, T=2K outside the kernels).
# In priority order, each step with its own limit:
# (1) the compiled tests of the new path (prefill attention and a GRPO step against XLA) and of
#     the masking and pairing knobs;
# (2) prefill_attention's fwd + bwd per launch (CUPTI) at the call-1 points;
# (3) train_bench at the P=1K points and the 64:8192:1024, against cuDNN;
# (4) A/B: the same shared points with the dK/dV kernel's unmasked branch (call 1's default).
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call2; mkdir -p $R; LOG=$R/log.txt
timeout 170 python3 -m pytest tests/test_mosaic_gpu_training.py -q -p no:cacheprovider --tb=short \
  -k "TestTrainingKernels and not Interpret and (prefill_attention_impl or grpo_step or unmasked or paired)" \
  >> $LOG 2>&1
echo "pytest rc=$?" | tee -a $LOG
timeout 90 python3 pallas_kernels/mosaic_gpu/check_training.py --out $R/breakdown \
  --breakdown=16:1024:2048,64:1024:1024,64:8192:1024 2>&1 | grep -v "^[IW]1" >> $LOG
echo "breakdown rc=${PIPESTATUS[0]}" | tee -a $LOG
P=8:1024:1024,8:1024:2048,16:1024:1024,16:1024:2048,64:1024:1024,64:1024:2048,64:8192:1024
timeout 180 python3 -m experiments.train_bench --nosmoke --points=$P --step_points= \
  --impls=per_seq_cudnn,shared_mosaic_gpu --workdir=$R/train_bench 2>&1 | grep -v "^[IW]1" >> $LOG
echo "train_bench rc=${PIPESTATUS[0]}" | tee -a $LOG
timeout 100 python3 -m experiments.train_bench --nosmoke --points=16:1024:2048,64:8192:1024 \
  --step_points= --impls=shared_mosaic_gpu --training_kernel_knobs=mask_all_steps_dkv=false \
  --workdir=$R/dkv_branch 2>&1 | grep -v "^[IW]1" >> $LOG
echo "dkv_branch rc=${PIPESTATUS[0]}" | tee -a $LOG
rm -f $R/dkv_branch/time.png $R/dkv_branch/README.md  # 8 files come back at most
grep -E "passed|failed|prefill fwd|launches|^\|" $LOG | cut -c1-400
