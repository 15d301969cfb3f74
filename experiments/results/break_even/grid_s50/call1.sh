#!/bin/bash
# Written in session 45, run in session 50 (2026-12-05). One nvidia-h200 (bash call1.sh <commit>, with
# OUT set; about 9 minutes), then call2.sh. The break-even grid re-run at a layer of a decode step:
# since session 44 `experiments.break_even` times plans after `for_step` (the lane table built once
# a step, outside the call), and its probe at B=8 / B=32, n=1024 measured 0.66-0.92 where the
# shipped thresholds (grid_2026-12-01, table built in every call) demote (1.05-1.17). The whole
# grid from scratch: B = 8..1024, 32/8 and 32/32 heads, n = 16384 down to 64, the staircase walk.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
W=$OUT/r/break_even; mkdir -p $W
( while sleep 60; do tar czf $OUT/r.tgz -C $OUT r; done ) &
timeout 560 python3 -m experiments.break_even --timer=cupti --budget_s=500 \
  --workdir=$W > $W/log1.txt 2>&1
echo "break_even rc=$?"; wc -l $W/results.jsonl; tail -5 $W/log1.txt
kill %1; tar czf $OUT/r.tgz -C $OUT r; rm -rf $OUT/r
