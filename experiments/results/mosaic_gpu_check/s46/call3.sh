#!/bin/bash
# Session 46, call 3 (the exact command, run as one `run` call at 470fa29 with OUT set; 321 s).
# Call 2 ran out of time in the middle of B=1024's token lanes: the kernels alone again, without
# the check layouts (call 2 passed them all), issue 10's 32/8 shapes B=1024 S=1, B=32 P=2K and
# S=128, and the 16/4 tensor-parallel shard at B=1024 and 256, default (0) against token lanes
# (20). Its gqa.txt is committed without the CUDA runtime's log lines.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=470fa29; mkdir -p $OUT/call3; timeout 470 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $OUT/call3/gqa --attend_only --shapes 1,4,14,3,15 --variants 0,20 > $OUT/call3/gqa.txt 2>&1; echo rc=$?; grep -v "^E1\|^=== \|^external\|^$" $OUT/call3/gqa.txt | cut -c1-330 | tail -40
