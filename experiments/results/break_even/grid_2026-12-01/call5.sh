#!/bin/bash
# Session 22, call 5 on nvidia-h200 (bash call5.sh <commit>, with OUT set): the break-even walks
# on from the 11-30 grid's 38 points (--resume) to n = 256 and 64, and writes the thresholds.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
W=$OUT/r/break_even; mkdir -p $W
cp experiments/results/break_even/grid_2026-11-30/results.jsonl $W/
( while sleep 60; do tar czf $OUT/r.tgz -C $OUT r; done ) &
timeout 400 python3 -m experiments.break_even --timer=cupti --budget_s=330 --resume \
  --workdir=$W --write_thresholds=$W/break_even_h200.json > $W/log.txt 2>&1
echo "break_even rc=$?"
kill %1; tar czf $OUT/r.tgz -C $OUT r; rm -rf $OUT/r
