#!/bin/bash
# Session 21, call 3: (1) does a Mosaic GPU kernel in a program make its dispatch wait
# (mgpu_dispatch_probe.py); (2) apps_eval, issue 12's H200 run, at this commit.
# Usage: bash .stage/s21/call3.sh <commit>   (carry .stage)
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1
export HYDRAJAX_GIT_COMMIT=$1
R=$OUT/r; mkdir -p $R/apps_eval
T0=$(date +%s)
timeout 150 python3 .stage/s21/mgpu_dispatch_probe.py > $R/mgpu_probe.jsonl 2> $R/mgpu_probe.err
echo "[$(( $(date +%s) - T0 )) s] probe rc=$?"; cat $R/mgpu_probe.jsonl; tail -3 $R/mgpu_probe.err
timeout 420 python3 -m experiments.apps_eval --model=random --preset=codellama_7b --num_problems=120 \
  --samples=128 --new_tokens=512 --fewshot_tokens=2400 --problem_tokens=400 --time_batches=1 \
  --impl=auto --workdir=$R/apps_eval > $R/apps_eval/log.txt 2>&1 || true
echo "[$(( $(date +%s) - T0 )) s] apps_eval done"; tail -4 $R/apps_eval/table.md
