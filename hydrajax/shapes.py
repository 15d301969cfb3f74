"""The static shapes of one attention call: what a backend plans for, and a jit static."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hydrajax.validation import FLOAT_DTYPES, check_query_and_caches


@dataclasses.dataclass(frozen=True)
class AttentionShapes:
  """Static facts of one attention call (hashable: a jit static).

  Attributes:
    num_rows: B, query rows.
    query_tokens: T, query tokens per row.
    num_heads: N, query heads.
    num_kv_heads: K, kv heads (N % K == 0).
    head_dim: H.
    kv_tokens: L, the length of ONE layer's buffer (what the layout indexes).
    dtype: the queries' dtype.
    kv_dtype: the K/V buffer's dtype (None: the same as `dtype`).
  """

  num_rows: int
  query_tokens: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  kv_tokens: int
  dtype: Any
  kv_dtype: Any = None

  def __post_init__(self):
    for name in ('num_rows', 'query_tokens', 'num_heads', 'num_kv_heads', 'head_dim', 'kv_tokens'):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f'AttentionShapes.{name} must be an integer >= 1, got {value!r}')
      object.__setattr__(self, name, int(value))
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f'AttentionShapes: query heads N={self.num_heads} must be a multiple of kv heads '
          f'K={self.num_kv_heads}'
      )
    for name in ('dtype', 'kv_dtype'):
      value = getattr(self, name)
      value = self.dtype if value is None else value
      try:
        value = jnp.dtype(value)
      except TypeError:
        raise ValueError(f'AttentionShapes.{name} must be a dtype, got {value!r}') from None
      if value not in FLOAT_DTYPES:
        raise ValueError(
            f'AttentionShapes.{name} must be float32, bfloat16 or float16, got {value}')
      object.__setattr__(self, name, value)

  @classmethod
  def of(cls, q, k_cache) -> 'AttentionShapes':
    """From q [B, T, N, H] and one layer's k_cache [L, K, H] (arrays or ShapeDtypeStructs)."""
    check_query_and_caches(q, k_cache, k_cache)
    b, t, n, h = q.shape
    length, kh, _ = k_cache.shape
    return cls(b, t, n, kh, h, length, q.dtype, k_cache.dtype)

  @property
  def group(self) -> int:
    """G = N / K, query heads per kv head."""
    return self.num_heads // self.num_kv_heads

  def query_struct(self) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(
        (self.num_rows, self.query_tokens, self.num_heads, self.head_dim), self.dtype
    )

  def kv_struct(self, kv_tokens: int | None = None) -> jax.ShapeDtypeStruct:
    length = self.kv_tokens if kv_tokens is None else kv_tokens
    return jax.ShapeDtypeStruct((length, self.num_kv_heads, self.head_dim), self.kv_dtype)
