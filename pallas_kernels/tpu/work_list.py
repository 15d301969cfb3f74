"""The shared kernel's work list: (row tile, kv block) items over all segment groups.

The shared kernel sees the queries as one matrix of B*T*G rows (row b's T*G
rows are [b*T*G, (b+1)*T*G)) cut into row tiles of `block_rows` rows, and the
KV buffer as blocks of `block_kv` tokens. A segment covers the rows
[row_begin*T*G, (row_begin+row_count)*T*G) and the tokens [kv_start,
kv_start+kv_length); it contributes one item per (row tile, kv block) pair it
touches, and the kernel masks the scores outside the segment's rows and tokens.

Items are sorted by row tile, so one tile's items are consecutive grid steps
that accumulate into the same VMEM online-softmax state: the LSE merge over a
row's whole root-to-leaf path happens in VMEM, for any tree depth, with no
partial state per segment or per chunk in HBM. Every tile also gets one item
with no keys (first in its tile), so tiles that no segment covers are still
initialised and written.

Row tiles are dealt round-robin to `num_splits` independent lists (tile t to
list t % num_splits), one per slice of a parallel grid axis, so that the two
TensorCores of a v5p chip share the work even when there is a single kv-head
block (MQA). Each list has the same static length, a bound from the groups'
capacities; its unused tail repeats its last item's block indices (no DMA,
no write-back of a block it did not finish) with the flags off.

The list is built on device (jnp, under jit) from the `TreeLayout`'s padded
arrays.
"""

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

if TYPE_CHECKING:  # annotations only: hydrajax imports these kernels (the registry)
  from hydrajax.layout import TreeLayout


FIRST = 1  # the item starts its row tile: load the private partial state
LAST = 2  # the item ends its row tile: write the tile's output


class WorkList(NamedTuple):
  """Scalar-prefetched item metadata, each [num_splits * E] int32 (split-major)."""

  tile: jax.Array  # row tile index
  kv_block: jax.Array  # kv block index
  row_lo: jax.Array  # the segment's matrix rows [row_lo, row_hi)
  row_hi: jax.Array
  kv_lo: jax.Array  # the segment's tokens [kv_lo, kv_hi); empty for tile-initialising items
  kv_hi: jax.Array
  flags: jax.Array  # FIRST | LAST bits; 0 inside a tile's run and in the unused tail


def _candidates_per_group(row_capacity, kv_capacity, rows_per_query, block_rows, block_kv,
                          num_tiles, num_kv_blocks) -> tuple[int, int]:
  """Row tiles and kv blocks one segment of the group can touch."""
  tiles = min(-(-row_capacity * rows_per_query // block_rows) + 1, num_tiles)
  blocks = min(-(-kv_capacity // block_kv) + 1, num_kv_blocks)
  return tiles, blocks


def work_list_size(layout: 'TreeLayout', *, rows_per_query: int, block_rows: int, block_kv: int,
                   num_tiles: int, kv_tokens: int, num_splits: int = 1) -> int:
  """Static items per split E, a bound on the items any split uses.

  A segment's tiles are contiguous, so at most ceil(tiles / num_splits) of
  them fall in one split.
  """
  num_kv_blocks = -(-kv_tokens // block_kv)
  size = -(-num_tiles // num_splits)
  for g in layout.groups:
    tiles, blocks = _candidates_per_group(
        g.row_capacity, g.kv_capacity, rows_per_query, block_rows, block_kv, num_tiles,
        num_kv_blocks,
    )
    size += g.num_segments * -(-tiles // num_splits) * blocks
  return size


def build_work_list(layout: 'TreeLayout', *, rows_per_query: int, block_rows: int, block_kv: int,
                    num_tiles: int, kv_tokens: int, num_splits: int = 1) -> WorkList:
  """Items of every segment of every group, dealt to splits and sorted by row tile.

  Args:
    layout: the tree layout.
    rows_per_query: T*G, matrix rows per query row.
    block_rows: rows per row tile.
    block_kv: tokens per kv block.
    num_tiles: row tiles in the (padded) query matrix.
    kv_tokens: L, tokens in the KV buffer.
    num_splits: independent lists (<= num_tiles, so that none is empty).
  """
  if not 1 <= num_splits <= num_tiles:
    raise ValueError(f'num_splits must be in [1, num_tiles={num_tiles}], got {num_splits}')
  num_kv_blocks = -(-kv_tokens // block_kv)
  fields = {name: [] for name in ('tile', 'kv_block', 'row_lo', 'row_hi', 'kv_lo', 'kv_hi')}
  valid, real = [], []
  for g in layout.groups:
    tiles, blocks = _candidates_per_group(
        g.row_capacity, g.kv_capacity, rows_per_query, block_rows, block_kv, num_tiles,
        num_kv_blocks,
    )
    shape = (g.num_segments, tiles, blocks)
    row_lo = g.row_begin * rows_per_query  # [J]
    row_hi = (g.row_begin + g.row_count) * rows_per_query
    kv_lo = g.kv_start
    kv_hi = g.kv_start + g.kv_length
    tile = row_lo[:, None] // block_rows + jnp.arange(tiles)[None, :]  # [J, tiles]
    kv_block = kv_lo[:, None] // block_kv + jnp.arange(blocks)[None, :]  # [J, blocks]
    ok = (
        (tile * block_rows < row_hi[:, None])[:, :, None]
        & (kv_block * block_kv < kv_hi[:, None])[:, None, :]
        & ((row_hi > row_lo) & (kv_hi > kv_lo))[:, None, None]
    )
    per_segment = lambda x: jnp.broadcast_to(x[:, None, None], shape)
    fields['tile'].append(jnp.broadcast_to(tile[:, :, None], shape))
    fields['kv_block'].append(jnp.broadcast_to(kv_block[:, None, :], shape))
    fields['row_lo'].append(per_segment(row_lo))
    fields['row_hi'].append(per_segment(row_hi))
    fields['kv_lo'].append(per_segment(kv_lo))
    fields['kv_hi'].append(per_segment(kv_hi))
    valid.append(ok)
    real.append(jnp.ones(shape, bool))
  # One keyless item per tile: it starts the tile (sorted first) even where no segment does.
  zeros = jnp.zeros((num_tiles,), jnp.int32)
  fields['tile'].append(jnp.arange(num_tiles, dtype=jnp.int32))
  for name in ('kv_block', 'row_lo', 'row_hi', 'kv_lo', 'kv_hi'):
    fields[name].append(zeros)
  valid.append(jnp.ones((num_tiles,), bool))
  real.append(jnp.zeros((num_tiles,), bool))

  flat = lambda xs: jnp.concatenate([jnp.ravel(x).astype(jnp.int32) for x in xs])
  fields = {name: flat(xs) for name, xs in fields.items()}
  valid = jnp.concatenate([jnp.ravel(x) for x in valid])
  real = jnp.concatenate([jnp.ravel(x) for x in real])
  size = valid.shape[0]

  # Sort by (split, tile, keyless first); invalid candidates go last.
  split = fields['tile'] % num_splits
  key = (split * num_tiles + fields['tile']) * 2 + real.astype(jnp.int32)
  order = jnp.argsort(jnp.where(valid, key, 2 * num_splits * num_tiles), stable=True)
  fields = {name: x[order] for name, x in fields.items()}
  real, split = real[order], split[order]
  count = jnp.sum(valid)
  index = jnp.arange(size)
  used = index < count

  # Keyless items reuse the kv block of the item before them (or of the first
  # real item), so that starting a tile fetches no kv block.
  last_real = jax.lax.cummax(jnp.where(used & real, index, -1))
  first_real = jnp.argmax(used & real)
  kv_source = jnp.where(real, index, jnp.where(last_real >= 0, last_real, first_real))
  fields['kv_block'] = fields['kv_block'][kv_source]

  tile = fields['tile']
  prev_tile = jnp.concatenate([jnp.full((1,), -1, jnp.int32), tile[:-1]])
  next_tile = jnp.concatenate([tile[1:], jnp.full((1,), -1, jnp.int32)])
  first = used & (tile != prev_tile)
  last = used & ((index == count - 1) | (tile != next_tile))
  fields['flags'] = jnp.where(first, FIRST, 0) | jnp.where(last, LAST, 0)

  # Deal the sorted items to their splits: split s owns [s * E, (s + 1) * E).
  per_split = work_list_size(
      layout, rows_per_query=rows_per_query, block_rows=block_rows, block_kv=block_kv,
      num_tiles=num_tiles, kv_tokens=kv_tokens, num_splits=num_splits,
  )
  counts = jnp.zeros((num_splits,), jnp.int32).at[split].add(used.astype(jnp.int32))
  start = jnp.cumsum(counts) - counts  # sorted index of each split's first item
  dest = jnp.where(used, split * per_split + index - start[split], num_splits * per_split)
  slot = jnp.arange(num_splits * per_split)
  slot_split = slot // per_split
  in_use = slot % per_split < counts[slot_split]
  tail_source = start[slot_split] + counts[slot_split] - 1  # the split's last item

  def deal(x, tail):
    placed = jnp.zeros((num_splits * per_split + 1,), jnp.int32).at[dest].set(x)[:-1]
    return jnp.where(in_use, placed, tail)

  return WorkList(
      tile=deal(tile, tile[tail_source]),
      kv_block=deal(fields['kv_block'], fields['kv_block'][tail_source]),
      row_lo=deal(fields['row_lo'], 0),
      row_hi=deal(fields['row_hi'], 0),
      kv_lo=deal(fields['kv_lo'], 0),
      kv_hi=deal(fields['kv_hi'], 0),
      flags=deal(fields['flags'].astype(jnp.int32), 0),
  )
