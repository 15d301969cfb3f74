"""Mosaic TPU kernel: the forward pass of a group of shared segments' attention (training).

The shared-segment part of `hydrajax.training.tree_attention_differentiable`'s
forward with `impl=MOSAIC_TPU`: for each segment z of a group, the queries of
every row it covers, times their T tokens and the GQA group, are one matrix of
M rows per kv head, attended against the segment's keys in one flash-attention
pass. Its result is the segment's partial state (out, lse), which XLA merges
into the rows with their other parts; `shared_segment_bwd` is its backward.

The segments are the outermost grid axis (one launch for the group) and the
kv blocks the innermost, the reduction axis: the running state
(`online_softmax`) stays in VMEM while K/V stream through. Tokens at or past
`kv_lengths[z]` are masked and their values zeroed (they may hold anything);
blocks wholly past it are skipped. Tested in TPU interpret mode only (no TPU
here). The default blocks are chosen on paper (`ROOFLINE.md`, "Training"): a
row tile re-reads its segment's K/V, so a tile of bm rows does 4 bm H FLOPs a
token for 4 H bytes, bm FLOP/byte; 512 rows clear the v5e and v5p ridges
(about 240 and 166 FLOP/byte), where 128 would leave the kernel memory bound.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu import online_softmax as osm


def _kernel(len_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, m_ref, l_ref, acc_ref, *, scale):
  # q_ref [bm, H]; k_ref, v_ref [bs, H]; out_ref [bm, H] float32; lse_ref [bm, 128] float32.
  kv_block = pl.program_id(3)
  block_s = k_ref.shape[0]
  length = len_ref[pl.program_id(0)]
  start = kv_block * block_s

  @pl.when(kv_block == 0)
  def _init():
    osm.reset(m_ref, l_ref, acc_ref)

  @pl.when(start < length)
  def _attend():
    token = start + jax.lax.broadcasted_iota(jnp.int32, v_ref.shape, 0)
    v = jnp.where(token < length, v_ref[...], jnp.zeros((), v_ref.dtype))
    col = start + jax.lax.broadcasted_iota(jnp.int32, (q_ref.shape[0], block_s), 1)
    osm.update(q_ref[...], k_ref[...], v, col < length, m_ref, l_ref, acc_ref, scale=scale)

  @pl.when(kv_block == pl.num_programs(3) - 1)
  def _finish():
    out_ref[...], lse_ref[...] = osm.finish(m_ref, l_ref, acc_ref)


def check_segments(q, k_cache, v_cache, kv_lengths):
  """ValueError naming the argument unless q [Z, M, K, H], K/V [Z, S, K, H], kv_lengths [Z]."""
  if q.ndim != 4:
    raise ValueError(f'q must be [Z, M, K, H] (segments, query rows, kv heads, head dim), got '
                     f'{q.shape}')
  z, _, kh, h = q.shape
  if k_cache.ndim != 4 or k_cache.shape[0] != z or k_cache.shape[2:] != (kh, h):
    raise ValueError(f'k_cache must be [Z={z}, S, K={kh}, H={h}], got {k_cache.shape}')
  if v_cache.shape != k_cache.shape:
    raise ValueError(f'v_cache must be k_cache\'s shape {k_cache.shape}, got {v_cache.shape}')
  if kv_lengths.shape != (z,):
    raise ValueError(f'kv_lengths must be [Z] = ({z},), got {kv_lengths.shape}')


@functools.partial(jax.jit, static_argnames=('scale', 'block_rows', 'block_kv', 'interpret'))
def shared_segments_fwd(
    q: jax.Array,  # [Z, M, K, H]: each segment's rows x T x G query matrix rows per kv head
    k_cache: jax.Array,  # [Z, S, K, H]: each segment's keys
    v_cache: jax.Array,  # [Z, S, K, H]
    kv_lengths: jax.Array,  # [Z] int32: tokens of each segment (<= S)
    *,
    scale: float,
    block_rows: int = 512,
    block_kv: int = 512,
    interpret=False,
) -> tuple[jax.Array, jax.Array]:
  """Returns each segment's partial state: (out [Z, M, K, H], lse [Z, M, K]), float32; a
  segment of length 0 gives (0, -inf). Blocks larger than the problem shrink to it (rounded up
  to 8 rows)."""
  check_segments(q, k_cache, v_cache, kv_lengths)
  z, m, kh, h = q.shape
  s = k_cache.shape[1]
  block_rows, block_kv = min(block_rows, -(-m // 8) * 8), min(block_kv, -(-s // 8) * 8)
  mp, sp = -(-m // block_rows) * block_rows, -(-s // block_kv) * block_kv
  heads_first = lambda x, n: jnp.pad(jnp.swapaxes(x, 1, 2),
                                     ((0, 0), (0, 0), (0, n - x.shape[1]), (0, 0)))
  rows_spec = lambda width: pl.BlockSpec((None, None, block_rows, width),
                                         lambda z, k, i, j, *_: (z, k, i, 0))
  kv_spec = pl.BlockSpec((None, None, block_kv, h), lambda z, k, i, j, *_: (z, k, j, 0))
  out, lse = pl.pallas_call(
      functools.partial(_kernel, scale=scale),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(z, kh, mp // block_rows, sp // block_kv),
          in_specs=[rows_spec(h), kv_spec, kv_spec],
          out_specs=[rows_spec(h), rows_spec(osm.LANES)],
          scratch_shapes=[pltpu.VMEM((block_rows, osm.LANES), jnp.float32)] * 2
          + [pltpu.VMEM((block_rows, h), jnp.float32)],
      ),
      out_shape=[jax.ShapeDtypeStruct((z, kh, mp, h), jnp.float32),
                 jax.ShapeDtypeStruct((z, kh, mp, osm.LANES), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel', 'parallel', 'arbitrary')),
      interpret=interpret,
      name='hydrajax_shared_segments_fwd',
  )(kv_lengths.astype(jnp.int32), heads_first(q, mp), heads_first(k_cache, sp),
    heads_first(v_cache, sp))
  return jnp.swapaxes(out[:, :, :m], 1, 2), jnp.swapaxes(lse[:, :, :m, 0], 1, 2)


def shared_segments_fwd_reference(q, k_cache, v_cache, kv_lengths, *, scale,
                                  block_rows: int = 512, block_kv: int = 512, interpret=False):
  """The same partial states in jnp (block sizes and interpret ignored)."""
  del block_rows, block_kv, interpret
  check_segments(q, k_cache, v_cache, kv_lengths)
  visible = jnp.arange(k_cache.shape[1])[None, :] < kv_lengths[:, None]  # [Z, S]
  v = jnp.where(visible[:, :, None, None], v_cache, jnp.zeros((), v_cache.dtype))
  hi = jax.lax.Precision.HIGHEST
  s = jnp.einsum('zmkh,zskh->zkms', q, k_cache, preferred_element_type=jnp.float32,
                 precision=hi) * scale
  s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
  lse = jax.nn.logsumexp(s, axis=-1)  # [Z, K, M]; -inf for an empty segment
  p = jnp.where(visible[:, None, None, :], jnp.exp(s - jnp.where(jnp.isfinite(lse), lse,
                                                                   0.0)[..., None]), 0.0)
  out = jnp.einsum('zkms,zskh->zmkh', p, v.astype(jnp.float32), precision=hi)
  return out, jnp.swapaxes(lse, 1, 2)
