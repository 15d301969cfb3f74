#!/bin/bash
# Session 54, one nvidia-h200 (`needs_h200`: the 32-layer B=1024 step takes 77 GiB), OUT set:
# bash call1.sh <commit> [seconds, 560] [layers, 32] [prefixes, 1024,16384] [shapes, 6,8] [apart, 1024]
# [probe, yes].
# With the SM clock, power and throttle reasons sampled every 100 ms throughout (smi.csv;
# phases.txt marks each phase's start and end):
#   probe: sustained_probe.py (the floor's matmul and the P=16K attention call, burst against
#          seconds back to back; about 50 s);
#   grid1: the CodeLlama-7B decode step at B=1024, the default (fused q/k/v; XLA's
#          rematerialization pass off over a cache), P=1K and 16K, every kernel of a step
#          profiled: issue 10's targets;
#   alone: the same shapes' kernels alone (check_on_device shapes 6 and 8: 9 private tokens a
#          row, 128-token pages, layer 31 of 32): is the shared kernel slower in the step
#          (434-452 µs a layer, s50) than alone (~400-415) because the clock drops under the
#          step's sustained load?
#   grid2: wq and wkv apart (`--fuse_qkv=false`), P=1K: fused against apart on the H200.
# On an H100 pass layers=16 (the 32-layer program does not fit); shapes=none skips alone,
# apart=none grid2, probe=no the probe.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
T=${2:-560}; L=${3:-32}; P=${4:-1024,16384}; SHAPES=${5:-6,8}; APART=${6:-1024}; PROBE=${7:-yes}
R=$OUT/call1; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee $R/gpu.txt
Q=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_event_reasons.active
nvidia-smi --query-gpu=$Q --format=csv,noheader -c 1 > /dev/null 2>&1 || Q=${Q/event/throttle}
nvidia-smi --query-gpu=$Q --format=csv,noheader,nounits -lms 100 > $R/smi.csv 2> $R/smi.err &
SMI=$!
mark() { echo "$(date -u +%Y/%m/%d\ %H:%M:%S.%3N) $*" >> $R/phases.txt; }
grid() {  # name, seconds, prefixes, extra flags
  mark start $1
  timeout $2 python3 -m experiments.throughput --preset=codellama_7b --num_layers=$L \
    --impls=mosaic_gpu --profile_kernels=64 --new_tokens=128 --modes=no_attention,tree \
    --max_decode_s=0.4 --batches=1024 --prefixes=$3 --deadline_s=$(($2 - 20)) "${@:4}" \
    --workdir=$R/$1 > $R/$1.log 2>&1
  echo "$1 [${*:4}] rc=$?"; mark end $1
  python3 -m experiments.throughput --summary=$R/$1/throughput.jsonl --summary_kernels=5
}
if [ $PROBE = yes ]; then
  mark start probe
  timeout 90 python3 experiments/results/mosaic_gpu_check/s54/sustained_probe.py --out $R/probe \
    > $R/probe.log 2>&1
  echo "probe rc=$?"; mark end probe; grep '^{' $R/probe.log | cut -c1-600
fi
SHARE=2; [ $SHAPES = none ] && [ $APART = none ] && SHARE=1
grid grid1 $(((T - SECONDS) / SHARE - 10)) $P
if [ $SHAPES != none ]; then
  mark start alone
  timeout $(((T - SECONDS) / 2)) python3 pallas_kernels/mosaic_gpu/check_on_device.py \
    --out $R/alone --attend_only --shapes $SHAPES --capacity=128 --deep_layer=31 > $R/alone.log 2>&1
  echo "alone rc=$?"; mark end alone
  grep -E '^\|' $R/alone.log
fi
[ $APART = none ] || grid grid2 $((T - SECONDS - 5)) $APART --fuse_qkv=false
kill $SMI; wait $SMI 2>/dev/null
python3 experiments/results/mosaic_gpu_check/s54/clock_summary.py $R
