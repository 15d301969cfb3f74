"""Block sizes of the Mosaic TPU tree-attention kernels, and their defaults per TPU generation.

TPU generations differ in what sizes the blocks should have: VMEM per TensorCore (v5e and v6e
128 MiB, v5p 64 MiB), TensorCores per chip (v5p's two form one megacore device; v5e and v6e
have one), MXU width (128 on v5e/v5p, 256 on v6e) and the ratio of peak bf16 FLOP/s to HBM
bandwidth (the ridge point: ~240 FLOP/byte on v5e, ~166 on v5p, ~560 on v6e; figures in
`pallas_kernels.tpu.aot.CHIPS` and ROOFLINE.md). `BLOCK_SIZES_BY_GENERATION` holds one entry
per generation; `block_sizes_for_device` maps a JAX device (its `device_kind`) to its entry,
and any other device (an unknown TPU, the CPU of interpret mode) to `FALLBACK_BLOCK_SIZES`.

The entries are compile-checked and chosen on paper, not timed: no TPU was available.
`experiments/tpu_block_sizes.py` compiled a few candidates per generation with libtpu's
compiler (deviceless) at the decode and prefill shapes of `experiments/tpu_aot.py` (bf16).
Each entry is the candidate that compiled at every shape with the fewest grid steps, i.e. the
most work per step and the least per-step pipeline overhead (the roofline does not tell the
candidates apart: the attention's FLOPs and the kv bytes it must read do not depend on the
blocks), and whose float32 compile of the head-dim-64 decode call, where `plan()`'s VMEM
estimate falls shortest of the compiler's, succeeded too. The shared kernel's row tile stays
above the chip's ridge point (a tile of `block_rows` query rows does ~block_rows FLOP per byte
of kv it reads). Results: experiments/results/tpu_block_sizes/.
"""

import dataclasses

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tuning knobs of the two kernels (the defaults: the fallback for a TPU not in the table).

  Attributes:
    block_rows: target query-matrix rows (rows x T x G) per row tile of the
      shared kernel; rounded down to a multiple of lcm(T*G, sublane tile) and
      capped at the whole batch. A tile's arithmetic intensity on the kv it
      reads is ~block_rows FLOP/byte, so it must exceed the bf16 ridge point
      (~240 on v5e, ~166 on v5p) for the shared phase to be MXU-bound.
    block_kv: kv tokens per block of the shared kernel (multiple of 128).
    heads_per_block: kv heads per grid step of the shared kernel (must divide
      K, on whole 128-lane vregs or all K); None picks the largest such divisor
      of K with heads * H <= lanes_per_block (H = 64: two heads share 128 lanes).
    lanes_per_block: the width (kv heads x H) a shared grid step aims at when
      heads_per_block is None: a width rather than a head count, so that one
      default suits every K and H (a head count must divide K).
    core_splits: independent work lists of the shared kernel, on a parallel
      grid axis (row tiles dealt round-robin; capped at the number of tiles).
      2 lets megacore (v5p's two TensorCores) split the work by row tile even
      when K / heads_per_block is 1, as with MQA; on one-core chips a split
      only adds a few no-op grid steps.
    private_block_kv: private kv tokens per row and grid step of the private
      kernel, rounded down to whole pages (at least one page).
    private_rows_per_block: rows per grid step of the private kernel (the
      largest divisor of the padded batch up to this, up to 64 unrolled
      row x page x head bodies, and rows within half the VMEM budget), so that
      decode rows with one short page do not pay a grid step each.
    private_heads_per_block: kv heads per grid step of the private kernel
      (must divide K, on whole vregs or all K); None picks the largest such
      divisor with heads * H <= 1024.
    vmem_limit_bytes: the Mosaic scoped-VMEM limit, and the budget the blocks'
      VMEM estimate must fit (a chip with 128 MiB per TensorCore can ask for
      more than v5p's 64 MiB allow); None derives the limit from the block
      sizes (at least 32 MiB, at most 60 MiB) with a 48 MiB budget.
  """

  block_rows: int = 1024
  block_kv: int = 1024
  heads_per_block: int | None = None
  lanes_per_block: int = 256
  core_splits: int = 2
  private_block_kv: int = 512
  private_rows_per_block: int = 8
  private_heads_per_block: int | None = None
  vmem_limit_bytes: int | None = None

  def __post_init__(self):
    if self.block_rows < 1:
      raise ValueError(f'block_rows must be >= 1, got {self.block_rows}')
    if self.block_kv < 128 or self.block_kv % 128:
      raise ValueError(f'block_kv must be a positive multiple of 128, got {self.block_kv}')
    if self.lanes_per_block < 128 or self.lanes_per_block % 128:
      raise ValueError(f'lanes_per_block must be a positive multiple of 128, got '
                       f'{self.lanes_per_block}')
    if self.core_splits < 1:
      raise ValueError(f'core_splits must be >= 1, got {self.core_splits}')
    if self.private_block_kv < 1:
      raise ValueError(f'private_block_kv must be >= 1, got {self.private_block_kv}')
    if self.private_rows_per_block < 1:
      raise ValueError(f'private_rows_per_block must be >= 1, got {self.private_rows_per_block}')
    for name in ('heads_per_block', 'private_heads_per_block'):
      value = getattr(self, name)
      if value is not None and value < 1:
        raise ValueError(f'{name} must be >= 1 or None, got {value}')


FALLBACK_BLOCK_SIZES = BlockSizes()

# `device_kind` strings of JAX TPU devices (what libtpu reports, on a chip or for a named
# topology; the same strings as jax's own `tpu_info`), by generation.
GENERATION_OF_DEVICE_KIND = {
    'TPU v5 lite': 'v5e',
    'TPU v5e': 'v5e',
    'TPU v5': 'v5p',
    'TPU v5p': 'v5p',
    'TPU v6 lite': 'v6e',
    'TPU v6e': 'v6e',
}

# Compile-checked, chosen by grid steps, not timed (see the module docstring).
BLOCK_SIZES_BY_GENERATION = {
    # 128 MiB VMEM, one TensorCore, ridge ~240 FLOP/byte. Twice the fallback's lanes per shared
    # step (4 kv heads of 128, 8 of 64): about half its shared grid steps at every benchmark
    # shape, at most ~62 MiB by plan() in float32 within the 96 MiB asked. One core split:
    # there is no second core to feed. Bigger steps failed a check: 2048-token kv blocks with
    # these lanes overflowed the scoped VMEM in the float32 head-dim-64 compile
    # (CompileTimeScopedVmemOom), and 2048-row tiles with 2048-token kv blocks exceed 96 MiB
    # at full size with head dim 64. The kv block stays 1024 tokens, within the 1024-2048 of
    # jax's measured ragged-paged-attention tables on 'TPU v5' and 'TPU v6' (8-16 pages of 128).
    'v5e': BlockSizes(lanes_per_block=512, core_splits=1, vmem_limit_bytes=96 * MiB),
    # 64 MiB VMEM, two TensorCores as one megacore device: the fallback, which was sized for
    # it. Every larger candidate failed here: 2048-token kv blocks overflow the scoped VMEM at
    # head dim 64 (CompileTimeScopedVmemOom at a 56 MiB limit), and 512-lane steps leave no
    # room for float32 by plan()'s estimate. Two core splits keep both cores busy when the kv
    # heads are one block (MQA).
    'v5p': FALLBACK_BLOCK_SIZES,
    # 128 MiB VMEM, one TensorCore, 256-wide MXUs: the same blocks as v5e, which passed the
    # same checks here (512 lanes are two MXU widths). Its ridge (~560 FLOP/byte) is the
    # highest; a 1024-row tile still clears it (1.8x).
    'v6e': BlockSizes(lanes_per_block=512, core_splits=1, vmem_limit_bytes=96 * MiB),
}


def tpu_generation(device_kind: str) -> str | None:
  """'TPU v5 lite' -> 'v5e', 'TPU v5' -> 'v5p', 'TPU v6 lite' -> 'v6e'; None for any other
  kind (exact names: 'TPU v5' is v5p, 'TPU v5 lite' is v5e)."""
  return GENERATION_OF_DEVICE_KIND.get(device_kind.strip())


def block_sizes_for_device(device) -> BlockSizes:
  """The table's entry for a JAX device (or abstract device) by its `device_kind`;
  `FALLBACK_BLOCK_SIZES` for None, a device that is not a TPU, or a TPU not in the table."""
  if device is None or getattr(device, 'platform', None) != 'tpu':
    return FALLBACK_BLOCK_SIZES
  generation = tpu_generation(device.device_kind)
  return BLOCK_SIZES_BY_GENERATION.get(generation, FALLBACK_BLOCK_SIZES)
