"""Compiles the tree-attention kernels at two shapes with Mosaic GPU's ptxas report on (the
environment sets MOSAIC_GPU_DUMP_PTXAS=1): registers and shared memory per kernel."""
import sys

import jax

from pallas_kernels.mosaic_gpu import check_on_device as cod
from pallas_kernels.mosaic_gpu import tree_attention as mosaic

cod.CAPACITY = 128
for shape in ((1024, 1024, 9, 32, 32), (256, 16384, 1, 32, 8)):
  _, layout, q, kc, vc = cod.problem(*shape)
  print('shape', shape, flush=True)
  jax.block_until_ready(jax.jit(mosaic.tree_attention)(q, kc, vc, layout))
  sys.stdout.flush()
