#!/bin/bash
# One nvidia-h200 (bash call4.sh <commit>, with OUT set; about 7 minutes), session 29 call 4:
# (1) the CodeLlama-7B decode grid (B=1024/32, P=1K/16K) at today's default, with every kernel
#     of one step profiled: the attention share in device time ("attn kernels/floor");
# (2) the same at B=1024 with 192-token shared-kernel steps (--mosaic_gpu_knobs=block_kv=192);
# (3) kernels alone, block_kv=192 (14) against the default (0), where the shared prefix is
#     short: B=1024 P=1K 9 tokens a row 32/32, B=32 P=2K 32/8, B=32 P=16K 9 tokens 32/32.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call4; mkdir -p $R/time
TP="python3 -m experiments.throughput --preset=codellama_7b --impls=mosaic_gpu --profile_kernels=16 --new_tokens=128 --modes=no_attention,tree --max_decode_s=0.4"
timeout 150 $TP --batches=1024,32 --prefixes=1024,16384 --deadline_s=135 --workdir=$R/grid \
  > $R/grid.log 2>&1; echo "grid rc=$?"; grep '^|' $R/grid/table.md 2>/dev/null | cut -c1-400
timeout 110 $TP --batches=1024 --prefixes=1024,16384 --deadline_s=100 --workdir=$R/grid192 \
  --mosaic_gpu_knobs=block_kv=192 > $R/grid192.log 2>&1; echo "grid192 rc=$?"
grep '^|' $R/grid192/table.md 2>/dev/null | cut -c1-400
timeout 150 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/time --attend_only \
  --shapes 8,4,9 --variants 14,0 --capacity=128 > $R/time/time.txt 2>&1
echo "time rc=$?"; grep '^|' $R/time/time.txt | grep -v xla
