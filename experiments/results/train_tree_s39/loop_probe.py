"""A/B of session 39's change: the tree VJP's segment groups one launch each (today's code)
against one launch per segment (the code before, restored here by monkeypatching).

  PYTHONPATH=. python experiments/results/train_tree_s39/loop_probe.py OUT.jsonl P:B:L:G:T ...

Runs `experiments.train_tree_bench.run_point` with tree_mosaic_gpu only, both ways, and writes
one record per way and point (impl 'tree_mosaic_gpu' or 'tree_mosaic_gpu_per_segment').
"""

import sys

from absl import flags
import jax.numpy as jnp

from experiments import train_tree_bench as bench
from hydrajax.benchmarking import report, roofline
from pallas_kernels.mosaic_gpu import training_attention as ta


def per_segment(batched):
  """`segments_forward` / `segments_backward` called once per segment (Z = 1), stacked."""
  def run(*args, **kw):
    z = args[0].shape[0]
    lengths = jnp.broadcast_to(args[-1], (z,))
    parts = [batched(*(a[j:j + 1] for a in args[:-1]), lengths[j:j + 1], **kw) for j in range(z)]
    return tuple(jnp.concatenate(xs) for xs in zip(*parts))
  return run


def main():
  flags.FLAGS(sys.argv[:1])
  path, points = sys.argv[1], [tuple(int(x) for x in p.split(':')) for p in sys.argv[2:]]
  writer = report.JsonlWriter(path)
  ceilings = roofline.measure_ceilings()
  batched = (ta.segments_forward, ta.segments_backward)
  for point in points:
    for way in ('batched', 'per_segment'):
      fwd, bwd = batched if way == 'batched' else (per_segment(batched[0]),
                                                    per_segment(batched[1]))
      ta.segments_forward, ta.segments_backward = fwd, bwd  # what the tree VJP imports
      records = bench.run_point(point, ['tree_mosaic_gpu'], (32, 8), 128, jnp.bfloat16,
                                ceilings, 0)
      for r in records:
        r['impl'] = 'tree_mosaic_gpu' + ('' if way == 'batched' else '_per_segment')
        writer.append(r)
        print(point, r['impl'], r.get('time_s'), r['status'])
  ta.segments_forward, ta.segments_backward = batched


if __name__ == '__main__':
  main()
