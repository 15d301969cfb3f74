#!/bin/bash
# Session 44, call 2. One nvidia-h200 (bash call2.sh <commit>, with OUT set; about 7 minutes).
# (1) The compiled step-plan test (call 1's compiled tests hit their limit while compiling).
# (2) An A/B of the CodeLlama-7B decode step at B=1024, P=16K (call 1: attention kernels 18.2 ms a
#     step, against 17.2-17.4 in sessions 29-30): the model as committed (`for_step` before the
#     layers) and, on this machine's copy only, with that line taken out (each layer's call builds
#     the table and XLA's CSE keeps one: the code before this session), alternated, twice each.
# (3) The kernels alone at B=1024, P=16K, S=1, 32/8, twice more (call 1 timed it once per form).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call2; mkdir -p $R
timeout 120 python3 -m pytest tests/test_mosaic_gpu_kernels.py -q -p no:cacheprovider --tb=short \
  -k "TestMosaicGpuKernels and not Interpret and step_plan" > $R/pytest.txt 2>&1
echo "pytest rc=$?"; tail -3 $R/pytest.txt
cp models/llama.py /tmp/llama_step_plan.py
grep -v '      plan = plan.for_step()' /tmp/llama_step_plan.py > /tmp/llama_per_call.py
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
for i in 1 2; do
  timeout 80 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/alone$i --attend_only \
    --shapes 1 --variants 0 > $R/alone$i.txt 2>&1
  echo "alone$i rc=$?"; grep '^|' $R/alone$i.txt | grep -v xla
done
