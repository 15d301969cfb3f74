#!/bin/bash
# Session 35, call 1. One nvidia-h200 (bash call1.sh <commit>, with OUT set; about 9 minutes).
# (1) Issue 10's two near-miss kernel targets, alone, in two separate processes (s29-s33:
#     B=256 1.49-1.56x, target <= 1.5x; B=1024 1.31-1.34x, target <= 1.3x).
# (2) The decode grid of a GQA model, Llama-3.1-8B shape (32/8 heads, random weights): every
#     earlier grid was CodeLlama-7B (MHA). Modes no_attention, tree and paged (per-row reads of
#     physically shared pages), Mosaic GPU, B=1024/32/256, P=16K/1K, every kernel of one step
#     profiled. A grid cut by the deadline goes on in the next call with --resume.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call1; mkdir -p $R
for i in 1 2; do
  timeout 80 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/alone$i --attend_only \
    --shapes 0,1 --variants 0 > $R/alone$i.txt 2>&1
  echo "alone$i rc=$?"; grep '^|' $R/alone$i.txt | grep -v xla
done
timeout 380 python3 -m experiments.throughput --preset=llama3_1_8b --impls=mosaic_gpu \
  --profile_kernels=16 --new_tokens=128 --modes=no_attention,tree,paged --max_decode_s=0.4 \
  --batches=1024,32,256 --prefixes=16384,1024 --deadline_s=330 --workdir=$R/grid > $R/grid.log 2>&1
echo "grid rc=$?"; grep '^|' $R/grid/table.md | cut -c1-260; tail -3 $R/grid.log
