"""experiments.benchmarking.gpu_clock: the clock sampler's summary, its empty result without NVML,
and its argument check. The NVML reads themselves need an NVIDIA GPU (the device scripts)."""

import threading

import pytest

from experiments.benchmarking import gpu_clock
from experiments.benchmarking.gpu_clock import POWER_CAP, ClockSampler, Reading


def test_summary_over_gpus_and_samples():
  """Two GPUs read three times: min and median over all six, the power cap's fraction."""
  reads = iter([
      [Reading(1980, 300.0, 0), Reading(1755, 690.0, POWER_CAP)],
      [Reading(1500, 700.0, POWER_CAP | 0x1), Reading(1980, 250.0, 0)],
      [Reading(1620, 695.0, POWER_CAP), Reading(1830, 640.0, 0)],
  ])
  done = threading.Event()

  def read():
    batch = next(reads, None)
    if batch is None:
      done.set()
      return None  # the sampler stops at the first empty read
    return batch

  with ClockSampler(read, interval_s=1e-4) as clock:
    assert done.wait(timeout=30)
  assert clock.summary() == {
      'sm_mhz_min': 1500, 'sm_mhz_median': (1755 + 1830) / 2, 'power_w_max': 700.0,
      'power_cap_fraction': 3 / 6, 'clock_samples': 6,
  }


def test_records_every_read_while_the_block_runs():
  """The sampler keeps reading while the block runs; each read is in the summary."""
  calls, three = [], threading.Event()

  def read():
    calls.append(1)
    if len(calls) >= 3:
      three.set()
    return [Reading(1980, 100.0, 0)]

  with ClockSampler(read, interval_s=1e-3) as clock:
    assert three.wait(timeout=30)
  assert clock.summary()['clock_samples'] == len(calls) >= 3


def test_no_nvml_reads_nothing(monkeypatch):
  """Without NVML (this CPU machine, or one whose library does not load) the summary is empty."""
  def no_library(*_):
    raise OSError('libnvidia-ml.so.1: cannot open shared object file')

  monkeypatch.setattr(gpu_clock.ctypes, 'CDLL', no_library)
  nvml = gpu_clock.Nvml()
  assert not nvml.available and nvml.read() is None
  with ClockSampler() as clock:
    pass
  assert clock.summary() == {}


def test_only_a_gpu_backend_reads(monkeypatch):
  """A CPU run on a machine with an NVIDIA driver reports nothing; a GPU run reads NVML."""
  class FakeNvml:
    def read(self):
      return [Reading(1980, 100.0, 0)]

  monkeypatch.setattr(gpu_clock, 'Nvml', FakeNvml)
  gpu_clock.host_nvml.cache_clear()  # made anew from FakeNvml (and cleared again below)
  with ClockSampler.for_backend('cpu') as cpu:
    pass
  assert cpu.summary() == {}
  with ClockSampler.for_backend('gpu', interval_s=1e-3) as gpu:
    pass
  assert gpu.summary()['sm_mhz_median'] == 1980  # the first read happens before the stop
  gpu_clock.host_nvml.cache_clear()


def test_interval_must_be_positive():
  with pytest.raises(ValueError, match='interval_s must be > 0, got 0'):
    ClockSampler(lambda: None, interval_s=0)
