#!/bin/bash
# Session 55, one GPU (an H100 when the H200 does not start), OUT set: bash verify_clock.sh <commit>.
# Runs on a GPU, for the first time, the clock records of session 54-55 (`gpu_clock`):
#   mb:    the microbenchmark's targets grid with the Mosaic GPU kernels and the PyTorch peer
#          (`timing.device_time` and the peer's CUDA-event timer each sample the clock:
#          `sm_mhz_*`, `power_cap_fraction` in results.jsonl), about 2 minutes;
#   call1: s54/call1.sh at 16 layers, P=1K (experiments.throughput's clock columns) and
#          check_on_device shape 6 alone (its deep-layer buffers at most half the device's
#          memory, untested on an H100).
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
mkdir -p $OUT/mb
timeout 200 python3 -m experiments.microbench --grid=targets --impls=mosaic_gpu,torch_flash_tree \
  --workdir=$OUT/mb > $OUT/mb/log.txt 2>&1
echo "microbench rc=$?"; cat $OUT/mb/table.md 2>/dev/null | head -30
python3 - $OUT/mb/results.jsonl <<'PY'
import json, sys
for line in open(sys.argv[1]):
  r = json.loads(line)
  if 'impl' in r:
    print(r['impl'], r.get('name'), r.get('status'), r.get('time_us'), {k: r.get(k) for k in
          ('sm_mhz_min', 'sm_mhz_median', 'power_cap_fraction', 'clock_samples')})
PY
bash experiments/results/mosaic_gpu_check/s54/call1.sh $1 ${2:-330} 16 1024 6 none no
