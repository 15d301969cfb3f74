"""Does Mosaic GPU lower a TMA copy of fewer than 8 rows into swizzled shared memory? (s30)

The private kernel's K/V slots are tiled (8, 64) with a 128-byte swizzle, and a slice of a
tiled dimension must be whole tiles, so a 1-, 2- or 4-token copy is refused (session 24). The
same bytes seen untiled, as [tiles, 2 column halves, 8, 64] with only the swizzle, take a copy
of n rows into each half. This cross-lowers that copy for CUDA on the CPU; it does not run it,
and it does not build the alias between this view and the tiled one wgmma reads.

  PYTHONPATH=. python3 experiments/results/mosaic_gpu_check/s30/partial_copy_probe.py
"""

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax


def lowers(rows: int) -> None:
  def kernel(k_ref, o_ref, smem, bar):
    tok = pl.multiple_of(lax.axis_index('x') * 8 + 16, 8)
    for half in range(2):  # one copy a 64-column half: its rows are contiguous there
      plgpu.copy_gmem_to_smem(k_ref.at[pl.ds(tok, rows), half], smem.at[1, half, pl.ds(0, rows)],
                              bar.at[0])
    plgpu.barrier_wait(bar.at[0])
    plgpu.copy_smem_to_gmem(smem, o_ref)
    plgpu.wait_smem_to_gmem(0)

  f = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((8, 2, 8, 64), jnp.bfloat16),
      scratch_types=[plgpu.SMEM((8, 2, 8, 64), jnp.bfloat16,
                                transforms=(plgpu.SwizzleTransform(128),)),
                     plgpu.Barrier(num_barriers=1, num_arrivals=2)],
      grid=(1,), grid_names=('x',))
  jax.jit(f).trace(jnp.zeros((256, 2, 64), jnp.bfloat16)).lower(lowering_platforms=('cuda',))


if __name__ == '__main__':
  for rows in (1, 2, 4, 8):
    lowers(rows)
    print(f'{rows} rows a half: lowers for CUDA')
