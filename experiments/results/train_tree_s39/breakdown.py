"""Where one forward + backward of the rollout-tree benchmark's variants goes: CUPTI kernel
times (`hydrajax.benchmarking.timing.kernel_times`) of one call after a warm-up, kernels summed
by name, XLA fusions together.

  PYTHONPATH=. python experiments/results/train_tree_s39/breakdown.py OUT.jsonl \
      VARIANT P:B:L:G:T [VARIANT P:B:L:G:T ...]
"""

import sys

from absl import flags
import jax
import jax.numpy as jnp

from experiments import train_tree_bench as bench
from hydrajax.benchmarking import report, timing


def main():
  flags.FLAGS(sys.argv[:1])
  writer = report.JsonlWriter(sys.argv[1])
  pairs = sys.argv[2:]
  for name, point in zip(pairs[::2], pairs[1::2]):
    point = tuple(int(x) for x in point.split(':'))
    fn, args, _ = bench._variant(name, point, (32, 8), 128, jnp.bfloat16, 0)
    program, program_args = timing.vjp_program(fn, args, 0)
    jax.block_until_ready(program(*program_args))  # compile and warm up
    _, kernels = timing.kernel_times(program, *program_args)
    total = sum(us for _, us, _ in kernels)
    pallas = [k for k in kernels if k[0].startswith('training_')]
    xla_us = total - sum(us for _, us, _ in pallas)
    xla_calls = sum(c for n, _, c in kernels if not n.startswith('training_'))
    writer.append(dict(impl=name, point=point, total_us=total, xla_us=xla_us,
                       xla_launches=xla_calls, kernels=kernels))
    print(name, point, f'total {total:.0f} us, XLA {xla_us:.0f} us in {xla_calls} launches')
    for k in pallas + [k for k in kernels if not k[0].startswith('training_')][:8]:
      print('   ', k)


if __name__ == '__main__':
  main()
