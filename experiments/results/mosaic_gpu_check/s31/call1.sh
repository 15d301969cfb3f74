#!/bin/bash
# Session 31, call 1 (session 30 left (1) and (2) as s30/call5_not_run.sh, removed once run; (3) is new).
# One nvidia-h200 (bash call1.sh <commit>, with OUT set; about 7 minutes):
# (1) the compiled (not interpret-mode) Mosaic GPU tests: the new `private_zero_unseen=False`
#     test on a finite cache (bitwise the guarded kernel), and the shared kernel's schedules
#     (with NaN/inf in every unattended slot);
# (2) every CHECK_SHAPES layout with the overlap forced on (variant 16). Their programs are
#     3-9 kv blocks, so the default (call 1) ran them all in order; `check_on_device.py` now
#     checks each of --variants (before session 30 only the first).
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
R=$OUT/call1; mkdir -p $R/check
timeout 150 python3 -m pytest tests/test_mosaic_gpu_kernels.py -q -p no:cacheprovider --tb=short \
  -k "TestMosaicGpuKernels and not Interpret and (unguarded or schedules_change_nothing)" \
  > $R/pytest.txt 2>&1
echo "pytest rc=$?"; tail -25 $R/pytest.txt
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
timeout 150 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/check --attend_only \
  --check_shapes all --shapes '' --variants 16 > $R/check.txt 2>&1
echo "check rc=$?"; grep -c '"error"' $R/check/results.jsonl
grep -o '"shape": \[[^]]*\]\|"out_rel_l2": [^,]*\|"garbage_bitwise_equal": [a-z]*' \
  $R/check/results.jsonl | paste -sd' '
# (3) A non-wgmma private decode kernel in Pallas Triton (s31/triton_private_probe.py): exact
#     reads of each row's valid tokens, against the Mosaic GPU private kernel's times at the
#     same shapes (s30 call 4: 95.2 µs at B=1024 9 tokens 32/32, 56.2 at 8, 317.1 at 65).
timeout 280 python3 experiments/results/mosaic_gpu_check/s31/triton_private_probe.py \
  --out $R/triton > $R/triton.txt 2>&1
echo "triton rc=$?"; grep -v Warning $R/triton.txt | tail -60
