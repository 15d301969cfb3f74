"""Burst against sustained: does a tensor-core-bound kernel slow down when it runs back to back
for seconds (the SM clock under the GPU's power limit)? A probe for issue 10, not library code.

In the 7B step at B=1024, P=16K the shared kernel takes about 8% longer a layer than alone
(H100: 450 against 417 µs), and nvidia-smi read 1,725-1,890 MHz with the power cap active
during the step's tree decode against 1,980 when idle. This probe times, for the floor's bf16
matmul (8192^3) and for the attention call of the step's shape (check_on_device shape 6:
B=1024, P=16K, 9 private tokens, 32/32 heads, 128-token pages):
  burst: CUPTI kernel time of one call after a second idle (the floor's rate and the
         kernels-alone table are measured in a few calls like this one);
  window: back-to-back calls for --seconds, in ~100 ms windows, wall time a call, with the SM
          clock and the clock-event reasons read through NVML while each window runs;
  hot: CUPTI kernel time of calls right after the windows (no idle).

  PYTHONPATH=. python3 experiments/results/mosaic_gpu_check/s54/sustained_probe.py --out $OUT/p
"""

import argparse
import ctypes
import json
import os
import time

import jax
import jax.numpy as jnp

from pallas_kernels.mosaic_gpu import check_on_device as cod


class Nvml:
  """The SM clock (MHz) and active clock-event reasons of GPU 0, or None without NVML."""

  def __init__(self):
    try:
      self.lib = ctypes.CDLL('libnvidia-ml.so.1')
      self.lib.nvmlInit_v2()
      self.handle = ctypes.c_void_p()
      self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.handle))
      self.reasons = (getattr(self.lib, 'nvmlDeviceGetCurrentClocksEventReasons', None)
                      or self.lib.nvmlDeviceGetCurrentClocksThrottleReasons)
    except (OSError, AttributeError):
      self.lib = None

  def read(self):
    if self.lib is None:
      return None, None
    clock, reasons = ctypes.c_uint(), ctypes.c_ulonglong()
    self.lib.nvmlDeviceGetClockInfo(self.handle, 1, ctypes.byref(clock))  # NVML_CLOCK_SM
    self.reasons(self.handle, ctypes.byref(reasons))
    return clock.value, reasons.value


def windows(fn, args, seconds, calls_per_window, nvml):
  rows, start = [], time.perf_counter()
  while time.perf_counter() - start < seconds:
    t0 = time.perf_counter()
    outs = [fn(*args) for _ in range(calls_per_window)]
    reads = []
    for _ in range(3):  # while the queued calls run
      reads.append(nvml.read())
      time.sleep(0.02)
    jax.block_until_ready(outs)
    t1 = time.perf_counter()
    clocks = [c for c, _ in reads if c is not None]
    rows.append({'at_s': round(t0 - start, 3), 'us': (t1 - t0) * 1e6 / calls_per_window,
                 'sm_mhz': min(clocks) if clocks else None,
                 'reasons': [hex(r) for _, r in reads if r is not None]})
  return rows


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--out', required=True)
  parser.add_argument('--seconds', type=float, default=4.0)
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  nvml = Nvml()
  # Four argument sets a case: calls in one measured program must differ (XLA merges equal ones).
  mats = [jax.random.normal(jax.random.key(i), (8192, 8192), jnp.bfloat16) for i in range(5)]
  matmul = jax.jit(lambda x, y: x @ y)
  cod.CAPACITY = 128
  _, layout, q, kc, vc = cod.problem(1024, 16384, 9, 32, 32)
  attend, prepared = cod.attend_fn(q, kc, layout, cod.VARIANTS[0])
  cases = {
      'matmul_8192': (matmul, [(m, mats[4]) for m in mats[:4]], 2 * 8192**3, 70),
      'attend_b1024_p16k_s9_32_32': (
          attend, [(q * (1 + 0.01 * i), kc, vc, prepared, jnp.int32(0)) for i in range(4)],
          4 * 1024 * 32 * (16384 + 9) * 128, 200),
  }
  records = []
  for name, (fn, arg_sets, flops, per_window) in cases.items():
    jax.block_until_ready(fn(*arg_sets[0]))  # compile
    cod.cupti_us(fn, arg_sets, iterations=1)  # compile the measured program
    time.sleep(1.0)
    burst, _ = cod.cupti_us(fn, arg_sets[:1], iterations=1)
    rows = windows(fn, arg_sets[0], args.seconds, per_window, nvml)
    hot, _ = cod.cupti_us(fn, arg_sets, iterations=3)
    rec = {'case': name, 'burst_us': burst, 'hot_us': hot, 'tflops_burst': flops / burst / 1e6,
           'tflops_hot': flops / hot / 1e6, 'first_window_us': rows[0]['us'],
           'last_window_us': rows[-1]['us'], 'window_sm_mhz': [r['sm_mhz'] for r in rows],
           'windows': rows}
    records.append(rec)
    print(json.dumps({k: v for k, v in rec.items() if k != 'windows'}), flush=True)
    time.sleep(1.0)
  with open(os.path.join(args.out, 'sustained.jsonl'), 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in records)


if __name__ == '__main__':
  main()
