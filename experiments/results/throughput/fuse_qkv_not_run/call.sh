#!/bin/bash
# Ready for a lent nvidia-h200 (bash call.sh <commit>, with OUT set; about 4 minutes): the
# CodeLlama-7B decode step with one q/k/v weight per layer (--fuse_qkv: Llama.fuse_qkv) against
# wq and wkv apart (XLA concatenates them every step: 1.7 ms of a 22.5 ms step at B=1024),
# the same flags otherwise. If it pays, make fusing the default for inference.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/fuse_qkv; mkdir -p $R
TP="python3 -m experiments.throughput --preset=codellama_7b --impls=mosaic_gpu --profile_kernels=12 --new_tokens=128 --modes=no_attention,tree --max_decode_s=0.4 --batches=1024,32 --prefixes=1024 --deadline_s=100"
timeout 115 $TP --fuse_qkv --workdir=$R/fused > $R/fused.log 2>&1; echo "fused rc=$?"
tar czf $OUT/fuse_qkv.tgz -C $OUT fuse_qkv
timeout 115 $TP --workdir=$R/apart > $R/apart.log 2>&1; echo "apart rc=$?"
tar czf $OUT/fuse_qkv.tgz -C $OUT fuse_qkv && rm -rf $R
