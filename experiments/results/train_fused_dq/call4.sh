#!/bin/bash
# Session 32, call 4. One nvidia-h200 (bash call4.sh <commit>, with OUT set; about 6 minutes):
# call 3's compiled tests ran out of their 200 s after the 19 kernel tests (all passed, the fused
# and the dQ-kernel backward included); here the rest: tree attention, scattered pages, prefill
# and the GRPO step on the compiled kernels (the fused dQ by default), and the plan's tests.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
R=$OUT/call4; mkdir -p $R
timeout 450 python3 -m pytest tests/test_mosaic_gpu_training.py tests/test_training_plan.py -q \
  -p no:cacheprovider --tb=short -k "(TestTrainingKernels and not Interpret and (tree_attention \
or scattered or prefill or grpo)) or test_training_plan" > $R/pytest.txt 2>&1
echo "pytest rc=$?"; tail -8 $R/pytest.txt
