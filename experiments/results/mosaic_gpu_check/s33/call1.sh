#!/bin/bash
# Session 33, call 1. One nvidia-h200 (bash call1.sh <commit>, with OUT set; about 8 minutes):
# (1) the lane table alone, session 32's against the new one (elementwise over a frame's rows),
#     CUPTI time and fusions (lane_table_probe.py), B=256 and B=1024 32/8, B=1024 32/32;
# (2) the kernels alone at issue 10's two near-miss shapes (B=256 and B=1024, P=16K, S=1,
#     32/8; s29-s31: 1.49-1.53x and 1.31x), twice, and every CHECK_SHAPES layout checked;
# (3) the compiled kernel tests that read the lane table, and the training tests;
# (4) training: the breakdown and train_bench at issue 15's point (write_kv a concatenation,
#     the segment dQ float32 into the VJP's sum).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. PYTHONUNBUFFERED=1 HYDRAJAX_GIT_COMMIT=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
S=experiments/results/mosaic_gpu_check/s33
R=$OUT/call1; mkdir -p $R
timeout 120 python3 $S/lane_table_probe.py --shapes 0,1,5 > $R/lane_probe.txt 2>&1
echo "probe rc=$?"; grep '^{' $R/lane_probe.txt
for i in 1 2; do
  timeout 150 python3 pallas_kernels/mosaic_gpu/check_on_device.py --out $R/time$i --attend_only \
    --shapes 0,1 --variants 0 $([ $i = 1 ] && echo --check_shapes all) > $R/time$i.txt 2>&1
  echo "time$i rc=$?"; grep -c '"error"' $R/time$i/results.jsonl
  python3 -c "
import json
for line in open('$R/time$i/results.jsonl'):
  r = json.loads(line)
  if r.get('kind') == 'time':
    print(r['shape'], r['impl'], round(r['us'], 1), round(r['x_floor'], 3), {k: round(v, 2) for k, v in r['kernels'].items()})
  elif r.get('kind') == 'check' and 'out_rel_l2' in r:
    print('check', r['shape'], round(r['out_rel_l2'], 5), r.get('garbage_bitwise_equal', ''))
"
done
timeout 200 python3 -m pytest tests/test_mosaic_gpu_kernels.py tests/test_mosaic_gpu_training.py -q \
  -p no:cacheprovider --tb=short -k "not Interpret and not interpret and (lane or private_kernel \
or matches_xla or backward or prefill)" > $R/pytest.txt 2>&1
echo "pytest rc=$?"; tail -6 $R/pytest.txt
timeout 100 python3 pallas_kernels/mosaic_gpu/check_training.py --breakdown > $R/breakdown.txt 2>&1
echo "breakdown rc=$?"; head -18 $R/breakdown.txt
timeout 100 python3 -m experiments.train_bench --nosmoke --points=64:8192:1024 --step_points= \
  --impls=per_seq_cudnn,shared_mosaic_gpu --workdir=$R/train_bench > $R/train_bench.txt 2>&1
echo "bench rc=$?"; tail -4 $R/train_bench.txt
