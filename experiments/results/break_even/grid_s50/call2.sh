#!/bin/bash
# Written in session 45, run in session 50 (2026-12-05). One nvidia-h200 (bash call2.sh <commit> <call1's r.tgz>, with OUT
# set; about 9 minutes): call 1's walk goes on (--resume) and writes the thresholds; copy
# break_even_h200.json to hydrajax/data/ only if write_thresholds accepted it (no measured shape
# kept shared where batched was more than 3% slower).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
mkdir -p $OUT/r && tar xzf $2 -C $OUT
W=$OUT/r/break_even
( while sleep 60; do tar czf $OUT/r.tgz -C $OUT r; done ) &
timeout 560 python3 -m experiments.break_even --timer=cupti --budget_s=480 --resume \
  --workdir=$W --write_thresholds=$W/break_even_h200.json > $W/log2.txt 2>&1
echo "break_even rc=$?"; wc -l $W/results.jsonl; tail -8 $W/log2.txt
kill %1; tar czf $OUT/r.tgz -C $OUT r; rm -rf $OUT/r
