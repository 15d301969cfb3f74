"""Builds segment_backward at the benchmark shape for each fused_dq mode given (argv), with
Mosaic GPU's ptxas report on (the environment sets MOSAIC_GPU_DUMP_PTXAS=1 and
MOSAIC_GPU_DUMP_TO): registers and spills of the dK/dV kernel per mode."""
import dataclasses
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.mosaic_gpu import training_attention as ta

m, n, kh, h, s = 65536, 32, 8, 128, 8192
for mode in map(int, sys.argv[1:]):
  cfg = dataclasses.replace(ta.TrainingKernelConfig(), fused_dq=mode)
  print('fused_dq', mode, flush=True)
  sd = jax.ShapeDtypeStruct
  q, kv, st = sd((m, n, h), jnp.bfloat16), sd((s, kh, h), jnp.bfloat16), sd((m, n), jnp.float32)
  jax.jit(lambda q, k, v, do, lse, delta: ta.segment_backward(
      q, k, v, do, lse, delta, s, scale=h ** -0.5, config=cfg)).lower(q, kv, kv, q, st, st).compile()
  sys.stdout.flush()
