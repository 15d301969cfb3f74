"""Mosaic TPU kernel: attention over every shared segment of a tree, in one launch.

The chunk-first phase of tree attention (Hydragen's inter-sequence batching).
The queries are one matrix of B*T*G rows per kv head (row b owns rows
[b*T*G, (b+1)*T*G)), so the rows a segment covers, times the GQA group and the
T query tokens, are one contiguous M range, and each (row tile, kv block) item
of the work list (`work_list.py`) is a [block_rows, H] x [H, block_kv] matmul
on the MXU plus an online-softmax update in VMEM.

Grid (splits, kv-head blocks, items): the work list is dealt by row tile to
`num_splits` lists that run on a parallel axis (both v5p TensorCores stay busy
even with one kv head). Items are sorted by row tile, so the query tile,
its running state and its output block stay in VMEM across the tile's items,
and Pallas only fetches a new kv block when the item's block index changes.
The first item of a tile loads the tile's private partial state (from
`private_attention`), so when the tile's last item is done the state is the
LSE merge over each row's private KV and every segment on its path: the
final attention. All segment groups (any depth) share the launch.

The segment starts and lengths are dynamic (scalar prefetch plus masks); only
the work list's length depends on the static capacities.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu import online_softmax
from pallas_kernels.tpu.online_softmax import LANES, out_struct
from pallas_kernels.tpu.work_list import FIRST, LAST, WorkList
from pallas_kernels.softmax_state import normalized


def _kernel(
    tile_ref,  # SMEM [E] int32 (the WorkList fields, in order)
    kv_block_ref,
    row_lo_ref,
    row_hi_ref,
    kv_lo_ref,
    kv_hi_ref,
    flags_ref,
    block_offset_ref,  # SMEM [1] int32: the layer's first kv block in the buffer (index maps only)
    q_ref,  # [bm, hb * H]
    k_ref,  # [bk, hb * H]
    v_ref,  # [bk, hb * H]
    init_out_ref,  # [bm, hb * H] float32
    init_lse_ref,  # [bm, hb * 128] float32
    out_ref,  # [bm, hb * H]
    lse_ref,  # [bm, hb * 128] float32
    m_ref,  # [hb, bm, 128] float32 scratch
    l_ref,  # [hb, bm, 128] float32 scratch
    acc_ref,  # [bm, hb * H] float32 scratch
    *,
    heads: int,
    head_dim: int,
    scale: float,
):
  del block_offset_ref
  e = pl.program_id(0) * pl.num_programs(2) + pl.program_id(2)  # index into the split-major list
  flags = flags_ref[e]
  block_rows, block_kv = q_ref.shape[0], k_ref.shape[0]
  lanes = lambda h: pl.ds(h * head_dim, head_dim)
  lse_lanes = lambda h: pl.ds(h * LANES, LANES)

  @pl.when((flags & FIRST) != 0)
  def _start():
    for h in range(heads):
      online_softmax.load_state(
          m_ref.at[h], l_ref.at[h], acc_ref.at[:, lanes(h)],
          init_out_ref[:, lanes(h)], init_lse_ref[:, lse_lanes(h)],
      )

  tile, kv_block = tile_ref[e], kv_block_ref[e]
  row_lo, row_hi, kv_lo, kv_hi = row_lo_ref[e], row_hi_ref[e], kv_lo_ref[e], kv_hi_ref[e]
  # Most items of a long, wide segment lie wholly inside it: no masks to compute.
  inside = (
      (tile * block_rows >= row_lo) & ((tile + 1) * block_rows <= row_hi)
      & (kv_block * block_kv >= kv_lo) & ((kv_block + 1) * block_kv <= kv_hi)
  )

  def attend(visible, v_all):
    for h in range(heads):
      online_softmax.update(
          q_ref[:, lanes(h)], k_ref[:, lanes(h)], v_all[:, h * head_dim : (h + 1) * head_dim],
          visible, m_ref.at[h], l_ref.at[h], acc_ref.at[:, lanes(h)], scale=scale,
      )

  @pl.when((kv_lo < kv_hi) & inside)
  def _compute_inside():
    attend(None, v_ref[...])

  @pl.when((kv_lo < kv_hi) & jnp.logical_not(inside))
  def _compute_edge():
    shape = (block_rows, block_kv)
    row = tile * block_rows + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    col = kv_block * block_kv + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    visible = (row >= row_lo) & (row < row_hi) & (col >= kv_lo) & (col < kv_hi)
    token = kv_block * block_kv + jax.lax.broadcasted_iota(
        jnp.int32, (block_kv, heads * head_dim), 0
    )
    # Tokens outside the segment (other segments, or past the buffer's end in the
    # last block) may hold anything; zero them so that 0 * value stays 0.
    attend(visible, jnp.where((token >= kv_lo) & (token < kv_hi), v_ref[...], 0))

  @pl.when((flags & LAST) != 0)
  def _finish():
    for h in range(heads):
      out, lse = online_softmax.finish(m_ref.at[h], l_ref.at[h], acc_ref.at[:, lanes(h)])
      out_ref[:, lanes(h)] = out.astype(out_ref.dtype)
      lse_ref[:, lse_lanes(h)] = lse


@functools.partial(
    jax.jit,
    static_argnames=(
        'scale', 'block_rows', 'block_kv', 'heads_per_block', 'num_splits', 'vmem_limit_bytes',
        'interpret',
    ),
)
def shared_attention(
    q: jax.Array,  # [M, K, H]: M = row tiles * block_rows query-matrix rows
    k_cache: jax.Array,  # [L, K, H]
    v_cache: jax.Array,  # [L, K, H]
    init_out: jax.Array,  # [M, K, H] float32
    init_lse: jax.Array,  # [M, K, 128] float32, lane-replicated
    work: WorkList,
    block_offset: jax.Array | int = 0,  # [] int32: the layer's first kv block in k/v_cache
    *,
    scale: float,
    block_rows: int,
    block_kv: int,
    heads_per_block: int = 1,
    num_splits: int = 1,
    vmem_limit_bytes: int | None = None,
    interpret=False,
) -> tuple[jax.Array, jax.Array]:
  """Merges every work item's segment attention into the initial states.

  Returns (out [M, K, H] in q.dtype, lse [M, K, 128] float32, natural log,
  lane-replicated). `block_kv` must be L or a multiple of the sublane tile
  (8 float32, 16 bfloat16), M a multiple of `block_rows`, itself a multiple
  of the sublane tile; `work` comes from `build_work_list` with the same
  block sizes and `num_splits`, its tokens relative to a layer's buffer that
  starts at token `block_offset * block_kv` of k/v_cache (a flat buffer of
  several layers: the work list is built once, not per layer).
  """
  rows, kv_heads, head_dim = q.shape
  hb = heads_per_block
  num_items = work.tile.shape[0] // num_splits  # per split
  tile_map = lambda s, h, e, tile, *_: (tile[s * num_items + e], h)

  def kv_map(s, h, e, tile, kv_block, *refs):
    return kv_block[s * num_items + e] + refs[-1][0], h
  wide = lambda x: x.reshape(x.shape[0], -1)  # [X, K, Y] -> [X, K * Y], free
  kernel = functools.partial(_kernel, heads=hb, head_dim=head_dim, scale=scale)
  operands = (*jax.tree.leaves(work), q, k_cache, v_cache, init_out, init_lse)
  out, lse = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(work) + 1,
          grid=(num_splits, kv_heads // hb, num_items),
          in_specs=[
              pl.BlockSpec((block_rows, hb * head_dim), tile_map),  # q
              pl.BlockSpec((block_kv, hb * head_dim), kv_map),  # k
              pl.BlockSpec((block_kv, hb * head_dim), kv_map),  # v
              pl.BlockSpec((block_rows, hb * head_dim), tile_map),  # init_out
              pl.BlockSpec((block_rows, hb * LANES), tile_map),  # init_lse
          ],
          out_specs=[
              pl.BlockSpec((block_rows, hb * head_dim), tile_map),
              pl.BlockSpec((block_rows, hb * LANES), tile_map),
          ],
          scratch_shapes=[
              pltpu.VMEM((hb, block_rows, LANES), jnp.float32),  # m
              pltpu.VMEM((hb, block_rows, LANES), jnp.float32),  # l
              pltpu.VMEM((block_rows, hb * head_dim), jnp.float32),  # acc
          ],
      ),
      out_shape=[
          out_struct((rows, kv_heads * head_dim), q.dtype, *operands),
          out_struct((rows, kv_heads * LANES), jnp.float32, *operands),
      ],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel', 'arbitrary'),
          vmem_limit_bytes=vmem_limit_bytes,
      ),
      interpret=interpret,
      name='hydrajax_shared_attention',
  )(
      *work,
      jnp.reshape(jnp.asarray(block_offset, jnp.int32), (1,)),
      wide(q),
      wide(k_cache),
      wide(v_cache),
      wide(init_out),
      wide(init_lse),
  )
  return out.reshape(rows, kv_heads, head_dim), lse.reshape(rows, kv_heads, LANES)


def shared_attention_reference(
    q: jax.Array,  # [M, K, H]
    k_cache: jax.Array,  # [L, K, H]
    v_cache: jax.Array,  # [L, K, H]
    init_out: jax.Array,  # [M, K, H] float32
    init_lse: jax.Array,  # [M, K, 128] float32
    work: WorkList,
    block_offset: jax.Array | int = 0,
    *,
    scale: float,
    block_kv: int | None = None,
    **unused_block_sizes,
) -> tuple[jax.Array, jax.Array]:
  """`shared_attention` in jnp (same arguments and results), dense over [M, L] in float32."""
  del unused_block_sizes
  rows = jnp.arange(q.shape[0])
  # Token indices relative to the layer's buffer (work lists index it from 0).
  tokens = jnp.arange(k_cache.shape[0]) - jnp.asarray(block_offset, jnp.int32) * (block_kv or 0)
  has_keys = work.kv_lo < work.kv_hi
  in_rows = (rows[None, :] >= work.row_lo[:, None]) & (rows[None, :] < work.row_hi[:, None])
  in_tokens = (tokens[None, :] >= work.kv_lo[:, None]) & (tokens[None, :] < work.kv_hi[:, None])
  # Items of one segment repeat its ranges: OR over items gives the [M, L] mask.
  visible = jnp.einsum(
      'em,el->ml', (in_rows & has_keys[:, None]).astype(jnp.float32),
      in_tokens.astype(jnp.float32),
  ) > 0
  s = jnp.einsum(
      'mkh,lkh->mkl', q.astype(jnp.float32), k_cache.astype(jnp.float32),
      precision=jax.lax.Precision.HIGHEST,
  ) * scale
  s = jnp.where(visible[:, None, :], s, -jnp.inf)
  init = init_lse[..., 0]  # [M, K]
  m = jnp.maximum(jnp.max(s, axis=-1), init)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m[..., None])
  w0 = jnp.exp(init - m)  # weight of the initial state (0 if empty)
  l = jnp.sum(p, axis=-1) + w0
  v = jnp.where(jnp.any(visible, axis=0)[:, None, None], v_cache.astype(jnp.float32), 0.0)
  o = jnp.einsum('mkl,lkh->mkh', p, v, precision=jax.lax.Precision.HIGHEST)
  o = o + w0[..., None] * jnp.where(jnp.isfinite(init)[..., None], init_out, 0.0)
  out, lse = normalized(o, l, m)
  return out.astype(q.dtype), jnp.broadcast_to(lse[..., None], lse.shape + (LANES,))
