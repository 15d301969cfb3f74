#!/bin/bash
# One nvidia-h200 (bash call2.sh <commit>, with OUT set; about 4 minutes), session 28 call 2:
# the overlapped shared kernel after the p conversion moved past the PV wait: (1) its schedules
# against the default at small problems (`diagnose.py`); (2) ptxas's report (serialized wgmma?);
# (3) the compiled tests of the schedules.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
D=experiments/results/mosaic_gpu_check/s28
R=$OUT/call2; mkdir -p $R /tmp/ptxas
timeout 200 python3 $D/diagnose.py 2>&1 | grep -v "Unknown config" | tee $R/diagnose.txt
MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=/tmp/ptxas timeout 90 python3 \
  experiments/results/mosaic_gpu_check/s27/ptxas.py shared_overlap=true > $R/ptxas.txt 2>&1
echo "ptxas rc=$?"; cp /tmp/ptxas/shared*.ptxas $R/ 2>/dev/null
grep -h "registers\|spill\|C7513" /tmp/ptxas/shared*.ptxas | sort | uniq -c
timeout 150 python3 -m pytest tests/test_mosaic_gpu_kernels.py -q -p no:cacheprovider --tb=line \
  -k "TestMosaicGpuKernels and not Interpret and shared_schedules" 2>&1 | tail -15 | tee $R/pytest.txt
