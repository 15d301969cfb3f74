#!/bin/bash
# Session 30, call 3. One nvidia-h200 (bash call3.sh <commit>, with OUT set; about 5 minutes):
# (1) 192-token shared-kernel steps (14) now that `segment_attention.overlaps` leaves the overlap
#     off there (call 2 ran them with it: 704 µs), against the default (0), B=1024 and B=256
#     P=16K 32/8;
# (2) the private kernel's step profiled (in-kernel profiler, time per named region) at the 7B
#     decode shapes: B=1024 P=16K 8 private tokens a row, and B=1024 P=1K 9 tokens, 32/32.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call3; mkdir -p $R/time $R/prof
timeout 200 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/time --attend_only \
  --shapes 1,0 --variants 14,0 --capacity=128 > $R/time/time.txt 2>&1
echo "time rc=$?"; grep '^|' $R/time/time.txt | grep -v xla
timeout 250 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/prof --attend_only \
  --shapes 5,8 --variants 0 --capacity=128 --profile > $R/prof/prof.txt 2>&1
echo "prof rc=$?"; grep '^|' $R/prof/prof.txt | grep -v xla
python3 -c "
import json
for path in ('$R/time/results.jsonl', '$R/prof/results.jsonl'):
  for line in open(path):
    r = json.loads(line)
    if r.get('kind') == 'profile':
      print(r['shape'], json.dumps(r['regions'])[:2500])
    elif r.get('kind') == 'time':
      print(r['shape'], r['impl'], round(r['us'], 1), json.dumps(r.get('kernels'))[:300])
"
rm -rf $R/prof/profile
