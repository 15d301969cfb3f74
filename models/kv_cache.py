"""KV caches of the Llama: the flat per-layer buffers of hydrajax, and dense per-sequence caches.

`KVCache` is what the tree path uses: per layer one flat buffer `[L, K, H]`
(stacked over layers: `[num_layers, L, K, H]`) that a hydrajax `TreeLayout`
indexes. Which token lives where is the layout's business; the model only
writes new tokens at given flat slots (`write_slots`, an index >= L drops the
write: padding).

`DenseKVCache` is the naive path's: one `[S, K, H]` buffer per sequence, token
at position p stored at index p.
"""

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from models import sharding_rules as sr
from models.config import LlamaConfig

# XLA compile options of every jitted program that runs the model over a donated KV cache.
# XLA's rematerialization pass misreads such programs: it counts the cache (most of the device's
# memory) more than once, finds the program over its memory limit, and recomputes what it can,
# which cannot lower a peak made of the cache (in a 7B decode step: the attention's lane table
# recomputed before every layer, with no memory saved). A CPU has no such pass.
CACHE_PROGRAM_OPTIONS = {'xla_disable_hlo_passes': 'rematerialization'}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Flat KV buffers of every layer: k, v [num_layers, L, K, H]."""

  k: jax.Array
  v: jax.Array

  logical_axes = (sr.LAYERS, sr.CACHE_TOKENS, sr.KV_HEADS, sr.HEAD_DIM)

  @classmethod
  def zeros(cls, config: LlamaConfig, num_tokens: int, dtype=jnp.bfloat16, *,
            mesh=None) -> 'KVCache':
    """With `mesh`, made in its shards: kv heads over tp (each stored tp / K times when
    K < tp), tokens over dp (each dp shard's own buffer of num_tokens / dp)."""
    if num_tokens < 1:
      raise ValueError(f'num_tokens (L) must be >= 1, got {num_tokens}')
    heads = config.num_kv_heads * sr.kv_replication(config.num_heads, config.num_kv_heads, mesh)
    shape = (config.num_layers, num_tokens, heads, config.head_dim)
    if mesh is None:
      return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    dp = sr.axis_size(mesh, sr.DP)
    if num_tokens % dp:
      raise ValueError(f'num_tokens (L) = {num_tokens} must divide over dp={dp}')
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype),
                    out_shardings=sr.sharding(cls.logical_axes, sr.auto_mesh(mesh), shape))
    return cls(zeros(), zeros())

  @property
  def num_tokens(self) -> int:
    return self.k.shape[1]

  def check(self, config: LlamaConfig, kv_replication: int = 1) -> None:
    """kv_replication: each kv head stored that many times (K < tp; see sharding_rules)."""
    want = (config.num_layers, config.num_kv_heads * kv_replication, config.head_dim)
    if self.k.shape != self.v.shape or self.k.ndim != 4 or (
        self.k.shape[0], self.k.shape[2], self.k.shape[3]) != want:
      raise ValueError(
          f'cache k, v must be [num_layers={want[0]}, L, K={want[1]}, H={want[2]}], '
          f'got {self.k.shape} and {self.v.shape}'
      )


def cache_sharding(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
  """Sharding of a flat `KVCache` array [num_layers, L, K', H] (K' the replicated kv heads)."""
  return sr.sharding(KVCache.logical_axes, mesh, shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseKVCache:
  """Per-sequence KV: k, v [num_layers, B, S, K, H]; position p at index p."""

  k: jax.Array
  v: jax.Array

  logical_axes = (sr.LAYERS, sr.BATCH, sr.CACHE_TOKENS, sr.KV_HEADS, sr.HEAD_DIM)

  @classmethod
  def zeros(cls, config: LlamaConfig, batch: int, max_len: int, dtype=jnp.bfloat16):
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

  def check(self, config: LlamaConfig, batch: int) -> None:
    want = (config.num_layers, batch, config.num_kv_heads, config.head_dim)
    got = self.k.shape
    if self.k.shape != self.v.shape or self.k.ndim != 5 or (got[0], got[1], got[3], got[4]) != want:
      raise ValueError(
          f'dense cache k, v must be [num_layers, B={batch}, S, K, H] matching {want}, got {got}'
      )
