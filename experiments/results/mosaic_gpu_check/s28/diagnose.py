"""Session 28: the shared kernel's schedules against the default, at a few small problems:
max |difference| of out and lse, error against XLA, NaN count, which query rows differ."""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import hydrajax
from pallas_kernels.mosaic_gpu import check_on_device as cod
from pallas_kernels.mosaic_gpu import tree_attention as mosaic

KNOBS = (dict(shared_overlap=True), dict(shared_overlap=True, shared_pingpong=False),
         dict(shared_pingpong=False))
for shape in ((64, 1024, 1, 8, 2), (64, 1000, 3, 8, 2), (8, 2048, 3, 32, 8), (256, 16384, 1, 32, 8)):
  plan, layout, q, kc, vc = cod.problem(*shape)
  want = jax.jit(hydrajax.tree_attention_xla)(q, kc, vc, layout)
  for bk in (64, 128):
    run = lambda **kw: jax.jit(lambda *a: mosaic.tree_attention(*a, block_kv=bk, **kw))(
        q, kc, vc, layout)
    base = run()
    print(shape, bk, 'default vs xla', cod.errors(base, want), flush=True)
    for knobs in KNOBS:
      try:
        got = run(**knobs)
        d = np.abs(np.asarray(got.out, np.float32) - np.asarray(base.out, np.float32))
        dl = np.abs(np.asarray(got.lse) - np.asarray(base.lse))
        rows = np.nonzero(d.max(axis=(1, 2, 3)) > 0)[0]
        heads = np.nonzero(d.max(axis=(0, 1, 3)) > 0)[0]
        print(shape, bk, knobs, 'max|dout|', float(np.nanmax(d)), 'max|dlse|',
              float(np.nanmax(dl)), 'nan', int(np.isnan(d).sum()), 'rows', rows[:12].tolist(),
              len(rows), 'heads', heads[:8].tolist(), 'vs xla', cod.errors(got, want), flush=True)
      except Exception as e:
        print(shape, bk, knobs, 'ERROR', repr(e)[:800], flush=True)
