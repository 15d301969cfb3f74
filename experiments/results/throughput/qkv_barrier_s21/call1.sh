#!/bin/bash
# (Results: experiments/results/serving/overlap/s21/ and experiments/results/throughput/qkv_barrier_s21/.)
# Session 21, call 1 (nvidia-h200): (1) which argument makes the overlapped engine's dispatch
# wait (experiments/results/serving/overlap/README.md); (2) the q and kv projections kept apart
# by an optimization barrier on kv's input (XLA's dot merger then has nothing to merge: no
# per-layer wrapped_concatenate, 1.72 ms of a 22.7 ms step at B=1024) against the default.
# Usage: bash .stage/s21/call1.sh <commit>   (carry .stage)
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1
export HYDRAJAX_GIT_COMMIT=$1 JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; tar czf $OUT/r.tgz -C $OUT r; }
F="--model=llama2_7b --prompt_lens=2048 --shared_fracs=1 --sharing=on --rates= \
  --profile_batches=256 --new_tokens=512 --kv_gib=80 --impl=auto --overlap_decode"
for mode in asis device_put block_inputs; do
  HYDRAJAX_PROBE=$mode timeout 100 python3 .stage/s21/dispatch_variants.py $F \
    --workdir=$R/overlap_$mode > $R/overlap_$mode.jsonl 2> $R/overlap_$mode.err
  el "overlap $mode rc=$?"
done
TP="python3 -m experiments.throughput --preset=codellama_7b --impls=mosaic_gpu --profile_kernels=12 \
  --batches=1024,32 --prefixes=1024 --new_tokens=128 --max_decode_s=0.4 --modes=no_attention,tree"
timeout 100 $TP --deadline_s=85 --workdir=$R/qkv_default > $R/qkv_default.log 2>&1
el "qkv default rc=$?"
# The barrier, on this machine's copy only (models/llama.py `_qkv`).
python3 - <<'PY'
p = 'models/llama.py'
s = open(p).read()
old = "  kv = jnp.einsum('btd,dckh->btckh', y, p['wkv'])"
new = ("  kv = jnp.einsum('btd,dckh->btckh', jax.lax.optimization_barrier(y), p['wkv'])")
assert s.count(old) == 1
open(p, 'w').write(s.replace(old, new))
PY
grep -n "optimization_barrier" models/llama.py > $R/qkv_patch.txt
timeout 100 $TP --deadline_s=85 --workdir=$R/qkv_barrier > $R/qkv_barrier.log 2>&1
el "qkv barrier rc=$?"
el done
rm -rf $R
