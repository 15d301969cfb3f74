"""Tree attention in jnp (the XLA path): Hydragen's algorithm over a `TreeLayout`.

For every shared segment, the covered rows (times the GQA group G, times the
T query tokens) form the M dimension of one matrix-matrix product against the
segment's keys; segments with the same static capacities are batched in one
einsum. Private KV is plain masked decode attention per row. All partial
states are then LSE-merged into their rows in one scatter.

This is also the reference the Pallas kernels are tested against.
"""

import functools

import jax
import jax.numpy as jnp

from hydrajax.layout import SegmentGroup, TreeLayout
from hydrajax.partial_state import PartialState
from hydrajax.validation import check_tree_attention_inputs


def _dot_precision(dtype):
  return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _attend(q, k, v, visible, scale):
  """Masked softmax attention with an (out, lse) result.

  q [Z, M, K, G, H]; k, v [Z, S, K, H]; visible [Z, M or 1, S] bool.
  Returns out [Z, M, K, G, H] float32, lse [Z, M, K, G] float32.
  """
  s = jnp.einsum(
      'zmkgh,zskh->zmkgs', q, k,
      preferred_element_type=jnp.float32, precision=_dot_precision(q.dtype),
  ) * scale
  s = jnp.where(visible[:, :, None, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m[..., None])
  l = jnp.sum(p, axis=-1)
  o = jnp.einsum(
      'zmkgs,zskh->zmkgh', p.astype(v.dtype), v,
      preferred_element_type=jnp.float32, precision=_dot_precision(v.dtype),
  )
  out = o / jnp.where(l > 0, l, 1.0)[..., None]
  lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
  return out, lse


def _group_partials(q, k_cache, v_cache, group: SegmentGroup, scale, kv_block):
  """Partial states of one segment group: rows [J, R], out [J, R, T, N, H], lse [J, R, T, N]."""
  b, t, n, h = q.shape
  kh = k_cache.shape[1]
  r = group.row_capacity
  rows = group.row_begin[:, None] + jnp.arange(r)[None, :]  # [J, R]
  rows = jnp.where(jnp.arange(r)[None, :] < group.row_count[:, None], rows, b)  # b = dump row
  qj = q[jnp.minimum(rows, b - 1)]  # [J, R, T, N, H]
  qj = qj.reshape(group.num_segments, r * t, kh, n // kh, h)

  block = min(kv_block, group.kv_capacity)
  num_blocks = -(-group.kv_capacity // block)

  def one_block(i):
    pos = i * block + jnp.arange(block)  # [S_b]
    tokens = jnp.minimum(group.kv_start[:, None] + pos[None, :], k_cache.shape[0] - 1)
    visible = (pos[None, :] < group.kv_length[:, None])[:, None, :]  # [J, 1, S_b]
    return _attend(qj, k_cache[tokens], v_cache[tokens], visible, scale)

  if num_blocks == 1:
    out, lse = one_block(0)
  else:  # bounded memory for long segments: a few partial states per row, merged below
    outs, lses = jax.lax.map(one_block, jnp.arange(num_blocks))
    out, lse = _merge_axis0(outs, lses)
  out = out.reshape(group.num_segments, r, t, n, h)
  lse = lse.reshape(group.num_segments, r, t, n)
  return rows, out, lse


def _merge_axis0(outs, lses):
  m = jnp.max(lses, axis=0)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.exp(lses - m)
  den = jnp.sum(w, axis=0)
  out = jnp.sum(w[..., None] * outs, axis=0) / jnp.where(den > 0, den, 1.0)[..., None]
  lse = jnp.where(den > 0, m + jnp.log(jnp.where(den > 0, den, 1.0)), -jnp.inf)
  return out, lse


def _private_partial(q, k_cache, v_cache, layout: TreeLayout, scale):
  """Causal attention of each row over its own pages: out [B, T, N, H], lse [B, T, N]."""
  b, t, n, h = q.shape
  kh = k_cache.shape[1]
  c = layout.page_size
  tokens = (layout.private_pages[:, :, None] * c + jnp.arange(c)).reshape(b, -1)  # [B, S]
  tokens = jnp.minimum(tokens, k_cache.shape[0] - 1)
  lengths = layout.private_lengths
  pos = jnp.arange(tokens.shape[1])
  limit = jnp.minimum(lengths[:, None] - t + jnp.arange(t)[None, :] + 1, lengths[:, None])
  visible = pos[None, None, :] < limit[..., None]  # [B, T, S]
  out, lse = _attend(
      q.reshape(b, t, kh, n // kh, h), k_cache[tokens], v_cache[tokens], visible, scale
  )
  return out.reshape(b, t, n, h), lse.reshape(b, t, n)


def merge_into_rows(num_rows, rows, outs, lses) -> PartialState:
  """LSE-merges partial states into their rows (rows == num_rows are dropped).

  rows [M] int32; outs [M, T, N, H] float32; lses [M, T, N]. Rows that receive
  nothing get (0, -inf).
  """
  size = num_rows + 1
  m = jnp.full((size,) + lses.shape[1:], -jnp.inf, jnp.float32).at[rows].max(lses)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.exp(lses - m[rows])
  den = jnp.zeros_like(m).at[rows].add(w)
  acc = jnp.zeros((size,) + outs.shape[1:], jnp.float32).at[rows].add(w[..., None] * outs)
  out = acc / jnp.where(den > 0, den, 1.0)[..., None]
  lse = jnp.where(den > 0, m + jnp.log(jnp.where(den > 0, den, 1.0)), -jnp.inf)
  return PartialState(out[:num_rows], lse[:num_rows])


@functools.partial(jax.jit, static_argnames=('scale', 'kv_block'))
def tree_attention_xla(
    q: jax.Array,  # [B, T, N, H]
    k_cache: jax.Array,  # [L, K, H]
    v_cache: jax.Array,  # [L, K, H]
    layout: TreeLayout,
    *,
    scale: float | None = None,
    kv_block: int = 4096,
) -> PartialState:
  """Exact attention of every row over its tree path and private KV.

  Returns (out [B, T, N, H] in q.dtype, lse [B, T, N] float32, natural log).
  """
  check_tree_attention_inputs(q, k_cache, v_cache, layout)
  b, t, n, h = q.shape
  scale = h**-0.5 if scale is None else scale
  rows, outs, lses = [jnp.arange(b)], [], []
  out, lse = _private_partial(q, k_cache, v_cache, layout, scale)
  outs.append(out)
  lses.append(lse)
  for group in layout.groups:
    g_rows, out, lse = _group_partials(q, k_cache, v_cache, group, scale, kv_block)
    rows.append(g_rows.reshape(-1))
    outs.append(out.reshape((-1,) + out.shape[2:]))
    lses.append(lse.reshape((-1,) + lse.shape[2:]))
  merged = merge_into_rows(b, jnp.concatenate(rows), jnp.concatenate(outs), jnp.concatenate(lses))
  return PartialState(merged.out.astype(q.dtype), merged.lse)
