#!/bin/bash
# Session 33, call 2. One nvidia-h200 (bash call2.sh <commit>, with OUT set; about 8 minutes).
# Call 1's kernels-alone runs stopped at a missing --out folder (check_on_device makes it now)
# and its compiled tests hit their 200 s limit after one failure (the two-device mesh of
# test_one_lane_table_serves_every_layer on a one-GPU host; the mesh takes the devices there are
# now). So:
# (1) the kernels alone at issue 10's two near-miss shapes (B=256 and B=1024, P=16K, S=1, 32/8;
#     s29-s31: 1.49-1.53x and 1.31x), twice, and every CHECK_SHAPES layout checked;
# (2) the compiled kernel tests that read the lane table, then the training kernels' tests.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call2; mkdir -p $R
for i in 1 2; do
  timeout 150 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/time$i --attend_only \
    --shapes 0,1 --variants 0 $([ $i = 1 ] && echo --check_shapes all) > $R/time$i.txt 2>&1
  echo "time$i rc=$?"; grep -c '"error"' $R/time$i/results.jsonl
  python3 -c "
import json
for line in open('$R/time$i/results.jsonl'):
  r = json.loads(line)
  if r.get('kind') == 'time':
    print(r['shape'], r['impl'], round(r['us'], 1), round(r['x_floor'], 3), {k: round(v, 2) for k, v in r['kernels'].items()})
  elif r.get('kind') == 'check' and 'out_rel_l2' in r:
    print('check', r['shape'], round(r['out_rel_l2'], 5), r.get('garbage_bitwise_equal', ''))
"
done
timeout 200 python3 -m pytest tests/test_mosaic_gpu_kernels.py -q -p no:cacheprovider --tb=short \
  -k "not Interpret and not interpret and (lane or private_kernel or matches_xla)" > $R/pytest_kernels.txt 2>&1
echo "pytest kernels rc=$?"; tail -8 $R/pytest_kernels.txt
timeout 150 python3 -m pytest tests/test_mosaic_gpu_training.py -q -p no:cacheprovider --tb=short \
  -k "not Interpret and not interpret and (backward or prefill)" > $R/pytest_training.txt 2>&1
echo "pytest training rc=$?"; tail -8 $R/pytest_training.txt
