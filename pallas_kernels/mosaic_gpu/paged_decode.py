"""Paged decode attention on Hopper (Pallas Mosaic GPU): rows with private KV only.

The kernel for layouts with no shared segment (plain paged decode: no sharing,
or the per-sequence baselines). One program per (query row b, row tile, kv
head), one warpgroup: flash-decoding over the row's own pages (T query tokens,
causal inside the private region: query token t sees private positions
`< length - T + t + 1`), streaming 64-token blocks through two shared-memory
slots; each block is read as rungs of 8/8/16/32 rows, only those holding valid
tokens (V slots are zeroed once, so rows never loaded are finite where P = 0).

Many programs each streaming one long row keep the copy engines busy; the
packed kernel (`private_attention`), which walks several rows per program, is
for the short private regions of shared-prefix decoding.

The program's query rows are the aligned frame `[F0, F0 + 64)` of the folded
matrix `[K, B*T*G, H]` with `F0 = round_down(b*T*G, 8) + tile*64`; only the
first `window_rows(T*G)` rows are loaded, and rows outside `[b*T*G, (b+1)*T*G)`
are computed on stale data and never stored (outputs are written with a ladder
of exact-size copies).
"""

import dataclasses

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

import numpy as np

from pallas_kernels.mosaic_gpu.schedule import ALIGN, PRIVATE_BLOCK, WG_M, cdiv, frame_pad, round_up
from pallas_kernels.mosaic_gpu.segment_attention import LN2, LOG2E, floor_div

_BLK = PRIVATE_BLOCK
_RUNGS = ((0, 8), (8, 16), (16, 32), (32, 64))  # row ranges of a private block's copies


@dataclasses.dataclass(frozen=True)
class PagedProblem:
  """Static shape facts of one call."""

  num_rows: int  # B
  query_tokens: int  # T
  group_size: int  # G
  page_size: int  # C
  scale: float

  @property
  def rows_per_query(self) -> int:
    return self.query_tokens * self.group_size


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


def _align_down(x):
  return x - lax.rem(x, jnp.int32(ALIGN))


def paged_attention(
    qf: jax.Array,  # [K, M_pad, H] folded queries, M_pad a multiple of ALIGN
    k_cache: jax.Array,  # [L, K, H], L a multiple of ALIGN
    v_cache: jax.Array,  # [L, K, H]
    private_pages: jax.Array,  # [B, P] int32
    private_lengths: jax.Array,  # [B] int32
    problem: PagedProblem,
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Final states in folded form: out [K, B*T*G, H] (q dtype) and lse tiles [K, B*tiles*64] f32.

  lse row r of tile `(b, tile)` is at `(b * tiles + tile) * 64 + r` and belongs
  to folded query row `round_down(b*T*G, 8) + tile*64 + r`.
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
  qk_scale = problem.scale * LOG2E
  win = window_rows(tg)

  def paged_kernel(q_ref, k_ref, v_ref, pages_ref, lengths_ref, out_ref, lse_out_ref, smem,
                   barriers):
    q_smem, kv_smem, p_smem, o_smem, lse_smem = smem
    q_bar, k_bars, v_bars = barriers
    row = lax.axis_index('row')
    tile = lax.axis_index('tile')
    kv_head = lax.axis_index('kv_head')
    first = row * tg  # the row's first folded query row
    frame = _align_down(first) + tile * WG_M  # F0
    length = lengths_ref[row]

    # Only the window's rows (this row's T*G rows, 8-aligned); the rest of the tile is
    # stale and its rows are never stored.
    plgpu.copy_gmem_to_smem(
        q_ref.at[kv_head, pl.ds(pl.multiple_of(frame, ALIGN), win)], q_smem.at[pl.ds(0, win)],
        q_bar.at[0],
    )
    # V rows past a block's loaded rows meet P = 0; zero them once so they are finite.
    for slot in range(2):
      kv_smem.at[1, slot][...] = plgpu.layout_cast(
          jnp.zeros((_BLK, h), dtype), plgpu.Layout.WGMMA
      )
    plgpu.commit_smem()

    # Private flash-decoding: step i reads page i // blocks_per_page, block i % blocks_per_page.
    full_pages = lax.div(length, jnp.int32(c))
    rest = lax.rem(length, jnp.int32(c))
    num_steps = full_pages * blocks_per_page + lax.div(rest + (_BLK - 1), jnp.int32(_BLK))

    def issue(step, slot):
      """Loads the rungs of the block that hold valid tokens: rows [0,8) [8,16) [16,32) [32,64).

      Every rung arrives on the slot's barriers once (a copy, or a plain arrival
      when the rung holds no valid token), so the barriers expect len(_RUNGS).
      """
      page = lax.div(step, jnp.int32(blocks_per_page))
      sub = lax.rem(step, jnp.int32(blocks_per_page))
      tok = pl.multiple_of(pages_ref[row, page] * c + sub * _BLK, ALIGN)
      valid = jnp.minimum(length - (page * c + sub * _BLK), min(_BLK, c))
      if c % _BLK:
        valid = jnp.minimum(valid, c - sub * _BLK)
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

    m_i = plgpu.layout_cast(jnp.full((WG_M,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.full((WG_M,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc = plgpu.layout_cast(jnp.full((WG_M, h), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    plgpu.barrier_wait(q_bar.at[0])

    def update(carry, s2, v_tile):
      """Online-softmax step on base-2 scores s2 [64, BLK] (-inf where masked)."""
      acc, m_i, l_i = carry
      m_new = jnp.maximum(m_i, s2.max(axis=1))
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      alpha = jnp.exp2(m_i - m_safe)
      p = jnp.exp2(s2 - lax.broadcast_in_dim(m_safe, s2.shape, [0]))
      l_i = l_i * alpha + p.sum(axis=1)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      p16 = p.astype(dtype)
      if p_smem is None:
        def pv(acc_ref):
          plgpu.wgmma(acc_ref, p16, v_tile)

        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      else:  # interpret mode: wgmma operands from shared memory only
        p_smem[...] = p16
        plgpu.commit_smem()

        def pv(acc_ref):
          plgpu.wgmma(acc_ref, p_smem, v_tile)
          return acc_ref[...]

        acc = acc + pl.run_scoped(pv, plgpu.ACC((WG_M, h), jnp.float32))
      return acc, m_new, l_i

    def private_step(step, carry):
      slot = lax.rem(step, jnp.int32(2))
      page = lax.div(step, jnp.int32(blocks_per_page))
      sub = lax.rem(step, jnp.int32(blocks_per_page))
      plgpu.barrier_wait(k_bars.at[slot])

      def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, kv_smem.at[0, slot].transpose((1, 0)))
        return acc_ref[...]

      s = pl.run_scoped(qk, plgpu.ACC((WG_M, _BLK), jnp.float32))
      in_page = cols + sub * _BLK
      visible = in_page + page * c < limit
      if c % _BLK:
        visible = visible & (in_page < c)
      s2 = jnp.where(visible, s * qk_scale, -jnp.inf)
      plgpu.barrier_wait(v_bars.at[slot])
      carry = update(carry, s2, kv_smem.at[1, slot])

      @pl.when(step + 2 < num_steps)
      def _():
        issue(step + 2, slot)

      return carry

    carry = lax.fori_loop(0, num_steps, private_step, (acc, m_i, l_i))

    acc, m_i, l_i = carry
    nonempty = l_i > 0
    l_safe = jnp.where(nonempty, l_i, 1.0)
    o_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(dtype)
    lse_smem[...] = jnp.where(nonempty, m_i * LN2 + jnp.log(l_safe), -jnp.inf)
    plgpu.commit_smem()
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
  operands = [qf, k_cache, v_cache, private_pages, private_lengths]
  return plgpu.kernel(
      paged_kernel,
      out_type=(
          jax.ShapeDtypeStruct((kh, m, h), dtype),
          jax.ShapeDtypeStruct((kh, b_rows * tiles * WG_M), jnp.float32),
      ),
      scratch_types=[smem, barriers],
      grid=(b_rows, tiles, kh),
      grid_names=('row', 'tile', 'kv_head'),
      compiler_params=plgpu.CompilerParams(
          approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane
      ),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )(*operands)
