#!/bin/bash
# Ready for the next session with an H200 (written in session 46, not run). One nvidia-h200
# (bash call1.sh <commit>, with OUT set; about 7 minutes). Token lanes at long private rows with
# many programs: `private_token_lanes=None` keeps chunk lanes when a row may hold more than 64
# private tokens, because at B=256, 32/8, 128 tokens a row token lanes were slower (s46: the
# private kernel 40.6 -> 50.3 µs, 128 programs). At B=1024 they make 512 programs; if they are
# no slower there (and at 65 tokens), the capacity condition can go and the CodeLlama-7B decode
# step (capacity 128) gets token lanes (s46: its two kernels 4326 -> 3593 µs a step at P=1K).
# Variant 0 is the default (chunk lanes at these capacities), 20 token lanes.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call1; mkdir -p $R
timeout 250 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/mha --attend_only \
  --shapes 13,17,8 --variants 0,20 --capacity=128 --deep_layer=31 > $R/mha.txt 2>&1
echo "mha rc=$?"
timeout 150 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/gqa --attend_only \
  --shapes 16,3 --variants 0,20 > $R/gqa.txt 2>&1
echo "gqa rc=$?"
grep '^|' $R/mha.txt $R/gqa.txt
# The compiled token-lane tests (call 1 of s46 ran into the fault before they could pass).
timeout $((560 - SECONDS)) python3 -m pytest tests/test_mosaic_gpu_kernels.py -q -p no:cacheprovider \
  --tb=short -k "not Interpret and token_lanes" > $R/pytest.txt 2>&1
echo "pytest rc=$?"; tail -4 $R/pytest.txt
