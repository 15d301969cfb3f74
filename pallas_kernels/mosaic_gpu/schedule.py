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
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax

if TYPE_CHECKING:  # annotations only: hydrajax imports these kernels (the registry)
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


DEFAULT_NUM_SMS = 132  # H100 / H200 SXM


def device_num_sms(interpret: bool = False) -> int:
  """Multiprocessors of the default device (DEFAULT_NUM_SMS off the GPU or in interpret mode)."""
  if not interpret and jax.default_backend() == 'gpu':
    return int(getattr(jax.devices()[0], 'core_count', DEFAULT_NUM_SMS) or DEFAULT_NUM_SMS)
  return DEFAULT_NUM_SMS


PROGRAM_COST_BLOCKS = 3  # a program's fixed cost (its Q tile in, its partial state out), in kv blocks


EXACT_RUNS = 64  # launches of more runs (after merging) take the closed form (`launch_time`)


def launch_time(programs: Sequence[tuple[int, int]], *, num_sms: int) -> int:
  """Estimated time of one launch, in kv blocks: the block scheduler as list scheduling.

  programs: (count, blocks) runs of programs in launch order, each program taking
  `blocks + PROGRAM_COST_BLOCKS`. The GPU starts each program on the first multiprocessor
  to free up (one program a multiprocessor: the shared kernel's shared memory takes it
  whole). So a run of `count` equal programs starts at the `count` earliest of the times
  `free + j * cost` over the multiprocessors: found by bisection over the few distinct free
  times, whatever the count. Past `EXACT_RUNS` runs of mixed lengths (many segment groups
  times many kv heads) the last wave's shape matters little, and the estimate is the work
  spread evenly or the longest program, whichever is longer.
  """
  runs = []
  for count, blocks in programs:  # adjacent runs of one length are one run
    if count <= 0:
      continue
    cost = blocks + PROGRAM_COST_BLOCKS
    if runs and runs[-1][1] == cost:
      runs[-1][0] += count
    else:
      runs.append([count, cost])
  if not runs:
    return 0
  if len(runs) > EXACT_RUNS:
    work = sum(count * cost for count, cost in runs)
    return max(cdiv(work, num_sms), max(cost for _, cost in runs))
  free = {0: num_sms}  # free time -> multiprocessors free from then
  for count, cost in runs:
    free = _deal(free, count, cost)
  return max(free)


def _deal(free: dict[int, int], count: int, cost: int) -> dict[int, int]:
  """Free times after `count` programs of `cost`, each started at the earliest free time."""
  def starts_before(t):  # start times f + j * cost < t
    return sum(n * cdiv(t - f, cost) for f, n in free.items() if f < t)

  lo = min(free)
  hi = lo + count * cost + 1  # starts_before(lo) = 0 <= count < starts_before(hi)
  while hi - lo > 1:  # the last t with starts_before(t) <= count
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if starts_before(mid) <= count else (lo, mid)
  left = count - starts_before(lo)  # these start at lo itself, on multiprocessors free then
  out: dict[int, int] = {}
  for f, n in free.items():
    after = f + cdiv(lo - f, cost) * cost if f < lo else f
    out[after] = out.get(after, 0) + n
  if left:
    out[lo] -= left
    out[lo + cost] = out.get(lo + cost, 0) + left
    if not out[lo]:
      del out[lo]
  return out


def row_parts(programs: int, blocks: int, *, num_sms: int, most: int = 4) -> int:
  """Parts (1..most, dividing `blocks`) to split each of `programs` equal programs of
  `blocks` steps into: the count whose launch ends first by `launch_time` (a part pays a
  program's fixed cost again), ties to fewer.

  The shared segment's dK/dV kernel has one program per kv tile and kv head, each streaming
  every query row: a 1K-token prompt at 8 kv heads is 64 programs on 132 multiprocessors.
  Two parts of the rows are 128 programs of half the steps, one wave of half the time.
  """
  candidates = [p for p in range(1, most + 1) if blocks % p == 0]
  return min(candidates, key=lambda p: (
      launch_time([(programs * p, blocks // p)], num_sms=num_sms), p))


def choose_splits(
    programs: Sequence[tuple[int, int]], *, num_kv_heads: int, num_sms: int, max_splits: int
) -> int:
  """KV splits per segment: the count (1..max_splits) whose launch ends first.

  programs: (count, blocks) runs of one kv head's unsplit programs (segments x row tiles
  with rows), in launch order; every kv head launches the same. S splits turn a run into
  count * S programs of ceil(blocks / S) blocks. Splitting pays twice: a long segment
  no longer leaves the chip to a few long programs (a 20K-token document above short
  questions), and the last wave fills up (13B's 20 kv heads a GPU at TP=2: 160 programs
  of a 16K prefix are 2 waves on 132 multiprocessors, the second a fifth full; 4 splits
  are 5 nearly full waves of a quarter the length). Ties go to fewer splits (fewer
  partial states to write and merge).
  """
  def time(splits):
    split = [(count * splits, cdiv(blocks, splits)) for count, blocks in programs]
    return launch_time(split * num_kv_heads, num_sms=num_sms)

  longest = max((blocks for _, blocks in programs), default=1)
  candidates = range(1, max(1, min(max_splits, longest)) + 1)
  return min(candidates, key=lambda s: (time(s), s))


def shared_schedule(
    layout: 'TreeLayout',
    *,
    rows_per_query: int,
    num_kv_heads: int,
    block_kv: int,
    num_sms: int,
    max_splits: int,
) -> SharedSchedule:
  """The static work decomposition of the shared kernel for this layout's capacities.

  Groups keep the layout's order (segment indices), but their work items are numbered
  longest segments first: programs start in item order, so the long ones do not wait
  behind many short ones (longest processing time first).
  """
  pad = frame_pad(rows_per_query)
  row_tiles = [cdiv(g.row_capacity * rows_per_query + pad, TILE_M) for g in layout.groups]
  # Splits are chosen from the tiles with rows in them: the frame's extra tile (when the
  # first row is not 8-aligned) is an empty program for 8-aligned segments such as roots.
  blocks = [cdiv(g.kv_capacity + ALIGN - 1, block_kv) for g in layout.groups]
  launch_order = sorted(range(len(blocks)), key=lambda i: -blocks[i])
  programs = [(layout.groups[i].num_segments
               * cdiv(layout.groups[i].row_capacity * rows_per_query, TILE_M), blocks[i])
              for i in launch_order]
  splits = choose_splits(programs, num_kv_heads=num_kv_heads, num_sms=num_sms,
                         max_splits=max_splits)
  item_offsets, item = {}, 0
  for i in launch_order:
    item_offsets[i] = item
    item += layout.groups[i].num_segments * splits * row_tiles[i]
  groups, segment = [], 0
  for i, (g, t) in enumerate(zip(layout.groups, row_tiles)):
    split_tokens = round_up(cdiv(g.kv_capacity + ALIGN - 1, splits), block_kv)
    groups.append(GroupSchedule(g.num_segments, t, split_tokens, item_offsets[i], segment, splits))
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
