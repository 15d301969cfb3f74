"""Static work decomposition of the Mosaic GPU tree-attention kernels.

Both kernels see the queries folded per kv head: `qf [K, M, H]` with
`M = B * TGp` rows, row b owning rows `[b*TGp, (b+1)*TGp)` (the T*G rows of
one kv head's group, zero-padded to TGp, `padded_rows_per_query`). A shared
segment covering rows `[row_begin, row_begin + row_count)` is then the
contiguous block `[row_begin*TGp, (row_begin + row_count)*TGp)` of that matrix:
the M dimension of its matrix products. The private kernel takes frames of F
consecutive folded rows (`private_frame_rows`).

Tensor-memory copies (TMA) into tiled shared memory need row offsets that are
multiples of `ALIGN`, so each segment's query rows and kv tokens are read in an
aligned frame that starts at the offset rounded down to `ALIGN`; the kernels
mask what lies before the real start or past the real end.

Shared kernel work items: for every segment group (static capacities R, S) and
every segment j of it, `num_splits` kv splits times `row_tiles` row tiles of
`TILE_M` rows, numbered `item_offset + (j * num_splits + split) * row_tiles +
row_tile`. Item w writes its partial state to rows `[w*TILE_M, (w+1)*TILE_M)`
of the partial buffers, so one (segment, split)'s tiles are contiguous and a
window of consecutive query rows is one contiguous read.
"""

import dataclasses

from hydrajax.layout import TreeLayout

ALIGN = 8  # rows per tile of the (8, 64) shared-memory tiling used by wgmma
TILE_M = 128  # query rows per shared-kernel program: two compute warpgroups of 64
WG_M = 64  # query rows per warpgroup
PRIVATE_BLOCK = 64  # private kv tokens per step of the private kernel
PARTIAL_PAD = WG_M  # unwritten rows before and after the shared kernel's partial buffers
CHUNK = 8  # private tokens per TMA copy of the private kernel (pages are multiples of it)


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def round_up(a: int, b: int) -> int:
  return cdiv(a, b) * b


def frame_pad(rows_per_query: int) -> int:
  """Extra rows an aligned frame may need in front of a segment's or row's first query row."""
  return 0 if rows_per_query % ALIGN == 0 else ALIGN - 1


@dataclasses.dataclass(frozen=True)
class GroupSchedule:
  """Static tiling of one segment group."""

  num_segments: int  # J
  row_tiles: int  # row tiles of TILE_M per (segment, split)
  split_tokens: int  # kv tokens per split, a multiple of block_kv
  item_offset: int  # first work item of the group
  segment_offset: int  # first index of the group in the concatenation of all groups
  num_splits: int

  @property
  def num_items(self) -> int:
    return self.num_segments * self.num_splits * self.row_tiles


@dataclasses.dataclass(frozen=True)
class SharedSchedule:
  """Static tiling of all shared segments: one launch for every group."""

  groups: tuple[GroupSchedule, ...]
  num_splits: int  # kv splits per segment (the same for every group)
  rows_per_query: int  # T*G
  block_kv: int

  @property
  def num_items(self) -> int:
    return sum(g.num_items for g in self.groups)

  @property
  def num_segments(self) -> int:
    return sum(g.num_segments for g in self.groups)


def choose_splits(total_blocks: int, max_blocks: int, *, num_sms: int, max_splits: int) -> int:
  """KV splits per segment: the longest program cut to about an even share of the work.

  total_blocks: kv blocks over every unsplit program (segment x row tile x kv head);
  max_blocks: those of the longest segment. S splits cut the longest program to
  max_blocks / S blocks; below total_blocks / num_sms there is no gain (the chip is full).
  With segments of one length this is num_sms // programs (no split at one program per
  multiprocessor). With one long segment among many short ones (a document and its
  questions) the long one is still split: counting programs instead, 16 one-block questions
  would leave a 20K-token document to 8 programs on a 132-multiprocessor GPU.
  A split with no block is an empty program.
  """
  if total_blocks <= 0:
    return 1
  return max(1, min(max_splits, max_blocks * num_sms // total_blocks, max_blocks))


def shared_schedule(
    layout: TreeLayout,
    *,
    rows_per_query: int,
    num_kv_heads: int,
    block_kv: int,
    num_sms: int,
    max_splits: int,
) -> SharedSchedule:
  """The static work decomposition of the shared kernel for this layout's capacities."""
  pad = frame_pad(rows_per_query)
  row_tiles = [cdiv(g.row_capacity * rows_per_query + pad, TILE_M) for g in layout.groups]
  # Splits are chosen from the tiles with rows in them: the frame's extra tile (when the
  # first row is not 8-aligned) is an empty program for 8-aligned segments such as roots.
  blocks = [cdiv(g.kv_capacity + ALIGN - 1, block_kv) for g in layout.groups]
  total_blocks = num_kv_heads * sum(
      g.num_segments * cdiv(g.row_capacity * rows_per_query, TILE_M) * b
      for g, b in zip(layout.groups, blocks)
  )
  splits = choose_splits(total_blocks, max(blocks, default=1), num_sms=num_sms,
                         max_splits=max_splits)
  groups, item, segment = [], 0, 0
  for g, t in zip(layout.groups, row_tiles):
    split_tokens = round_up(cdiv(g.kv_capacity + ALIGN - 1, splits), block_kv)
    gs = GroupSchedule(g.num_segments, t, split_tokens, item, segment, splits)
    groups.append(gs)
    item += gs.num_items
    segment += g.num_segments
  return SharedSchedule(tuple(groups), splits, rows_per_query, block_kv)


def padded_rows_per_query(tg: int) -> int:
  """Folded rows per query row, TGp >= T*G: a power of two up to WG_M, else a multiple of it.

  Then a private-kernel frame of F rows holds whole query rows (or a whole
  64-row tile of one), so frames never share a row and store whole tiles.
  """
  if tg <= WG_M:
    return 1 << max(0, tg - 1).bit_length()
  return round_up(tg, WG_M)


def private_frame_rows(num_rows: int, rows_per_query: int, num_kv_heads: int, num_sms: int) -> int:
  """F, folded query rows per private-kernel program (one of 8, 16, 32, 64).

  The largest F whose programs still cover every multiprocessor, so large
  batches pack many query rows into one program and small ones keep the chip busy.
  """
  smallest = max(ALIGN, rows_per_query)
  if smallest >= WG_M:
    return WG_M
  for f in (64, 32, 16, 8):
    if f < smallest:
      break
    if cdiv(num_rows * rows_per_query, f) * num_kv_heads >= num_sms:
      return f
  return smallest
