"""Sharing layouts: a radix tree of KV segments over a decoding batch.

A batch of B sequences (query rows) keeps its keys/values in one flat buffer
`[L, K, H]` per layer. Two kinds of KV regions are described:

* Shared segments (the chunk-first phase): a contiguous token range
  `[kv_start, kv_start + kv_length)` of the buffer attended by the contiguous
  query rows `[row_begin, row_end)`. With rows in depth-first order of the
  sharing tree, every tree node is such a segment; a row attends every segment
  on its root-to-leaf path, and all T query tokens of a row see all of it.
* Private KV (the sequence-first phase): per row, a page table into the same
  buffer viewed as pages of `page_size` tokens, and a length. The T query
  tokens of a row are the last T private tokens: causal inside this region.

`SharingPlan` is the host-side description (built once per tree change by the
builders in `hydrajax.builders` or by the chunked KV cache). `plan.to_device()`
gives a `TreeLayout`: padded int32 arrays with static capacities, so that
attention over it runs under `jit` and only recompiles when a capacity bucket
changes.
"""

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Segment:
  """A run of KV tokens shared by the query rows [row_begin, row_end)."""

  kv_start: int
  kv_length: int
  row_begin: int
  row_end: int
  parent: int = -1  # index of the parent segment in the plan, -1 at a root
  position: int = 0  # sequence position of the segment's first token (for RoPE)
  label: str = ''
  # The slot the tokens sit in (0: kv_length). A layout sizes the segment's group by it, so a
  # slot of fixed width (a training batch's padded prompt) keeps the layout's static shapes
  # whatever its real length: one compile for every batch of one shape.
  kv_capacity: int = 0

  def __post_init__(self):
    for name in ('kv_start', 'kv_length', 'row_begin', 'row_end', 'parent', 'position',
                 'kv_capacity'):
      object.__setattr__(self, name, as_int(getattr(self, name), f'Segment.{name}'))
    if self.kv_capacity and self.kv_capacity < self.kv_length:
      raise ValueError(f'Segment.kv_capacity ({self.kv_capacity}) must be 0 or at least its '
                       f'kv_length ({self.kv_length})')

  @property
  def num_rows(self) -> int:
    return self.row_end - self.row_begin


MAX_KV_TOKENS = 2**31 - 1


def as_int(value, name: str) -> int:
  """`value` as a Python int (ints and numpy integers), else ValueError naming `name`."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise ValueError(f'{name} must be an integer, got {value!r} ({type(value).__name__})')
  return int(value)


@dataclasses.dataclass(frozen=True)
class SharingPlan:
  """Host-side sharing layout of a batch; see the module docstring.

  Attributes:
    num_rows: B, query rows (sequences), in depth-first order.
    segments: shared segments, parents before children.
    page_size: C, tokens per private page.
    private_pages: per row, the page ids of its private KV, in order.
    private_lengths: per row, the number of valid private tokens.
    kv_tokens: L, tokens in the flat KV buffer this plan indexes.
  """

  num_rows: int
  segments: tuple[Segment, ...]
  page_size: int
  private_pages: tuple[tuple[int, ...], ...]
  private_lengths: tuple[int, ...]
  kv_tokens: int

  def __post_init__(self):
    for name in ('num_rows', 'page_size', 'kv_tokens'):
      object.__setattr__(self, name, as_int(getattr(self, name), f'SharingPlan.{name}'))
    object.__setattr__(self, 'segments', tuple(self.segments))
    object.__setattr__(self, 'private_lengths', _ints(self.private_lengths, 'private_lengths'))
    object.__setattr__(self, 'private_pages', tuple(
        _ints(pages, f'private_pages[{b}]') for b, pages in enumerate(self.private_pages)))
    _check_plan(self)

  def path(self, row: int) -> list[int]:
    """Indices of the segments that `row` attends, root first."""
    return [j for j, s in enumerate(self.segments) if s.row_begin <= row < s.row_end]

  def row_token_indices(self) -> tuple[np.ndarray, np.ndarray]:
    """Each row's KV token indices in the flat buffer, concatenated root to leaf.

    Returns (indices [B, max_len] int32 padded with 0, lengths [B] int32): the
    naive oracle gathers these to materialise each sequence's own KV.
    """
    per_row = []
    for b in range(self.num_rows):
      parts = [
          np.arange(s.kv_start, s.kv_start + s.kv_length)
          for s in (self.segments[j] for j in self.path(b))
      ]
      pages = np.asarray(self.private_pages[b], np.int64)
      priv = (pages[:, None] * self.page_size + np.arange(self.page_size)).reshape(-1)
      parts.append(priv[: self.private_lengths[b]])
      per_row.append(np.concatenate(parts) if parts else np.zeros(0, np.int64))
    lengths = np.array([len(p) for p in per_row], np.int32)
    width = max(1, int(lengths.max(initial=0)))
    indices = np.zeros((self.num_rows, width), np.int32)
    for b, p in enumerate(per_row):
      indices[b, : len(p)] = p
    return indices, lengths

  def private_position(self, row: int) -> int:
    """Sequence position of the row's first private token."""
    return sum(self.segments[j].kv_length for j in self.path(row))

  def shared_tokens(self) -> int:
    return sum(s.kv_length for s in self.segments)

  def unshared_tokens(self) -> int:
    """Tokens a cache without sharing would store: every row's full context."""
    return int(self.row_token_indices()[1].sum())

  def to_device(self, *, bucket: bool = True, max_private_pages: int | None = None,
                policy: 'LayoutPolicy | None' = None) -> 'TreeLayout':
    """Padded device arrays whose static shapes follow `policy` (see `LayoutPolicy`).

    Without a policy: capacities bucketed (`LayoutPolicy.BUCKETED`, or exact with
    bucket=False) so that similar trees share a compile. `max_private_pages`: the width of
    the page table (default: the widest row's pages, or `policy.page_width` of it).
    """
    if policy is None:
      policy = LayoutPolicy.BUCKETED if bucket else LayoutPolicy.EXACT
    if not isinstance(policy, LayoutPolicy):
      raise ValueError(f'policy must be a LayoutPolicy (e.g. LayoutPolicy.BUCKETED) or None, got '
                       f'{policy!r}')
    if max_private_pages is not None:
      max_private_pages = as_int(max_private_pages, 'max_private_pages')
    return build_layout(self, policy, max_private_pages=max_private_pages)


def _ints(values, name: str) -> tuple[int, ...]:
  values = tuple(values)
  if all(type(v) is int for v in values):  # the common case, cheap for large page tables
    return values
  return tuple(as_int(v, f'SharingPlan.{name}[{i}]') for i, v in enumerate(values))


def _check_plan(plan: SharingPlan) -> None:
  if plan.num_rows < 1:
    raise ValueError(f'num_rows must be >= 1, got {plan.num_rows}')
  if plan.page_size < 1:
    raise ValueError(f'page_size must be >= 1, got {plan.page_size}')
  if plan.kv_tokens > MAX_KV_TOKENS:  # device token indices are int32
    raise ValueError(f'kv_tokens must be at most {MAX_KV_TOKENS} (int32 token indices), got '
                     f'{plan.kv_tokens}')
  if len(plan.private_pages) != plan.num_rows or len(plan.private_lengths) != plan.num_rows:
    raise ValueError(
        f'private_pages and private_lengths need one entry per row ({plan.num_rows}), '
        f'got {len(plan.private_pages)} and {len(plan.private_lengths)}'
    )
  for j, s in enumerate(plan.segments):
    if not 0 <= s.row_begin < s.row_end <= plan.num_rows:
      raise ValueError(f'segment {j}: rows [{s.row_begin}, {s.row_end}) not in [0, {plan.num_rows})')
    if s.kv_length < 0 or s.kv_start < 0 or s.kv_start + s.kv_length > plan.kv_tokens:
      raise ValueError(
          f'segment {j}: tokens [{s.kv_start}, {s.kv_start + s.kv_length}) not in the '
          f'buffer of {plan.kv_tokens} tokens'
      )
    if s.parent >= j:
      raise ValueError(f'segment {j}: parent {s.parent} must come before it')
    if s.parent >= 0:
      p = plan.segments[s.parent]
      if not (p.row_begin <= s.row_begin and s.row_end <= p.row_end):
        raise ValueError(f'segment {j}: rows not inside those of its parent {s.parent}')
  _check_laminar(plan.segments)
  num_pages = plan.kv_tokens // plan.page_size
  for b, (pages, n) in enumerate(zip(plan.private_pages, plan.private_lengths)):
    if not 0 <= n <= len(pages) * plan.page_size:
      raise ValueError(
          f'row {b}: private length {n} must be in [0, {len(pages) * plan.page_size}] '
          f'({len(pages)} pages of {plan.page_size})'
      )
    if any(not 0 <= p < num_pages for p in pages):
      raise ValueError(f'row {b}: private page ids must be in [0, {num_pages})')


def _check_laminar(segments: Sequence[Segment]) -> None:
  """Row ranges must nest or be disjoint (a radix tree or forest): kernels give every
  segment one column of the rows' path table."""
  order = sorted(range(len(segments)), key=lambda j: (segments[j].row_begin, -segments[j].row_end))
  open_ranges: list[int] = []
  for j in order:
    s = segments[j]
    while open_ranges and segments[open_ranges[-1]].row_end <= s.row_begin:
      open_ranges.pop()
    if open_ranges and segments[open_ranges[-1]].row_end < s.row_end:
      o = segments[open_ranges[-1]]
      raise ValueError(
          f'segments {open_ranges[-1]} (rows [{o.row_begin}, {o.row_end})) and {j} (rows '
          f'[{s.row_begin}, {s.row_end})) overlap without nesting; segments must form a tree'
      )
    open_ranges.append(j)


def bucket_size(n: int, minimum: int = 1) -> int:
  """Round n up to the next of {m, 1.25m, 1.5m, 1.75m, 2m, ...} on a power-of-two m grid.

  Wastes at most 25% (and nothing at powers of two), so similar trees share a compile.
  """
  n = max(as_int(n, 'n'), as_int(minimum, 'minimum'))
  if n <= 4:
    return n
  base = 1 << (n.bit_length() - 1)
  step = max(base // 4, 1)
  return -(-n // step) * step


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SegmentGroup:
  """Segments with the same static capacities (R rows, S tokens), batched in J."""

  kv_start: jax.Array  # [J] int32
  kv_length: jax.Array  # [J] int32, <= kv_capacity; 0 marks a padding slot
  row_begin: jax.Array  # [J] int32
  row_count: jax.Array  # [J] int32, <= row_capacity
  row_capacity: int = dataclasses.field(metadata=dict(static=True))
  kv_capacity: int = dataclasses.field(metadata=dict(static=True))

  @property
  def num_segments(self) -> int:
    return self.kv_start.shape[0]


@dataclasses.dataclass(frozen=True)
class HostFacts:
  """What the host plan knew when it built a layout, for checks that need concrete values.

  Attributes:
    kv_tokens: L, the buffer length the plan indexes (a K/V buffer must hold at least this).
    min_private_length: the shortest non-zero private length of a row (rows of length 0 are
      padding); T query tokens need at least T private tokens.
  """

  kv_tokens: int
  min_private_length: int


@dataclasses.dataclass(frozen=True)
class TreeLayout:
  """Device form of a `SharingPlan`: a jit-friendly pytree of int32 arrays."""

  groups: tuple[SegmentGroup, ...]
  private_pages: jax.Array  # [B, max_pages] int32
  private_lengths: jax.Array  # [B] int32
  page_size: int = dataclasses.field(metadata=dict(static=True))
  num_rows: int = dataclasses.field(metadata=dict(static=True))
  # [B, D] int32 or None: per row, the non-empty shared segments on its path
  # (root first) as indices into the concatenation of `groups`, -1 padded; a
  # segment has the same column on all of its rows (`path_columns`); D is the
  # deepest path rounded up to a multiple of 4. Host metadata for kernels that
  # merge per row (the Mosaic GPU kernels need it).
  row_segments: jax.Array | None = None
  # Host-only facts of the plan it came from (not a pytree field: None once the layout has
  # been through a transformation, e.g. under jit, or `dataclasses.replace`d).
  host: HostFacts | None = dataclasses.field(default=None, init=False, compare=False, repr=False)

  @property
  def max_private_tokens(self) -> int:
    return self.private_pages.shape[1] * self.page_size

  def with_host_facts(self, plan: 'SharingPlan') -> 'TreeLayout':
    """Records `plan`'s kv_tokens and shortest private length (see `HostFacts`); returns self."""
    nonzero = [n for n in plan.private_lengths if n > 0]
    object.__setattr__(self, 'host', HostFacts(plan.kv_tokens, min(nonzero, default=0)))
    return self


jax.tree_util.register_dataclass(
    TreeLayout,
    data_fields=['groups', 'private_pages', 'private_lengths', 'row_segments'],
    meta_fields=['page_size', 'num_rows'],
)


ROUNDINGS = ('pow2', 'quarter', 'exact')


@dataclasses.dataclass(frozen=True)
class LayoutPolicy:
  """How a `SharingPlan` becomes a `TreeLayout`: the one bucketing policy of static shapes.

  A program jitted over a layout compiles once per distinct layout shape, so the shapes must
  not change with every tree change. Shared segments longer than `kv_piece` tokens are split
  into pieces of `kv_piece` (each piece is one more partial state for its rows, merged like any
  other). Pieces are grouped by their capacities (R rows, S tokens):

  * rounding='pow2': R the next power of two of the rows, S that of the length (at least
    `min_kv_capacity`, at most `kv_piece`); the J pieces of a group padded to a power of two
    (at least `min_segments`) with empty slots; the rows' path table width a power of two;
  * rounding='quarter': R and S rounded by `bucket_size` (at most 25% waste), J exact, the
    path width a multiple of 4 (`SharingPlan.to_device`'s default, `BUCKETED`);
  * rounding='exact': R and S exact (`EXACT`).

  `fixed_shapes` (with a `kv_piece`) instead gives every piece R = the layout's rows and
  S = kv_piece: one group (present even when empty), whose shape then depends only on the
  batch size and J (more masked work per piece, far fewer compiles).

  Attributes:
    kv_piece: longest run of shared tokens in one partial state; None: never split.
    rounding: 'pow2', 'quarter' or 'exact' (above).
    min_kv_capacity: smallest kv capacity S of a group (pow2 and quarter).
    min_segments: smallest padded J of a group (pow2).
    fixed_shapes: see above.
    min_private_pages: smallest width of the private page table; the width is the
      next power of two of the widest row's pages (at most the cache's maximum),
      since the XLA path reads every row's table to its full width. Set to the
      cache's `max_pages` for one width whatever rows hold (a serving engine then
      never compiles as rows grow; the Mosaic GPU kernels read only valid pages).
  """

  kv_piece: int | None = 1024
  min_kv_capacity: int = 16
  min_segments: int = 1
  fixed_shapes: bool = False
  min_private_pages: int = 1
  rounding: str = 'pow2'

  def __post_init__(self):
    for name in ('kv_piece', 'min_kv_capacity', 'min_segments', 'min_private_pages'):
      value = getattr(self, name)
      if value is None and name == 'kv_piece':
        continue
      if as_int(value, f'LayoutPolicy.{name}') < 1:
        raise ValueError(f'LayoutPolicy.{name} must be >= 1, got {value}')
    if self.rounding not in ROUNDINGS:
      raise ValueError(f'LayoutPolicy.rounding must be one of {ROUNDINGS}, got {self.rounding!r}')
    if self.fixed_shapes and self.kv_piece is None:
      raise ValueError('LayoutPolicy.fixed_shapes needs a kv_piece (the S of every piece)')

  def page_width(self, widest: int, limit: int) -> int:
    """Page-table width for a widest row of `widest` pages, at most `limit`."""
    return min(limit, max(next_power_of_two(max(widest, 1)), self.min_private_pages))

  def capacity(self, length: int, rows: int, num_rows: int) -> tuple[int, int]:
    """(R, S) of a piece of `length` tokens over `rows` rows, in a layout of `num_rows`."""
    if self.fixed_shapes:
      return num_rows, self.kv_piece
    if self.rounding == 'exact':
      return rows, length
    if self.rounding == 'quarter':
      return bucket_size(rows), bucket_size(length, self.min_kv_capacity)
    kv = max(next_power_of_two(length), self.min_kv_capacity)
    if self.kv_piece is not None:
      kv = min(kv, self.kv_piece)
    return next_power_of_two(rows), max(kv, length)

  def num_slots(self, members: int) -> int:
    """J of a group of `members` pieces."""
    if self.rounding != 'pow2':
      return members
    return max(next_power_of_two(members), next_power_of_two(self.min_segments))

  def path_width(self, depth: int) -> int:
    """Width of the rows' path table for paths of at most `depth` pieces."""
    if self.rounding == 'pow2':
      return next_power_of_two(max(1, depth))
    return 4 * max(1, -(-depth // 4))  # a deeper tree recompiles only past a multiple of 4


LayoutPolicy.BUCKETED = LayoutPolicy(kv_piece=None, rounding='quarter')
LayoutPolicy.EXACT = LayoutPolicy(kv_piece=None, rounding='exact')


def next_power_of_two(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def segment_pieces(plan: SharingPlan, kv_piece: int | None) -> list[tuple[int, int, int, int]]:
  """(kv_start, kv_length, row_begin, num_rows) of every non-empty piece of every segment."""
  return [piece for piece, _ in _pieces(plan, kv_piece)]


def _pieces(plan: SharingPlan, kv_piece: int | None):
  """`segment_pieces`, each with the tokens its group is sized by: its length, or its share
  of the segment's `kv_capacity` (the whole slot when the segment is not split)."""
  pieces = []
  for s in plan.segments:
    slot = max(s.kv_length, s.kv_capacity)
    step = kv_piece or max(1, slot)
    for offset in range(0, s.kv_length, step):
      length = min(step, s.kv_length - offset)
      sized_by = length if offset + step < s.kv_length else min(step, slot - offset)
      pieces.append(((s.kv_start + offset, length, s.row_begin, s.num_rows), sized_by))
  return pieces


def group_arrays(plan: SharingPlan, policy: LayoutPolicy):
  """Host form of the groups and the rows' paths through them.

  Returns ([(R, S, columns [4, J] int32: kv_start, kv_length, row_begin, rows)],
  row_pieces [B, D] int32: each row's pieces, root first, as indices into the
  concatenation of the groups, -1 padded).
  """
  sized = _pieces(plan, policy.kv_piece)
  pieces = [piece for piece, _ in sized]
  by_capacity: dict[tuple[int, int], list[int]] = {}
  if policy.fixed_shapes:  # the one group exists even when empty: one shape per (B, J)
    by_capacity[(plan.num_rows, policy.kv_piece)] = []
  for i, ((_, _, _, rows), tokens) in enumerate(sized):
    by_capacity.setdefault(policy.capacity(tokens, rows, plan.num_rows), []).append(i)
  groups, global_id, offset = [], np.zeros(len(pieces), np.int64), 0
  for (rows, tokens), members in sorted(by_capacity.items()):
    size = policy.num_slots(len(members))
    columns = np.zeros((4, size), np.int32)  # padding: empty slots
    if members:
      columns[:, : len(members)] = np.array([pieces[i] for i in members], np.int32).T
    global_id[members] = offset + np.arange(len(members))
    offset += size
    groups.append((rows, tokens, columns))
  columns = path_columns([(row_begin, rows) for _, _, row_begin, rows in pieces], plan.num_rows)
  width = policy.path_width(int(columns.max(initial=-1)) + 1)
  if policy.fixed_shapes:
    width = offset  # J of the one group: the width never changes with the tree
  table = np.full((plan.num_rows, width), -1, np.int32)
  for i, (_, _, row_begin, rows) in enumerate(pieces):  # segments come parents first
    table[row_begin : row_begin + rows, columns[i]] = global_id[i]
  return groups, table


def host_groups(plan: SharingPlan, policy: LayoutPolicy):
  """(segment groups of numpy arrays, row_pieces [B, D]): the layout's groups, not uploaded."""
  groups, table = group_arrays(plan, policy)
  return tuple(SegmentGroup(*np.ascontiguousarray(columns), row_capacity=rows, kv_capacity=tokens)
               for rows, tokens, columns in groups), table


def device_groups(plan: SharingPlan, policy: LayoutPolicy):
  """(segment groups on the device, row_pieces [B, D] on the device): one upload per column
  (slicing on the device costs more)."""
  return jax.tree.map(jnp.asarray, host_groups(plan, policy))


def page_table(plan: SharingPlan, width: int) -> np.ndarray:
  """Private page ids [B, width] int32, zero-padded."""
  widest = max((len(p) for p in plan.private_pages), default=0)
  if width < max(1, widest):
    raise ValueError(f'max_private_pages={width} is below the widest private page table ({widest})')
  pages = np.zeros((plan.num_rows, width), np.int32)
  for b, p in enumerate(plan.private_pages):
    pages[b, : len(p)] = p
  return pages


def make_layout(groups, row_pieces, private_pages, private_lengths, page_size: int) -> 'TreeLayout':
  """A `TreeLayout` with the rows' paths as `row_segments`."""
  return TreeLayout(
      groups=groups, private_pages=private_pages, private_lengths=private_lengths,
      page_size=page_size, num_rows=private_lengths.shape[0], row_segments=row_pieces,
  )


def host_layout(plan: SharingPlan, policy: LayoutPolicy, *,
                max_private_pages: int | None = None) -> 'TreeLayout':
  """`plan` as a `TreeLayout` of numpy arrays whose static shapes follow `policy`.

  The page table is `max_private_pages` wide if given, else as wide as the widest row.
  Per-shard layouts are stacked on the host and uploaded once (`hydrajax.attention.parallel`).
  """
  widest = max((len(p) for p in plan.private_pages), default=0)
  width = max_private_pages if max_private_pages is not None else max(1, widest)
  groups, row_pieces = host_groups(plan, policy)
  return make_layout(groups, row_pieces, page_table(plan, width),
                     np.array(plan.private_lengths, np.int32), plan.page_size
                     ).with_host_facts(plan)


def build_layout(plan: SharingPlan, policy: LayoutPolicy, *,
                 max_private_pages: int | None = None) -> 'TreeLayout':
  """`plan` as a device `TreeLayout` whose static shapes follow `policy`: the one conversion
  (`host_layout`, uploaded)."""
  layout = host_layout(plan, policy, max_private_pages=max_private_pages)
  return jax.tree.map(jnp.asarray, layout).with_host_facts(plan)


def path_columns(pieces: Sequence[tuple[int, int]], num_rows: int) -> np.ndarray:
  """Column of each (row_begin, num_rows) piece in the rows' path table, parents first.

  One column per piece for all of its rows (kernels keep one partial-state slab
  per column): the first column past every earlier piece on any of its rows. In
  a tree (nested row ranges) that is the piece's depth on the path.
  """
  filled = np.zeros(num_rows, np.int64)
  columns = np.zeros(len(pieces), np.int64)
  for i, (row_begin, rows) in enumerate(pieces):
    col = int(filled[row_begin : row_begin + rows].max(initial=0))
    columns[i] = col
    filled[row_begin : row_begin + rows] = col + 1
  return columns

