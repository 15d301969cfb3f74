#!/bin/bash
# One nvidia-h200 (bash call3.sh <commit>, with OUT set; about 1 minute), session 27 call 3:
# ptxas's report (registers, shared memory) of the tree-attention kernels at B=1024 P=1K 9
# tokens 32/32 and B=256 P=16K S=1 32/8: can three private-kernel programs share a
# multiprocessor (registers <= 168 a thread at 128 threads)?
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
R=$OUT/call3; mkdir -p $R/dump
MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=$R/dump timeout 200 python3 \
  experiments/results/mosaic_gpu_check/s27/ptxas.py > $R/ptxas.txt 2>&1
echo "ptxas rc=$?"; ls $R/dump | head; grep -i "registers\|smem\|Compiling entry" $R/ptxas.txt $R/dump/* 2>/dev/null | head -40
tar czf $OUT/call3.tgz -C $OUT call3 && rm -rf $R
