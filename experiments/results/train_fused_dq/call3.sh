#!/bin/bash
# Session 32, call 3. One nvidia-h200 (bash call3.sh <commit>, with OUT set; about 7 minutes):
# the fused dQ as the default (TrainingKernelConfig.fused_dq=True: call 2's mode 3, shared
# segments only), and the prepared training plan (hydrajax.training.training_plan).
# (1) the compiled training-kernel tests (fused and dQ-kernel backward, prefill, GRPO);
# (2) check_training.py: the default and fused_dq=false, checked and timed in one run;
# (3) the prefill fwd+bwd breakdown (CUPTI); (4) train_bench at issue 15's point against cuDNN.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
R=$OUT/call3; mkdir -p $R
timeout 200 python3 -m pytest tests/test_mosaic_gpu_training.py tests/test_training_plan.py -q \
  -p no:cacheprovider --tb=short -k "not Interpret and not interpret" > $R/pytest.txt 2>&1
echo "pytest rc=$?"; tail -6 $R/pytest.txt
timeout 200 python3 pallas_kernels/mosaic_gpu/check_training.py --configs=';fused_dq=false' \
  --out $R/check > $R/check.txt 2>&1
echo "check rc=$?"; tail -4 $R/check.txt
timeout 100 python3 pallas_kernels/mosaic_gpu/check_training.py --breakdown > $R/breakdown.txt 2>&1
echo "breakdown rc=$?"; head -18 $R/breakdown.txt
timeout 100 python3 -m experiments.train_bench --nosmoke --points=64:8192:1024 --step_points= \
  --impls=per_seq_cudnn,shared_mosaic_gpu --workdir=$R/train_bench > $R/train_bench.txt 2>&1
echo "bench rc=$?"; tail -4 $R/train_bench.txt
