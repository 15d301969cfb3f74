"""Which XLA fusion is the slow gather-reduce of the tree VJP: compiles forward + backward of
one rollout-tree point with the optimized HLO dumped, and prints every instruction whose name
starts with `needle` (a regular expression) with the computation it calls.

  XLA_FLAGS=--xla_dump_to=/tmp/dump PYTHONPATH=. python fusion_dump.py /tmp/dump \
      P:B:L:G:T needle [variant]
"""

import glob
import os
import re
import sys

from absl import flags
import jax
import jax.numpy as jnp

from experiments import train_tree_bench as bench
from hydrajax.benchmarking import timing


def main():
  flags.FLAGS(sys.argv[:1])
  dump, point, needle = sys.argv[1], tuple(int(x) for x in sys.argv[2].split(':')), sys.argv[3]
  variant = sys.argv[4] if len(sys.argv) > 4 else 'tree_mosaic_gpu'
  fn, args, _ = bench._variant(variant, point, (32, 8), 128, jnp.bfloat16, 0)
  program, program_args = timing.vjp_program(fn, args, 0)
  jax.block_until_ready(program(*program_args))
  files = [f for f in glob.glob(os.path.join(dump, '*after_optimizations.txt'))
           if 'jit_run' in f]
  text = open(max(files, key=os.path.getsize)).read()
  computations = dict(re.findall(r'\n(%?[\w.\-]+) (?:\([^\n]*\) -> [^\n]*)?\{\n(.*?)\n\}', text,
                                 re.S))
  for line in text.splitlines():
    if re.search(rf'%{needle}(\.\d+)? = ', line):
      print(line.strip()[:2000])
      called = re.search(r'calls=(%[\w.\-]+)', line)
      if called:
        body = computations.get(called.group(1)) or computations.get(called.group(1)[1:])
        print(called.group(1), '\n', (body or 'not found')[:6000])


if __name__ == '__main__':
  main()
