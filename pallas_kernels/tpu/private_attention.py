"""Mosaic TPU kernel: attention of each row over its own paged (private) KV.

The sequence-first phase of tree attention (flash-decoding per row): row b's
T query tokens (times its GQA group G, folded into T*G matrix rows) attend the
first `lengths[b]` tokens of its pages, causally at the end: query token t sees
private tokens `< lengths[b] - T + t + 1`.

Grid (kv-head blocks, row blocks, page steps). The page table and lengths are
scalar prefetched; every (row, page) of a step is its own input with a
BlockSpec whose index map reads the page table, so Pallas pipelines the page
DMAs (several rows and pages per grid step, no manual DMA code). Pages past a
row's length repeat its last page's block index (no new DMA) and skip their
compute with `pl.when`. Pages are read whole: a row with 1 valid token in a
page of C still reads C tokens.

The result is a partial state (out, lse) per row in float32, which the shared
kernel (`shared_attention`) continues from.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu import online_softmax
from pallas_kernels.tpu.online_softmax import LANES, out_struct
from pallas_kernels.softmax_state import normalized


def _kernel(
    lengths_ref,  # SMEM [Bq] int32
    pages_ref,  # SMEM [Bq * P] int32
    page_offset_ref,  # SMEM [1] int32 (index maps only)
    q_ref,  # [rows, TG, hb * H]
    *refs,  # rows * pages_per_block key pages [C, hb * H] (row-major), as many value pages,
    # then out, lse, and the scratch m, l, acc
    num_queries: int,
    group: int,
    heads: int,
    head_dim: int,
    pages_per_block: int,
    scale: float,
):
  del page_offset_ref
  rows, tg, _ = q_ref.shape
  n = rows * pages_per_block
  k_refs, v_refs = refs[:n], refs[n : 2 * n]
  out_ref, lse_ref, m_ref, l_ref, acc_ref = refs[2 * n :]
  block, step = pl.program_id(1), pl.program_id(2)
  page_size = k_refs[0].shape[0]
  lanes = lambda h: pl.ds(h * head_dim, head_dim)

  @pl.when(step == 0)
  def _start():
    online_softmax.reset(m_ref, l_ref, acc_ref)

  # Query row i is token t = i // G of its row.
  t = jax.lax.broadcasted_iota(jnp.int32, (tg, page_size), 0) // group
  col = jax.lax.broadcasted_iota(jnp.int32, (tg, page_size), 1)
  v_row = jax.lax.broadcasted_iota(jnp.int32, (page_size, heads * head_dim), 0)

  for r in range(rows):
    length = lengths_ref[block * rows + r]
    limit = jnp.minimum(length - num_queries + t + 1, length)  # [TG, C]: token t sees < limit
    for p in range(pages_per_block):
      first = (step * pages_per_block + p) * page_size
      k_ref, v_ref = k_refs[r * pages_per_block + p], v_refs[r * pages_per_block + p]

      @pl.when(first < length)
      def _page(r=r, first=first, length=length, limit=limit, k_ref=k_ref, v_ref=v_ref):
        visible = first + col < limit
        v_all = jnp.where(first + v_row < length, v_ref[...], 0)  # tokens past length may be NaN
        for h in range(heads):
          online_softmax.update(
              q_ref[r, :, lanes(h)], k_ref[:, lanes(h)],
              v_all[:, h * head_dim : (h + 1) * head_dim], visible, m_ref.at[h, r],
              l_ref.at[h, r], acc_ref.at[r, :, lanes(h)], scale=scale,
          )

  @pl.when(step == pl.num_programs(2) - 1)
  def _finish():
    for r in range(rows):
      for h in range(heads):
        out, lse = online_softmax.finish(m_ref.at[h, r], l_ref.at[h, r], acc_ref.at[r, :, lanes(h)])
        out_ref[r, :, lanes(h)] = out
        lse_ref[r, :, pl.ds(h * LANES, LANES)] = lse


@functools.partial(
    jax.jit,
    static_argnames=(
        'num_queries', 'scale', 'pages_per_block', 'rows_per_block', 'heads_per_block',
        'vmem_limit_bytes', 'interpret',
    ),
)
def private_attention(
    q: jax.Array,  # [Bq, TG, K, H]; row i of a row's TG block is token i // G, head i % G
    k_pages: jax.Array,  # [L // C, C, K, H]
    v_pages: jax.Array,  # [L // C, C, K, H]
    lengths: jax.Array,  # [Bq] int32
    pages: jax.Array,  # [Bq, P] int32
    page_offset: jax.Array | int = 0,  # [] int32, added to every page id (a layer's first page)
    *,
    num_queries: int,
    scale: float,
    pages_per_block: int = 4,
    rows_per_block: int = 1,
    heads_per_block: int = 1,
    vmem_limit_bytes: int | None = None,
    interpret=False,
) -> tuple[jax.Array, jax.Array]:
  """Causal attention of each row over its pages.

  `rows_per_block` (a divisor of Bq) rows and `pages_per_block` pages per row
  share a grid step, so that short decode rows do not pay one step each.

  Returns (out [Bq, TG, K, H] float32, lse [Bq, TG, K, 128] float32, natural
  log, replicated over the last axis); a row of length 0 gets (0, -inf).
  """
  bq, tg, kv_heads, head_dim = q.shape
  _, page_size, _, _ = k_pages.shape
  rows, hb = rows_per_block, heads_per_block
  if bq % rows:
    raise ValueError(f'rows_per_block={rows} must divide the {bq} rows of q')
  width = pages.shape[1]
  ppb = min(pages_per_block, width)
  steps = -(-width // ppb)

  def page_spec(r, p):
    def index_map(h, block, i, lengths_ref, pages_ref, offset_ref):
      row = block * rows + r
      # Past the row's last page, repeat it: same block index, so no new DMA.
      last = jnp.maximum((lengths_ref[row] + page_size - 1) // page_size - 1, 0)
      slot = jnp.minimum(jnp.minimum(i * ppb + p, last), width - 1)
      return pages_ref[row * width + slot] + offset_ref[0], 0, h

    return pl.BlockSpec((None, page_size, hb * head_dim), index_map)

  row_map = lambda h, block, i, *_: (block, 0, h)
  page_specs = [page_spec(r, p) for r in range(rows) for p in range(ppb)]
  kernel = functools.partial(
      _kernel, num_queries=num_queries, group=tg // num_queries, heads=hb, head_dim=head_dim,
      pages_per_block=ppb, scale=scale,
  )
  k_flat = k_pages.reshape(k_pages.shape[:2] + (-1,))  # [L // C, C, K * H], free
  v_flat = v_pages.reshape(v_pages.shape[:2] + (-1,))
  operands = (lengths, pages, q, k_pages, v_pages)
  out, lse = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3,
          grid=(kv_heads // hb, bq // rows, steps),
          in_specs=[pl.BlockSpec((rows, tg, hb * head_dim), row_map)] + page_specs + page_specs,
          out_specs=[
              pl.BlockSpec((rows, tg, hb * head_dim), row_map),
              pl.BlockSpec((rows, tg, hb * LANES), row_map),
          ],
          scratch_shapes=[
              pltpu.VMEM((hb, rows, tg, LANES), jnp.float32),  # m
              pltpu.VMEM((hb, rows, tg, LANES), jnp.float32),  # l
              pltpu.VMEM((rows, tg, hb * head_dim), jnp.float32),  # acc
          ],
      ),
      out_shape=[
          out_struct((bq, tg, kv_heads * head_dim), jnp.float32, *operands),
          out_struct((bq, tg, kv_heads * LANES), jnp.float32, *operands),
      ],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel', 'arbitrary'),
          vmem_limit_bytes=vmem_limit_bytes,
      ),
      interpret=interpret,
      name='hydrajax_private_attention',
  )(
      lengths.astype(jnp.int32),
      pages.reshape(-1).astype(jnp.int32),
      jnp.reshape(jnp.asarray(page_offset, jnp.int32), (1,)),
      q.reshape(bq, tg, -1),
      *([k_flat] * len(page_specs)),
      *([v_flat] * len(page_specs)),
  )
  return (
      out.reshape(bq, tg, kv_heads, head_dim),
      lse.reshape(bq, tg, kv_heads, LANES),
  )


def private_attention_reference(
    q: jax.Array,  # [Bq, TG, K, H]
    k_pages: jax.Array,  # [L // C, C, K, H]
    v_pages: jax.Array,  # [L // C, C, K, H]
    lengths: jax.Array,  # [Bq] int32
    pages: jax.Array,  # [Bq, P] int32
    page_offset: jax.Array | int = 0,
    *,
    num_queries: int,
    scale: float,
    **unused_block_sizes,
) -> tuple[jax.Array, jax.Array]:
  """`private_attention` in jnp (same arguments and results), computed in float32."""
  del unused_block_sizes
  pages = pages + page_offset
  bq, tg, kv_heads, head_dim = q.shape
  k = k_pages[pages].reshape(bq, -1, kv_heads, head_dim).astype(jnp.float32)  # [Bq, S, K, H]
  v = v_pages[pages].reshape(bq, -1, kv_heads, head_dim).astype(jnp.float32)
  s = jnp.einsum(
      'bikh,bskh->bkis', q.astype(jnp.float32), k, precision=jax.lax.Precision.HIGHEST
  ) * scale
  t = jnp.arange(tg) // (tg // num_queries)
  limit = jnp.minimum(lengths[:, None] - num_queries + t[None, :] + 1, lengths[:, None])  # [Bq, TG]
  visible = jnp.arange(k.shape[1])[None, None, :] < limit[:, :, None]  # [Bq, TG, S]
  s = jnp.where(visible[:, None], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m)
  l = jnp.sum(p, axis=-1)
  v = jnp.where((jnp.arange(k.shape[1])[None, :] < lengths[:, None])[..., None, None], v, 0.0)
  o = jnp.einsum('bkis,bskh->bikh', p, v, precision=jax.lax.Precision.HIGHEST)
  l = jnp.moveaxis(l, 1, 2)  # [Bq, TG, K]
  out, lse = normalized(o, l, jnp.moveaxis(m[..., 0], 1, 2))  # [Bq, TG, K(, H)]
  return out, jnp.broadcast_to(lse[..., None], lse.shape + (LANES,))
