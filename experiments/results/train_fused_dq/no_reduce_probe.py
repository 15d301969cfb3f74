"""Timing probe, not a check: the shared segment's backward at the benchmark shape with the
fused dQ's TMA reduce-adds dropped (the kernel computes dQ's partials and stages them, but
never adds them into dQ), per fused_dq mode in argv. The gap to the real kernel is what the
reductions cost."""
import dataclasses
import sys
import types

import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.mosaic_gpu import check_training as ct
from pallas_kernels.mosaic_gpu import training_attention as ta


def _copy(src, dst, *args, reduction_op=None, **kw):
  if reduction_op is None:
    plgpu.copy_smem_to_gmem(src, dst, *args, **kw)


proxy = types.SimpleNamespace(**{k: getattr(plgpu, k) for k in dir(plgpu) if not k.startswith('__')})
proxy.copy_smem_to_gmem = _copy
ta.plgpu = proxy
for mode in map(int, sys.argv[1:]):
  cfg = dataclasses.replace(ta.TrainingKernelConfig(), fused_dq=mode)
  print(f'== fused_dq={mode}, reduce-adds dropped', flush=True)
  ct.bench(cfg)
