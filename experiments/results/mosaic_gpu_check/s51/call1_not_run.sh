#!/bin/bash
# Session 51, prepared, not run (no GPU was lent). One nvidia-h200 (`needs_h200`: the B=1024 step
# does not fit an H100), OUT set: bash call1_not_run.sh <commit>. The CodeLlama-7B decode step at
# B=1024, P=1K and 16K, every kernel of one step profiled, as s50 ran it, twice in one call: the
# library's compile options (XLA's rematerialization pass off for programs over a cache), then
# the pass on again (`--compiler_options`), in that order and then once more the default.
# Expected (experiments/results/xla_programs/): the tree step ~0.35 ms shorter with the pass off.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call1; mkdir -p $R
i=1
for options in '' '{"xla_disable_hlo_passes": ""}' ''; do
  left=$(( (585 - SECONDS) / (4 - i) ))
  timeout $left python3 -m experiments.throughput --preset=codellama_7b --impls=mosaic_gpu \
    --profile_kernels=64 --new_tokens=128 --modes=no_attention,tree --max_decode_s=0.4 \
    --batches=1024 --prefixes=1024,16384 --deadline_s=$((left - 20)) \
    --compiler_options="$options" --workdir=$R/grid$i > $R/grid$i.log 2>&1
  echo "grid$i options=[$options] rc=$? left=$left"
  python3 -c "
import json
for l in open('$R/grid$i/throughput.jsonl'):
  r = json.loads(l)
  if r.get('status') == 'ok':
    print(r['mode'], r['prefix'], 'step ms %.2f' % (r['step_s'] * 1e3),
          'program GiB %.1f' % (r.get('program_bytes', 0) / 2**30),
          'attn/floor %.2f' % r.get('attention_over_floor', 0),
          'matched/floor %.2f' % r.get('attention_kernel_matched_over_floor', 0),
          'impl/floor %.2f' % r.get('impl_kernels_over_floor', 0))
"
  i=$((i + 1))
done
