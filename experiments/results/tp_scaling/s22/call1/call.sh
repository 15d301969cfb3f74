#!/bin/bash
# Issue 11, ready for a lent nvidia-h200-x2 (bash tp2_call.sh <commit>, with OUT set): TP=2 with a bfloat16 all-reduce, and at B=32 the
# collective-latency flags (XLA's one-shot all-reduce kernel; command buffers over collectives).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export HYDRAJAX_GIT_COMMIT=$1
# Compiles shared by the processes of a call (and the next call while the machine is warm).
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
# Each step ends with the results so far in one archive (a call cut by the budget keeps them).
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; tar czf $OUT/r.tgz -C $OUT r; }
nvidia-smi topo -m > $R/topo.txt 2>&1
TP="python3 -m experiments.throughput --impls=mosaic_gpu --max_decode_s=0.4 --profile_kernels=24"
G13="--preset=codellama_13b --new_tokens=64 --modes=no_attention,tree"
timeout 200 $TP $G13 --batches=1024,32 --prefixes=16384,1024 --mesh=tp:2 --tp_reduce_dtype=bfloat16 \
  --deadline_s=170 --workdir=$R/13b_tp2_bf16 > $R/13b_tp2_bf16.log 2>&1
el "tp2 bf16 rc=$?"
XLA_FLAGS=--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true timeout 110 $TP $G13 \
  --batches=32 --prefixes=1024 --mesh=tp:2 --tp_reduce_dtype=bfloat16 --deadline_s=90 \
  --workdir=$R/13b_tp2_bf16_oneshot > $R/13b_tp2_bf16_oneshot.log 2>&1
el "tp2 oneshot rc=$?"
XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,COLLECTIVES,WHILE,CONDITIONAL \
  timeout 80 $TP $G13 --batches=32 --prefixes=1024 --mesh=tp:2 --tp_reduce_dtype=bfloat16 \
  --deadline_s=60 --workdir=$R/13b_tp2_bf16_cmdbuf > $R/13b_tp2_bf16_cmdbuf.log 2>&1
el "tp2 command buffers rc=$?"
timeout 130 $TP $G13 --batches=1024,32 --prefixes=16384,1024 --mesh=tp:1 --deadline_s=105 \
  --workdir=$R/13b_tp1 > $R/13b_tp1.log 2>&1
el "tp1 rc=$?"
el done
rm -rf $R  # r.tgz holds it all
