#!/bin/bash
# Session 47, call 2. One nvidia-h200 (bash call2.sh <commit> "<knobs>" "<knobs>" ..., with OUT
# set; about 4.5 minutes a knob set). The CodeLlama-7B decode step at B=1024, P=1K and 16K, every
# kernel of one step profiled (`--profile_kernels`), each `--mosaic_gpu_knobs` value in turn
# ("" is the default). Since a57ff0f the profiled step's floor is taken at its own private
# tokens (`kernel_suffix`, one step past the timed ones) and the Mosaic kernels' own sum is
# recorded (`impl_kernels_s`).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
shift; R=$OUT/call2; mkdir -p $R
i=1; n=$#
for knobs in "$@"; do
  left=$(( (585 - SECONDS) / (n - i + 1) ))
  timeout $left python3 -m experiments.throughput --preset=codellama_7b --impls=mosaic_gpu \
    --profile_kernels=64 --new_tokens=128 --modes=no_attention,tree --max_decode_s=0.4 \
    --batches=1024 --prefixes=1024,16384 --deadline_s=$((left - 20)) --mosaic_gpu_knobs="$knobs" \
    --workdir=$R/grid$i > $R/grid$i.log 2>&1
  echo "grid$i knobs=[$knobs] rc=$? left=$left"
  python3 -c "
import json
for l in open('$R/grid$i/throughput.jsonl'):
  r = json.loads(l)
  if r.get('mode') == 'tree' and r.get('status') == 'ok':
    ks = {k: round(us) for k, us, _ in r['top_kernels'] if 'mosaic' in k}
    print(r['prefix'], 'timed suffix', r['suffix_mid'], 'profiled', r.get('kernel_suffix'),
          'attn/floor %.2f' % r['attention_over_floor'],
          'attn kernels/floor %.2f' % r.get('attention_kernel_over_floor', 0),
          'impl kernels/floor %.2f' % r.get('impl_kernels_over_floor', 0), ks)
"
  i=$((i + 1))
done
