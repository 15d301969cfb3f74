#!/bin/bash
# Session 55, one Hopper GPU, OUT set: bash gpu_tests.sh [seconds, 540] [test files, all five].
# The tests that run only on a Hopper GPU (CI has none), compiled: the tree-attention kernels
# (TestMosaicGpuKernels), the conformance base's compiled backend (TestMosaicGpuCompiled), the
# training kernels (TestTrainingKernels), and the dispatch / training-plan tests that ask for
# Hopper. One pytest run, its report in $OUT/pytest.txt, a line a test (-v: a run cut by the
# timeout still says which passed; call 2 ran -q and was cut at 190 of 228 tests, all passed).
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T=${1:-540}
FILES="${*:2}"
[ -n "$FILES" ] || FILES="tests/test_mosaic_gpu_kernels.py tests/test_mosaic_gpu_conformance.py
  tests/test_mosaic_gpu_training.py tests/test_dispatch.py tests/test_training_plan.py"
# Four workers share the GPU (memory grows on demand) where pytest-xdist is installed: the
# kernels' compiles are host work.
N=""; python3 -c "import xdist" 2>/dev/null && N="-n 4"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout $((T - 10)) python3 -m pytest $N -v -p no:cacheprovider --tb=short -rfEs --durations=15 \
  $FILES -k "not Interpret" > $OUT/pytest.txt 2>&1
echo "pytest rc=$?"; grep -cE " PASSED" $OUT/pytest.txt; grep -E "passed|failed|FAILED|ERROR" $OUT/pytest.txt | tail -30
