"""Online-softmax state in registers, shared by the Mosaic GPU tree-attention kernels.

A warpgroup keeps, per query row of its wgmma tile, the running maximum `m`,
the running sum `l` of 2^(score - m) and the unnormalised output
`acc = sum 2^(score - m) * v`, in the layouts wgmma produces: `acc [M, H]` in
`Layout.WGMMA`, `m` and `l` `[M]` in `Layout.WGMMA.reduce(1)`. Scores are in
base 2 (the softmax scale times log2(e) is one multiply); `finish` writes the
natural-log lse of `hydrajax.partial_state`. (The TPU twin is
`pallas_kernels/tpu/online_softmax.py`.)

Masked scores are -inf. A row that has seen no visible key keeps m = -inf and
l = 0; `step` uses m = 0 for it (`may_be_empty`), so it never computes
-inf - -inf, and `finish` turns it into the empty state (0, -inf).

Non-finite K or V at a masked position (padding inside a partial block, an
unwritten private slot, a stale value in a reused chunk) must not reach any
output: the where on the scores drops K, but `p @ V` computes 0 * V, which is
NaN for V = inf or NaN. `zero_rows` clears the V rows no query sees, in shared
memory, before that product; kernels call it only for blocks that hold such
rows (boundary blocks), so the fast path is unchanged.
"""

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.mosaic_gpu.schedule import WG_M

LOG2E = 1.4426950408889634  # log2(e): natural-log scores to base 2
LN2 = 0.6931471805599453  # ln(2): base-2 lse to natural log

ROWS = plgpu.Layout.WGMMA.reduce(1)  # layout of per-row vectors (m, l, lse)


def store_untiled(ref, value) -> None:
  """`ref[...] = value` for an untiled shared-memory ref, bank conflicts allowed.

  JAX 0.11 lowers that assignment so (`optimized=False`). JAX 0.12 defaults to
  `optimized=True`, which refuses a wgmma-layout tile into untiled rows ("Failed to
  synthesize a transfer pattern that avoids bank conflicts"), and asks for
  `plgpu.store(..., optimized=False)`, which 0.11 does not have.
  """
  store = getattr(plgpu, 'store', None)
  if store is None:  # JAX 0.11
    ref[...] = value
  else:
    store(ref, value, optimized=False)


def init(rows: int, h: int):
  """Empty state (acc [rows, h] = 0, m [rows] = -inf, l [rows] = 0)."""
  m = plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), ROWS)
  l = plgpu.layout_cast(jnp.full((rows,), 0.0, jnp.float32), ROWS)
  acc = plgpu.layout_cast(jnp.full((rows, h), 0.0, jnp.float32), plgpu.Layout.WGMMA)
  return acc, m, l


def _rows(x, shape):
  return lax.broadcast_in_dim(x, shape, [0])


def step(s, acc, m, l, *, scale_log2: float, dtype, visible=None, may_be_empty: bool = True):
  """Adds a block of raw scores to the state; the caller then adds `p @ V` to acc.

  Args:
    s: [M, S] float32 raw scores q.k (a wgmma result).
    acc, m, l: the state (see `init`).
    scale_log2: softmax scale * log2(e).
    dtype: dtype of the returned p (the V dtype, for the PV wgmma).
    visible: [M, S] bool, or None when every score of the block is visible.
    may_be_empty: False when every row sees at least one key of the block (the shared
      kernel: all rows of a tile see the same columns), which saves a select per row.

  Returns:
    (acc * alpha, m, l, p in dtype): acc rescaled to the new maximum, the new m and l.
  """
  alpha, m_new, p = _probabilities(s, m, scale_log2, visible, may_be_empty)
  acc = acc * _rows(alpha, acc.shape)
  l = l * alpha
  p16 = p.astype(dtype)
  l = l + p.sum(axis=1)
  return acc, m_new, l, p16


def step_deferred(s, m, l, *, scale_log2: float, visible=None, may_be_empty: bool = True):
  """`step` for a kernel whose acc and previous p are still in a wgmma while this runs.

  Returns:
    (alpha, m, l, p float32): once that wgmma is done, the caller multiplies acc by alpha
    and converts p for its PV wgmma. (Registers that feed a wgmma written while another is
    in flight make ptxas serialize the wgmmas.)
  """
  alpha, m_new, p = _probabilities(s, m, scale_log2, visible, may_be_empty)
  return alpha, m_new, l * alpha + p.sum(axis=1), p


def _probabilities(s, m, scale_log2, visible, may_be_empty):
  """(alpha, new m, p): the block's probabilities against the new running maximum."""
  if visible is not None:
    s = jnp.where(visible, s, -jnp.inf)
  m_new = jnp.maximum(m, s.max(axis=1) * scale_log2)
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if may_be_empty else m_new
  alpha = jnp.exp2(m - m_use)
  p = jnp.exp2(s * scale_log2 - _rows(m_use, s.shape))
  return alpha, m_new, p


def rescale(acc, alpha):
  """acc [M, H] times alpha [M] per row (`step_deferred`'s deferred half)."""
  return acc * _rows(alpha, acc.shape)


def add_pv(acc, p16, v_smem, p_smem=None):
  """acc + p16 @ V, V [S, H] in shared memory.

  On the GPU p comes from registers (accumulated in place). `p_smem` [M, S] is
  for interpret mode, where wgmma takes operands from shared memory only.
  """
  if p_smem is None:
    def run(acc_ref):
      plgpu.wgmma(acc_ref, p16, v_smem)

    return pl.run_state(run)(plgpu.ACC.init(acc))
  p_smem[...] = p16
  plgpu.commit_smem()

  def run(acc_ref):
    plgpu.wgmma(acc_ref, p_smem, v_smem)
    return acc_ref[...]

  return acc + pl.run_scoped(run, plgpu.ACC(acc.shape, jnp.float32))


def merge(acc, m, l, out, lse2):
  """Merges a normalised partial state (out [M, H], lse2 [M] in base 2, -inf: none).

  A row with lse2 = -inf takes nothing from `out`, even when `out` is not finite
  (windows of the shared kernel's buffers hold other rows and unwritten pads).
  """
  m_new = jnp.maximum(m, lse2)
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp2(m - m_use)
  beta = jnp.exp2(lse2 - m_use)
  beta_b = _rows(beta, acc.shape)
  acc = acc * _rows(alpha, acc.shape) + jnp.where(beta_b == 0, 0.0, out.astype(jnp.float32) * beta_b)
  return acc, m_new, l * alpha + beta


def finish(acc, m, l, o_smem, lse_smem, dtype):
  """Normalised out [M, H] and natural-log lse [M] into shared memory; (0, -inf) if empty."""
  seen = l != 0  # NaN (a NaN score or value) stays NaN
  l_safe = jnp.where(seen, l, 1.0)
  store_untiled(o_smem, (acc / _rows(l_safe, acc.shape)).astype(dtype))
  store_untiled(lse_smem, jnp.where(seen, m * LN2 + jnp.log(l_safe), -jnp.inf))
  plgpu.commit_smem()


def row_index(rows: int):
  """[rows] int32 row index in the `ROWS` layout (a wgmma tile's row of each value)."""
  full = plgpu.broadcasted_iota(jnp.int32, (rows, WG_M), 0, layout=plgpu.Layout.WGMMA)
  return full.astype(jnp.float32).max(axis=1).astype(jnp.int32)


def zero_rows(v_smem, keep, piece_needed=None) -> None:
  """Sets the V rows that `keep` drops to zero, in place, in 64-row pieces.

  v_smem: [S, H] shared-memory ref (S a multiple of 64, wgmma tiling).
  keep: function of the row index [64] int32 (`ROWS` layout, rows of v_smem) -> [64] bool.
  piece_needed: function of a piece's first row -> scalar bool, False when the piece
    drops no row (skipped); None: every piece is rewritten.
  The caller's next wgmma sees the writes (`commit_smem`). Warpgroups that share the
  slot may each call this: they write zeros over dropped rows and elsewhere the values
  they read, so their writes agree.
  """
  s, h = v_smem.shape
  index = row_index(WG_M)
  for first in range(0, s, WG_M):
    def rewrite(first=first):
      piece = v_smem.at[pl.ds(first, WG_M)]
      v = plgpu.load(piece, layout=plgpu.Layout.WGMMA)
      kept = _rows(jnp.where(keep(index + first), 1, 0), (WG_M, h))
      piece[...] = jnp.where(kept != 0, v, jnp.zeros_like(v))

    if piece_needed is None:
      rewrite()
    else:
      pl.when(piece_needed(first))(rewrite)
  plgpu.commit_smem()
