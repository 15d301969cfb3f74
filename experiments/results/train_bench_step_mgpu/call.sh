#!/bin/bash
# One nvidia-h200 (bash call.sh <commit>, with OUT set; about 5 minutes): the GRPO training step
# (Llama-3-8B shape, 2 layers, 32K vocab; G=32 completions of 1024 tokens on an 8192-token
# prompt) with every attention part on the Mosaic GPU kernels, against per-sequence cuDNN.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
R=$OUT/train_step; mkdir -p $R
timeout 330 python3 -m experiments.train_bench --nosmoke --points= --step_points=32:8192:1024 \
  --impls=per_seq_cudnn,shared_mosaic_gpu --repeats=2 --workdir=$R > $R/log.txt 2>&1
echo "train step rc=$?"
tar czf $OUT/train_step.tgz -C $OUT train_step && rm -rf $R
