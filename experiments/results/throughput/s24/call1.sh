#!/bin/bash
# One nvidia-h200 (bash call1.sh <commit>, with OUT set; about 9 minutes), session 24 call 1:
# (1) the private kernel without Pallas's automatic warpgroup barriers (variant 12,
#     private_explicit_barriers) against the default, alone, at the decode step's MHA shapes
#     (B=1024 P=1K, 9 and 65 tokens a row; B=32 P=1K) and the 32/8 targets (S=128, B=256 S=1,
#     B=32 P=2K), every CHECK_SHAPES entry checked with it (XLA, NaN/inf in unattended slots);
# (2) the CodeLlama-7B decode step: wq/wkv apart (today), one fused wqkv (--fuse_qkv), and
#     apart with the explicit-barrier private kernel.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
R=$OUT/call1; mkdir -p $R/check
timeout 170 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/check --attend_only \
  --check_shapes all --shapes 8,13,10,3,0,4 --variants 0,12 --capacity=128 > $R/check/check.txt 2>&1
echo "check rc=$?"
tar czf $OUT/call1.tgz -C $OUT call1
TP="python3 -m experiments.throughput --preset=codellama_7b --impls=mosaic_gpu --profile_kernels=12 --new_tokens=128 --modes=no_attention,tree --max_decode_s=0.4 --batches=1024,32 --prefixes=1024 --deadline_s=95"
timeout 110 $TP --workdir=$R/apart > $R/apart.log 2>&1; echo "apart rc=$?"
tar czf $OUT/call1.tgz -C $OUT call1
timeout 110 $TP --fuse_qkv --workdir=$R/fused > $R/fused.log 2>&1; echo "fused rc=$?"
tar czf $OUT/call1.tgz -C $OUT call1
timeout 110 $TP --modes=tree --mosaic_gpu_knobs=private_explicit_barriers=true \
  --workdir=$R/barriers > $R/barriers.log 2>&1; echo "barriers rc=$?"
tar czf $OUT/call1.tgz -C $OUT call1 && rm -rf $R
