#!/bin/bash
# Session 31, call 2. One nvidia-h200 (bash call2.sh <commit>, with OUT set; about 3 minutes):
# the Triton probe's dot-based variant (contiguous [bt, hb, H] loads, tensor-core scores masked
# to each q row's head) against call 1's gather variant and the Mosaic GPU private kernel.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
R=$OUT/call2; mkdir -p $R
timeout 280 python3 experiments/results/mosaic_gpu_check/s31/triton_private_probe.py \
  --out $R > $R/triton.txt 2>&1
echo "triton rc=$?"; grep -v Warning $R/triton.txt | cut -c1-400 | tail -40
