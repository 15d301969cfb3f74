#!/bin/bash
# Ready for a lent nvidia-h200 (bash call.sh <commit>, with OUT set; about 7 minutes): the private
# kernel's plans from a lane table (MosaicGpuConfig.private_lane_table) against the in-kernel walk,
# alone (check_on_device: the decode step's shapes at 8 and 9 private tokens a row, 128-token
# pages) and in the CodeLlama-7B decode step (issue 10's grid at P=1K, where the private kernel
# is the lever).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; tar czf $OUT/r.tgz -C $OUT r; }
timeout 150 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R --attend_only \
  --shapes 7,8,5 --variants 0,11 --capacity=128 > $R/check.txt 2>&1
el "check rc=$?"
TP="python3 -m experiments.throughput --preset=codellama_7b --impls=mosaic_gpu --profile_kernels=12 --new_tokens=128 --modes=no_attention,tree --max_decode_s=0.4 --batches=1024,32 --prefixes=1024,16384"
timeout 120 $TP --deadline_s=100 --workdir=$R/walk > $R/walk.log 2>&1
el "walk rc=$?"
timeout 120 $TP --deadline_s=100 --mosaic_gpu_knobs=private_lane_table=true --workdir=$R/table \
  > $R/table.log 2>&1
el "table rc=$?"
el done
rm -rf $R
