#!/bin/bash
# Ready for a lent nvidia-h200 (bash call1_not_run.sh <commit>, with OUT set; about 8 minutes):
# issue 15's training kernels under other block sizes (`TrainingKernelConfig`), each checked
# against its jnp reference on the small shapes, then timed with CUPTI at the benchmark shapes
# (shared 8K prompt x 64x1024 rows; causal 64x1024 completions and the 8K prompt). Every config
# below cross-lowers on the CPU (`check_training.py --lower_only --configs=...`); registers are
# checked only by ptxas, so a config may still fail here, reported and skipped. Then the whole
# prefill fwd+bwd breakdown at the default. If a config beats the default and checks, make it
# the default (training_attention.TrainingKernelConfig) and re-run experiments.train_bench.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
R=$OUT/sweep; mkdir -p $R
CONFIGS=';block_kv_dq=64;block_q_dkv=128;block_kv_dkv=128;block_kv=64'
CONFIGS="$CONFIGS;block_kv_dq=64,block_q_dkv=128;block_q_dq=128,block_kv_dq=64;compute_wgs=1"
timeout 420 python3 pallas_kernels/mosaic_gpu/check_training.py --configs="$CONFIGS" \
  > $R/sweep.txt 2>&1
echo "sweep rc=$?"
timeout 100 python3 pallas_kernels/mosaic_gpu/check_training.py --breakdown > $R/breakdown.txt 2>&1
echo "breakdown rc=$?"
tar czf $OUT/sweep.tgz -C $OUT sweep
