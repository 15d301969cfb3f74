#!/bin/bash
# Session 22, call 6 on nvidia-h200 (bash call6.sh, with OUT set): the shared kernel's time against
# its kv split count at 13B's per-GPU shapes (20 and 40 MHA heads, B=1024, P=16K): the default
# (launch estimate: 4 and 2 splits) and splits capped at 1, 2, 3.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 230 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $OUT --attend_only \
  --shapes 12,11 --variants 0,8,9,10 > $OUT/check.txt 2>&1
echo "rc=$?"
