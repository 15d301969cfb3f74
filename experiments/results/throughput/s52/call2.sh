#!/bin/bash
# Session 52, one nvidia-h200 (`needs_h200`: the B=1024 step does not fit an H100), OUT set:
# bash call2.sh <commit> [batches: 1024,32 by default; 512,32 on an H100] [seconds, 585]. The CodeLlama-7B
# decode step at P=1K, no attention and tree, every kernel of one step profiled: wq/wkv apart
# (the default), fused (`--fuse_qkv`, at tp=1 now [D, 1, N + 2K, H], the order of XLA's own
# concatenation), apart again.
# The question: does XLA keep the cuBLAS GEMM for the fused weight (s24's grouped layout got a
# slower Triton GEMM) and the step lose the 1.7 ms concatenation?
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call2; mkdir -p $R
i=1
for fuse in false true false; do
  left=$(( (${3:-585} - SECONDS) / (4 - i) ))
  timeout $left python3 -m experiments.throughput --preset=codellama_7b --impls=mosaic_gpu \
    --profile_kernels=64 --new_tokens=128 --modes=no_attention,tree --max_decode_s=0.4 \
    --batches=${2:-1024,32} --prefixes=1024 --deadline_s=$((left - 20)) \
    --fuse_qkv=$fuse --workdir=$R/grid$i > $R/grid$i.log 2>&1
  echo "grid$i fuse_qkv=$fuse rc=$? left=$left"
  python3 -c "
import json
for l in open('$R/grid$i/throughput.jsonl'):
  r = json.loads(l)
  if r.get('status') == 'ok':
    print(r['mode'], r['batch'], r['prefix'], 'step ms %.2f' % (r['step_s'] * 1e3),
          'attn/floor %.2f' % r.get('attention_over_floor', 0),
          'matched/floor %.2f' % r.get('attention_kernel_matched_over_floor', 0))
    for name, us, n in r.get('top_kernels', [])[:6]:
      print('   %8.0f us x%-4d %s' % (us, n, name[:90]))
"
  i=$((i + 1))
done
