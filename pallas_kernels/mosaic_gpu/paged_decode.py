"""Paged decode attention on Hopper (Pallas Mosaic GPU): rows with private KV only.

The kernel for layouts with no shared segment (plain paged decode: no sharing,
or the per-sequence baselines). One program per (query row b, row tile, kv
head), one warpgroup: flash-decoding over the row's own pages (T query tokens,
causal inside the private region: query token t sees private positions
`< length - T + t + 1`), streaming 64-token blocks through two shared-memory
slots; each block is read as rungs of 8/8/16/32 rows, only those holding valid
tokens. A partial block's V rows past its valid tokens (never loaded, or
unwritten slots of the page) are zeroed before `p @ V`, so 0 * inf never
reaches the output; full blocks skip that.

Many programs each streaming one long row keep the copy engines busy; the
packed kernel (`private_attention`), which walks several rows per program, is
for the short private regions of shared-prefix decoding.

The program's query rows are the aligned frame `[F0, F0 + 64)` of the folded
matrix `[K, B*T*G, H]` with `F0 = round_down(b*T*G, 8) + tile*64`; only the
first `window_rows(T*G)` rows are loaded, and rows outside `[b*T*G, (b+1)*T*G)`
are computed on stale data and never stored.

Outputs (`PagedProblem.direct`): when a row's T*G query rows fit one tile and
T*G <= 32, in the caller's order, out `[B*T, K, G, H]` (a reshape of
`[B, T, N, H]`; one TMA store of `[G, H]` per query token) and lse
`[B*T, K, G]` (scalar stores: G floats are too narrow for TMA at an arbitrary
shared-memory row); otherwise folded (`paged_attention`), written with a
ladder of exact-size copies. `unfold_states` gives `[B, T, N, H]`, `[B, T, N]`.
"""

import dataclasses

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

import numpy as np

from pallas_kernels.mosaic_gpu import profiling
from pallas_kernels.mosaic_gpu import online_softmax as osm
from pallas_kernels.mosaic_gpu.online_softmax import LOG2E
from pallas_kernels.mosaic_gpu.schedule import ALIGN, PRIVATE_BLOCK, WG_M, cdiv, frame_pad, round_up
from pallas_kernels.mosaic_gpu.segment_attention import floor_div, offset_operand
from pallas_kernels.softmax_state import normalized

_BLK = PRIVATE_BLOCK
_RUNGS = ((0, 8), (8, 16), (16, 32), (32, 64))  # row ranges of a private block's copies
DIRECT_MAX_ROWS = 32  # most T*G of the direct output (lse: a scalar store per query row)


@dataclasses.dataclass(frozen=True)
class PagedProblem:
  """Static shape facts of one call."""

  num_rows: int  # B
  query_tokens: int  # T
  group_size: int  # G
  page_size: int  # C

  @property
  def rows_per_query(self) -> int:
    return self.query_tokens * self.group_size

  @property
  def direct(self) -> bool:
    """Outputs in [B*T, K, G, ...] order: one tile per row, and few lse scalar stores."""
    return private_row_tiles(self.rows_per_query) == 1 and self.rows_per_query <= DIRECT_MAX_ROWS


def private_row_tiles(rows_per_query: int) -> int:
  """Row tiles of WG_M per query row (each row's frame starts 8-aligned)."""
  return cdiv(rows_per_query + frame_pad(rows_per_query), WG_M)


def window_rows(rows_per_query: int) -> int:
  """Query rows a program loads (a multiple of ALIGN)."""
  return min(WG_M, round_up(rows_per_query + frame_pad(rows_per_query), ALIGN))


def lse_index(b: int, tg: int) -> np.ndarray:
  """For each folded row f = b*T*G + i, its place in the kernel's lse tiles."""
  tiles = private_row_tiles(tg)
  f = np.arange(b * tg)
  row = f // tg
  within = f - (row * tg - (row * tg) % ALIGN)
  return (row * tiles + within // WG_M) * WG_M + within % WG_M


def unfold_states(out, lse, problem: PagedProblem, num_heads: int):
  """`paged_attention`'s outputs -> out [B, T, N, H], lse [B, T, N]."""
  b, t, g = problem.num_rows, problem.query_tokens, problem.group_size
  h = out.shape[-1]
  if problem.direct:
    return out.reshape(b, t, num_heads, h), lse.reshape(b, t, num_heads)
  kh = num_heads // g
  out = out.reshape(kh, b, t, g, h).transpose(1, 2, 0, 3, 4).reshape(b, t, num_heads, h)
  lse = lse[:, lse_index(b, t * g)].reshape(kh, b, t, g).transpose(1, 2, 0, 3)
  return out, lse.reshape(b, t, num_heads)


def _align_down(x):
  return x - lax.rem(x, jnp.int32(ALIGN))


def _store_row(problem: PagedProblem, o_smem, lse_smem, out_ref, lse_out_ref, *, row, tile,
               kv_head, first, frame):
  """The program's rows of its query row into out and lse: when `problem.direct`, its T*G rows
  (one tile) in [B*T, K, G, ...] order; else the rows of the tile that are this row's, folded."""
  t_tok, g_size, tg = problem.query_tokens, problem.group_size, problem.rows_per_query
  tiles = private_row_tiles(tg)
  if problem.direct:  # the row's T*G rows start at first - frame (one tile)
    r0 = first - frame
    for t in range(t_tok):
      plgpu.copy_smem_to_gmem(
          o_smem.at[pl.ds(r0 + t * g_size, g_size)], out_ref.at[row * t_tok + t, kv_head]
      )
    for i in range(tg):
      lse_out_ref[row * t_tok + i // g_size, kv_head, i % g_size] = lse_smem[r0 + i]
    plgpu.wait_smem_to_gmem(0)
    return
  # Exact rows [r0, r1) of the tile that are this row's: a ladder of power-of-two copies.
  r0 = jnp.maximum(first - frame, 0)
  r1 = jnp.minimum(first + tg - frame, WG_M)
  count = jnp.maximum(r1 - r0, 0)
  start = r0
  size = WG_M
  while size >= 1:
    @pl.when(lax.bitwise_and(count, jnp.int32(size)) != 0)
    def _(start=start, size=size):
      plgpu.copy_smem_to_gmem(
          o_smem.at[pl.ds(start, size)], out_ref.at[kv_head, pl.ds(frame + start, size)]
      )

    start = start + lax.bitwise_and(count, jnp.int32(size))
    size //= 2
  lse_row = pl.multiple_of((row * tiles + tile) * WG_M, ALIGN)
  plgpu.copy_smem_to_gmem(lse_smem, lse_out_ref.at[kv_head, pl.ds(lse_row, WG_M)])
  plgpu.wait_smem_to_gmem(0)


def _scratch(h: int, dtype, interpret: bool):
  """(shared memory, barriers) of a program."""
  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  smem = (
      plgpu.SMEM((WG_M, h), dtype, transforms=tiled),  # Q
      plgpu.SMEM((2, 2, _BLK, h), dtype, transforms=tiled),  # K, V x 2 slots
      plgpu.SMEM((WG_M, _BLK), dtype, transforms=tiled) if interpret else None,  # P
      plgpu.SMEM((WG_M, h), dtype),  # output rows, untiled for exact-size copies
      plgpu.SMEM((WG_M,), jnp.float32),
  )
  barriers = (
      plgpu.Barrier(num_barriers=1),
      plgpu.Barrier(num_arrivals=len(_RUNGS), num_barriers=2),
      plgpu.Barrier(num_arrivals=len(_RUNGS), num_barriers=2),
  )
  return [smem, barriers]


def paged_attention(
    qf: jax.Array,  # [K, M_pad, H] folded queries, M_pad a multiple of ALIGN
    k_cache: jax.Array,  # [L, K, H], L a multiple of ALIGN
    v_cache: jax.Array,  # [L, K, H]
    private_pages: jax.Array,  # [B, P] int32
    private_lengths: jax.Array,  # [B] int32
    problem: PagedProblem,
    *,
    scale: float,
    kv_offset: jax.Array | int = 0,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Final states: when `problem.direct`, out [B*T, K, G, H] (q dtype) and lse [B*T, K, G] f32;
  else folded, out [K, B*T*G, H] and lse tiles [K, B*tiles*64].

  Folded lse row r of tile `(b, tile)` is at `(b * tiles + tile) * 64 + r` and
  belongs to folded query row `round_down(b*T*G, 8) + tile*64 + r` (`lse_index`).
  `kv_offset` (int32 scalar, a multiple of the page size) is added to every kv
  token index: the pages index one layer's buffer that starts there in k_cache.
  """
  kh, _, h = qf.shape
  dtype = qf.dtype
  b_rows = problem.num_rows
  t_tok = problem.query_tokens
  g_size = problem.group_size
  tg = problem.rows_per_query
  c = problem.page_size
  m = b_rows * tg
  tiles = private_row_tiles(tg)
  blocks_per_page = -(-c // _BLK)
  qk_scale = scale * LOG2E
  win = window_rows(tg)

  def paged_kernel(q_ref, k_ref, v_ref, pages_ref, lengths_ref, offset_ref, out_ref, lse_out_ref,
                   smem, barriers):
    q_smem, kv_smem, p_smem, o_smem, lse_smem = smem
    q_bar, k_bars, v_bars = barriers
    row = lax.axis_index('row')
    tile = lax.axis_index('tile')
    kv_head = lax.axis_index('kv_head')
    first = row * tg  # the row's first folded query row
    frame = _align_down(first) + tile * WG_M  # F0
    length = lengths_ref[row]
    kv_offset = offset_ref[0]

    # Only the window's rows (this row's T*G rows, 8-aligned); the rest of the tile is
    # stale and its rows are never stored.
    plgpu.copy_gmem_to_smem(
        q_ref.at[kv_head, pl.ds(pl.multiple_of(frame, ALIGN), win)], q_smem.at[pl.ds(0, win)],
        q_bar.at[0],
    )
    # Private flash-decoding: step i reads page i // blocks_per_page, block i % blocks_per_page.
    full_pages = lax.div(length, jnp.int32(c))
    rest = lax.rem(length, jnp.int32(c))
    num_steps = full_pages * blocks_per_page + lax.div(rest + (_BLK - 1), jnp.int32(_BLK))

    def block_valid(step):
      """(page, block in the page, valid tokens of the step's block)."""
      page = lax.div(step, jnp.int32(blocks_per_page))
      sub = lax.rem(step, jnp.int32(blocks_per_page))
      valid = jnp.minimum(length - (page * c + sub * _BLK), min(_BLK, c))
      if c % _BLK:
        valid = jnp.minimum(valid, c - sub * _BLK)
      return page, sub, valid

    def issue(step, slot):
      """Loads the rungs of the block that hold valid tokens: rows [0,8) [8,16) [16,32) [32,64).

      Every rung arrives on the slot's barriers once (a copy, or a plain arrival
      when the rung holds no valid token), so the barriers expect len(_RUNGS).
      """
      page, sub, valid = block_valid(step)
      tok = pl.multiple_of(kv_offset + pages_ref[row, page] * c + sub * _BLK, ALIGN)
      for begin, end in _RUNGS:
        def copy(begin=begin, end=end):
          src = pl.ds(pl.multiple_of(tok + begin, ALIGN), end - begin)
          plgpu.copy_gmem_to_smem(
              k_ref.at[src, kv_head], kv_smem.at[0, slot, begin:end], k_bars.at[slot]
          )
          plgpu.copy_gmem_to_smem(
              v_ref.at[src, kv_head], kv_smem.at[1, slot, begin:end], v_bars.at[slot]
          )

        def skip():
          plgpu.barrier_arrive(k_bars.at[slot])
          plgpu.barrier_arrive(v_bars.at[slot])

        pl.when(valid > begin)(copy)
        pl.when(valid <= begin)(skip)

    for i in range(2):
      pl.when(i < num_steps)(lambda i=i: issue(i, i))

    # Per query row of the tile: its last visible private position + 1 (causal).
    rows = plgpu.broadcasted_iota(jnp.int32, (WG_M, _BLK), 0, layout=plgpu.Layout.WGMMA)
    cols = plgpu.broadcasted_iota(jnp.int32, (WG_M, _BLK), 1, layout=plgpu.Layout.WGMMA)
    if t_tok == 1:
      limit = length
    else:
      rel = rows + (frame - first)  # query index t*G + g within the row
      tq = floor_div(rel, g_size)
      limit = jnp.minimum(length - t_tok + 1 + tq, length)

    acc, m_i, l_i = osm.init(WG_M, h)
    plgpu.barrier_wait(q_bar.at[0])

    def private_step(step, carry):
      acc, m_i, l_i = carry
      slot = lax.rem(step, jnp.int32(2))
      page, sub, valid = block_valid(step)
      plgpu.barrier_wait(k_bars.at[slot])
      plgpu.barrier_wait(v_bars.at[slot])

      def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, kv_smem.at[0, slot].transpose((1, 0)))
        # A partial block, while the wgmma runs: rows past `valid` hold unwritten slots or
        # an older block's rows.
        osm.zero_rows(kv_smem.at[1, slot], lambda r: r < valid, lambda first: valid < _BLK)
        return acc_ref[...]

      s = pl.run_scoped(qk, plgpu.ACC((WG_M, _BLK), jnp.float32))
      in_page = cols + sub * _BLK
      visible = in_page + page * c < limit
      if c % _BLK:
        visible = visible & (in_page < c)
      acc, m_i, l_i, p16 = osm.step(
          s, acc, m_i, l_i, scale_log2=qk_scale, dtype=dtype, visible=visible
      )
      carry = (osm.add_pv(acc, p16, kv_smem.at[1, slot], p_smem), m_i, l_i)

      @pl.when(step + 2 < num_steps)
      def _():
        issue(step + 2, slot)

      return carry

    carry = lax.fori_loop(0, num_steps, private_step, (acc, m_i, l_i))

    osm.finish(*carry, o_smem, lse_smem, dtype)
    _store_row(problem, o_smem, lse_smem, out_ref, lse_out_ref, row=row, tile=tile,
               kv_head=kv_head, first=first, frame=frame)

  operands = [qf, k_cache, v_cache, private_pages, private_lengths, offset_operand(kv_offset)]
  return plgpu.kernel(
      paged_kernel,
      out_type=(
          jax.ShapeDtypeStruct((b_rows * t_tok, kh, g_size, h), dtype) if problem.direct
          else jax.ShapeDtypeStruct((kh, m, h), dtype),
          jax.ShapeDtypeStruct((b_rows * t_tok, kh, g_size), jnp.float32) if problem.direct
          else jax.ShapeDtypeStruct((kh, b_rows * tiles * WG_M), jnp.float32),
      ),
      scratch_types=_scratch(h, dtype, interpret),
      grid=(b_rows, tiles, kh),
      grid_names=('row', 'tile', 'kv_head'),
      compiler_params=profiling.compiler_params(),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )(*operands)


def private_states_reference(
    q: jax.Array,  # [K, B, I, H]: folded query index i = t*G + g (rows i >= T*G are padding)
    k_cache: jax.Array,  # [S_total, K, H]
    v_cache: jax.Array,  # [S_total, K, H]
    private_pages: jax.Array,  # [B, P] int32
    private_lengths: jax.Array,  # [B] int32
    *,
    query_tokens: int,
    group_size: int,
    page_size: int,
    scale: float,
    kv_offset=0,
) -> tuple[jax.Array, jax.Array]:
  """Causal attention of each row over its own pages in jnp (float32): out [K, B, I, H], lse
  [K, B, I]. V at tokens past a row's length is never used (it may be garbage)."""
  kh, b, rows, h = q.shape
  tokens = (private_pages[:, :, None] * page_size + jnp.arange(page_size)).reshape(b, -1)
  tokens = jnp.minimum(tokens + kv_offset, k_cache.shape[0] - 1)  # [B, S]
  pos = jnp.arange(tokens.shape[1])
  lengths = private_lengths[:, None]
  tq = jnp.minimum(jnp.arange(rows) // group_size, query_tokens - 1)
  limit = jnp.minimum(lengths - query_tokens + 1 + tq[None, :], lengths)  # [B, I]
  visible = pos[None, None, :] < limit[..., None]  # [B, I, S]
  k = k_cache[tokens].astype(jnp.float32)  # [B, S, K, H]
  v = jnp.where((pos[None, :] < lengths)[..., None, None], v_cache[tokens].astype(jnp.float32), 0.0)
  hi = jax.lax.Precision.HIGHEST
  s = jnp.einsum('kbih,bskh->kbis', q.astype(jnp.float32), k, precision=hi) * scale
  s = jnp.where(visible[None], s, -jnp.inf)
  m = jnp.max(s, axis=-1)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m[..., None])
  l = p.sum(-1)
  o = jnp.einsum('kbis,bskh->kbih', p, v, precision=hi)
  return normalized(o, l, m)


def paged_attention_reference(
    qf, k_cache, v_cache, private_pages, private_lengths, problem: PagedProblem, *,
    scale: float, kv_offset=0, interpret: bool = False,
):
  """`paged_attention` in jnp (float32 math): same arguments, same output layouts."""
  del interpret
  kh, _, h = qf.shape
  b, tg = problem.num_rows, problem.rows_per_query
  out, lse = private_states_reference(
      qf[:, : b * tg].reshape(kh, b, tg, h), k_cache, v_cache, private_pages, private_lengths,
      query_tokens=problem.query_tokens, group_size=problem.group_size,
      page_size=problem.page_size, scale=scale, kv_offset=kv_offset,
  )
  if problem.direct:  # [K, B, T*G, ...] -> [B*T, K, G, ...]
    t, g = problem.query_tokens, problem.group_size
    out = out.reshape(kh, b, t, g, h).transpose(1, 2, 0, 3, 4).reshape(b * t, kh, g, h)
    lse = lse.reshape(kh, b, t, g).transpose(1, 2, 0, 3).reshape(b * t, kh, g)
    return out.astype(qf.dtype), lse
  tiles = private_row_tiles(tg)
  lse_tiles = jnp.full((kh, b * tiles * WG_M), -jnp.inf, jnp.float32)
  lse_tiles = lse_tiles.at[:, lse_index(b, tg)].set(lse.reshape(kh, b * tg))
  return out.reshape(kh, b * tg, h).astype(qf.dtype), lse_tiles
