#!/bin/bash
# Session 44, call 4. One nvidia-h200 (bash call4.sh <commit>, with OUT set; about 2 minutes).
# Call 3's A/B put the 7B step's attention kernels at 18.1 / 17.6 ms with `for_step` against
# 17.1 / 17.3 without; only one run's per-kernel records came back. One more run of each, every
# kernel of the tree step printed side by side (top 40), raw records kept.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call4; mkdir -p $R
cp models/llama.py /tmp/llama_step_plan.py
sed 's/      plan = plan.for_step()/      pass/' /tmp/llama_step_plan.py > /tmp/llama_per_call.py
for run in per_call step_plan; do
  cp /tmp/llama_$run.py models/llama.py
  timeout 100 python3 -m experiments.throughput --preset=codellama_7b --impls=mosaic_gpu \
    --profile_kernels=40 --new_tokens=128 --modes=no_attention,tree --max_decode_s=0.4 \
    --batches=1024 --prefixes=16384 --deadline_s=80 --workdir=/tmp/ab_$run > $R/ab_$run.log 2>&1
  echo "$run rc=$?"; cp /tmp/ab_$run/raw.jsonl $R/raw_$run.jsonl
done
cp /tmp/llama_step_plan.py models/llama.py
python3 - $R <<'PY'
import json, sys
runs = {}
for run in ('per_call', 'step_plan'):
  for line in open(f'{sys.argv[1]}/raw_{run}.jsonl'):
    r = json.loads(line)
    runs[(run, r['mode'])] = r
for run in ('per_call', 'step_plan'):
  print(run, {m: round(runs[(run, m)]['kernel_step_s'] * 1e3, 2) for m in ('no_attention', 'tree')})
kernels = {run: {k: (us, n) for k, us, n in runs[(run, 'tree')]['top_kernels']} for run in ('per_call', 'step_plan')}
for name in sorted(set(kernels['per_call']) | set(kernels['step_plan']), key=lambda k: -max(kernels['per_call'].get(k, (0,))[0], kernels['step_plan'].get(k, (0,))[0])):
  print(f"{name[:50]:50s} {kernels['per_call'].get(name, ('-', '-'))} {kernels['step_plan'].get(name, ('-', '-'))}")
PY
