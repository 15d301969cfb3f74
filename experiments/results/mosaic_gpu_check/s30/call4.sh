#!/bin/bash
# Session 30, call 4. One nvidia-h200 (bash call4.sh <commit>, with OUT set; about 4 minutes):
# what the private kernel's NaN/inf guard costs. Kernels alone, `private_zero_unseen=False`
# (variant 19: no zeroing of V rows past a partial chunk's valid tokens; right only on caches
# whose unattended slots are finite, as these random ones are) against the default (0):
# B=1024 P=1K 9 and 65 private tokens a row (every step partial; one partial step in nine),
# B=1024 P=16K 8 tokens (no partial step), 32/32; B=256 P=16K 1 token and B=32 P=2K, 32/8.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call4; mkdir -p $R
timeout 400 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R --attend_only \
  --shapes 8,13,5,0,4 --variants 19,0 --capacity=128 > $R/time.txt 2>&1
echo "time rc=$?"; grep '^|' $R/time.txt | grep -v xla
python3 -c "
import json
for line in open('$R/results.jsonl'):
  r = json.loads(line)
  if r.get('kind') == 'time' and r['impl'] != 'xla':
    k = r.get('kernels') or {}
    print(r['shape'], r['impl'], round(r['us'], 1), {n: round(v, 1) for n, v in k.items() if 'kernel' in n})
  elif r.get('kind') == 'error':
    print(r)
"
