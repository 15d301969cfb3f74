#!/bin/bash
# Session 44, call 1. One nvidia-h200 (bash call1.sh <commit>, with OUT set; about 9 minutes).
# The lane table moved out of the per-layer call: `AttentionPlan.for_step` builds it once a
# decode step (the model does, before its layers), and `attend` on such a plan builds none.
# (1) Issue 10's kernel shapes alone (B=256 / B=1024 P=16K S=1, S=128, B=32 P=2K; 32/8), in two
#     processes: `mosaic attend default` (a call that builds its table, as before) next to
#     `... (step plan)` (a layer of a step) and `lane table (for_step)` alone. The first run also
#     checks every CHECK_SHAPES layout against XLA and with NaN/inf in unattended slots.
# (2) The compiled kernel tests that read the lane table, the new step-plan test among them.
# (3) The CodeLlama-7B decode step at B=1024 (P=16K, 1K), modes no_attention and tree, every
#     kernel of a step profiled: the model builds the table once either way (before: XLA's CSE).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call1; mkdir -p $R
for i in 1 2; do
  timeout 170 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/alone$i --attend_only \
    --shapes 0,1,3,4 --variants 0 $([ $i = 1 ] && echo --check_shapes all) > $R/alone$i.txt 2>&1
  echo "alone$i rc=$?"; grep -c '"error"' $R/alone$i/results.jsonl
  python3 -c "
import json
for line in open('$R/alone$i/results.jsonl'):
  r = json.loads(line)
  if r.get('kind') == 'time':
    print(r['shape'], r['impl'], round(r['us'], 1), round(r.get('x_floor', 0), 3))
  elif r.get('kind') == 'ceilings':
    print('ceilings', round(r['matmul_tflops'], 1), round(r['copy_tbps'], 2))
  elif r.get('kind') in ('check', 'garbage') and 'out_rel_l2' in r:
    print(r['kind'], r['shape'], round(r['out_rel_l2'], 5), r.get('garbage_bitwise_equal', r.get('bitwise_equal', '')))
"
done
timeout 150 python3 -m pytest tests/test_mosaic_gpu_kernels.py -q -p no:cacheprovider --tb=short \
  -k "not Interpret and not interpret and (step_plan or lane or matches_xla)" > $R/pytest_kernels.txt 2>&1
echo "pytest kernels rc=$?"; tail -4 $R/pytest_kernels.txt
timeout 200 python3 -m experiments.throughput --preset=codellama_7b --impls=mosaic_gpu \
  --profile_kernels=16 --new_tokens=128 --modes=no_attention,tree --max_decode_s=0.4 \
  --batches=1024 --prefixes=16384,1024 --deadline_s=170 --workdir=$R/grid > $R/grid.log 2>&1
echo "grid rc=$?"; grep '^|' $R/grid/table.md | cut -c1-260; tail -3 $R/grid.log
