#!/bin/bash
# Session 21, call 7: issue 10's decode grid at this commit (CodeLlama-7B, B 1024/32, P 16K/1K).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1
export HYDRAJAX_GIT_COMMIT=$1
R=$OUT/r; mkdir -p $R
timeout 200 python3 -m experiments.throughput --preset=codellama_7b --impls=mosaic_gpu --profile_kernels=12 \
  --batches=1024,32 --prefixes=16384,1024 --new_tokens=128 --modes=no_attention,tree \
  --max_decode_s=0.4 --deadline_s=150 --workdir=$R/grid > $R/grid.log 2>&1
echo "grid rc=$?"; grep "^| " $R/grid/table.md | cut -d'|' -f2-12
