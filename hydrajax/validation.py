"""Input checks shared across the library; each raises ValueError naming the argument.

The tree-attention checks run at trace time on shapes and dtypes, so that bad input never
reaches a kernel; `token_ids` is every API's check of token ids (builders, generate, the
engine, sampling's stop tokens, the chunk cache).
"""

import numbers

import jax.numpy as jnp
import numpy as np

from hydrajax.layout import TreeLayout

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_tree_attention_inputs(q, k_cache, v_cache, layout) -> None:
  if not isinstance(layout, TreeLayout):
    raise ValueError(
        f'layout must be a TreeLayout (SharingPlan.to_device()), got {type(layout).__name__}'
    )
  check_query_and_caches(q, k_cache, v_cache)
  b, length = q.shape[0], k_cache.shape[0]
  if b != layout.num_rows:
    raise ValueError(f'q has B={b} rows but the layout has {layout.num_rows}')
  pages = layout.private_pages.shape[1]
  if layout.private_lengths.shape != (b,) or layout.private_pages.shape[0] != b:
    raise ValueError(f'layout private arrays must have B={b} rows')
  if pages * layout.page_size > 0 and length < layout.page_size:
    raise ValueError(f'k_cache holds {length} tokens, less than one page of {layout.page_size}')


def check_query_and_caches(q, k_cache, v_cache) -> None:
  """q [B, T, N, H] and one layer's caches [L, K, H] (arrays or ShapeDtypeStructs): ranks,
  one head dim, N a multiple of K, float dtypes (the caches' shared)."""
  if getattr(q, 'ndim', None) != 4:
    raise ValueError(f'q must be [B, T, N, H], got shape {getattr(q, "shape", None)}')
  b, t, n, h = q.shape
  for name, x in (('k_cache', k_cache), ('v_cache', v_cache)):
    if getattr(x, 'ndim', None) != 3:
      raise ValueError(f'{name} must be [L, K, H], got shape {getattr(x, "shape", None)}')
  if k_cache.shape != v_cache.shape:
    raise ValueError(f'k_cache {k_cache.shape} and v_cache {v_cache.shape} must have one shape [L, K, H]')
  _, kh, hk = k_cache.shape
  if hk != h:
    raise ValueError(f'head dim H differs: q has {h}, k_cache has {hk}')
  if kh < 1 or n % kh:
    raise ValueError(f'query heads N={n} must be a multiple of kv heads K={kh}')
  if min(b, t, h) < 1:
    raise ValueError(f'q must have B, T, H >= 1, got shape {q.shape}')
  for name, x in (('q', q), ('k_cache', k_cache), ('v_cache', v_cache)):
    if x.dtype not in FLOAT_DTYPES:
      raise ValueError(f'{name} must be float32, bfloat16 or float16, got {x.dtype}')
  if k_cache.dtype != v_cache.dtype:
    raise ValueError(f'k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must share a dtype')


def token_ids(value, name: str, *, vocab_size: int | None = None,
              allow_empty: bool = True) -> tuple[int, ...]:
  """`value`, a 1-D sequence or integer array of token ids, as a tuple of Python ints.

  Ids must be >= 0 (and < `vocab_size` where given). ValueError naming `name` otherwise: a
  float, bool or string would be cut or read as an id that is not the token meant.
  """
  if isinstance(value, (str, bytes)) or not hasattr(value, '__iter__'):
    raise ValueError(f'{name} must be a 1-D sequence of integer token ids, got {value!r}')
  if hasattr(value, '__array__') and not isinstance(value, (list, tuple)):
    array = np.asarray(value)  # checked whole: a 16K-token prompt is no Python loop
    if array.ndim != 1:
      raise ValueError(f'{name} must be 1-D, got shape {array.shape}')
    if not np.issubdtype(array.dtype, np.integer):
      raise ValueError(f'{name} must hold integer token ids, got dtype {array.dtype}')
    ids = tuple(array.tolist())
  else:
    ids = tuple(value)
    bad = [t for t in ids if not isinstance(t, numbers.Integral) or isinstance(t, (bool, np.bool_))]
    if bad:
      raise ValueError(f'{name} must hold integer token ids (not {type(bad[0]).__name__}), '
                       f'got {bad[0]!r}')
    ids = tuple(int(t) for t in ids)
  if not ids:
    if allow_empty:
      return ids
    raise ValueError(f'{name} must hold at least one token id')
  low, high = min(ids), max(ids)  # Python ints: no overflow before the range check
  if low < 0:
    raise ValueError(f'{name} must hold token ids >= 0, got {low}')
  if vocab_size is not None and high >= vocab_size:
    raise ValueError(f'{name} token ids must be in [0, {vocab_size}), got {high}')
  return ids
