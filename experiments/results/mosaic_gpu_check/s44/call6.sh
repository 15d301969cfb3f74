#!/bin/bash
# Session 44, call 6. One nvidia-h200 (bash call6.sh <commit>, with OUT set; about 3 minutes).
# `experiments.break_even` now times a layer of a decode step (the lane table built by `for_step`
# outside the timed call). The shipped thresholds (break_even/grid_2026-12-01) timed calls that
# built it, 4.5 µs of XLA against 23-27 µs calls at B=8, n=1024. A probe of the points nearest
# the line there: B=8 and B=32, 32/8 heads, n=1024, r=2, 4, 8 (2026-12-01: ratios 1.047-1.166 at
# B=8, all lost; 1.101 and 0.941 at B=32).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
R=$OUT/call6; mkdir -p $R
timeout 200 python3 -m experiments.break_even --timer=cupti --search=full --batches=8,32 \
  --heads=32:8 --lengths=1024 --rows=2,4,8 --budget_s=150 --workdir=$R/probe > $R/probe.log 2>&1
echo "probe rc=$?"
python3 -c "
import json
for line in open('$R/probe/results.jsonl'):
  r = json.loads(line)
  print(r['batch'], r['length'], r['rows'], r['status'], round(r.get('time_batched_us', 0), 1), round(r.get('time_per_sequence_us', 0), 1), round(r.get('ratio', 0), 3))
"
