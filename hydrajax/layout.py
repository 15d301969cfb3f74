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
import math
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

  def __post_init__(self):
    for name in ('kv_start', 'kv_length', 'row_begin', 'row_end', 'parent', 'position'):
      object.__setattr__(self, name, as_int(getattr(self, name), f'Segment.{name}'))

  @property
  def num_rows(self) -> int:
    return self.row_end - self.row_begin


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

  def to_device(self, *, bucket: bool = True, max_private_pages: int | None = None) -> 'TreeLayout':
    """Padded device arrays; capacities bucketed so that similar trees share a compile."""
    return _to_device(self, bucket=bucket, max_private_pages=max_private_pages)


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
  n = max(n, minimum)
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


def _to_device(plan: SharingPlan, *, bucket: bool, max_private_pages: int | None) -> TreeLayout:
  by_capacity: dict[tuple[int, int], list[int]] = {}  # capacities -> indices into plan.segments
  for j, s in enumerate(plan.segments):
    if s.kv_length == 0:
      continue  # an empty segment is a no-op
    cap = (bucket_size(s.num_rows), bucket_size(s.kv_length, 16)) if bucket else (s.num_rows, s.kv_length)
    by_capacity.setdefault(cap, []).append(j)
  groups = []
  global_id: dict[int, int] = {}  # plan segment index -> index in the concatenation of the groups
  for (rows, tokens), members in sorted(by_capacity.items()):
    segs = [plan.segments[j] for j in members]
    global_id.update((j, len(global_id)) for j in members)
    col = lambda f: jnp.asarray(np.array([f(s) for s in segs], np.int32))
    groups.append(
        SegmentGroup(
            kv_start=col(lambda s: s.kv_start),
            kv_length=col(lambda s: s.kv_length),
            row_begin=col(lambda s: s.row_begin),
            row_count=col(lambda s: s.num_rows),
            row_capacity=rows,
            kv_capacity=tokens,
        )
    )
  widest = max((len(p) for p in plan.private_pages), default=0)
  width = max_private_pages if max_private_pages is not None else max(1, widest)
  if width < widest:
    raise ValueError(f'max_private_pages={width} is below the widest private page table ({widest})')
  pages = np.zeros((plan.num_rows, width), np.int32)
  for b, p in enumerate(plan.private_pages):
    pages[b, : len(p)] = p
  return TreeLayout(
      groups=tuple(groups),
      private_pages=jnp.asarray(pages),
      private_lengths=jnp.asarray(np.array(plan.private_lengths, np.int32)),
      page_size=plan.page_size,
      num_rows=plan.num_rows,
      row_segments=jnp.asarray(_row_segments(plan, global_id)),
  ).with_host_facts(plan)


def _row_segments(plan: SharingPlan, global_id: dict[int, int]) -> np.ndarray:
  """[B, D] int32: each row's non-empty path segments (root first) as group-concatenation ids."""
  # Width padded to a multiple of 4, so a deeper tree recompiles only past that.
  columns = path_columns(
      [(s.row_begin, s.num_rows) for s in plan.segments if s.kv_length > 0], plan.num_rows
  )
  width = 4 * max(1, -(-(int(columns.max(initial=-1)) + 1) // 4))
  table = np.full((plan.num_rows, width), -1, np.int32)
  members = [j for j, s in enumerate(plan.segments) if s.kv_length > 0]
  for j, col in zip(members, columns):
    s = plan.segments[j]
    table[s.row_begin : s.row_end, col] = global_id[j]
  return table


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

