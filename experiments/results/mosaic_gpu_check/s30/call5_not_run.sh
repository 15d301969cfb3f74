#!/bin/bash
# Not yet run (session 30 had too little device time left to start a machine).
# One nvidia-h200 (bash call5_not_run.sh <commit>, with OUT set; about 3 minutes):
# the compiled (not interpret-mode) Mosaic GPU tests:
# the new `private_zero_unseen=False` test on a finite cache (bitwise the guarded kernel),
# and the shared kernel's schedules (with NaN/inf in every unattended slot).
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
R=$OUT/call5; mkdir -p $R
timeout 150 python3 -m pytest tests/test_mosaic_gpu_kernels.py -q -p no:cacheprovider --tb=short \
  -k "TestMosaicGpuKernels and not Interpret and (unguarded or schedules_change_nothing)" \
  > $R/pytest.txt 2>&1
echo "pytest rc=$?"; tail -25 $R/pytest.txt
