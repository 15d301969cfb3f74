#!/bin/bash
# Session 22, call 2 on nvidia-h200-x2 (bash call2.sh <commit>, with OUT set): 13B at TP=2 and TP=1
# with the wave-aware split choice; NCCL's Simple protocol for the all-reduces; 34B at TP=2 and TP=1.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; tar czf $OUT/r.tgz -C $OUT r; }
TP="python3 -m experiments.throughput --impls=mosaic_gpu --max_decode_s=0.4 --profile_kernels=24"
G13="--preset=codellama_13b --new_tokens=64 --modes=no_attention,tree --batches=1024,32 --prefixes=16384,1024"
G34="--preset=codellama_34b --new_tokens=64 --modes=no_attention,tree --batches=1024,32 --prefixes=16384,1024"
timeout 170 $TP $G13 --mesh=tp:2 --tp_reduce_dtype=bfloat16 --deadline_s=150 --workdir=$R/13b_tp2_bf16 \
  > $R/13b_tp2_bf16.log 2>&1
el "13b tp2 rc=$?"
timeout 125 $TP $G13 --mesh=tp:1 --deadline_s=100 --workdir=$R/13b_tp1 > $R/13b_tp1.log 2>&1
el "13b tp1 rc=$?"
NCCL_PROTO=Simple NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING timeout 60 $TP --preset=codellama_13b \
  --new_tokens=64 --modes=no_attention --batches=1024 --prefixes=16384 --mesh=tp:2 \
  --tp_reduce_dtype=bfloat16 --workdir=$R/13b_tp2_bf16_simple > $R/13b_tp2_bf16_simple.log 2>&1
el "13b tp2 Simple rc=$?"
timeout 110 $TP $G34 --mesh=tp:2 --tp_reduce_dtype=bfloat16 --deadline_s=85 --workdir=$R/34b_tp2_bf16 \
  > $R/34b_tp2_bf16.log 2>&1
el "34b tp2 rc=$?"
timeout 100 $TP $G34 --mesh=tp:1 --deadline_s=75 --workdir=$R/34b_tp1 > $R/34b_tp1.log 2>&1
el "34b tp1 rc=$?"
el done
rm -rf $R  # r.tgz holds it all
