#!/bin/bash
# One nvidia-h200 (bash call2.sh <commit>, with OUT set; about 9 minutes), session 27 call 2:
# (1) every CHECK_SHAPES entry with the private kernel's K slot refilled right after its QK
#     wgmma (`private_early_k`, variant 13 at this commit), then kernels alone, 13 and the
#     default (0: lane-table plans read a step ahead since call 1) at B=1024 P=1K, 9 and 65
#     tokens a row (32/32);
# (2) issue 15's attention point (G=64, 8K prompt, 1K completions, 32/8) against per-sequence
#     cuDNN and its CUPTI breakdown, after session 26's single merge (8b4057a, not timed then).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call2; mkdir -p $R/check
timeout 240 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/check --attend_only \
  --check_shapes all --shapes 8,13 --variants 13,0 --capacity=128 > $R/check/check.txt 2>&1
echo "check rc=$?"
tar czf $OUT/call2.tgz -C $OUT call2
timeout 200 python3 -m experiments.train_bench --nosmoke --points=64:8192:1024 --step_points= \
  --impls=per_seq_cudnn,shared_mosaic_gpu --workdir=$R/train_bench > $R/train_bench.txt 2>&1
echo "train_bench rc=$?"
tar czf $OUT/call2.tgz -C $OUT call2
timeout 110 python3 pallas_kernels/mosaic_gpu/check_training.py --breakdown > $R/breakdown.txt 2>&1
echo "breakdown rc=$?"
tar czf $OUT/call2.tgz -C $OUT call2 && rm -rf $R
