"""Writes the optimized HLO of prefill_attention's forward + backward (Mosaic GPU kernels) at
G:P:T points, to see which XLA fusions sit between the kernels (session 37, call 1).

  PYTHONPATH=. python3 experiments/results/train_prefixed_s37/dump_glue.py OUT_DIR 16:1024:2048
"""
import sys

import jax
import jax.numpy as jnp

from hydrajax.dispatch import AttentionImpl
from hydrajax.training import prefill_layout as pl


def main(out_dir, points):
  n, kh, h = 32, 8, 128
  for point in points.split(','):
    g, p, t = (int(x) for x in point.split(':'))
    layout = pl.plan_prefill([p], g, t).to_device()
    sd = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    args = (sd(1, p, n, h), sd(g, t, n, h), sd(1, p, kh, h), sd(g, t, kh, h), sd(1, p, kh, h),
            sd(g, t, kh, h))

    def shared(q_p, q_c, k_p, k_c, v_p, v_c):
      kb, vb = pl.write_kv(layout, k_p, k_c), pl.write_kv(layout, v_p, v_c)
      prompt, completion = pl.prefill_attention(q_p, q_c, kb, vb, layout,
                                                impl=AttentionImpl.MOSAIC_GPU)
      return prompt.out, completion.out

    def run(*a):
      out, vjp = jax.vjp(shared, *a)
      return vjp(jax.tree.map(jnp.ones_like, out))

    text = jax.jit(run).trace(*args).lower().compile().as_text()
    with open(f'{out_dir}/hlo_{g}_{p}_{t}.txt', 'w') as f:
      f.write(text)
    print(f'{point}: {len(text)} characters of optimized HLO', flush=True)


if __name__ == '__main__':
  main(*sys.argv[1:])
