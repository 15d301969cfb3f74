"""Compiles the tree-attention kernels at two shapes with Mosaic GPU's ptxas report on (the
environment sets MOSAIC_GPU_DUMP_PTXAS=1): registers and shared memory per kernel.
Arguments: MosaicGpuConfig knobs (name=value), e.g. private_lean_registers=true."""
import sys

import jax

from pallas_kernels.mosaic_gpu import check_on_device as cod
from pallas_kernels.mosaic_gpu import tree_attention as mosaic

cod.CAPACITY = 128
config = mosaic.MosaicGpuConfig.from_knobs(sys.argv[1:])
print('config', config, flush=True)
for shape in ((1024, 1024, 9, 32, 32), (256, 16384, 1, 32, 8)):
  _, layout, q, kc, vc = cod.problem(*shape)
  print('shape', shape, flush=True)
  jax.block_until_ready(jax.jit(lambda *a: mosaic.tree_attention(
      *a, **{f: getattr(config, f) for f in config.__dataclass_fields__}))(q, kc, vc, layout))
  sys.stdout.flush()
