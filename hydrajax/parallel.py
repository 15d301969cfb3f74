"""Tensor-parallel tree attention: `jax.shard_map` over a mesh axis of heads.

Query heads are split into contiguous blocks, one per device along `head_axis`;
with K % tp == 0 each block's kv heads go with it (GQA groups never straddle a
device). With K == 1 (MQA) the single kv head is replicated. The layout is
host-planned metadata, replicated on every device. Data parallelism over
independent sharing groups is a separate mesh axis (each group its own layout).
"""

import functools

import jax
from jax.sharding import Mesh, PartitionSpec as P

from hydrajax.attention_plan import tree_attention
from hydrajax.dispatch import AttentionImpl
from hydrajax.layout import TreeLayout
from hydrajax.partial_state import PartialState


def tree_attention_sharded(
    q: jax.Array,  # [B, T, N, H]
    k_cache: jax.Array,  # [L, K, H]
    v_cache: jax.Array,  # [L, K, H]
    layout: TreeLayout,
    *,
    mesh: Mesh,
    head_axis: str = 'tp',
    impl: AttentionImpl | str = AttentionImpl.AUTO,
    scale: float | None = None,
) -> PartialState:
  """`hydrajax.tree_attention` with heads sharded over `mesh.shape[head_axis]` devices."""
  if head_axis not in mesh.shape:
    raise ValueError(f'head_axis {head_axis!r} is not an axis of the mesh {dict(mesh.shape)}')
  tp = mesh.shape[head_axis]
  n, kh = q.shape[2], k_cache.shape[1]
  if n % tp:
    raise ValueError(f'query heads N={n} must divide evenly over {head_axis}={tp} devices')
  if kh % tp and kh != 1:
    raise ValueError(f'kv heads K={kh} must divide evenly over {head_axis}={tp} devices, or be 1 (MQA)')
  kv_spec = P(None, head_axis, None) if kh % tp == 0 else P()
  fn = jax.shard_map(
      functools.partial(tree_attention, impl=impl, scale=scale),
      mesh=mesh,
      in_specs=(P(None, None, head_axis, None), kv_spec, kv_spec, P()),
      out_specs=PartialState(P(None, None, head_axis, None), P(None, None, head_axis)),
  )
  return fn(q, k_cache, v_cache, layout)
