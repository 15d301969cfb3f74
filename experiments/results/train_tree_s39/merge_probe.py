"""A/B of the tree VJP's path merges: today's (one gather, then reductions over the path axis
D: `merge_stacked`, `jnp.sum`) against the same math unrolled over D into elementwise ops (a
candidate for small D). Call 2's breakdown put one gather-reduce fusion at 5.6 ms of 90.6 at
8192:8:1024:64:1024.

  PYTHONPATH=. python experiments/results/train_tree_s39/merge_probe.py OUT.jsonl P:B:L:G:T ...

For each point and way: the device time of forward + backward (`train_tree_bench.run_point`,
tree_mosaic_gpu) and its CUPTI kernel breakdown.
"""

import functools
import sys

from absl import flags
import jax
import jax.numpy as jnp

from experiments import train_tree_bench as bench
from hydrajax.tree_attention import _along_paths, _expand
from hydrajax.benchmarking import report, roofline, timing
from hydrajax.partial_state import PartialState
from hydrajax.training import tree_attention_vjp as vjp


def merge_list(outs, lses):
  """`merge_stacked` of a list of states, elementwise (no reduction over the state axis)."""
  m = functools.reduce(jnp.maximum, lses)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  ws = [jnp.exp(lse - m) for lse in lses]
  total = functools.reduce(jnp.add, ws)
  acc = functools.reduce(jnp.add, [jnp.where(w[..., None] > 0, w[..., None] * o, 0.0)
                                   for w, o in zip(ws, outs)])
  lse = jnp.where(total > 0, m + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
  return PartialState(acc / jnp.where(total > 0, total, 1.0)[..., None], lse)


def merge_unrolled(dense, index, outs, lses, out_dtype=None):
  valid, (out, lse) = _along_paths(index, dense.out.shape[0], outs, lses)
  lse = jnp.where(_expand(valid, lse), lse.astype(jnp.float32), -jnp.inf)
  d = index.shape[1]
  merged = merge_list([dense.out.astype(jnp.float32)] + [out[i].astype(jnp.float32)
                                                          for i in range(d)],
                      [dense.lse.astype(jnp.float32)] + [lse[i] for i in range(d)])
  return PartialState(merged.out.astype(out_dtype or dense.out.dtype), merged.lse)


def sum_unrolled(dense, index, items):
  valid, (item,) = _along_paths(index, dense.shape[0], items)
  item = jnp.where(_expand(valid, item), item.astype(jnp.float32), 0.0)
  return functools.reduce(jnp.add, [dense.astype(jnp.float32)] + [item[i] for i in
                                                                   range(index.shape[1])])


def main():
  flags.FLAGS(sys.argv[:1])
  writer = report.JsonlWriter(sys.argv[1])
  ceilings = roofline.measure_ceilings()
  today = (vjp.merge_along_paths, vjp.sum_along_paths)
  for point in [tuple(int(x) for x in p.split(':')) for p in sys.argv[2:]]:
    for way, (merge, add) in (('reduce', today), ('unrolled', (merge_unrolled, sum_unrolled))):
      vjp.merge_along_paths, vjp.sum_along_paths = merge, add  # what the tree VJP calls
      [rec] = bench.run_point(point, ['tree_mosaic_gpu'], (32, 8), 128, jnp.bfloat16,
                              ceilings, 0)
      fn, args, _ = bench._variant('tree_mosaic_gpu', point, (32, 8), 128, jnp.bfloat16, 0)
      program, program_args = timing.vjp_program(fn, args, 0)
      jax.block_until_ready(program(*program_args))
      _, kernels = timing.kernel_times(program, *program_args)
      xla = [k for k in kernels if not k[0].startswith('training_')]
      rec.update(way=way, kernels=kernels, xla_us=sum(us for _, us, _ in xla))
      writer.append(rec)
      print(point, way, f"{rec.get('time_s', 0) * 1e3:.2f} ms", rec['status'],
            f"rel_err {rec.get('rel_err')}, XLA {rec['xla_us']:.0f} us", xla[:4])
  vjp.merge_along_paths, vjp.sum_along_paths = today


if __name__ == '__main__':
  main()
