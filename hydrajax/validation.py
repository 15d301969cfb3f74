"""Input checks shared by every tree-attention implementation.

They run at trace time on shapes and dtypes, and raise ValueError naming the
argument and the expected shape, so that bad input never reaches a kernel.
"""

import jax.numpy as jnp

from hydrajax.layout import TreeLayout

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_tree_attention_inputs(q, k_cache, v_cache, layout) -> None:
  if not isinstance(layout, TreeLayout):
    raise ValueError(
        f'layout must be a TreeLayout (SharingPlan.to_device()), got {type(layout).__name__}'
    )
  if getattr(q, 'ndim', None) != 4:
    raise ValueError(f'q must be [B, T, N, H], got shape {getattr(q, "shape", None)}')
  b, t, n, h = q.shape
  for name, x in (('k_cache', k_cache), ('v_cache', v_cache)):
    if getattr(x, 'ndim', None) != 3:
      raise ValueError(f'{name} must be [L, K, H], got shape {getattr(x, "shape", None)}')
  if k_cache.shape != v_cache.shape:
    raise ValueError(f'k_cache {k_cache.shape} and v_cache {v_cache.shape} must have one shape [L, K, H]')
  length, kh, hk = k_cache.shape
  if hk != h:
    raise ValueError(f'head dim H differs: q has {h}, k_cache has {hk}')
  if kh < 1 or n % kh:
    raise ValueError(f'query heads N={n} must be a multiple of kv heads K={kh}')
  if b != layout.num_rows:
    raise ValueError(f'q has B={b} rows but the layout has {layout.num_rows}')
  if min(b, t, h) < 1:
    raise ValueError(f'q must have B, T, H >= 1, got shape {q.shape}')
  for name, x in (('q', q), ('k_cache', k_cache), ('v_cache', v_cache)):
    if x.dtype not in FLOAT_DTYPES:
      raise ValueError(f'{name} must be float32, bfloat16 or float16, got {x.dtype}')
  if k_cache.dtype != v_cache.dtype:
    raise ValueError(f'k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must share a dtype')
  pages = layout.private_pages.shape[1]
  if layout.private_lengths.shape != (b,) or layout.private_pages.shape[0] != b:
    raise ValueError(f'layout private arrays must have B={b} rows')
  if pages * layout.page_size > 0 and length < layout.page_size:
    raise ValueError(f'k_cache holds {length} tokens, less than one page of {layout.page_size}')
