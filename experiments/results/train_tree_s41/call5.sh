#!/bin/bash
# Session 41, call 5. One nvidia-h200: bash call5.sh <commit>, with OUT set (about 2 minutes).
# After `attend_differentiable` became the one-plan case of the levels' custom VJP: the
# compiled walked tree prefill and the one-plan differentiable attention on the kernels.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
R=$OUT/call5; mkdir -p $R; LOG=$R/log.txt
timeout 100 python3 -m pytest -q -p no:cacheprovider \
  tests/test_mosaic_gpu_training.py::TestTrainingKernels -k \
  "tree_prefill_impl and walked or tree_attention_differentiable_matches_xla" 2>&1 \
  | tail -5 >> $LOG
echo "tests rc=${PIPESTATUS[0]}" | tee -a $LOG
cat $LOG
