"""Burst against sustained: does a tensor-core-bound kernel slow down when it runs back to back
for seconds (the SM clock under the GPU's power limit)? A probe for issue 10, not library code.

In the 7B step at B=1024, P=16K the shared kernel takes about 8% longer a layer than alone
(H100: 450 against 417 µs), and nvidia-smi read 1,725-1,890 MHz with the power cap active
during the step's tree decode against 1,980 when idle. Two cases: the floor's bf16 matmul
(8192^3, as `check_on_device.ceilings` measures the rate) and the attention call of the step's
shape (check_on_device shape 6: B=1024, P=16K, 9 private tokens, 32/32 heads, 128-token pages).
Each case is one jitted program of N distinct calls (~20-30 ms of GPU work, one dispatch, so the
GPU never waits on the host; distinct operands, so XLA merges none). Per case:
  burst: CUPTI kernel time a call of a program of 1 call after a second idle, the way the
         floor's rate and the kernels-alone tables are measured;
  burst_n: CUPTI a call of the N-call program after a second idle;
  window: the N-call program back to back for --seconds, windows of --window_s, wall time a
          call, with the SM clock (min of 3 reads), power and clock-event reasons read through
          NVML while each window runs;
  hot_n: CUPTI a call of the N-call program right after the windows.

  PYTHONPATH=. python3 experiments/results/mosaic_gpu_check/s54/sustained_probe.py --out $OUT/p

Calls 3-5 ran earlier versions (README: commits); since, NVML is read through
`hydrajax.benchmarking.gpu_clock.Nvml` instead of a copy of it here.
"""

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

from hydrajax.benchmarking.gpu_clock import Nvml
from pallas_kernels.mosaic_gpu import check_on_device as cod


def windows(program, arg_sets, seconds, window_s, nvml):
  """Wall µs a call of `program` (len(arg_sets) calls) run back to back, per window."""
  per_run = len(arg_sets)
  jax.block_until_ready(program(arg_sets))  # compile
  t_run = time.perf_counter()
  jax.block_until_ready(program(arg_sets))
  # Enough programs queued that the GPU outlasts the window's reads (s54 call 4 timed the
  # compile here: one program a window, the GPU idle for most of each).
  runs = max(2, round(2 * window_s / (time.perf_counter() - t_run)))
  rows, start = [], time.perf_counter()
  while time.perf_counter() - start < seconds:
    t0 = time.perf_counter()
    outs = [program(arg_sets) for _ in range(runs)]
    known = []
    for _ in range(3):  # while the queued programs run
      time.sleep(window_s / 4)
      known += nvml.read() or []  # every GPU of the host (one on the lent machines)
    jax.block_until_ready(outs)
    t1 = time.perf_counter()
    rows.append({'at_s': round(t0 - start, 3), 'us': (t1 - t0) * 1e6 / (runs * per_run),
                 'sm_mhz': min(r.sm_mhz for r in known) if known else None,
                 'power_w': max(r.power_w for r in known) if known else None,
                 'reasons': sorted({hex(r.reasons) for r in known})})
  return rows


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--out', required=True)
  parser.add_argument('--seconds', type=float, default=5.0)
  parser.add_argument('--window_s', type=float, default=0.1)
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  nvml = Nvml()
  mats = [jax.random.normal(jax.random.key(i), (8192, 8192), jnp.bfloat16) for i in range(5)]
  matmul = lambda x, y: x @ y
  cod.CAPACITY = 128
  _, layout, q, kc, vc = cod.problem(1024, 16384, 9, 32, 32)
  attend, prepared = cod.attend_fn(q, kc, layout, cod.VARIANTS[0])
  cases = {
      'matmul_8192': (matmul, [(a, b) for a in mats for b in mats if a is not b],
                      2 * 8192**3),
      'attend_b1024_p16k_s9_32_32': (
          attend, [(q * (1 + 0.001 * i), kc, vc, prepared, jnp.int32(0)) for i in range(40)],
          4 * 1024 * 32 * (16384 + 9) * 128),
  }
  records = []
  for name, (fn, arg_sets, flops) in cases.items():
    program = jax.jit(lambda sets, fn=fn: [fn(*a) for a in sets])
    cod.cupti_us(fn, arg_sets[:1], iterations=1)  # compile both measured programs
    cod.cupti_us(fn, arg_sets, iterations=1)
    time.sleep(1.0)
    burst, _ = cod.cupti_us(fn, arg_sets[:1], iterations=1)
    time.sleep(1.0)
    burst_n, _ = cod.cupti_us(fn, arg_sets, iterations=1)
    rows = windows(program, arg_sets, args.seconds, args.window_s, nvml)
    hot_n, kernels = cod.cupti_us(fn, arg_sets, iterations=3)
    sustained = statistics.median(r['us'] for r in rows[len(rows) // 2:])
    rec = {'case': name, 'calls_a_program': len(arg_sets), 'burst_us': burst,
           'burst_n_us': burst_n, 'hot_n_us': hot_n, 'sustained_us': sustained,
           'tflops': {k: flops / v / 1e6 for k, v in
                      (('burst', burst), ('burst_n', burst_n), ('sustained', sustained),
                       ('hot_n', hot_n))},
           'hot_kernels_us': kernels,
           'window_sm_mhz': [r['sm_mhz'] for r in rows],
           'window_power_w': [r['power_w'] for r in rows], 'windows': rows}
    records.append(rec)
    print(json.dumps({k: v for k, v in rec.items() if k != 'windows'}), flush=True)
    time.sleep(1.0)
  with open(os.path.join(args.out, 'sustained.jsonl'), 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in records)


if __name__ == '__main__':
  main()
