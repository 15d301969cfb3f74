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

import numpy as np

from hydrajax.layout import Segment, SharingPlan

# Rows are int32 on the device: a min_rows this large demotes every demotable segment.
MAX_ROWS = 2**31 - 1
# The packaged thresholds that `SharingPolicy.default()` loads.
DEFAULT_THRESHOLDS = ('data', 'break_even_h200.json')


@dataclasses.dataclass(frozen=True)
class SharingPolicy:
  """Break-even thresholds r_min(n): a segment of n tokens with fewer rows goes per-sequence.

  r_min(n) is a step function: `min_rows` below the first step, then the
  `min_rows` of the last step whose length is <= n. A measured step applies
  from its measured length up to the next one: the side of more demotion when
  r_min falls with n. Thresholds depend on the segment only; the heads, head
  dim, T and batch they were measured at are recorded in the data file.

  Attributes:
    min_rows: r_min of segments shorter than every step (of all, when `steps` is empty).
    steps: ((length, min_rows), ...) with strictly increasing lengths >= 0.
    source: where the thresholds come from (not compared).
  """

  min_rows: int = 2
  steps: tuple[tuple[int, int], ...] = ()
  source: str = dataclasses.field(default='', compare=False)

  def __post_init__(self):
    _check_int('min_rows', self.min_rows, 1)
    pairs = isinstance(self.steps, (tuple, list)) and all(
        isinstance(s, (tuple, list)) and len(s) == 2 for s in self.steps
    )
    if not pairs:
      raise ValueError(f'steps must be (length, min_rows) pairs, got {self.steps!r}')
    for n, r in self.steps:
      _check_int('steps: length', n, 0)
      _check_int('steps: min_rows', r, 1)
    steps = tuple((int(n), int(r)) for n, r in self.steps)
    if any(a[0] >= b[0] for a, b in zip(steps, steps[1:])):
      raise ValueError(f'steps: lengths must be strictly increasing, got {[n for n, _ in steps]}')
    object.__setattr__(self, 'min_rows', int(self.min_rows))
    object.__setattr__(self, 'steps', steps)

  @classmethod
  def never(cls) -> 'SharingPolicy':
    """Demotes nothing: every segment stays batched."""
    return cls(min_rows=1, source='never')

  @classmethod
  def demote_all(cls) -> 'SharingPolicy':
    """Demotes every demotable segment: plain paged decode where alignment allows."""
    return cls(min_rows=MAX_ROWS, source='demote_all')

  @classmethod
  def default(cls) -> 'SharingPolicy':
    """The packaged thresholds measured on an H200 (see `status` in the data file)."""
    return _load_default()

  @classmethod
  def from_dict(cls, data: dict[str, Any], source: str = '') -> 'SharingPolicy':
    """From the JSON `experiments.break_even` writes: {'min_rows': r, 'steps': [[n, r], ...]}."""
    if not isinstance(data, dict) or 'min_rows' not in data:
      raise ValueError(f'data must be a dict with min_rows and steps, got {data!r:.200}')
    steps = data.get('steps', ())
    if not isinstance(steps, (tuple, list)):
      raise ValueError(f'data: steps must be a list of [length, min_rows], got {steps!r:.200}')
    steps = tuple(tuple(s) if isinstance(s, list) else s for s in steps)
    return cls(data['min_rows'], steps, source)

  @classmethod
  def load(cls, path: str) -> 'SharingPolicy':
    """From a thresholds JSON file (as written by `experiments.break_even --write_thresholds`)."""
    with open(path) as f:
      return cls.from_dict(json.load(f), source=path)

  def to_dict(self) -> dict[str, Any]:
    return {'min_rows': self.min_rows, 'steps': [list(s) for s in self.steps]}

  def rows_needed(self, kv_length: int) -> int:
    """r_min(kv_length): the fewest rows at which a segment of that length stays batched."""
    if kv_length < 0:
      raise ValueError(f'kv_length must be >= 0, got {kv_length}')
    rows = self.min_rows
    for n, r in self.steps:
      if n > kv_length:
        break
      rows = r
    return rows

  def demoted(self, plan: SharingPlan) -> tuple[int, ...]:
    """Indices (ascending) of the segments that `apply` demotes; see the module docstring."""
    chosen = []
    tail_demoted = np.ones(plan.num_rows, bool)  # every later non-empty path segment is demoted
    for j in reversed(range(len(plan.segments))):
      s = plan.segments[j]
      if s.num_rows >= self.rows_needed(s.kv_length):
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

  def apply(self, plan: SharingPlan) -> SharingPlan:
    """The plan with `demoted(plan)` moved into the rows' private pages (`plan` if none)."""
    return demote(plan, self.demoted(plan))


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
def _load_default() -> SharingPolicy:
  resource = importlib.resources.files('hydrajax').joinpath(*DEFAULT_THRESHOLDS)
  data = json.loads(resource.read_text())
  status = data.get('status', 'unknown status')
  return SharingPolicy.from_dict(data, source=f'hydrajax/{"/".join(DEFAULT_THRESHOLDS)} ({status})')
