#!/bin/bash
# One nvidia-h200 (bash call2.sh <commit>, with OUT set; about 4 minutes), session 29 call 2:
# the shared kernel alone with its steady-state V (then K and V) refills skipped (`l2_probe.py`):
# does it wait on its K/V reads?
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
R=$OUT/call2; mkdir -p $R
timeout 500 python3 experiments/results/mosaic_gpu_check/s29/l2_probe.py $R/probe.jsonl 2>&1 \
  | grep -v "Unknown config" | tail -20
