#!/bin/bash
# Session 35, call 2. One nvidia-h200 (bash call2.sh <commit>, with OUT set; about 8 minutes).
# Issue 15's whole attention grid with the Mosaic GPU kernels, never run before at the current
# kernels (only G=64, P=8K, T=1K was): G in {8, 16, 64} x prompt {1K, 4K, 8K} x completion
# {256, 1K, 2K}, 32/8 heads, d=128, bf16, against per-sequence cuDNN attention in the same run.
# Records are written as each point ends, smallest G first, so a cut run keeps what ran.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call2; mkdir -p $R
P=8:1024:256,8:1024:1024,8:1024:2048,8:4096:256,8:4096:1024,8:4096:2048,8:8192:256,8:8192:1024
P=$P,8:8192:2048,16:1024:256,16:1024:1024,16:1024:2048,16:4096:256,16:4096:1024,16:4096:2048
P=$P,16:8192:256,16:8192:1024,16:8192:2048,64:1024:256,64:1024:1024,64:1024:2048,64:4096:256
P=$P,64:4096:1024,64:4096:2048,64:8192:256,64:8192:1024,64:8192:2048
timeout 560 python3 -m experiments.train_bench --nosmoke --points=$P --step_points= \
  --impls=per_seq_cudnn,shared_mosaic_gpu --workdir=$R/train_bench > $R/train_bench.txt 2>&1
echo "train_bench rc=$?"; grep -c '"kind": "attention"' $R/train_bench/results.jsonl
grep '^|' $R/train_bench/table.md
