#!/bin/bash
# Session 32, call 1. One nvidia-h200 (bash call1.sh <commit>, with OUT set; about 9 minutes):
# dQ computed in the dK/dV kernel and TMA-reduce-added into float32 (TrainingKernelConfig.fused_dq:
# 1 = each warpgroup adds its own [64, 128] partial, 2 = the two warpgroups split H), against the
# default (dQ kernel + dK/dV kernel) in the same run.
# (1) check_training.py: each config checked against its jnp reference on the small shapes
#     (compiled), then timed (CUPTI) at the benchmark shapes;
# (2) ptxas's register report of the fused dK/dV kernels;
# (3) experiments.train_bench at issue 15's point, per-sequence cuDNN, the default, fused 1, fused 2.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
D=experiments/results/train_fused_dq
R=$OUT/call1; mkdir -p $R
timeout 300 python3 pallas_kernels/mosaic_gpu/check_training.py --configs=';fused_dq=1;fused_dq=2' \
  --out $R/check > $R/check.txt 2>&1
echo "check rc=$?"; grep -v "^check" $R/check.txt | grep -v Warning | tail -30
MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=$R/dump timeout 120 python3 $D/ptxas_fused.py 1 2 \
  > $R/ptxas.txt 2>&1
echo "ptxas rc=$?"; grep -h "Compiling entry\|Used\|spill" $R/dump/*.ptxas 2>/dev/null | head -20
rm -rf $R/dump
P='--nosmoke --points=64:8192:1024 --step_points='
timeout 100 python3 -m experiments.train_bench $P --impls=per_seq_cudnn,shared_mosaic_gpu \
  --workdir=$R/bench_default > $R/bench_default.txt 2>&1
echo "bench default rc=$?"; tail -4 $R/bench_default.txt
for mode in 1 2; do
  timeout 80 python3 -m experiments.train_bench $P --impls=shared_mosaic_gpu \
    --training_kernel_knobs=fused_dq=$mode --workdir=$R/bench_fused$mode > $R/bench_fused$mode.txt 2>&1
  echo "bench fused $mode rc=$?"; tail -3 $R/bench_fused$mode.txt
done
