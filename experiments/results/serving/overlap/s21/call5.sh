#!/bin/bash
# Session 21, call 5: the overlapped serving profile at the static sampling mode (no lax.cond
# in the step), against the waited engine; as experiments/results/serving/overlap/README.md.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1
export HYDRAJAX_GIT_COMMIT=$1 JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/r; mkdir -p $R
F="--model=llama2_7b --prompt_lens=2048 --shared_fracs=1 --sharing=on --rates= \
  --profile_batches=256 --new_tokens=512 --kv_gib=80 --impl=auto"
for v in overlap waited; do
  X=""; [ $v = overlap ] && X=--overlap_decode
  timeout 200 python3 -m experiments.serving $F $X --workdir=$R/$v > $R/$v.log 2>&1
  echo "$v rc=$?"; grep -o "'mean_decode_step_ms[^}]*device_ms': [0-9.]*" $R/$v.log | head -2
done
