#!/bin/bash
# Ready for a lent nvidia-h200-x2 (bash call3_not_run.sh <commit>, with OUT set; about 7 minutes):
# can the all-reduces hide behind matmuls? 13B TP=2 at B=1024, P=16K with the rows after attention
# in 2 blocks (ordered all-reduces, Llama.tp_micro_batches) and XLA's latency-hiding scheduler on,
# against 1 block with and without it.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; tar czf $OUT/r.tgz -C $OUT r; }
TP="python3 -m experiments.throughput --impls=mosaic_gpu --max_decode_s=0.4 --profile_kernels=24"
G13="--preset=codellama_13b --new_tokens=64 --modes=no_attention,tree --batches=1024 --prefixes=16384 --mesh=tp:2 --tp_reduce_dtype=bfloat16"
LHS="--xla_gpu_enable_latency_hiding_scheduler=true"
timeout 90 $TP $G13 --workdir=$R/13b_tp2_m1 > $R/13b_tp2_m1.log 2>&1
el "m1 rc=$?"
XLA_FLAGS="$LHS" timeout 90 $TP $G13 --tp_micro_batches=2 --workdir=$R/13b_tp2_m2_lhs \
  > $R/13b_tp2_m2_lhs.log 2>&1
el "m2 lhs rc=$?"
XLA_FLAGS="$LHS" timeout 90 $TP $G13 --workdir=$R/13b_tp2_m1_lhs > $R/13b_tp2_m1_lhs.log 2>&1
el "m1 lhs rc=$?"
timeout 90 $TP $G13 --tp_micro_batches=2 --workdir=$R/13b_tp2_m2 > $R/13b_tp2_m2.log 2>&1
el "m2 rc=$?"
# Greedy tokens at TP=2 against one device with the Mosaic GPU kernels, on a trained model
# whose top-2 margins are real (a random model's near-ties flip with rounding).
timeout 120 python3 -m experiments.tp_greedy_check --checkpoint=experiments/data/tiny_coder_h64 \
  --meshes='none;tp:2' --impl=mosaic_gpu --workdir=$R/tp_greedy_trained > $R/tp_greedy_trained.log 2>&1
el "greedy rc=$?"
el done
rm -rf $R
