"""Private-KV attention fused with the tree-level LSE merge, on Hopper (Pallas Mosaic GPU).

One program per (frame, kv head) (with token lanes, below: per frame and h kv heads), one
warpgroup. A frame is F consecutive rows
of the folded query matrix (`schedule.private_frame_rows`): R = F / TGp whole
query rows, or one 64-row tile of a single row when TGp > 64. The 64 rows of
the wgmma M dimension start at the frame; rows past F are computed on whatever
follows and never stored.

Private phase: the private tokens of the frame's rows are cut into 8-token
chunks (a chunk never crosses a page: pages are multiples of 8) and packed,
row after row, 8 chunks to a 64-token step: one TMA copy per chunk into one of
`slots` shared-memory slots, loads running `slots` steps ahead. Scores of all
64 query rows against a step's tokens are masked block-diagonally (a query row
sees only its own row's chunks) and, for T > 1, causally (query token t sees
private positions `< length - T + t + 1`). At decode, with a few private tokens
per row, 8 rows share one step instead of taking one each. A step with a chunk
that is not 8 valid tokens (a row's last chunk, or a lane with no chunk) zeroes
those V rows in shared memory while its QK wgmma runs, so unwritten or stale
slots never reach an output through 0 * inf. Token indices are `kv_offset` (an
operand) plus the page's.

Per step, the scalar work is a plan of the step `slots` ahead (its chunks' first
tokens, page ids read while this step's QK wgmma runs so the refill copy goes
out as soon as the slot is free, and its valid tokens per lane packed in
one int32 carried to the step that consumes it). A step of 8 more chunks of one
row (long rows: 64 tokens, one or two page-id reads, one copy when they are
contiguous) is planned in closed form; others
walk their 8 lanes. With `lane_steps` (`MosaicGpuConfig.private_lane_table`) the plans
come from a table XLA builds once per decode step (`private_problem.lane_table`): 10 reads a
step, issued a step before the refill that uses them (`slots + 1` steps ahead), so they land
under that step's work. The score mask needs no walk: each query row sees one range of
the packed lane-token positions (its row's chunks, cut at its length and causal bound),
two per-row bounds computed once, so a step's mask is two compares per score.

Merge phase: the rows' shared partial states are read from the shared kernel's
item buffers straight into registers, one 64-row window per (path column, kv
split, run of the frame's rows under one segment); the next window is loaded
while the current one is merged, and the first before the private phase, so
its latency hides behind it. Columns of `row_segments` are filled root first
with no gaps (laminar plans, `SharingPlan`), so a row's depth is its count of
non-negative entries.

Token lanes (`PrivateProblem.lane_heads` h > 1, `MosaicGpuConfig.private_token_lanes`; the
problem, the lane table and the output layouts are `private_problem`'s): a chunk
lane copies 8 tokens of one kv head, so at decode, with a few private tokens a row, most of
what a step reads is past the rows' lengths (9 tokens: 16 read; 1: 8). In the cache's flat
`[L*K, H]` view one token's 8 kv heads are one 8-row tile, and so are two tokens of 4 kv heads
or four of 2 (K = 4, 2). A token lane copies such a tile, 8/h tokens of h kv heads, and a
program takes those heads' rows of a frame of F = 64/h folded rows: score row F*k + j is
folded row j of kv head k, column 8l + m is lane l's token m // h at kv head m % h, and a
score is visible when, besides the chunk-lane bounds (counted in tokens), k == m % h. Q comes
in h copies (one per kv head), out and lse go out in h stores, and the merge windows are
`[h heads, F rows]` blocks of the item buffers, copied by TMA into one buffer and read from
there (on the GPU that buffer then holds the output rows). The plans always come from the
lane table, a lane's valid rows there being h per valid token.

Outputs (`PrivateProblem.direct_out`): when T*G == TGp and G divides F, a
frame is whole (b, t) query rows, and out is written in the caller's order,
`[B*T, K, G, H]` (a reshape of `[B, T, N, H]`), by one 3D TMA store of the
frame's `[F/G, G, H]` rows into `out[bt0:bt0 + F/G, kv_head]`; lse likewise,
`[B*T, K, G]`, when G is a multiple of 4 (TMA boxes are at least 16 bytes
wide; `direct_lse`). A last frame that runs past the batch stores a ladder of
power-of-two copies (lse: scalar stores). Otherwise out is folded,
`[K, frames*F, H]` (frame p at rows `[p*F, (p+1)*F)`), and lse is
`[K, frames*64]` (frame p's rows at `p*64 + [0, F)`); `unfold_states` turns
any of these into `[B, T, N, H]`, `[B, T, N]`.
"""

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.mosaic_gpu import profiling
from pallas_kernels.mosaic_gpu import online_softmax as osm
from pallas_kernels.mosaic_gpu.online_softmax import LOG2E
from pallas_kernels.mosaic_gpu.schedule import (
    ALIGN, CHUNK, PARTIAL_PAD, PRIVATE_BLOCK, TILE_M, WG_M, SharedSchedule,
)
from pallas_kernels.mosaic_gpu.paged_decode import private_states_reference
from pallas_kernels.mosaic_gpu.private_problem import (
    LANE_FIELDS, LANES, PrivateProblem, lane_heads_for,
)
from pallas_kernels.mosaic_gpu.segment_attention import (
    as_folded, floor_div, offset_operand, q_tile, segment_fields, start_q,
)
from pallas_kernels.softmax_state import normalized

_BLK = PRIVATE_BLOCK
# A step's valid tokens per lane, 4 bits a lane (lane j at bits 4j..4j+3), as an int32:
_FULL = 0x88888888 - (1 << 32)  # every lane 8
_FULL_BUT_LAST = 0x08888888  # lanes 0..6 8, lane 7 0


def grouped_rows(ref, staging, groups: int):
  """`rows(start, size)`: rows `[start*G, (start+size)*G)` of a `[64, ...]` shared-memory ref
  as `[size, G, ...]`, for a TMA store of whole (b, t) rows.

  On the GPU a reshape of the ref's slice (free); interpret mode cannot reshape refs, so
  there `staging` (`[64/G, G, ...]`) gets a copy through registers.
  """
  rest = ref.shape[1:]
  if staging is None:
    return lambda start, size: ref.at[pl.ds(start * groups, size * groups)].reshape(
        size, groups, *rest
    )
  staging[...] = ref[...].reshape(staging.shape)
  plgpu.commit_smem()
  return lambda start, size: staging.at[pl.ds(start, size)]


@dataclasses.dataclass(frozen=True)
class _Statics:
  """What every program of one call knows statically (derived once by `private_attention`)."""

  problem: PrivateProblem
  sched: SharedSchedule | None
  num_kv_heads: int  # K
  head_dim: int  # H
  dtype: Any
  max_pages: int  # the page table's width
  qk_scale: float  # scale * log2(e): scores in base 2
  merging: bool  # the rows have shared partial states to merge
  depth_cap: int  # columns of row_segments (0 without a merge)
  splits: int  # kv splits of a shared segment (0 without a merge)
  interpret: bool

  @property
  def tabled(self) -> bool:
    """Step plans come from the lane table (`private_problem.lane_table`), not the walk."""
    return self.problem.lane_steps > 0

  @property
  def ahead(self) -> int:
    """Extra steps a plan is read ahead: with the lane table each step reads the plan of
    step + slots + 1 (one more than its refill needs), so the table's loads land under a
    whole step's work."""
    return int(self.tabled)

  @property
  def token(self) -> bool:
    return self.problem.token_lanes

  @property
  def window_merge(self) -> bool:
    """Token lanes merge windows of h kv heads copied by TMA (`_Merge.start_window`)."""
    return self.merging and self.token

  @property
  def tiles_per_row(self) -> int:
    """Frames per query row when TGp > 64."""
    return max(1, self.problem.rows_per_query // WG_M)


class _Refs(NamedTuple):
  """A program's operands, outputs and scratch (None where the call has no such thing)."""

  q: Any
  k: Any
  v: Any
  pages: Any
  lengths: Any
  offset: Any
  lanes: Any  # the lane table (`tabled`)
  row_segments: Any  # the merge's operands (`merging`)
  segments: Any
  partial_out: Any
  partial_lse: Any
  out: Any
  lse_out: Any
  q_smem: Any
  kv_smem: Any  # [2 (K, V), slots, 64, H]
  p_smem: Any  # P (interpret mode)
  o_smem: Any  # the output rows
  lse_smem: Any
  len_smem: Any  # the frame's private lengths (the walk)
  chunk_smem: Any  # and their chunks
  o_staging: Any  # interpret mode: [64/G, G, H] copies of the output rows (`grouped_rows`)
  lse_staging: Any
  window_o: Any  # token lanes: the merge window [kv heads, F rows, ...]
  window_lse: Any
  q_bar: Any
  k_bars: Any
  v_bars: Any
  window_bars: Any


class _FrameRows(NamedTuple):
  """A frame's scalars, from independent loads (`_frame_rows`)."""

  row0: Any  # its first row
  q0: Any  # the query index (t*G + g) of its first folded row
  rows_here: Any  # its rows inside the batch
  t_last: Any  # the last query token its rows see (None at T = 1)
  lengths: list  # per row: the private length
  chunk_counts: list  # the lanes of the tokens the frame's queries see
  lane_starts: list  # the first lane (a row with no chunk takes one empty lane)
  num_steps: Any  # the frame's private steps


def _frame_rows(st: _Statics, refs: _Refs, frame) -> _FrameRows:
  """The frame's rows, their lengths and lanes, and its steps."""
  problem = st.problem
  r_rows, tgp, b_rows = problem.rows_per_frame, problem.rows_per_query, problem.num_rows
  t_tok, unit = problem.query_tokens, problem.lane_tokens
  if r_rows > 1 or tgp <= WG_M:
    row0 = frame * r_rows
    q0 = jnp.int32(0)
  else:
    row0 = lax.div(frame, jnp.int32(st.tiles_per_row))
    q0 = lax.rem(frame, jnp.int32(st.tiles_per_row)) * WG_M
  rows_here = jnp.minimum(r_rows, b_rows - row0)
  if t_tok == 1:
    t_last = None
  elif r_rows > 1 or tgp <= WG_M:
    t_last = jnp.int32(t_tok - 1)
  else:  # the last query token among this tile's rows
    t_last = jnp.minimum(lax.div(q0 + (WG_M - 1), jnp.int32(problem.group_size)), t_tok - 1)
  lengths, chunk_counts, lane_starts = [], [], []
  lanes_total = jnp.int32(0)
  for r in range(r_rows):
    inside = r < rows_here
    length = jnp.where(inside, refs.lengths[jnp.minimum(row0 + r, b_rows - 1)], 0)
    seen = length if t_last is None else jnp.clip(length - t_tok + 1 + t_last, 0, length)
    # Lanes of the row: its tokens (one-token lanes) or `unit`-token runs (seen >= 0).
    chunks = seen if unit == 1 else lax.shift_right_logical(
        seen + (unit - 1), jnp.int32(unit.bit_length() - 1))
    lengths.append(length)
    chunk_counts.append(chunks)
    lane_starts.append(lanes_total)
    lanes_total += jnp.where(inside, jnp.maximum(chunks, 1), 0)
  num_steps = lax.shift_right_logical(lanes_total + (LANES - 1), jnp.int32(3))  # // 8
  return _FrameRows(row0, q0, rows_here, t_last, lengths, chunk_counts, lane_starts, num_steps)


def _copy_step(st: _Statics, refs: _Refs, kv_head, slot, toks, contiguous):
  """Copies a step's lanes into `slot`: one 64-token copy when they are one row's contiguous
  tokens (the barriers then get 7 plain arrivals each), else one copy a lane; each barrier
  sees 8 arrivals a step. Token lanes copy each lane's tile (8/h tokens of h kv heads: one
  8-row tile of the flat [L*K, H] view)."""
  kh = st.num_kv_heads

  def copy(tok, rows, j):
    dst = pl.ds(j * CHUNK, rows)
    if st.token:
      src = pl.ds(pl.multiple_of(tok * kh + kv_head, CHUNK), rows)
    else:
      src = (pl.ds(pl.multiple_of(tok, CHUNK), rows), kv_head)
    plgpu.copy_gmem_to_smem(refs.k.at[src], refs.kv_smem.at[0, slot, dst], refs.k_bars.at[slot])
    plgpu.copy_gmem_to_smem(refs.v.at[src], refs.kv_smem.at[1, slot, dst], refs.v_bars.at[slot])

  def each_lane():
    for j in range(LANES):
      copy(toks[j], CHUNK, j)

  if st.token:
    each_lane()
    return

  @pl.when(contiguous)
  def _():
    copy(toks[0], _BLK, 0)
    for _ in range(LANES - 1):
      plgpu.barrier_arrive(refs.k_bars.at[slot])
      plgpu.barrier_arrive(refs.v_bars.at[slot])

  pl.when(jnp.logical_not(contiguous))(each_lane)


def _pack(valids):
  """Valid tokens per lane, 4 bits a lane, as one int32."""
  packed = jnp.int32(0)
  for j, valid in enumerate(valids):
    packed = packed | lax.shift_left(valid, jnp.int32(4 * j))
  return packed


class _Planner:
  """The plans of a frame's steps: which tokens each lane copies and how many are valid.

  A plan is read `slots` (+ `ahead`) steps before its step copies: from the lane table (10
  independent loads, returned raw, so their latency runs under the next step's work), or
  walked here. The walk: a cursor (r, i) is chunk i of frame row r; lanes run row after row,
  max(chunks, 1) per row. A step's plan is its 8 first KV tokens (the layer's first 8 for a
  lane with no chunk), whether they are 64 contiguous tokens, the cursor after it, and its
  valid tokens per lane packed 4 bits a lane (`_FULL`: every lane 8 valid tokens).
  """

  def __init__(self, st: _Statics, refs: _Refs, frame, rows: _FrameRows, kv_offset):
    self.st, self.refs, self.frame, self.rows, self.kv_offset = st, refs, frame, rows, kv_offset
    if not st.tabled:  # the walk reads the rows' lengths and chunks at dynamic rows
      for r, (length, chunks) in enumerate(zip(rows.lengths, rows.chunk_counts)):
        refs.len_smem[r] = length
        refs.chunk_smem[r] = chunks

  def first_cursor(self):
    return jnp.int32(0) if self.st.tabled else (jnp.int32(0), jnp.int32(0))

  def plan_step(self, cursor):
    """(the cursor after the step, its plan)."""
    if self.st.tabled:
      return self._read_plan(cursor)
    cursor, toks, packed = self._walk_plan(cursor)
    return cursor, (toks, packed)

  def use_plan(self, plan):
    """((first tokens, contiguous), packed valid counts) of a step's plan."""
    if not self.st.tabled:
      return plan
    toks = [self.kv_offset + tok for tok in plan[:LANES]]
    return (toks, plan[LANES] != 0), plan[LANES + 1]

  def _read_plan(self, step):
    """The lane table's row of a step (a step past the frame's last reads the last row,
    never used)."""
    row = jnp.minimum(step, jnp.int32(self.st.problem.lane_steps - 1))
    return step + 1, tuple(self.refs.lanes[self.frame, row, j] for j in range(LANE_FIELDS))

  def _row_chunks(self, r):
    """(chunks, length) of frame row r; (0, 0) past the frame's rows."""
    r_rows = self.st.problem.rows_per_frame
    rr = jnp.minimum(r, r_rows - 1)
    here = r < r_rows
    return (jnp.where(here, self.refs.chunk_smem[rr], 0),
            jnp.where(here, self.refs.len_smem[rr], 0))

  def _lane_at(self, cursor):
    """The chunk at cursor: (r, pos, real, valid tokens), and the next cursor. One shared-
    memory read on the walk's dependent chain (chunks and lengths were counted once)."""
    r, i = cursor
    chunks, length = self._row_chunks(r)
    real = i < chunks
    more = i + 1 < jnp.maximum(chunks, 1)
    nxt = (jnp.where(more, r, r + 1), jnp.where(more, i + 1, 0))
    pos = i * CHUNK
    return (r, pos, real, jnp.where(real, jnp.clip(length - pos, 0, CHUNK), 0)), nxt

  def _page_id(self, r, page):
    """The id of page `page` of frame row r (clamped: a lane with no chunk reads some id)."""
    problem = self.st.problem
    r = jnp.minimum(r, problem.rows_per_frame - 1)
    page = jnp.minimum(page, self.st.max_pages - 1)
    return self.refs.pages[jnp.minimum(self.rows.row0 + r, problem.num_rows - 1), page]

  def _tokens(self, lanes):
    """First KV token of each lane's chunk and whether the 8 chunks are 64 contiguous
    tokens (8 independent page-id reads)."""
    c = self.st.problem.page_size
    toks, contiguous = [], lanes[0][2]
    for j, (r, pos, real) in enumerate(lanes):
      page = lax.div(pos, jnp.int32(c))
      toks.append(self.kv_offset + jnp.where(real, self._page_id(r, page) * c + (pos - page * c),
                                             0))
      if j:
        contiguous &= real & (r == lanes[0][0]) & (toks[j] == toks[0] + j * CHUNK)
    return toks, contiguous

  def _run_tokens(self, r, pos0):
    """`_tokens` of 8 chunks of row r from token pos0 (a fast step). With pages of >= 64
    tokens the step spans at most two pages: two page-id reads, and the step is one copy
    unless it crosses into a page that does not follow."""
    c = self.st.problem.page_size
    if c < _BLK:
      return self._tokens([(r, pos0 + j * CHUNK, jnp.bool_(True)) for j in range(LANES)])
    page = lax.div(pos0, jnp.int32(c))
    left = (page + 1) * c - pos0  # tokens of the step in its first page (a multiple of 8)
    id0, id1 = self._page_id(r, page), self._page_id(r, page + 1)
    first = self.kv_offset + id0 * c + (pos0 - page * c)
    second = self.kv_offset + id1 * c - left
    toks = [first] + [
        jnp.where(j * CHUNK < left, first, second) + j * CHUNK for j in range(1, LANES)
    ]
    return toks, (left >= _BLK) | (id1 == id0 + 1)

  def _walk_plan(self, cursor):
    """The next step's plan. Fast path: 8 more chunks of the cursor's row (a long row), in
    closed form, the cursor 8 chunks on; else the lane-by-lane walk."""
    r, i = cursor
    chunks, length = self._row_chunks(r)

    def fast():
      pos0 = i * CHUNK
      more = i + LANES < chunks
      nxt = (jnp.where(more, r, r + 1), jnp.where(more, i + LANES, 0))
      # Chunks 0..6 are whole (chunk 7 holds a seen token); chunk 7 may be partial (T > 1).
      last = jnp.clip(length - pos0 - (LANES - 1) * CHUNK, 0, CHUNK)
      packed = _FULL_BUT_LAST | lax.shift_left(last, jnp.int32(4 * (LANES - 1)))
      return (*self._run_tokens(r, pos0), *nxt, packed)

    def general():
      lanes, valids, cur = [], [], cursor
      for _ in range(LANES):
        (lr, pos, real, valid), cur = self._lane_at(cur)
        lanes.append((lr, pos, real))
        valids.append(valid)
      return (*self._tokens(lanes), *cur, _pack(valids))

    toks, contiguous, nr, ni, packed = lax.cond(i + LANES <= chunks, fast, general)
    return (nr, ni), (toks, contiguous), packed


def _score_mask(st: _Statics, rows: _FrameRows):
  """(step_mask(step) -> [64, 64] visible, rho: each score row's frame row or None).

  Lane-token position g = 64 * step + column: row rho's chunk tokens sit at
  g - 8 * lane_start(rho) = its private position. A score (query row q of frame row rho,
  column) is visible iff 0 <= that position < bound(q) = min(tokens in rho's chunks, length,
  and for T > 1 length - T + 1 + t(q)), i.e. lo(q) <= g < hi(q) with per-row vectors lo, hi
  computed once: no per-step walk, no per-lane selects over the tile. Token lanes of h kv
  heads: score row F*k + j is folded row j of the program's kv head k; column 8l + m is lane
  l's token m // h at kv head m % h, so g = 64/h * step + l * 8/h + m // h, and the heads must
  match.
  """
  problem = st.problem
  f_rows, r_rows, tgp = problem.frame_rows, problem.rows_per_frame, problem.rows_per_query
  t_tok, unit, heads = problem.query_tokens, problem.lane_tokens, problem.heads_per_program
  index = osm.row_index(WG_M)  # [64] score row, ROWS layout
  if st.token:
    head_of = floor_div(index, f_rows)  # the program's kv head of each score row
    row_in = index - head_of * f_rows  # its folded row in the frame
  else:
    row_in = index
  if r_rows > 1:
    rho = floor_div(row_in, tgp)  # frame row of each score row
    within = row_in - rho * tgp
  else:
    rho = None
    within = row_in + rows.q0
  t_of = floor_div(within, problem.group_size) if t_tok > 1 else None  # query token of a row

  def per_row(values):
    """[64] ROWS vector: values[r] on the score rows of frame row r, 0 past the frame."""
    if rho is None:  # derived from index: a splat constant has no broadcast to the tile
      return index * 0 + values[0]
    out = jnp.zeros_like(index)
    for r, value in enumerate(values):
      out = jnp.where(rho == r, value, out)
    return out

  lo_rows = per_row([s * unit for s in rows.lane_starts])
  bound = per_row([jnp.minimum(n, k * unit) for n, k in zip(rows.lengths, rows.chunk_counts)])
  if t_of is not None:
    bound = jnp.minimum(bound, per_row(rows.lengths) - (t_tok - 1) + t_of)
  hi_rows = lo_rows + jnp.maximum(bound, 0)
  cols = plgpu.broadcasted_iota(jnp.int32, (WG_M, _BLK), 1, layout=plgpu.Layout.WGMMA)
  same_head = None
  if st.token:
    lane_cols = floor_div(cols, CHUNK)
    head_col = cols - lane_cols * CHUNK  # m, then m % h
    cols = lane_cols
    if unit > 1:
      token_in = floor_div(head_col, heads)
      head_col = head_col - token_in * heads
      cols = lane_cols * unit + token_in
    same_head = head_col == lax.broadcast_in_dim(head_of, cols.shape, [0])

  def step_mask(step):
    first = step * (LANES * unit)
    lo = lax.broadcast_in_dim(lo_rows - first, (WG_M, _BLK), [0])
    hi = lax.broadcast_in_dim(hi_rows - first, (WG_M, _BLK), [0])
    visible = (cols >= lo) & (cols < hi)
    return visible if same_head is None else visible & same_head

  return step_mask, rho


def _zero_unseen(v_smem, packed):
  """Zeroes the step's V rows past each chunk's valid tokens (unwritten or stale slots, lanes
  with no chunk): P is 0 there, and 0 * inf would reach the output."""
  valids = [lax.shift_right_logical(packed, jnp.int32(4 * j)) & 15 for j in range(LANES)]

  def keep(r):
    lane_r = floor_div(r, CHUNK)
    count = jnp.zeros_like(r)
    for j, valid in enumerate(valids):
      count = jnp.where(lane_r == j, valid, count)
    return r - lane_r * CHUNK < count

  osm.zero_rows(v_smem, keep)


class _Merge:
  """The merge phase: the rows' shared partial states, read from the shared kernel's item
  buffers, one 64-row window per (path column, kv split, run of the frame's rows under one
  segment). The first window is loaded before the private phase (its latency hides behind
  it), and each next one while the current one is merged. Columns of `row_segments` are
  filled root first with no gaps, so a row's depth is its count of non-negative entries."""

  def __init__(self, st: _Statics, refs: _Refs, kv_head, f0, rows: _FrameRows):
    self.st, self.refs, self.kv_head, self.f0, self.rows = st, refs, kv_head, f0, rows
    self.max_depth = jnp.int32(0)
    for r in range(st.problem.rows_per_frame):
      self.max_depth = jnp.maximum(self.max_depth, self._row_depth(r))
    self.first = self._describe(jnp.int32(0), jnp.int32(0))
    if st.window_merge:  # copied now, waited for after the private phase; none if no window
      pl.when(self.max_depth > 0)(lambda: self._start_window(self.first[1]))
      self.first_window = None
    else:
      self.first_window = self._load_window(self.first[1])

  def _row_depth(self, r):
    """Non-negative entries of the row's path (a prefix of its columns), 0 outside;
    independent loads, so all rows' columns are read in one round trip."""
    row = jnp.minimum(self.rows.row0 + r, self.st.problem.num_rows - 1)
    filled = jnp.int32(0)
    for col in range(self.st.depth_cap):
      filled += jnp.where(self.refs.row_segments[row, col] >= 0, 1, 0)
    return jnp.where(r < self.rows.rows_here, filled, 0)

  def _describe(self, d, r):
    """The run of the frame's rows from row r under the segment in path column d:
    (valid, buffer row of its split-0 window, rows per split, end of the run)."""
    st, rows = self.st, self.rows
    row = jnp.minimum(rows.row0 + r, st.problem.num_rows - 1)
    index = self.refs.row_segments[row, jnp.minimum(d, st.depth_cap - 1)]
    seg = segment_fields(st.sched, self.refs.segments, index)
    valid = (index >= 0) & seg.valid & (d < st.depth_cap) & (r < rows.rows_here)
    seg_frame = seg.row_begin * st.problem.rows_per_query
    seg_frame = seg_frame - lax.rem(seg_frame, jnp.int32(ALIGN))
    base = PARTIAL_PAD + seg.item_base * TILE_M + (self.f0 - seg_frame)
    run_end = jnp.minimum(seg.row_begin + seg.row_count - rows.row0, rows.rows_here)
    return (
        valid, jnp.where(valid, base, PARTIAL_PAD), jnp.where(valid, seg.row_tiles * TILE_M, 0),
        jnp.where(valid, run_end, r + 1),
    )

  def _load_window(self, start):
    rows = pl.ds(start, WG_M)
    o = plgpu.load(self.refs.partial_out.at[self.kv_head, rows], layout=plgpu.Layout.WGMMA,
                   optimized=False)
    lse = plgpu.load(self.refs.partial_lse.at[self.kv_head, rows],
                     layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
    return o, lse

  def _start_window(self, start):
    """Token lanes: a window is F rows of each of the program's h kv heads, [h, F, ...] in
    score-row order: a TMA copy into the merge buffer (`_window_values` waits for it)."""
    problem, refs = self.st.problem, self.refs
    rows = (pl.ds(self.kv_head, problem.heads_per_program), pl.ds(start, problem.frame_rows))
    plgpu.copy_gmem_to_smem(refs.partial_out.at[rows], refs.window_o, refs.window_bars.at[0])
    plgpu.copy_gmem_to_smem(refs.partial_lse.at[rows], refs.window_lse, refs.window_bars.at[0])

  def _window_values(self):
    refs, h = self.refs, self.st.head_dim
    plgpu.barrier_wait(refs.window_bars.at[0])
    if self.st.interpret:  # interpret mode cannot reshape refs
      return refs.window_o[...].reshape(WG_M, h), refs.window_lse[...].reshape(WG_M)
    o = plgpu.load(refs.window_o.reshape(WG_M, h), layout=plgpu.Layout.WGMMA, optimized=False)
    lse = plgpu.load(refs.window_lse.reshape(WG_M), layout=osm.ROWS, optimized=False)
    return o, lse

  def run(self, acc, m_i, l_i, rho):
    """Merges every window into (acc, m_i, l_i). Items in order (column d, run of rows from
    r, split); a run's segment is read once (lax.cond), its splits' windows follow at a fixed
    stride, each loaded one item ahead."""
    st, max_depth, rows_here = self.st, self.max_depth, self.rows.rows_here
    frame_row = None if rho is None else rho.astype(jnp.float32)  # each score row's frame row

    def merge_body(carry):
      (d, r, split), run, window, acc, m_i, l_i = carry
      valid, _, _, run_end = run
      more_splits = split + 1 < st.splits
      more_runs = run_end < rows_here
      nxt = (
          jnp.where(more_splits | more_runs, d, d + 1),
          jnp.where(more_splits, r, jnp.where(more_runs, run_end, 0)),
          jnp.where(more_splits, split + 1, 0),
      )
      next_run = lax.cond(
          more_splits | (nxt[0] >= max_depth), lambda: run, lambda: self._describe(*nxt[:2])
      )
      next_start = next_run[1] + nxt[2] * next_run[2]
      if st.window_merge:  # this window into registers, then the next (if any) into the buffer
        o, lse = self._window_values()
        next_window = None
        pl.when(nxt[0] < max_depth)(lambda: self._start_window(next_start))
      else:
        next_window = self._load_window(next_start)
        o, lse = window
      lse2 = jnp.where(valid, lse * LOG2E, -jnp.inf)
      if frame_row is not None:
        in_run = ((frame_row >= r.astype(jnp.float32))
                  & (frame_row < run_end.astype(jnp.float32)))
        lse2 = jnp.where(in_run, lse2, -jnp.inf)
      acc, m_i, l_i = osm.merge(acc, m_i, l_i, o, lse2)
      return nxt, next_run, next_window, acc, m_i, l_i

    zero = jnp.int32(0)
    carry = ((zero, zero, zero), self.first, self.first_window, acc, m_i, l_i)
    *_, acc, m_i, l_i = lax.while_loop(lambda c: c[0][0] < max_depth, merge_body, carry)
    return acc, m_i, l_i


def _start_steps(st: _Statics, refs: _Refs, kv_head, planner: _Planner, rows: _FrameRows):
  """The first `slots` steps' copies, every plan (page ids included) before the first copy.
  Returns the loop's (cursor, valid counts of the steps in flight, plans read ahead)."""
  slots = st.problem.slots
  cursor = planner.first_cursor()
  plans = []
  for _ in range(slots + st.ahead):
    cursor, plan = planner.plan_step(cursor)
    plans.append(plan)
  first_steps = [planner.use_plan(plan) for plan in plans[:slots]]
  for slot, (toks, _) in enumerate(first_steps):
    pl.when(slot < rows.num_steps)(
        lambda slot=slot, t=toks: _copy_step(st, refs, kv_head, slot, *t))
  packs = tuple(packed for _, packed in first_steps)
  pending = tuple(plans[slots:])  # with the lane table: step `slots`'s plan, read early
  return cursor, packs, pending


def _kv_loop(st: _Statics, refs: _Refs, kv_head, planner: _Planner, rows: _FrameRows,
             step_mask, started):
  """The private phase: flash attention over the frame's lanes, `slots` steps in flight
  (`started`: `_start_steps`'s). Returns (acc, m_i, l_i)."""
  slots, zero_unseen = st.problem.slots, st.problem.zero_unseen
  num_steps = rows.num_steps
  cursor, packs, pending = started
  plgpu.barrier_wait(refs.q_bar.at[0])

  def private_step(step, carry):
    acc, m_i, l_i, cursor, packs, pending = carry
    slot = lax.rem(step, jnp.int32(slots))
    packed = packs[0]
    k_bar, v_bar = refs.k_bars.at[slot], refs.v_bars.at[slot]
    # A lane with fewer than 8 valid tokens (None: not looked for, `zero_unseen` off).
    partial = (packed != _FULL) if zero_unseen else None
    when_partial = (lambda f: pl.when(partial)(f)) if partial is not None else (lambda f: None)
    # Named scopes are the regions of the profiler's traces (`profiling`), nothing otherwise.
    with jax.named_scope('mask'):
      visible = step_mask(step)
    with jax.named_scope('wait_k'):
      plgpu.barrier_wait(k_bar)
      # A step to clean waits for V before QK and cleans it while the QK wgmma runs; any
      # other waits after the softmax, so V's arrival overlaps QK (long rows).
      when_partial(lambda: plgpu.barrier_wait(v_bar))

    def qk(acc_ref):
      plgpu.wgmma(acc_ref, refs.q_smem, refs.kv_smem.at[0, slot].transpose((1, 0)))
      # While the QK wgmma runs: the plan of step + slots (+ 1 with the lane table; the
      # walk's page ids included), so the refill of this slot is only the copy.
      with jax.named_scope('plan'):
        plan = planner.plan_step(cursor)
      with jax.named_scope('zero_unseen'):
        when_partial(lambda: _zero_unseen(refs.kv_smem.at[1, slot], packed))
      with jax.named_scope('qk_wait'):
        return acc_ref[...], plan

    s, (cursor, plan) = pl.run_scoped(qk, plgpu.ACC((WG_M, _BLK), jnp.float32))
    if st.ahead:  # refill with the plan read a step ago; this one waits for the next
      plan, pending = pending[0], (plan,)
    with jax.named_scope('softmax'):
      acc, m_new, l_i, p16 = osm.step(
          s, acc, m_i, l_i, scale_log2=st.qk_scale, dtype=st.dtype, visible=visible
      )
    with jax.named_scope('wait_v'):
      if partial is None:
        plgpu.barrier_wait(v_bar)
      else:
        pl.when(jnp.logical_not(partial))(lambda: plgpu.barrier_wait(v_bar))
    with jax.named_scope('pv'):
      acc = osm.add_pv(acc, p16, refs.kv_smem.at[1, slot], refs.p_smem)
    # The slot's wgmmas are done (their results are in registers): refill it.
    with jax.named_scope('refill'):
      next_toks, next_packed = planner.use_plan(plan)
      pl.when(step + slots < num_steps)(
          lambda: _copy_step(st, refs, kv_head, slot, *next_toks))
    return acc, m_new, l_i, cursor, (*packs[1:], next_packed), pending

  acc, m_i, l_i = osm.init(WG_M, st.head_dim)
  with jax.named_scope('private'):
    acc, m_i, l_i, *_ = lax.fori_loop(
        0, num_steps, private_step, (acc, m_i, l_i, cursor, packs, pending)
    )
  return acc, m_i, l_i


def _load_q(st: _Statics, refs: _Refs, kv_head, f0):
  """Issues the copy of the frame's Q rows (`q_bar` says when they landed): token lanes copy
  each of the program's kv heads' F rows into its F rows of q_smem."""
  problem = st.problem
  if not st.token:
    start_q(refs.q, kv_head, f0, problem.q_by_row, refs.q_smem, refs.q_bar.at[0])
    return
  f_rows = problem.frame_rows
  for k in range(problem.heads_per_program):
    plgpu.copy_gmem_to_smem(q_tile(refs.q, kv_head + k, f0, problem.q_by_row, f_rows),
                            refs.q_smem.at[pl.ds(k * f_rows, f_rows)], refs.q_bar.at[0])


def _store_heads(st: _Statics, refs: _Refs, frame, kv_head):
  """Token lanes: each of the program's kv heads' F rows (score rows [F*k, F*(k + 1))) into
  out and lse, one TMA store each; frames hold whole query rows inside the batch."""
  problem = st.problem
  f_rows, g_size = problem.frame_rows, problem.group_size
  f0 = pl.multiple_of(frame * f_rows, ALIGN)
  per = f_rows // g_size  # (b, t) rows of a frame
  o_rows = grouped_rows(refs.o_smem, refs.o_staging, g_size) if problem.direct_out else None
  lse_rows = (grouped_rows(refs.lse_smem, refs.lse_staging, g_size) if problem.direct_lse
              else None)
  for k in range(problem.heads_per_program):
    if o_rows is not None:
      plgpu.copy_smem_to_gmem(o_rows(k * per, per),
                              refs.out.at[pl.ds(frame * per, per), kv_head + k])
    else:
      plgpu.copy_smem_to_gmem(refs.o_smem.at[pl.ds(k * f_rows, f_rows)],
                              refs.out.at[kv_head + k, pl.ds(f0, f_rows)])
    if lse_rows is not None:
      plgpu.copy_smem_to_gmem(lse_rows(k * per, per),
                              refs.lse_out.at[pl.ds(frame * per, per), kv_head + k])
    else:
      plgpu.copy_smem_to_gmem(refs.lse_smem.at[pl.ds(k * f_rows, f_rows)],
                              refs.lse_out.at[kv_head + k, pl.ds(f0, f_rows)])


def _store_direct(st: _Statics, refs: _Refs, frame, kv_head):
  """The frame's F/G whole (b, t) rows into out [B*T, K, G, H] (and lse [B*T, K, G]): one 3D
  TMA store each, a ladder of them when the last frame runs past the batch."""
  problem = st.problem
  f_rows, g_size = problem.frame_rows, problem.group_size
  per = f_rows // g_size  # (b, t) rows of a full frame
  bt0 = frame * per
  o_rows = grouped_rows(refs.o_smem, refs.o_staging, g_size)
  lse_rows = (grouped_rows(refs.lse_smem, refs.lse_staging, g_size) if problem.direct_lse
              else None)

  def store_out(start, size):
    plgpu.copy_smem_to_gmem(o_rows(start, size), refs.out.at[pl.ds(bt0 + start, size), kv_head])

  def store_full():
    store_out(0, per)
    if lse_rows is not None:
      plgpu.copy_smem_to_gmem(lse_rows(0, per), refs.lse_out.at[pl.ds(bt0, per), kv_head])

  if (problem.num_rows * problem.rows_per_query) % f_rows == 0:  # no frame runs past the batch
    store_full()
    return
  count = jnp.minimum(per, problem.num_rows * problem.query_tokens - bt0)  # rows in the batch
  pl.when(count == per)(store_full)

  @pl.when(count < per)
  def _():
    start, size = jnp.int32(0), per // 2
    while size >= 1:
      pl.when(lax.bitwise_and(count, size) != 0)(functools.partial(store_out, start, size))
      start = start + lax.bitwise_and(count, size)
      size //= 2
    if lse_rows is not None:  # 16-byte rows at any offset: too small for TMA, and rare
      for i in range(f_rows):
        def store(i=i):
          refs.lse_out[bt0 + i // g_size, kv_head, i % g_size] = refs.lse_smem[i]

        pl.when(i // g_size < count)(store)


def _store(st: _Statics, refs: _Refs, frame, kv_head, f0):
  """The frame's final rows into out and lse, in the layout of `PrivateProblem.direct_out`
  and `direct_lse` (module docstring)."""
  problem = st.problem
  if st.token:
    _store_heads(st, refs, frame, kv_head)
  elif problem.direct_out:
    _store_direct(st, refs, frame, kv_head)
  else:
    f_rows = problem.frame_rows
    plgpu.copy_smem_to_gmem(refs.o_smem.at[pl.ds(0, f_rows)],
                            refs.out.at[kv_head, pl.ds(pl.multiple_of(f0, ALIGN), f_rows)])
  if not (problem.direct_lse or st.token):
    rows = pl.ds(pl.multiple_of(frame * WG_M, ALIGN), WG_M)
    plgpu.copy_smem_to_gmem(refs.lse_smem, refs.lse_out.at[kv_head, rows])
  plgpu.wait_smem_to_gmem(0)


def _kernel_body(st: _Statics, *flat_refs):
  """One program: a frame of folded query rows at one kv head (token lanes: h kv heads): its
  Q, the first steps' copies, the score mask's bounds, the first merge window, the private
  steps, the merge, the stores."""
  refs = _unpack_refs(st, flat_refs)
  frame = lax.axis_index('frame')
  kv_head = lax.axis_index('kv_head')  # the program's (first) kv head
  if st.token:
    kv_head = kv_head * st.problem.heads_per_program
  if refs.o_smem is None:  # token lanes on the GPU: the merge window's buffer, free after it
    refs = refs._replace(o_smem=refs.window_o.reshape(WG_M, st.head_dim))
  f0 = frame * st.problem.frame_rows  # first folded row of the frame
  rows = _frame_rows(st, refs, frame)
  _load_q(st, refs, kv_head, f0)
  planner = _Planner(st, refs, frame, rows, refs.offset[0])
  started = _start_steps(st, refs, kv_head, planner, rows)
  step_mask, rho = _score_mask(st, rows)
  merge = _Merge(st, refs, kv_head, f0, rows) if st.merging else None
  acc, m_i, l_i = _kv_loop(st, refs, kv_head, planner, rows, step_mask, started)
  if merge is not None:
    with jax.named_scope('merge'):
      acc, m_i, l_i = merge.run(acc, m_i, l_i, rho)
  with jax.named_scope('finish'):
    osm.finish(acc, m_i, l_i, refs.o_smem, refs.lse_smem, st.dtype)
  _store(st, refs, frame, kv_head, f0)


def _unpack_refs(st: _Statics, flat_refs) -> _Refs:
  """`plgpu.kernel`'s refs (operands, outputs, then the scratch of `_scratch`) by name."""
  q, k, v, pages, lengths, offset, *rest = flat_refs
  lanes = rest.pop(0) if st.tabled else None
  merge_refs = [rest.pop(0) for _ in range(4)] if st.merging else [None] * 4
  out, lse_out, smem, barriers = rest
  q_bar, k_bars, v_bars, window_bars = barriers
  return _Refs(q, k, v, pages, lengths, offset, lanes, *merge_refs, out, lse_out, *smem, q_bar,
               k_bars, v_bars, window_bars)


def _scratch(st: _Statics):
  """(shared memory, barriers) of a program, in the order of `_Refs`."""
  problem, h, dtype, interpret = st.problem, st.head_dim, st.dtype, st.interpret
  r_rows, g_size, f_rows = problem.rows_per_frame, problem.group_size, problem.frame_rows
  heads, slots = problem.heads_per_program, problem.slots
  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  smem = (
      plgpu.SMEM((WG_M, h), dtype, transforms=tiled),  # Q
      plgpu.SMEM((2, slots, _BLK, h), dtype, transforms=tiled),  # K, V per slot
      plgpu.SMEM((WG_M, _BLK), dtype, transforms=tiled) if interpret else None,  # P
      # output rows, untiled (token lanes on the GPU: the merge window's buffer)
      None if st.window_merge and not interpret else plgpu.SMEM((WG_M, h), dtype),
      plgpu.SMEM((WG_M,), jnp.float32),
      plgpu.SMEM((r_rows,), jnp.int32),  # the frame's private lengths
      plgpu.SMEM((r_rows,), jnp.int32),  # and their chunks (of the tokens the queries see)
      # Interpret mode only: the [64/G, G, ...] copies of the output rows (`grouped_rows`).
      plgpu.SMEM((WG_M // g_size, g_size, h), dtype) if interpret and problem.direct_out
      else None,
      plgpu.SMEM((WG_M // g_size, g_size), jnp.float32)
      if interpret and problem.direct_lse else None,
      # Token lanes: the merge window, [kv heads, F rows, ...] (`_Merge.start_window`); on the
      # GPU it is also the output rows (o_smem) once the merge is done.
      plgpu.SMEM((heads, f_rows, h), dtype) if st.window_merge else None,
      plgpu.SMEM((heads, f_rows), jnp.float32) if st.window_merge else None,
  )
  barriers = (
      plgpu.Barrier(num_arrivals=heads, num_barriers=1),  # Q: a copy per kv head
      plgpu.Barrier(num_arrivals=LANES, num_barriers=slots),  # K
      plgpu.Barrier(num_arrivals=LANES, num_barriers=slots),  # V
      plgpu.Barrier(num_arrivals=2, num_barriers=1) if st.window_merge else None,  # out, lse
  )
  return [smem, barriers]


def _check_args(st: _Statics, qf, lanes):
  problem = st.problem
  want_lanes = (problem.num_frames, problem.lane_steps, LANE_FIELDS)
  if st.tabled and (lanes is None or tuple(lanes.shape) != want_lanes):
    raise ValueError(f'lanes must be the lane table {want_lanes} (lane_table), got '
                     f'{None if lanes is None else lanes.shape}')
  if problem.q_by_row and qf.ndim != 3:
    raise ValueError(f'q by row must be the [B*T, K, H] view of a G = 1 query, got {qf.shape}')
  heads, kh = problem.heads_per_program, st.num_kv_heads
  b_rows, tgp = problem.num_rows, problem.rows_per_query
  if st.token and lane_heads_for(b_rows, tgp, kh) != heads:  # frames: `PrivateProblem` checks
    raise ValueError(f'token lanes of {heads} kv heads need frames of {problem.frame_rows} '
                     f'folded rows holding whole query rows, and K a multiple of 8 or K = '
                     f'{heads} (lane_heads_for); got B={b_rows}, TGp={tgp}, K={kh}')
  if st.token and not st.tabled:
    raise ValueError('token lanes read their plans from the lane table')


def private_attention(
    qf: jax.Array,  # [K, M_q, H] folded queries, M_q >= frames*F + 64; by row [M_q, K, H]
    k_cache: jax.Array,  # [L, K, H], L a multiple of ALIGN
    v_cache: jax.Array,  # [L, K, H]
    private_pages: jax.Array,  # [B, P] int32
    private_lengths: jax.Array,  # [B] int32
    row_segments: jax.Array | None,  # [B, D] int32 path columns, -1 padded (TreeLayout)
    segments: jax.Array | None,  # [4, J] int32, segment_attention.pack_segments(layout.groups)
    sched: SharedSchedule | None,
    partial_out: jax.Array | None,  # [K, PAD + W*TILE_M + PAD, H] (segment_attention)
    partial_lse: jax.Array | None,  # [K, PAD + W*TILE_M + PAD] float32
    problem: PrivateProblem,
    *,
    scale: float,
    kv_offset: jax.Array | int = 0,
    lanes: jax.Array | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Final states of every folded query row; layouts in the module docstring.

  `kv_offset` (int32 scalar, a multiple of the page size) is added to every kv
  token index: the pages index one layer's buffer that starts there in k_cache.
  `lanes`: `private_problem.lane_table(private_lengths, private_pages, problem)`, required when
  `problem.lane_steps` (the steps' plans are read there, not walked).
  """
  kh = qf.shape[1] if problem.q_by_row else qf.shape[0]
  merging = sched is not None and sched.num_items > 0 and row_segments is not None
  st = _Statics(
      problem=problem, sched=sched, num_kv_heads=kh, head_dim=qf.shape[-1], dtype=qf.dtype,
      max_pages=private_pages.shape[1], qk_scale=scale * LOG2E, merging=merging,
      depth_cap=row_segments.shape[1] if merging else 0,
      splits=sched.num_splits if merging else 0, interpret=interpret,
  )
  _check_args(st, qf, lanes)
  if st.token:  # a lane is 8 rows of the flat view (free: a reshape of a row-major buffer)
    k_cache, v_cache = k_cache.reshape(-1, st.head_dim), v_cache.reshape(-1, st.head_dim)
  operands = [qf, k_cache, v_cache, private_pages, private_lengths, offset_operand(kv_offset)]
  if st.tabled:
    operands.append(lanes)
  if merging:
    operands += [row_segments, segments, partial_out, partial_lse]
  b_rows, t_tok, g_size, h = problem.num_rows, problem.query_tokens, problem.group_size, st.head_dim
  frames = problem.num_frames
  def private_merge_kernel(*flat_refs):  # the kernel's name in profiles and lowered modules
    _kernel_body(st, *flat_refs)

  return plgpu.kernel(
      private_merge_kernel,
      out_type=(
          jax.ShapeDtypeStruct((b_rows * t_tok, kh, g_size, h), qf.dtype) if problem.direct_out
          else jax.ShapeDtypeStruct((kh, frames * problem.frame_rows, h), qf.dtype),
          jax.ShapeDtypeStruct((b_rows * t_tok, kh, g_size), jnp.float32) if problem.direct_lse
          else jax.ShapeDtypeStruct((kh, frames * problem.lse_frame_rows), jnp.float32),
      ),
      scratch_types=_scratch(st),
      grid=(frames, kh // problem.heads_per_program),
      grid_names=('frame', 'kv_head'),
      compiler_params=profiling.compiler_params(),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )(*operands)


def private_attention_reference(
    qf, k_cache, v_cache, private_pages, private_lengths, row_segments, segments,
    sched: SharedSchedule | None, partial_out, partial_lse, problem: PrivateProblem, *,
    scale: float, kv_offset=0, lanes=None, interpret: bool = False,
):
  """`private_attention` in jnp (float32 math): same arguments, same output layouts (`lanes`,
  a plan of the kernel's steps, changes nothing here).

  The merge reads the shared partial states at the places the module docstring of
  `schedule` gives, so this checks the kernel's indexing too. `row_segments` and
  `segments` must be concrete (for tests). Rows past the batch get (0, -inf).
  """
  del interpret, lanes
  qf = as_folded(qf, problem.q_by_row)
  kh, _, h = qf.shape
  b, tgp, f = problem.num_rows, problem.rows_per_query, problem.frame_rows
  out, lse = private_states_reference(
      qf[:, : b * tgp].reshape(kh, b, tgp, h), k_cache, v_cache, private_pages, private_lengths,
      query_tokens=problem.query_tokens, group_size=problem.group_size,
      page_size=problem.page_size, scale=scale, kv_offset=kv_offset,
  )
  if sched is not None and sched.num_items > 0 and row_segments is not None:
    table, segs = np.asarray(row_segments), np.asarray(segments)
    starts = np.full(table.shape + (sched.num_splits,), -1, np.int64)  # [B, D, splits]
    for row, col in zip(*np.nonzero(table >= 0)):
      index = int(table[row, col])
      gs = next(g for g in sched.groups if 0 <= index - g.segment_offset < g.num_segments)
      item = gs.item_offset + (index - gs.segment_offset) * gs.num_splits * gs.row_tiles
      first = int(segs[2, index]) * tgp
      base = PARTIAL_PAD + item * TILE_M + row * tgp - (first - first % ALIGN)
      starts[row, col] = base + np.arange(gs.num_splits) * gs.row_tiles * TILE_M
    rows = np.maximum(starts, 0)[..., None] + np.arange(tgp)  # [B, D, splits, TGp]
    windows = partial_out[:, rows].astype(jnp.float32).reshape(kh, b, -1, tgp, h)
    window_lse = partial_lse[:, rows].reshape(kh, b, -1, tgp)
    window_lse = jnp.where(jnp.asarray(starts >= 0).reshape(1, b, -1, 1), window_lse, -jnp.inf)
    out = jnp.concatenate([out[..., None, :], windows.transpose(0, 1, 3, 2, 4)], axis=3)
    lse = jnp.concatenate([lse[..., None], window_lse.transpose(0, 1, 3, 2)], axis=3)
    m = jnp.max(lse, axis=-1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m[..., None])
    den = w.sum(-1)
    acc = jnp.sum(jnp.where(w[..., None] == 0, 0.0, w[..., None] * out), axis=3)
    out, lse = normalized(acc, den, m)
  frames = problem.num_frames
  t, g = problem.query_tokens, problem.group_size
  if problem.direct_out:  # [K, B, T*G, ...] -> [B*T, K, G, ...]
    folded = out.reshape(kh, b, t, g, h).transpose(1, 2, 0, 3, 4).reshape(b * t, kh, g, h)
  else:
    folded = jnp.zeros((kh, frames * f, h), jnp.float32).at[:, : b * tgp].set(
        out.reshape(kh, b * tgp, h)
    )
  if problem.direct_lse:
    return folded.astype(qf.dtype), lse.reshape(kh, b, t, g).transpose(1, 2, 0, 3).reshape(
        b * t, kh, g
    )
  per = problem.lse_frame_rows
  where = (np.arange(b * tgp) // f) * per + np.arange(b * tgp) % f
  lse_tiles = jnp.full((kh, frames * per), -jnp.inf, jnp.float32)
  lse_tiles = lse_tiles.at[:, where].set(lse.reshape(kh, b * tgp))
  return folded.astype(qf.dtype), lse_tiles
