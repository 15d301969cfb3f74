#!/bin/bash
# Session 22, call 4 on nvidia-h200 (bash call4.sh <commit>, with OUT set): issue 10's decode grid
# with the list-scheduled kv splits (run 10), and the one-device mesh path (--mesh=tp:1) at P=1K in
# the same machine start, against the grid's --mesh=none points.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1
export HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; tar czf $OUT/r.tgz -C $OUT r; }
TP="python3 -m experiments.throughput --preset=codellama_7b --impls=mosaic_gpu --profile_kernels=12 --new_tokens=128 --modes=no_attention,tree --max_decode_s=0.4"
timeout 190 $TP --batches=1024,32 --prefixes=16384,1024 --deadline_s=150 --workdir=$R/grid > $R/grid.log 2>&1
el "grid rc=$?"
timeout 100 $TP --batches=1024,32 --prefixes=1024 --mesh=tp:1 --deadline_s=80 --workdir=$R/mesh_tp1 > $R/mesh_tp1.log 2>&1
el "mesh tp:1 rc=$?"
timeout 100 $TP --batches=1024,32 --prefixes=1024 --mesh=none --deadline_s=80 --workdir=$R/mesh_none > $R/mesh_none.log 2>&1
el "mesh none rc=$?"
el done
rm -rf $R
