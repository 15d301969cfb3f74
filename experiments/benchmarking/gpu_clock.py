"""The SM clock and power cap of NVIDIA GPUs while a timed region runs, read through NVML.

Why: a tensor-core-bound program that runs for seconds holds the GPU at its power limit, and the
driver lowers the SM clock under it. On an H100 the 8192^3 bf16 matmul that the floors' rate is
measured with runs at 808 TFLOP/s one call after idle and at 706 back to back, the clock at
1,170-1,440 MHz instead of 1,980 (`experiments/results/mosaic_gpu_check/s54`). A decode step's
time therefore depends on the clock it ran at, and a benchmark record should say which.

`ClockSampler.for_backend(jax.default_backend())` is a context manager: a thread reads the SM
clock, power and clock-event reasons of every GPU of the host (NVML does not follow
CUDA_VISIBLE_DEVICES) every `interval_s` while the block runs; `summary()` gives the lowest and
median clock over GPUs and samples, the highest power, and the fraction of samples with the
software power cap set. Without NVML (no NVIDIA driver) or off a GPU backend it reads nothing
and `summary()` is empty. NVML's calls release the GIL (ctypes), so the thread does not hold up
the timed program's dispatch. `timing.device_time` and `timing.host_time` (their timed repeats,
in `Timing.clock`, which the sweeps' records carry), the PyTorch peer's CUDA-event timer and
`experiments.throughput` (its timed decode steps) sample this way.
"""

import ctypes
import functools
import statistics
import threading
from collections.abc import Callable
from typing import NamedTuple

POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap
# NVML's clock-event reason bits (nvml.h: nvmlClocksEventReason*), as nvidia-smi reports them.
REASON_NAMES = {0x1: 'idle', 0x2: 'app_clocks', POWER_CAP: 'sw_power_cap', 0x8: 'hw_slowdown',
                0x20: 'sync_boost', 0x40: 'sw_thermal', 0x80: 'hw_thermal',
                0x100: 'hw_power_brake'}
_CLOCK_SM = 1  # NVML_CLOCK_SM


class Reading(NamedTuple):
  sm_mhz: int
  power_w: float
  reasons: int  # NVML's clock-event reason bits


class Nvml:
  """Readings of every GPU of the host, or None where NVML cannot be loaded or initialised."""

  def __init__(self):
    self._lib = None
    try:
      lib = ctypes.CDLL('libnvidia-ml.so.1')
      if lib.nvmlInit_v2() != 0:
        return
      count = ctypes.c_uint()
      lib.nvmlDeviceGetCount_v2(ctypes.byref(count))
      self._handles = []
      for index in range(count.value):
        handle = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) == 0:
          self._handles.append(handle)
      # The reasons' call was renamed in newer drivers; either is the same bit mask.
      self._reasons = (getattr(lib, 'nvmlDeviceGetCurrentClocksEventReasons', None)
                       or lib.nvmlDeviceGetCurrentClocksThrottleReasons)
      self._lib = lib if self._handles else None
    except (OSError, AttributeError):
      self._lib = None

  @property
  def available(self) -> bool:
    return self._lib is not None

  def read(self) -> list[Reading] | None:
    if self._lib is None:
      return None
    readings = []
    for handle in self._handles:
      clock, milliwatts, reasons = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
      self._lib.nvmlDeviceGetClockInfo(handle, _CLOCK_SM, ctypes.byref(clock))
      self._lib.nvmlDeviceGetPowerUsage(handle, ctypes.byref(milliwatts))
      self._reasons(handle, ctypes.byref(reasons))
      readings.append(Reading(clock.value, milliwatts.value / 1e3, reasons.value))
    return readings


@functools.cache
def host_nvml() -> Nvml:
  """The process's one `Nvml` (NVML is loaded and its handles found once, not per timing)."""
  return Nvml()


class ClockSampler:
  """Samples `read` (default: `host_nvml()`, every GPU) every `interval_s` inside a `with` block."""

  def __init__(self, read: Callable[[], list[Reading] | None] | None = None,
               interval_s: float = 0.01):
    if interval_s <= 0:
      raise ValueError(f'interval_s must be > 0, got {interval_s}')
    self._read = read if read is not None else host_nvml().read
    self._interval_s = interval_s
    self._readings: list[Reading] = []
    self._stop = threading.Event()
    self._thread = None

  @classmethod
  def for_backend(cls, backend: str, interval_s: float = 0.01) -> 'ClockSampler':
    """NVML's sampler where `backend` is 'gpu', else one that reads nothing (a CPU run on a
    machine with an NVIDIA driver must not report the idle GPU's clock)."""
    return cls(None if backend == 'gpu' else (lambda: None), interval_s)

  def _run(self):
    while True:
      readings = self._read()
      if readings is None:  # nothing to read: stop at once
        return
      self._readings.extend(readings)
      if self._stop.wait(self._interval_s):
        return

  def __enter__(self):
    self._readings, self._stop = [], threading.Event()
    self._thread = threading.Thread(target=self._run, name='gpu-clock', daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    return False

  def summary(self) -> dict[str, float]:
    """{sm_mhz_min, sm_mhz_median, power_w_max, power_cap_fraction, clock_samples}, or {}."""
    if not self._readings:
      return {}
    clocks = [r.sm_mhz for r in self._readings]
    return {
        'sm_mhz_min': min(clocks),
        'sm_mhz_median': statistics.median(clocks),
        'power_w_max': max(r.power_w for r in self._readings),
        'power_cap_fraction': sum(bool(r.reasons & POWER_CAP) for r in self._readings)
                              / len(self._readings),
        'clock_samples': len(self._readings),
    }
