#!/bin/bash
# Session 46, call 2. One nvidia-h200 (bash call2.sh <commit>, with OUT set; about 9.5
# minutes). Call 1 faulted (CUDA_ERROR_MISALIGNED_ADDRESS) at the first token-lane layout with
# lse stored straight into [B*T, K, G] (G = 4: a strided TMA store per kv head from a 32-byte
# aligned shared-memory row); token lanes now store lse folded there
# (`PrivateProblem.direct_lse`). So again, with token lanes (variant 20) against the default:
# (1) every CHECK_SHAPES layout against XLA and with NaN/inf in unattended slots, and issue
#     10's 32/8 kernel shapes plus the 16/4 tensor-parallel shard (SHAPES 0, 1, 3, 4, 14, 15);
# (2) the CodeLlama-7B decode step at B=1024, P=1K and 16K, every kernel profiled: the default,
#     then `--mosaic_gpu_knobs=private_token_lanes=true` (one run each: no time for more).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call2; mkdir -p $R
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
timeout 300 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/gqa --attend_only \
  --shapes 0,1,3,4,14,15 --variants 0,20 --check_shapes all > $R/gqa.txt 2>&1
echo "gqa rc=$?"; show $R/gqa
i=1
for knobs in "" private_token_lanes=true; do
  left=$((585 - SECONDS)); [ $i = 1 ] && left=$(( (585 - SECONDS) / 2 ))
  timeout $left python3 -m experiments.throughput --preset=codellama_7b --impls=mosaic_gpu \
    --profile_kernels=16 --new_tokens=128 --modes=no_attention,tree --max_decode_s=0.4 \
    --batches=1024 --prefixes=1024,16384 --deadline_s=$((left - 20)) --mosaic_gpu_knobs="$knobs" \
    --workdir=$R/grid$i > $R/grid$i.log 2>&1
  echo "grid$i knobs=[$knobs] rc=$? left=$left"; grep '^|' $R/grid$i/table.md | cut -c1-260; tail -2 $R/grid$i.log
  i=$((i + 1))
done
