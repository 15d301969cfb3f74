#!/bin/bash
# Session 53, one nvidia-h100-x1 (OUT set): bash call2_h100.sh <commit> [seconds, 570].
# 1. streams_probe.py (this folder): does a second CUDA stream run the shared kernel beside the
#    private one? B=1024, 32/32 heads, 13 private tokens a row, P=1K and 16K.
# 2. What fits an H100 of issue 10's B=1024 step: CodeLlama-7B with 16 of its 32 layers (the
#    32-layer program takes 77 GiB), the default (fused q/k/v), P=1K and 16K; the attention
#    share's ratio to its floor does not depend on the layer count.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
T=${2:-570}
R=$OUT/call2; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 experiments/results/mosaic_gpu_check/s53/streams_probe.py --out $R \
  > $R/streams_probe.log 2>&1
echo "streams_probe rc=$?"; grep '^{' $R/streams_probe.log
left=$((T - SECONDS))
timeout $left python3 -m experiments.throughput --preset=codellama_7b --num_layers=16 \
  --impls=mosaic_gpu --profile_kernels=64 --new_tokens=128 --modes=no_attention,tree \
  --max_decode_s=0.4 --batches=1024 --prefixes=1024,16384 --deadline_s=$((left - 25)) \
  --workdir=$R/l16 > $R/l16.log 2>&1
echo "l16 rc=$? left=$left"
python3 -m experiments.throughput --summary=$R/l16/throughput.jsonl --summary_kernels=5
