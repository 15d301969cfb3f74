#!/bin/bash
# Session 30, call 2 (was s29/call8_not_run.sh). One nvidia-h200 (bash call2.sh
# <commit>, with OUT set; about 6 minutes):
# (1) the CodeLlama-7B decode grid (B=1024/32, P=1K/16K) at the session-29 default (the
#     overlap on for long programs), every kernel of one step profiled ("attn kernels/floor";
#     session 29 call 4 has the same grid before the overlap);
# (2) the overlap with 192-token steps (ptxas: registers, spills), alone at B=1024 P=16K 32/8
#     and B=256 P=16K 32/8, against 192-token steps in order (14) and the default (0).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call8; mkdir -p $R/time /tmp/ptxas
timeout 150 python3 -m experiments.throughput --preset=codellama_7b --impls=mosaic_gpu \
  --profile_kernels=16 --new_tokens=128 --modes=no_attention,tree --max_decode_s=0.4 \
  --batches=1024,32 --prefixes=1024,16384 --deadline_s=135 --workdir=$R/grid > $R/grid.log 2>&1
echo "grid rc=$?"; grep '^|' $R/grid/table.md | cut -c1-400; rm -f $R/grid/*.png
MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=/tmp/ptxas timeout 90 python3 \
  experiments/results/mosaic_gpu_check/s27/ptxas.py block_kv=192 shared_overlap=true > $R/ptxas.txt 2>&1
grep -h "registers\|spill" /tmp/ptxas/shared*.ptxas | sort | uniq -c
timeout 200 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/time --attend_only \
  --shapes 1,0 --variants 18,14,0 --capacity=128 > $R/time/time.txt 2>&1
echo "time rc=$?"; grep '^|' $R/time/time.txt | grep -v xla
