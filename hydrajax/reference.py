"""The naive oracle: softmax attention over each sequence's own concatenated KV.

Ground truth for every other implementation. Row b attends its first
`kv_lengths[b]` tokens; its T query tokens are the last T of them, so query
token t sees tokens `< kv_lengths[b] - T + t + 1` (causal at the end).
"""

import jax
import jax.numpy as jnp

from hydrajax.layout import SharingPlan
from hydrajax.partial_state import PartialState, normalized


def naive_attention(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, S, K, H]
    v: jax.Array,  # [B, S, K, H]
    kv_lengths: jax.Array,  # [B] int32
    *,
    scale: float | None = None,
) -> PartialState:
  """Returns (out [B, T, N, H] in q.dtype, lse [B, T, N] float32); computes in float32."""
  if getattr(q, 'ndim', None) != 4:
    raise ValueError(f'q must be [B, T, N, H], got shape {getattr(q, "shape", None)}')
  for name, x in (('k', k), ('v', v)):
    if getattr(x, 'ndim', None) != 4 or x.shape[0] != q.shape[0] or x.shape[3] != q.shape[3]:
      raise ValueError(f'{name} must be [B={q.shape[0]}, S, K, H={q.shape[3]}], got shape '
                       f'{getattr(x, "shape", None)}')
  if k.shape != v.shape or k.shape[2] < 1 or q.shape[2] % k.shape[2]:
    raise ValueError(f'k {k.shape} and v {v.shape} must share one shape whose K divides '
                     f'N={q.shape[2]}')
  if getattr(kv_lengths, 'shape', None) != (q.shape[0],):
    raise ValueError(f'kv_lengths must be [B={q.shape[0]}], got shape '
                     f'{getattr(kv_lengths, "shape", None)}')
  out_dtype = q.dtype
  if k.shape[1] == 0:  # no keys at all: the empty state
    return PartialState(jnp.zeros(q.shape, out_dtype), jnp.full(q.shape[:-1], -jnp.inf))
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  b, t, n, h = q.shape
  kh = k.shape[2]
  scale = h**-0.5 if scale is None else scale
  qg = q.reshape(b, t, kh, n // kh, h)
  s = jnp.einsum(
      'btkgh,bskh->btkgs', qg, k, precision=jax.lax.Precision.HIGHEST
  ) * scale
  pos = jnp.arange(k.shape[1])
  limit = kv_lengths[:, None] - t + jnp.arange(t)[None, :] + 1  # [B, T]
  visible = pos[None, None, :] < jnp.minimum(limit, kv_lengths[:, None])[..., None]  # [B, T, S]
  s = jnp.where(visible[:, :, None, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m)
  l = jnp.sum(p, axis=-1)
  # Padding past a row's length may hold anything (NaN): zero it, so that p = 0 keeps it out.
  v = jnp.where((pos[None, :] < kv_lengths[:, None])[:, :, None, None], v, 0.0)
  o = jnp.einsum('btkgs,bskh->btkgh', p, v, precision=jax.lax.Precision.HIGHEST)
  o, lse = normalized(o, l, m[..., 0])
  return PartialState(o.reshape(b, t, n, h).astype(out_dtype), lse.reshape(b, t, n))


def naive_tree_attention(
    q: jax.Array,  # [B, T, N, H]
    k_cache: jax.Array,  # [L, K, H]
    v_cache: jax.Array,  # [L, K, H]
    plan: SharingPlan,
    *,
    scale: float | None = None,
) -> PartialState:
  """The oracle over a sharing plan: materialises every row's own KV copy."""
  indices, lengths = plan.row_token_indices()
  return naive_attention(q, k_cache[indices], v_cache[indices], jnp.asarray(lengths), scale=scale)
