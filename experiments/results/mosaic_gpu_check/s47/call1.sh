#!/bin/bash
# Session 47, call 1. One nvidia-h200 (bash call1.sh <commit>, with OUT set; about 9 minutes).
# (1) s47_ready's question, whether token lanes lose at long private rows with many programs
#     (B=1024: 512 programs; 65 and 128 tokens a row, 32/32 at a 128-token capacity; 128 tokens
#     at 32/8), which decides `TOKEN_LANES_MAX_CAPACITY` (variant 0 the default, 20 token lanes);
# (2) `private_token_runs` (variant 22, new, built with no GPU): a step of one row's
#     consecutive tokens of all 8 kv heads as one copy, at 32/8 with 128 and 1 tokens a row,
#     after the check layouts token lanes take at K = 8, 4, 2 (against XLA, and bitwise with
#     NaN/inf in unattended slots);
# (3) the compiled token-lane and token-run tests.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call1; mkdir -p $R
show() {
  python3 -c "
import json
for line in open('$1/results.jsonl'):
  r = json.loads(line)
  if r.get('kind') == 'time':
    print(r['shape'], r['impl'], round(r['us'], 1), round(r.get('x_floor', 0), 3),
          {k: round(v, 1) for k, v in r.get('kernels', {}).items() if 'mosaic' in k})
  elif r.get('kind') == 'ceilings':
    print('ceilings', round(r['matmul_tflops'], 1), round(r['copy_tbps'], 2))
  elif r.get('kind') in ('check', 'garbage') and 'out_rel_l2' in r:
    print(r['kind'], r['shape'], r.get('variant', r.get('impl')), round(r['out_rel_l2'], 5),
          r.get('garbage_bitwise_equal', r.get('bitwise_equal', '')))
  elif r.get('kind') == 'error':
    print('ERROR', r.get('shape'), r.get('variant', r.get('impl')), r['error'][-300:])
"
}
timeout 190 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/mha --attend_only \
  --shapes 13,17,8 --variants 0,20 --capacity=128 > $R/mha.txt 2>&1
echo "mha rc=$?"; show $R/mha
timeout 230 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/gqa --attend_only \
  --shapes 16,3,1 --variants 0,20,22 --check_shapes 2,3,8,9,10 > $R/gqa.txt 2>&1
echo "gqa rc=$?"; show $R/gqa
timeout $((570 - SECONDS)) python3 -m pytest tests/test_mosaic_gpu_kernels.py -q -p no:cacheprovider \
  --tb=short -k "not Interpret and (token_lanes or token_runs)" > $R/pytest.txt 2>&1
echo "pytest rc=$?"; tail -4 $R/pytest.txt
