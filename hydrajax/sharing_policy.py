"""Per-segment choice between batched (shared) and per-sequence attention.

A shared segment of n tokens read by r rows can be computed

* batched (the shared phase): one matrix-matrix attention of the r rows'
  queries over the segment's KV, read once, then merged into each row; or
* per sequence: each row reads the segment's KV itself as the first pages of
  its private KV, as plain paged decode does (the KV stays stored once; the
  rows' page tables point at the same pages).

Batched reads the KV once instead of r times, but its fixed costs (one more
partial state per row, the merge, row tiles padded past r) can lose for few
rows or short segments. `SharingPolicy` holds the measured break-even points,
r_min(n) = fewest rows at which batched is not slower, and `apply` demotes
every segment with fewer rows to per-sequence.

Demotion rules. A row's private region is its pages in sequence order (whole
pages, all full but the last) and its T query tokens are the last T of it, so
a demoted segment must

1. be whole aligned pages: kv_start and kv_length multiples of `page_size`;
2. come after every kept segment on each of its rows' paths: the demoted
   segments of a row are the deepest ones of its path, prepended root first to
   its private pages.

So demotion is decided bottom-up: a segment is demoted when it has too few
rows, is aligned, and every non-empty segment below it on its rows' paths is
demoted too. A segment that breaks rule 1 or 2 is kept shared (it is never
slower than incorrect), which also keeps everything above it shared. Empty
segments hold no tokens: they neither block nor are blocked, and are dropped
when demoted (kept children then hang from their nearest kept ancestor).
"""

import dataclasses
import functools
import importlib.resources
import json
from typing import Any, Iterable

import jax
import numpy as np

from hydrajax.layout import Segment, SharingPlan

# Rows are int32 on the device: a min_rows this large demotes every demotable segment.
MAX_ROWS = 2**31 - 1
# The packaged thresholds, by the GPU they were measured on (a substring of its device kind).
# `SharingPolicy.default()` loads the default device's table, else the H200's.
DEVICE_THRESHOLDS = {
    'h100': ('data', 'break_even_h100.json'),
    'h200': ('data', 'break_even_h200.json'),
}
DEFAULT_THRESHOLDS = DEVICE_THRESHOLDS['h200']


FORMAT_V1 = 'hydrajax.sharing_policy/1'
FORMAT_V2 = 'hydrajax.sharing_policy/2'


def _check_steps(steps, where: str) -> tuple[tuple[int, int], ...]:
  pairs = isinstance(steps, (tuple, list)) and all(
      isinstance(s, (tuple, list)) and len(s) == 2 for s in steps
  )
  if not pairs:
    raise ValueError(f'{where}steps must be (length, min_rows) pairs, got {steps!r:.200}')
  for n, r in steps:
    _check_int(f'{where}steps: length', n, 0)
    _check_int(f'{where}steps: min_rows', r, 1)
  steps = tuple((int(n), int(r)) for n, r in steps)
  if any(a[0] >= b[0] for a, b in zip(steps, steps[1:])):
    raise ValueError(
        f'{where}steps: lengths must be strictly increasing, got {[n for n, _ in steps]}'
    )
  return steps


def _step_rows(min_rows: int, steps, kv_length: int) -> int:
  if kv_length < 0:
    raise ValueError(f'kv_length must be >= 0, got {kv_length}')
  rows = min_rows
  for n, r in steps:
    if n > kv_length:
      break
    rows = r
  return rows


@dataclasses.dataclass(frozen=True)
class Thresholds:
  """r_min(n) measured at one query-heads-per-kv-head group size over a range of batch sizes.

  Attributes:
    group_size: query heads per KV head (N / K) of the measurement.
    batches: (smallest, largest) batch size B (rows of the whole batch) it was measured at.
    min_rows, steps: r_min(n) as in `SharingPolicy`.
  """

  group_size: int
  batches: tuple[int, int]
  min_rows: int
  steps: tuple[tuple[int, int], ...] = ()

  def __post_init__(self):
    _check_int('Thresholds.group_size', self.group_size, 1)
    ok = isinstance(self.batches, (tuple, list)) and len(self.batches) == 2
    if not ok or not all(_is_int(b) and b >= 1 for b in self.batches) or (
        self.batches[0] > self.batches[1]):
      raise ValueError(f'Thresholds.batches must be (lo, hi) with 1 <= lo <= hi, got '
                       f'{self.batches!r}')
    _check_int('Thresholds.min_rows', self.min_rows, 1)
    object.__setattr__(self, 'steps', _check_steps(self.steps, 'Thresholds.'))
    object.__setattr__(self, 'batches', (int(self.batches[0]), int(self.batches[1])))
    object.__setattr__(self, 'group_size', int(self.group_size))
    object.__setattr__(self, 'min_rows', int(self.min_rows))

  def rows_needed(self, kv_length: int) -> int:
    return _step_rows(self.min_rows, self.steps, kv_length)

  def batch_distance(self, num_rows: int) -> float:
    """0 inside the measured batch range, else log2 distance to it."""
    lo, hi = self.batches
    return max(0.0, np.log2(lo / num_rows), np.log2(num_rows / hi))

  def to_dict(self) -> dict[str, Any]:
    return {'group_size': self.group_size, 'batches': list(self.batches),
            'min_rows': self.min_rows, 'steps': [list(s) for s in self.steps]}


@dataclasses.dataclass(frozen=True)
class SharingPolicy:
  """Break-even thresholds r_min(n): a segment of n tokens with fewer rows goes per-sequence.

  r_min(n) is a step function: `min_rows` below the first step, then the
  `min_rows` of the last step whose length is <= n. A measured step applies
  from its measured length up to the next one: the side of more demotion when
  r_min falls with n.

  With `tables` (measured per group size N/K and batch range, format 2), the
  table used for a plan of B rows and group size g is the one of the nearest
  measured group size (log2; g unknown: every group size), and among those the
  one whose batch range holds B (else the nearest, log2). Where several tables
  are equally near, the largest r_min wins (more demotion: demoting never makes
  a segment slower than plain paged decode, which is what it becomes). Without
  tables, `min_rows` and `steps` apply to every shape (format 1).

  Attributes:
    min_rows: r_min of segments shorter than every step (of all, when `steps` is empty).
    steps: ((length, min_rows), ...) with strictly increasing lengths >= 0.
    tables: per (group size, batch range) thresholds; when given they decide.
    source: where the thresholds come from (not compared).
  """

  min_rows: int = 2
  steps: tuple[tuple[int, int], ...] = ()
  tables: tuple[Thresholds, ...] = ()
  source: str = dataclasses.field(default='', compare=False)

  def __post_init__(self):
    _check_int('min_rows', self.min_rows, 1)
    object.__setattr__(self, 'min_rows', int(self.min_rows))
    object.__setattr__(self, 'steps', _check_steps(self.steps, ''))
    if not isinstance(self.tables, (tuple, list)) or not all(
        isinstance(t, Thresholds) for t in self.tables):
      raise ValueError(f'tables must be Thresholds, got {self.tables!r:.200}')
    object.__setattr__(self, 'tables', tuple(self.tables))

  @classmethod
  def never(cls) -> 'SharingPolicy':
    """Demotes nothing: every segment stays batched."""
    return cls(min_rows=1, source='never')

  @classmethod
  def demote_all(cls) -> 'SharingPolicy':
    """Demotes every demotable segment: plain paged decode where alignment allows."""
    return cls(min_rows=MAX_ROWS, source='demote_all')

  @classmethod
  def default(cls, device_kind: str | None = None) -> 'SharingPolicy':
    """The packaged thresholds measured on this GPU (see `status` in the data file).

    Args:
      device_kind: the device whose table to load, as `jax.Device.device_kind` names it
        (None: the default device's). An H100 gets the H100's table; every other device
        the H200's (the break-even points move with the device: the H100's keep
        2-row segments of 1K tokens per-sequence at B = 8 and 32 where the H200's share them).
    """
    if device_kind is None:
      device_kind = jax.devices()[0].device_kind
    if not isinstance(device_kind, str):
      raise ValueError(f'device_kind must be a str or None, got {device_kind!r:.100}')
    kind = device_kind.lower()
    resource = next((f for name, f in DEVICE_THRESHOLDS.items() if name in kind),
                    DEFAULT_THRESHOLDS)
    return _load_packaged(resource)

  @classmethod
  def from_dict(cls, data: dict[str, Any], source: str = '') -> 'SharingPolicy':
    """From the JSON `experiments.break_even` writes.

    Format 2: {'format': 'hydrajax.sharing_policy/2', 'tables': [{'group_size': g,
    'batches': [lo, hi], 'min_rows': r, 'steps': [[n, r], ...]}, ...]}; format 1 (or no
    'format'): {'min_rows': r, 'steps': [[n, r], ...]}.
    """
    if not isinstance(data, dict):
      raise ValueError(f'data must be a dict, got {data!r:.200}')
    fmt = data.get('format', FORMAT_V1)
    if fmt == FORMAT_V2:
      tables = data.get('tables')
      if not isinstance(tables, list) or not tables or not all(
          isinstance(t, dict) for t in tables):
        raise ValueError(f'data: format 2 needs a non-empty list of tables, got {tables!r:.200}')
      try:
        parsed = tuple(
            Thresholds(t['group_size'], tuple(t['batches']), t['min_rows'],
                       tuple(tuple(s) if isinstance(s, list) else s for s in t.get('steps', ())))
            for t in tables)
      except (KeyError, TypeError) as e:
        raise ValueError(f'data: a table lacks group_size, batches or min_rows: {e}') from e
      return cls(min_rows=1, tables=parsed, source=source)
    if fmt != FORMAT_V1:
      raise ValueError(f'data: format must be {FORMAT_V1!r} or {FORMAT_V2!r}, got {fmt!r}')
    if 'min_rows' not in data:
      raise ValueError(f'data must be a dict with min_rows and steps, got {data!r:.200}')
    steps = data.get('steps', ())
    if not isinstance(steps, (tuple, list)):
      raise ValueError(f'data: steps must be a list of [length, min_rows], got {steps!r:.200}')
    steps = tuple(tuple(s) if isinstance(s, list) else s for s in steps)
    return cls(data['min_rows'], steps, source=source)

  @classmethod
  def load(cls, path: str) -> 'SharingPolicy':
    """From a thresholds JSON file (as written by `experiments.break_even --write_thresholds`)."""
    with open(path) as f:
      return cls.from_dict(json.load(f), source=path)

  def to_dict(self) -> dict[str, Any]:
    if self.tables:
      return {'format': FORMAT_V2, 'tables': [t.to_dict() for t in self.tables]}
    return {'format': FORMAT_V1, 'min_rows': self.min_rows,
            'steps': [list(s) for s in self.steps]}

  def _tables_for(self, num_rows: int | None, group_size: int | None) -> tuple[Thresholds, ...]:
    tables = self.tables
    if group_size is not None:
      _check_int('group_size', group_size, 1)
      dist = [abs(np.log2(t.group_size / group_size)) for t in tables]
      tables = tuple(t for t, d in zip(tables, dist) if d == min(dist))
    if num_rows is not None:
      _check_int('num_rows', num_rows, 1)
      dist = [t.batch_distance(num_rows) for t in tables]
      tables = tuple(t for t, d in zip(tables, dist) if d == min(dist))
    return tables

  def rows_needed(self, kv_length: int, *, num_rows: int | None = None,
                  group_size: int | None = None) -> int:
    """r_min(kv_length): the fewest rows at which a segment of that length stays batched.

    num_rows: the batch size B of the plan; group_size: query heads per KV head. Both
    choose among `tables` (None: every table is a candidate; the largest r_min wins).
    """
    if not self.tables:
      return _step_rows(self.min_rows, self.steps, kv_length)
    return max(t.rows_needed(kv_length) for t in self._tables_for(num_rows, group_size))

  def demoted(self, plan: SharingPlan, *, group_size: int | None = None) -> tuple[int, ...]:
    """Indices (ascending) of the segments that `apply` demotes; see the module docstring."""
    if not isinstance(plan, SharingPlan):
      raise ValueError(f'plan must be a SharingPlan, got {type(plan).__name__}')
    chosen = []
    tail_demoted = np.ones(plan.num_rows, bool)  # every later non-empty path segment is demoted
    for j in reversed(range(len(plan.segments))):
      s = plan.segments[j]
      needed = self.rows_needed(s.kv_length, num_rows=plan.num_rows, group_size=group_size)
      if s.num_rows >= needed:
        wanted = False
      elif s.kv_length == 0:
        wanted = True
      else:
        wanted = _aligned(s, plan.page_size) and tail_demoted[s.row_begin : s.row_end].all()
      if wanted:
        chosen.append(j)
      elif s.kv_length > 0:
        tail_demoted[s.row_begin : s.row_end] = False
    return tuple(reversed(chosen))

  def apply(self, plan: SharingPlan, *, group_size: int | None = None) -> SharingPlan:
    """The plan with `demoted(plan)` moved into the rows' private pages (`plan` if none).

    group_size: query heads per KV head of the model that attends (chooses the measured
    table; None: the most demoting one).
    """
    return demote(plan, self.demoted(plan, group_size=group_size))


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_int(name: str, x, minimum: int) -> None:
  if not _is_int(x) or x < minimum:
    raise ValueError(f'{name} must be an int >= {minimum}, got {x!r}')


def _aligned(s: Segment, page_size: int) -> bool:
  return s.kv_start % page_size == 0 and s.kv_length % page_size == 0


def demote(plan: SharingPlan, segments: Iterable[int]) -> SharingPlan:
  """Moves the given segments from the shared phase into their rows' private pages.

  Each row's demoted segments (root first) become the first pages of its
  private KV, before its existing private pages; every row keeps the same
  tokens in the same order, so the attention is unchanged, and
  `private_position` moves back by the demoted tokens. Kept segments keep
  their order; a parent that was demoted is replaced by the nearest kept
  ancestor. Returns `plan` itself when `segments` is empty.

  Raises ValueError (naming `segments`) for an index out of range or repeated,
  a non-empty segment that is not whole aligned pages, or one that a kept
  non-empty segment follows on some row's path.
  """
  chosen = list(segments)
  count = len(plan.segments)
  if not all(_is_int(j) for j in chosen):
    raise ValueError(f'segments must be segment indices (ints), got {chosen}')
  if any(not 0 <= j < count for j in chosen) or len(set(chosen)) != len(chosen):
    raise ValueError(f'segments must be distinct indices in [0, {count}), got {chosen}')
  if not chosen:
    return plan
  gone = set(int(j) for j in chosen)
  c = plan.page_size
  tail_demoted = np.ones(plan.num_rows, bool)
  for j in reversed(range(count)):
    s = plan.segments[j]
    if s.kv_length == 0:
      continue
    rows = slice(s.row_begin, s.row_end)
    if j not in gone:
      tail_demoted[rows] = False
    elif not _aligned(s, c):
      raise ValueError(
          f'segments: segment {j} (tokens [{s.kv_start}, {s.kv_start + s.kv_length})) is not '
          f'whole pages of {c}'
      )
    elif not tail_demoted[rows].all():
      raise ValueError(f'segments: segment {j} is followed on a row\'s path by a kept segment')

  # Per row, the demoted pages in path order (plan order is root first on every path).
  lead: list[list[int]] = [[] for _ in range(plan.num_rows)]
  lead_tokens = np.zeros(plan.num_rows, np.int64)
  for j in sorted(gone):
    s = plan.segments[j]
    pages = list(range(s.kv_start // c, (s.kv_start + s.kv_length) // c))
    for b in range(s.row_begin, s.row_end):
      lead[b].extend(pages)
    lead_tokens[s.row_begin : s.row_end] += s.kv_length

  new_index: dict[int, int] = {}
  kept: list[Segment] = []
  for j, s in enumerate(plan.segments):
    if j in gone:
      continue
    parent = s.parent
    while parent in gone:
      parent = plan.segments[parent].parent
    new_index[j] = len(kept)
    kept.append(dataclasses.replace(s, parent=new_index[parent] if parent >= 0 else -1))
  return SharingPlan(
      num_rows=plan.num_rows,
      segments=tuple(kept),
      page_size=c,
      private_pages=tuple(tuple(lead[b]) + tuple(p) for b, p in enumerate(plan.private_pages)),
      private_lengths=tuple(
          int(lead_tokens[b]) + n for b, n in enumerate(plan.private_lengths)
      ),
      kv_tokens=plan.kv_tokens,
  )


@functools.cache
def _load_packaged(resource: tuple[str, ...]) -> SharingPolicy:
  data = json.loads(importlib.resources.files('hydrajax').joinpath(*resource).read_text())
  status = data.get('status', 'unknown status')
  return SharingPolicy.from_dict(data, source=f'hydrajax/{"/".join(resource)} ({status})')
