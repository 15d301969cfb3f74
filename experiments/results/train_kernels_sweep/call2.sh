#!/bin/bash
# One nvidia-h200 (bash call2.sh <commit>, with OUT set; about 9 minutes): issue 15 at the new
# default (block_kv_dq=64, from call 1): the attention fwd+bwd benchmark point (G=64, 8K prompt,
# 1K completions, 32/8 heads) against per-sequence cuDNN, its CUPTI breakdown, then the two
# configs call 1's time limit cut (128 query rows a dQ block; one compute warpgroup).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
R=$OUT/call2; mkdir -p $R
timeout 200 python3 -m experiments.train_bench --nosmoke --points=64:8192:1024 --step_points= \
  --impls=per_seq_cudnn,shared_mosaic_gpu --workdir=$R/train_bench > $R/train_bench.txt 2>&1
echo "train_bench rc=$?"
timeout 90 python3 pallas_kernels/mosaic_gpu/check_training.py --breakdown > $R/breakdown.txt 2>&1
echo "breakdown rc=$?"
tar czf $OUT/call2.tgz -C $OUT call2
timeout 230 python3 pallas_kernels/mosaic_gpu/check_training.py \
  --configs='block_q_dq=128;compute_wgs=1' > $R/sweep.txt 2>&1
echo "sweep rc=$?"
tar czf $OUT/call2.tgz -C $OUT call2 && rm -rf $R
