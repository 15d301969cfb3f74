#!/bin/bash
# One nvidia-h200 (bash call1.sh <commit>, with OUT set; about 9 minutes), session 28 call 1:
# the shared kernel's intra-warpgroup overlap (`shared_overlap`, variant 13; 14 without the
# warpgroups' turns, 15 the default order without turns).
# (1) the compiled tests of the schedules (bitwise the default's, NaN/inf in unattended slots);
# (2) ptxas's report of the overlapped kernel (registers, spills, serialized wgmma);
# (3) every CHECK_SHAPES entry with 13 (XLA, NaN/inf in unattended slots), then kernels alone:
#     13, the default (0), 14, 15 at B=256 P=16K S=1 32/8, B=1024 P=16K 8 tokens 32/32,
#     B=32 P=2K 32/8.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call1; mkdir -p $R/check $R/ptxas
timeout 150 python3 -m pytest tests/test_mosaic_gpu_kernels.py -q -p no:cacheprovider \
  -k "TestMosaicGpuKernels and not Interpret and shared_schedules" > $R/pytest.txt 2>&1
echo "pytest rc=$?"; tail -3 $R/pytest.txt
MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=$R/ptxas timeout 90 python3 \
  experiments/results/mosaic_gpu_check/s27/ptxas.py shared_overlap=true > $R/ptxas/ptxas.txt 2>&1
echo "ptxas rc=$?"; grep -h "registers\|spill\|serializ" $R/ptxas/*.ptxas $R/ptxas/ptxas.txt | head -20
tar czf $OUT/call1.tgz -C $OUT call1
timeout 330 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/check --attend_only \
  --check_shapes all --shapes 0,5,4 --variants 13,0,14,15 --capacity=128 > $R/check/check.txt 2>&1
echo "check rc=$?"; grep '^|' $R/check/check.txt
tar czf $OUT/call1.tgz -C $OUT call1 && rm -rf $R
