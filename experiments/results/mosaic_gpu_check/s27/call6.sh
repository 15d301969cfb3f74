#!/bin/bash
# One nvidia-h200 (bash call6.sh <commit>, with OUT set; about 3 minutes), session 27 call 6:
# issue 15's attention point (G=64, 8K prompt, 1K completions, 32/8) and its CUPTI breakdown
# after the rows gather their segments' states and dQ along their paths (no scatter; call 2
# is the same point before).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
R=$OUT/call6; mkdir -p $R
timeout 110 python3 -m experiments.train_bench --nosmoke --points=64:8192:1024 --step_points= \
  --impls=per_seq_cudnn,shared_mosaic_gpu --workdir=$R/train_bench > $R/train_bench.txt 2>&1
echo "train_bench rc=$?"
tar czf $OUT/call6.tgz -C $OUT call6
timeout 80 python3 pallas_kernels/mosaic_gpu/check_training.py --breakdown > $R/breakdown.txt 2>&1
echo "breakdown rc=$?"
tar czf $OUT/call6.tgz -C $OUT call6 && rm -rf $R
