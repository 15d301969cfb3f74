#!/bin/bash
# Session 35, call 4, on the machine call 3 left warm (the session's last 112 s of device time):
# the compiled tests of the two changes that call 3's 90 s pytest limit did not reach.
mkdir -p $OUT/call4 && PYTHONPATH=. JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache timeout 85 python3 -m pytest tests/test_mosaic_gpu_training.py -q -p no:cacheprovider --tb=short -k "TestTrainingKernels and not Interpret and (row_parts or unmasked)" > $OUT/call4/pytest_new.txt 2>&1; echo rc=$?; tail -5 $OUT/call4/pytest_new.txt
