"""Logical axis names of parameters and caches, and the one table mapping them to mesh axes.

Every `nnx.Param` of the Llama carries `logical_axes` metadata (a name per
dimension), and `KVCache.logical_axes` names the cache dimensions. A later
parallelism issue shards the model by editing `RULES` (or passing its own
table) and calling `partition_spec` / `param_partition_specs`: the model code
does not change. Today every name maps to None (replicated).
"""

from typing import Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import PartitionSpec

# Logical axis names (one per kind of dimension).
LAYERS = 'layers'  # stacked decoder blocks
VOCAB = 'vocab'  # V
EMBED = 'embed'  # D
HEADS = 'heads'  # N
KV_HEADS = 'kv_heads'  # K
HEAD_DIM = 'head_dim'  # H
MLP = 'mlp'  # F
CACHE_TOKENS = 'cache_tokens'  # L, tokens of the flat KV buffer
BATCH = 'batch'  # B

# Logical name -> mesh axis (or None: replicated). Tensor parallelism would map
# heads/kv_heads/mlp/vocab to 'tp'; data parallelism batch/cache_tokens to 'dp'.
RULES: tuple[tuple[str, str | None], ...] = (
    (LAYERS, None),
    (VOCAB, None),
    (EMBED, None),
    (HEADS, None),
    (KV_HEADS, None),
    (HEAD_DIM, None),
    (MLP, None),
    (CACHE_TOKENS, None),
    (BATCH, None),
)


def partition_spec(
    names: Sequence[str | None], rules: Sequence[tuple[str, str | None]] = RULES
) -> PartitionSpec:
  """PartitionSpec of an array whose dimensions carry these logical names."""
  table: Mapping[str, str | None] = dict(rules)
  for name in names:
    if name is not None and name not in table:
      raise ValueError(f'logical axis {name!r} has no rule; known: {sorted(table)}')
  return PartitionSpec(*(None if n is None else table[n] for n in names))


def param_partition_specs(state: nnx.State, rules=RULES):
  """A tree like `state` (of `nnx.Variable`s) holding each parameter's PartitionSpec."""

  def spec(v):
    names = v.get_metadata().get('logical_axes')
    if names is None:
      raise ValueError(f'parameter of shape {v.get_value().shape} has no logical_axes metadata')
    if len(names) != v.get_value().ndim:
      raise ValueError(f'logical_axes {names} do not match shape {v.get_value().shape}')
    return partition_spec(names, rules)

  return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
