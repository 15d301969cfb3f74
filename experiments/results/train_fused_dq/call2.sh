#!/bin/bash
# Session 32, call 2. One nvidia-h200 (bash call2.sh <commit>, with OUT set; about 6 minutes).
# Call 1: fused_dq=1 slower (segment backward 58.3 ms against 49.6), fused_dq=2 about even in
# train_bench (74.8 against 75.4 ms) but its check failed at H=64 (now: mode 1 there).
# (1) check_training.py: fused_dq=2 and 3 (3: a step late, so the warpgroups drift) checked and
#     timed; (2) the same with the reduce-adds dropped (timing probe: what the reductions cost);
# (3) train_bench, fused_dq=3 against per-sequence cuDNN (rel err); (4) ptxas registers.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
D=experiments/results/train_fused_dq
R=$OUT/call2; mkdir -p $R
timeout 200 python3 pallas_kernels/mosaic_gpu/check_training.py --configs='fused_dq=2;fused_dq=3' \
  --out $R/check > $R/check.txt 2>&1
echo "check rc=$?"; grep -v "^check" $R/check.txt | grep -v Warning | tail -12
timeout 120 python3 $D/no_reduce_probe.py 2 3 > $R/no_reduce.txt 2>&1
echo "probe rc=$?"; grep "==\|^backward\|^forward" $R/no_reduce.txt
P='--nosmoke --points=64:8192:1024 --step_points='
timeout 100 python3 -m experiments.train_bench $P --impls=per_seq_cudnn,shared_mosaic_gpu \
  --training_kernel_knobs=fused_dq=3 --workdir=$R/bench_fused3 > $R/bench_fused3.txt 2>&1
echo "bench fused 3 rc=$?"; tail -4 $R/bench_fused3.txt
MOSAIC_GPU_DUMP_PTXAS=1 timeout 120 python3 $D/ptxas_fused.py 0 1 2 3 > $R/ptxas_full.txt 2>&1
echo "ptxas rc=$?"; grep -i "fused_dq\|Compiling entry\|Used [0-9]* registers\|spill" $R/ptxas_full.txt \
  | grep -v "0 bytes spill" | head -40 > $R/ptxas.txt; cat $R/ptxas.txt; rm $R/ptxas_full.txt
