#!/bin/bash
# Session 30, call 5. One nvidia-h200 (bash call5.sh <commit>, with OUT set; about 5 minutes):
# the compiled (not interpret-mode) Mosaic GPU tests of the private kernel's knobs, bitwise
# against the default with NaN/inf in every unattended slot, the new `private_zero_unseen=False`
# test on a finite cache, and the shared kernel's schedules.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
R=$OUT/call5; mkdir -p $R
timeout 280 python3 -m pytest tests/test_mosaic_gpu_kernels.py -q -p no:cacheprovider --tb=short \
  -k "TestMosaicGpuKernels and not Interpret and (unguarded or knobs_change_nothing or schedules_change_nothing)" \
  > $R/pytest.txt 2>&1
echo "pytest rc=$?"; tail -25 $R/pytest.txt
