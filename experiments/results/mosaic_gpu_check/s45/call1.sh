#!/bin/bash
# Session 45, call 1 (never run as is: session 46 ran its successor, `../s46/call1.sh`). One nvidia-h200 (bash call1.sh
# <commit>, with OUT set; about 9 minutes). Token lanes in the private kernel
# (`MosaicGpuConfig.private_token_lanes`: a lane is one token of 8 kv heads, so a step copies only
# tokens the rows hold), against the default (chunk lanes), the kernels alone:
# (1) issue 10's 32/8 shapes (B=256 / B=1024 P=16K S=1, S=128, B=32 P=2K), variants 0 (default)
#     and 20 (token lanes); every CHECK_SHAPES layout checked against XLA and with NaN/inf in
#     unattended slots under both;
# (2) the CodeLlama-7B decode step's shapes (32/32, 128-token pages, layer 31 of 32): B=1024 at
#     P=1K and P=16K with 8 and 9 private tokens a row (chunk lanes read 16 tokens' bytes at 9);
# (3) the compiled token-lane tests.
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
          {k: round(v, 1) for k, v in r.get('kernels', {}).items()})
  elif r.get('kind') == 'ceilings':
    print('ceilings', round(r['matmul_tflops'], 1), round(r['copy_tbps'], 2))
  elif r.get('kind') in ('check', 'garbage') and 'out_rel_l2' in r:
    print(r['kind'], r['shape'], r.get('variant', r.get('impl')), round(r['out_rel_l2'], 5),
          r.get('garbage_bitwise_equal', r.get('bitwise_equal', '')))
  elif r.get('kind') == 'error':
    print('ERROR', r.get('shape'), r.get('variant', r.get('impl')), r['error'][-600:])
"
}
timeout 250 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/gqa --attend_only \
  --shapes 0,1,3,4 --variants 0,20 --check_shapes all > $R/gqa.txt 2>&1
echo "gqa rc=$?"; show $R/gqa
timeout 170 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/mha --attend_only \
  --shapes 7,8,5,6 --variants 0,20 --capacity=128 --deep_layer=31 > $R/mha.txt 2>&1
echo "mha rc=$?"; show $R/mha
timeout 100 python3 -m pytest tests/test_mosaic_gpu_kernels.py tests/test_mosaic_gpu_lowering.py \
  -q -p no:cacheprovider --tb=short -k "not Interpret and token_lanes" > $R/pytest.txt 2>&1
echo "pytest rc=$?"; tail -4 $R/pytest.txt
