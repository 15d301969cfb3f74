#!/bin/bash
# One nvidia-h200 (bash <this> <commit>, with OUT set; about 5 minutes), session 23 call 3:
# the lane table (now the default, variant 0) against the walk (variant 11) at the kernel
# targets' shapes (long rows S=128, B=256 S=1, B=32 P=2K) and the decode step's MHA shape,
# every CHECK_SHAPES entry checked with the table; then the q/kv merge probe.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
R=$OUT/call3; mkdir -p $R/check
timeout 240 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/check --attend_only \
  --check_shapes all --shapes 3,0,4,8 --variants 0,11 --capacity=128 > $R/check/check.txt 2>&1
echo "check rc=$?"
P=experiments/results/throughput/qkv_merge_s23/probe.py
timeout 60 python3 $P > $R/probe.txt 2>&1; echo "probe rc=$?"
XLA_FLAGS=--xla_disable_hlo_passes=dot_merger timeout 60 python3 $P > $R/probe_no_dot_merger.txt 2>&1
echo "probe no dot_merger rc=$?"
tar czf $OUT/call3.tgz -C $OUT call3 && rm -rf $R
