#!/bin/bash
# Session 30, call 1 (was s29/call7_not_run.sh). One nvidia-h200 (bash call1.sh
# <commit>, with OUT set; about 8 minutes): the shared kernel's overlap, on by default since
# session 29 for programs of 16 kv blocks or more (`segment_attention.overlaps`).
# (1) every CHECK_SHAPES entry at the default (0) and with the overlap everywhere (16), against
#     XLA and with NaN/inf in unattended slots (session 29 checked the one-sided turns only at
#     B=256/1024 P=16K and in the compiled schedule test);
# (2) kernels alone, overlap everywhere (16), nowhere (17) and the default (0), at programs of
#     9-17 blocks, where the threshold was not measured: B=1024 P=1K 9 tokens 32/32 (9 blocks),
#     B=32 P=16K 9 tokens 32/32, and the 7B decode shape B=1024 P=16K 8 tokens 32/32.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call7; mkdir -p $R/check $R/time
timeout 250 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/check --attend_only \
  --check_shapes all --shapes '' --variants 0,16 --capacity=128 > $R/check/check.txt 2>&1
echo "check rc=$?"; grep -c '"error"' $R/check/results.jsonl
grep -o '"shape": \[[^]]*\]\|"out_rel_l2": [^,]*\|"garbage_bitwise_equal": [a-z]*\|"nan": [a-z]*' \
  $R/check/results.jsonl | paste -sd' ' | head -c 3000; echo
timeout 280 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/time --attend_only \
  --shapes 8,9,5 --variants 16,17,0 --capacity=128 > $R/time/time.txt 2>&1
echo "time rc=$?"; grep '^|' $R/time/time.txt | grep -v xla
