"""The private kernel's static problem and its plan of a decode step's lanes.

`PrivateProblem` holds the static facts of one `private_attention` call: frames of folded query
rows, K/V slots, and the lane kind. A step of the kernel copies 8 lanes, each one 8-row tile of
its K and V slots: 8 tokens of one kv head (chunk lanes), or 8/h tokens of h kv heads (token
lanes, `lane_heads_for`: one token of 8 heads, or two of 4, or four of 2). `lane_table` is
every step's plan, built by XLA once a decode step from the rows' private lengths and pages
(`tree_attention.for_step`); `unfold_states` turns the kernel's outputs into `[B, T, N, H]` and
`[B, T, N]`. The kernel is `private_attention`.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.mosaic_gpu.schedule import CHUNK, PRIVATE_BLOCK, WG_M, cdiv

LANES = PRIVATE_BLOCK // CHUNK  # lanes a step: each an 8-row tile of the K/V slot


@dataclasses.dataclass(frozen=True)
class PrivateProblem:
  """Static shape facts of one call."""

  num_rows: int  # B
  query_tokens: int  # T
  group_size: int  # G
  rows_per_query: int  # TGp >= T*G, `schedule.padded_rows_per_query`
  frame_rows: int  # F, `schedule.private_frame_rows`
  page_size: int  # C, a multiple of CHUNK
  slots: int = 2  # K/V steps in flight
  # > 0: each step's plan is read from a lane table of this many steps a frame (`lane_table`,
  # built once per decode step for every layer and kv head) instead of walked in the kernel.
  lane_steps: int = 0
  # qf is q's [B*T, K, H] view (G = 1), not a folded copy (`segment_attention.q_tile`).
  q_by_row: bool = False
  # False: the caller promises finite values in every kv slot a step copies but no row attends
  # (past a row's length in its last chunk); the V rows there are then not zeroed.
  zero_unseen: bool = True
  # kv heads of a lane. 1 (chunk lanes): a lane is 8 tokens of one kv head. h = 2, 4 or 8
  # (token lanes, `lane_heads_for`): a lane is CHUNK / h tokens of h kv heads, one 8-row tile of
  # the cache's flat [L*K, H] view (token-major), and a program takes those heads' rows of a
  # frame of WG_M / h folded rows, so a step copies only tokens (h = 8) or pairs or quads of
  # tokens a row holds.
  lane_heads: int = 1

  def __post_init__(self):
    if self.lane_heads not in (1, 2, 4, MAX_LANE_HEADS):
      raise ValueError(f'lane_heads must be 1, 2, 4 or {MAX_LANE_HEADS}, got {self.lane_heads}')
    if self.token_lanes and self.frame_rows != token_frame_rows(self.lane_heads):
      raise ValueError(f'token lanes of {self.lane_heads} kv heads need frame_rows = '
                       f'{token_frame_rows(self.lane_heads)} (token_frame_rows), got '
                       f'{self.frame_rows}')

  @property
  def token_lanes(self) -> bool:
    return self.lane_heads > 1

  @property
  def lane_tokens(self) -> int:
    """Tokens a lane holds: CHUNK // lane_heads."""
    return CHUNK // self.lane_heads

  @property
  def heads_per_program(self) -> int:
    return self.lane_heads

  @property
  def lse_frame_rows(self) -> int:
    """Rows a frame takes in the folded lse (`[K, frames * this]`)."""
    return self.frame_rows if self.token_lanes else WG_M

  @property
  def rows_per_frame(self) -> int:
    return max(1, self.frame_rows // self.rows_per_query)

  @property
  def num_frames(self) -> int:
    return cdiv(self.num_rows * self.rows_per_query, self.frame_rows)

  @property
  def direct_out(self) -> bool:
    """out is `[B*T, K, G, H]`: frames are whole (b, t) rows (no padding rows)."""
    return (
        self.rows_per_query == self.query_tokens * self.group_size
        and self.frame_rows % self.group_size == 0
    )

  @property
  def direct_lse(self) -> bool:
    """lse is `[B*T, K, G]`: as `direct_out`, and G*4 bytes a whole TMA box row. With token
    lanes kv head k's rows start at float F*k of the lse buffer, and a strided TMA store needs
    its shared-memory source 128-byte aligned (at F*4 = 32 or 64 bytes the H200 faults with
    CUDA_ERROR_MISALIGNED_ADDRESS); the folded lse's stores are
    contiguous (`cp.async.bulk`: 16 bytes suffice)."""
    aligned = not self.token_lanes or self.frame_rows * 4 % 128 == 0
    return self.direct_out and self.group_size % 4 == 0 and aligned


MAX_LANE_HEADS = CHUNK  # kv heads of a token lane at most: one token's 8-row tile


def lane_heads_for(num_rows: int, rows_per_query: int, num_kv_heads: int) -> int:
  """kv heads of a token lane for this shape, or 1 (chunk lanes) where token lanes do not fit.

  h = 8 when K is a multiple of 8 (a lane: one token of 8 kv heads), h = K when K is 2 or 4 (a
  lane: 8/K tokens of every kv head; with 8-token pages such a pair or quad never crosses a
  page). A frame is WG_M / h folded rows: it must hold whole query rows (TGp <= WG_M / h) and
  end inside the batch (B*TGp a multiple of it: no frame's stores run past it)."""
  if num_kv_heads % MAX_LANE_HEADS == 0:
    heads = MAX_LANE_HEADS
  elif num_kv_heads in (2, 4):
    heads = num_kv_heads
  else:
    return 1
  frame = token_frame_rows(heads)
  fits = rows_per_query <= frame and num_rows * rows_per_query % frame == 0
  return heads if fits else 1


def token_frame_rows(lane_heads: int) -> int:
  """Folded rows per kv head of a token-lane program: its WG_M score rows over its kv heads."""
  return WG_M // lane_heads


LANE_FIELDS = 10  # a lane-table step: 8 lanes' first tokens, contiguous, packed valid counts


def lane_steps(problem: PrivateProblem, max_pages: int) -> int:
  """Steps a frame's lane table holds: every lane of `rows_per_frame` rows at full capacity."""
  chunks = max(1, max_pages * problem.page_size // problem.lane_tokens)
  return cdiv(problem.rows_per_frame * chunks, LANES)


def lane_table(private_lengths, private_pages, problem: PrivateProblem) -> jax.Array:
  """The plan of every step of every frame, as the kernel's chunk walk would make it.

  [num_frames, lane_steps, LANE_FIELDS] int32: per step, each lane's first KV token (relative
  to the layer: the kernel adds kv_offset; 0 for a lane with no chunk), whether the 8 lanes
  are one row's consecutive tokens (64 contiguous tokens; never with token lanes: a lane is a
  tile of its own), and the lanes' valid rows packed 4 bits a
  lane (valid tokens; with token lanes h per valid token). A step's lanes
  depend only on the rows' private lengths and pages, so one table per decode step serves all
  layers and kv heads, and the kernel's plan is 10 reads instead of a walk of 8 dependent
  lanes. Rows run after each other, max(chunks, 1) lanes a row (a row with no chunk takes one
  empty lane), rows past the batch none.

  Two XLA fusions: the rows' lane ranges (a cumsum over the frame's R rows), then every lane's
  fields, elementwise over the R ranges. A reduce over R, or over a step's 8 lanes, would be a
  fusion, and a launch, of its own (1-2 µs each, against a call of tens of µs).
  """
  steps, unit = problem.lane_steps, problem.lane_tokens
  r_rows, b_rows, c = problem.rows_per_frame, problem.num_rows, problem.page_size
  tgp, t_tok, g_size = problem.rows_per_query, problem.query_tokens, problem.group_size
  frames = jnp.arange(problem.num_frames, dtype=jnp.int32)
  if r_rows > 1 or tgp <= WG_M:
    row0, q0 = frames * r_rows, jnp.zeros_like(frames)
  else:  # one query row over several 64-row tiles
    tiles = tgp // WG_M
    row0, q0 = frames // tiles, (frames % tiles) * WG_M
  # Row facts [F, R].
  rows = row0[:, None] + jnp.arange(r_rows, dtype=jnp.int32)
  inside = rows < b_rows
  lengths = jnp.asarray(private_lengths, jnp.int32)
  length = jnp.where(inside, lengths[jnp.minimum(rows, b_rows - 1)], 0)
  if t_tok == 1 or r_rows > 1 or tgp <= WG_M:
    seen = length  # the last query token sees the whole row
  else:  # the tile's last query token
    t_last = jnp.minimum((q0 + WG_M - 1) // g_size, t_tok - 1)[:, None]
    seen = jnp.clip(length - t_tok + 1 + t_last, 0, length)
  chunks = (seen + unit - 1) // unit
  ends = jnp.cumsum(jnp.where(inside, jnp.maximum(chunks, 1), 0), axis=1)
  starts = ends - jnp.where(inside, jnp.maximum(chunks, 1), 0)
  # Lane facts [F, lanes]: lane l belongs to row j when starts[j] <= l < ends[j] (at most one j;
  # none past the frame's rows, whose r is then R).
  lane = jnp.arange(steps * LANES, dtype=jnp.int32)[None, :]
  r = jnp.full(lane.shape, r_rows, jnp.int32)
  first = row_length = row_chunks = jnp.zeros_like(lane)
  for j in range(r_rows):
    hit = (starts[:, j:j + 1] <= lane) & (lane < ends[:, j:j + 1])
    r = jnp.where(hit, j, r)
    first = jnp.where(hit, starts[:, j:j + 1], first)
    row_length = jnp.where(hit, length[:, j:j + 1], row_length)
    row_chunks = jnp.where(hit, chunks[:, j:j + 1], row_chunks)
  i = lane - first
  real = (r < r_rows) & (i < row_chunks)
  pos = i * unit
  valid = jnp.where(real, jnp.clip(row_length - pos, 0, unit), 0)
  if unit != CHUNK:  # a token lane's valid rows: its kv heads of each valid token
    valid = valid * problem.lane_heads
  pages = jnp.asarray(private_pages, jnp.int32)
  page = jnp.clip(pos // c, 0, pages.shape[1] - 1)
  page_row = jnp.minimum(row0[:, None] + jnp.minimum(r, r_rows - 1), pages.shape[0] - 1)
  tok = jnp.where(real, pages[page_row, page] * c + pos - page * c, 0)
  shape = (problem.num_frames, steps, LANES)
  tok, real, r, valid = (x.reshape(shape) for x in (tok, real, r, valid))
  contiguous = real[..., 0] if unit == CHUNK else jnp.zeros_like(real[..., 0])
  packed = valid[..., 0]
  for j in range(1, LANES):  # lane 7's bit 31 wraps to the sign, as the kernel's int32 does
    contiguous &= real[..., j] & (r[..., j] == r[..., 0]) & (tok[..., j] == tok[..., 0] + j * unit)
    packed |= lax.shift_left(valid[..., j], jnp.int32(4 * j))
  return jnp.concatenate([tok, contiguous[..., None].astype(jnp.int32), packed[..., None]], -1)


def unfold_states(out, lse, problem, num_heads: int):
  """The kernel's outputs (any of the layouts in the module docstring) -> out [B, T, N, H],
  lse [B, T, N]. Direct layouts are reshapes; folded ones a slice and a transpose."""
  b, t, g = problem.num_rows, problem.query_tokens, problem.group_size
  h = out.shape[-1]
  kh = num_heads // g
  tgp = problem.rows_per_query
  if problem.direct_out:
    out = out.reshape(b, t, num_heads, h)
  else:
    out = out[:, : b * tgp].reshape(kh, b, tgp, h)[:, :, : t * g]
    out = out.reshape(kh, b, t, g, h).transpose(1, 2, 0, 3, 4).reshape(b, t, num_heads, h)
  if problem.direct_lse:
    return out, lse.reshape(b, t, num_heads)
  f, frames = problem.frame_rows, problem.num_frames
  rows = lse.reshape(kh, frames, problem.lse_frame_rows)[:, :, :f].reshape(kh, frames * f)
  rows = rows[:, : b * tgp].reshape(kh, b, tgp)[:, :, : t * g]
  return out, rows.reshape(kh, b, t, g).transpose(1, 2, 0, 3).reshape(b, t, num_heads)
