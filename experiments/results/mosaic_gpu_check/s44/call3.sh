#!/bin/bash
# Session 44, call 3. One nvidia-h200 (bash call3.sh <commit>, with OUT set; about 4 minutes).
# Call 2's A/B, again: its "per_call" runs stopped at an IndentationError (the line was deleted
# from under its `if`; here it becomes `pass`). Only the A/B.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call3; mkdir -p $R
cp models/llama.py /tmp/llama_step_plan.py
sed 's/      plan = plan.for_step()/      pass/' /tmp/llama_step_plan.py > /tmp/llama_per_call.py
grep -c 'for_step()' /tmp/llama_step_plan.py /tmp/llama_per_call.py
i=1
for run in step_plan per_call step_plan per_call; do
  cp /tmp/llama_$run.py models/llama.py
  timeout 100 python3 -m experiments.throughput --preset=codellama_7b --impls=mosaic_gpu \
    --profile_kernels=16 --new_tokens=128 --modes=no_attention,tree --max_decode_s=0.4 \
    --batches=1024 --prefixes=16384 --deadline_s=80 --workdir=$R/ab_$run$i > $R/ab_$run$i.log 2>&1
  echo "$run rc=$?"; grep '^| tree' $R/ab_$run$i/table.md | cut -d'|' -f2-13
  i=$((i + 1))
done
cp /tmp/llama_step_plan.py models/llama.py
