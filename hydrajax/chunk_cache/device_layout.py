"""From a chunk-cache `SharingPlan` to a `TreeLayout` with few distinct static shapes.

A serving engine jits its model step once per distinct layout shape, so the
layout must not change shape with every tree change. `SharingPlan.to_device`
buckets capacities but gives each group exactly as many segments as it has;
here:

* shared segments longer than `kv_piece` tokens are split into pieces of
  `kv_piece` (each piece is one more partial state for its rows, merged like
  any other: a 4K prompt with kv_piece=1024 costs 4 states per row, not 64);
* a piece's row capacity R is the next power of two of its rows, its kv
  capacity S the next power of two of its length (at most kv_piece);
  `fixed_shapes` instead gives every piece R = the layout's rows and
  S = kv_piece: one group (present even when empty), whose shape then
  depends only on the batch size and J (more masked work per piece, far
  fewer compiles);
* the number of pieces J of each (R, S) group is padded to a power of two
  (at least `min_segments`) with empty slots (kv_length 0: a no-op).

`row_segments` (per row, its pieces root first, as indices into the
concatenation of the groups) is filled, its width padded to a power of two.

The private page table is padded to a power of two of columns (see
`LayoutPolicy.page_width`), and a plan may already carry padding rows (no
pages, length 0: their output is (0, -inf)).
"""

import dataclasses

import jax.numpy as jnp
import numpy as np

from hydrajax.layout import SegmentGroup, SharingPlan, TreeLayout, path_columns


@dataclasses.dataclass(frozen=True)
class LayoutPolicy:
  """Static-shape policy of device layouts.

  Attributes:
    kv_piece: longest run of shared tokens in one partial state (tokens).
    min_kv_capacity: smallest kv capacity S of a group.
    min_segments: smallest padded J of a group.
    fixed_shapes: R = all rows and S = kv_piece for every piece (see the module docstring).
    min_private_pages: smallest width of the private page table; the width is the
      next power of two of the widest row's pages (at most the cache's maximum),
      since the XLA path reads every row's table to its full width. Set to the
      cache's `max_pages` for one width whatever rows hold (a serving engine then
      never compiles as rows grow; the Mosaic GPU kernels read only valid pages).
  """

  kv_piece: int = 1024
  min_kv_capacity: int = 16
  min_segments: int = 1
  fixed_shapes: bool = False
  min_private_pages: int = 1

  def page_width(self, widest: int, limit: int) -> int:
    """Page-table width for a widest row of `widest` pages, at most `limit`."""
    return min(limit, max(next_power_of_two(max(widest, 1)), self.min_private_pages))

  def __post_init__(self):
    for name in ('kv_piece', 'min_kv_capacity', 'min_segments', 'min_private_pages'):
      if getattr(self, name) < 1:
        raise ValueError(f'LayoutPolicy.{name} must be >= 1, got {getattr(self, name)}')


def next_power_of_two(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def segment_pieces(plan: SharingPlan, kv_piece: int) -> list[tuple[int, int, int, int]]:
  """(kv_start, kv_length, row_begin, num_rows) of every non-empty piece of every segment."""
  pieces = []
  for s in plan.segments:
    for offset in range(0, s.kv_length, kv_piece):
      length = min(kv_piece, s.kv_length - offset)
      pieces.append((s.kv_start + offset, length, s.row_begin, s.num_rows))
  return pieces


def _capacity(piece, plan: SharingPlan, policy: LayoutPolicy) -> tuple[int, int]:
  _, length, _, rows = piece
  if policy.fixed_shapes:
    return plan.num_rows, policy.kv_piece
  kv = min(max(next_power_of_two(length), policy.min_kv_capacity), policy.kv_piece)
  return next_power_of_two(rows), max(kv, length)


def group_arrays(plan: SharingPlan, policy: LayoutPolicy):
  """Host form of the groups and the rows' paths through them.

  Returns ([(R, S, columns [4, J] int32: kv_start, kv_length, row_begin, rows)],
  row_pieces [B, D] int32: each row's pieces, root first, as indices into the
  concatenation of the groups, -1 padded, D a power of two).
  """
  pieces = segment_pieces(plan, policy.kv_piece)
  by_capacity: dict[tuple[int, int], list[int]] = {}
  if policy.fixed_shapes:  # the one group exists even when empty: one shape per (B, J)
    by_capacity[(plan.num_rows, policy.kv_piece)] = []
  for i, piece in enumerate(pieces):
    by_capacity.setdefault(_capacity(piece, plan, policy), []).append(i)
  groups, global_id, offset = [], np.zeros(len(pieces), np.int64), 0
  for (rows, tokens), members in sorted(by_capacity.items()):
    size = max(next_power_of_two(len(members)), next_power_of_two(policy.min_segments))
    columns = np.zeros((4, size), np.int32)  # padding: empty slots
    if members:
      columns[:, : len(members)] = np.array([pieces[i] for i in members], np.int32).T
    global_id[members] = offset + np.arange(len(members))
    offset += size
    groups.append((rows, tokens, columns))
  columns = path_columns([(row_begin, rows) for _, _, row_begin, rows in pieces], plan.num_rows)
  width = next_power_of_two(max(1, int(columns.max(initial=-1)) + 1))
  if policy.fixed_shapes:
    width = offset  # J of the one group: the width never changes with the tree
  table = np.full((plan.num_rows, width), -1, np.int32)
  for i, (_, _, row_begin, rows) in enumerate(pieces):  # segments come parents first
    table[row_begin : row_begin + rows, columns[i]] = global_id[i]
  return groups, table


def device_groups(plan: SharingPlan, policy: LayoutPolicy):
  """(segment groups on the device, row_pieces [B, D] on the device)."""
  groups, table = group_arrays(plan, policy)
  out = []
  for rows, tokens, columns in groups:  # one upload per column (slicing on the device costs more)
    start, length, begin, count = (jnp.asarray(c) for c in np.ascontiguousarray(columns))
    out.append(
        SegmentGroup(
            kv_start=start, kv_length=length, row_begin=begin, row_count=count,
            row_capacity=rows, kv_capacity=tokens,
        )
    )
  return tuple(out), jnp.asarray(table)


def make_layout(groups, row_pieces, private_pages, private_lengths, page_size: int) -> TreeLayout:
  """A `TreeLayout` with the rows' paths as `row_segments`."""
  return TreeLayout(
      groups=groups, private_pages=private_pages, private_lengths=private_lengths,
      page_size=page_size, num_rows=private_lengths.shape[0], row_segments=row_pieces,
  )


def page_table(plan: SharingPlan, width: int) -> np.ndarray:
  """Private page ids [B, width] int32, zero-padded."""
  widest = max((len(p) for p in plan.private_pages), default=0)
  if width < max(1, widest):
    raise ValueError(f'max_private_pages={width} is below the widest private page table ({widest})')
  pages = np.zeros((plan.num_rows, width), np.int32)
  for b, p in enumerate(plan.private_pages):
    pages[b, : len(p)] = p
  return pages


def device_layout(
    plan: SharingPlan,
    *,
    policy: LayoutPolicy = LayoutPolicy(),
    max_private_pages: int | None = None,
) -> TreeLayout:
  """The plan as a `TreeLayout` whose static shapes follow `policy` (see the module docstring)."""
  width = max_private_pages or max(1, max((len(p) for p in plan.private_pages), default=0))
  groups, row_pieces = device_groups(plan, policy)
  return make_layout(
      groups, row_pieces, jnp.asarray(page_table(plan, width)),
      jnp.asarray(np.array(plan.private_lengths, np.int32)), plan.page_size,
  )
