"""Logical axis names of parameters and caches, and the one table mapping them to mesh axes.

Every `nnx.Param` of the Llama carries `logical_axes` metadata (a name per
dimension) and `KVCache.logical_axes` names the cache dimensions. `RULES` maps
each name to a mesh axis: Megatron-style tensor parallelism on `tp` (query and
kv heads, the MLP hidden width and the vocabulary), data parallelism on `dp`
(rows of the batch and, with them, each shard's own KV buffer). Everything that
places or constrains an array goes through `sharding` / `partition_spec` with
this table, so the model code never names a mesh axis.

A name whose mesh axis is not in the mesh is replicated (a `tp`-only mesh has no
`dp`). A dimension that does not divide its mesh axis:

* heads (N): an error (`check_mesh` says so before any work);
* kv heads (K < tp, e.g. MQA, or 8 kv heads on 16 devices): `tp % K` must be 0;
  the weights wk, wv stay replicated and the cache holds every kv head
  `tp / K` times (`kv_replication`), so that each device keeps exactly the one
  kv head its query heads read (the same memory as K = tp);
* anything else (a vocabulary of 97 on 2 devices): replicated.
"""

from typing import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hydrajax.attention.parallel import DP, MESH_AXES, TP, AttentionAxes  # the mesh axes

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

# Logical name -> mesh axis (or None: replicated).
RULES: tuple[tuple[str, str | None], ...] = (
    (LAYERS, None),
    (VOCAB, TP),
    (EMBED, None),
    (HEADS, TP),
    (KV_HEADS, TP),
    (HEAD_DIM, None),
    (MLP, TP),
    (CACHE_TOKENS, DP),
    (BATCH, DP),
)

# Names whose dimension may be replicated when it does not divide its mesh axis.
_REPLICABLE = (VOCAB, EMBED, MLP, KV_HEADS, LAYERS, HEAD_DIM, CACHE_TOKENS)


_TABLE: Mapping[str, str | None] = dict(RULES)


def axis_size(mesh: Mesh | None, axis: str) -> int:
  """Devices along `axis` of the mesh (1 without a mesh or without that axis)."""
  if mesh is None or axis not in mesh.shape:
    return 1
  return int(mesh.shape[axis])


def partition_spec(names: Sequence[str | None], *, mesh: Mesh | None = None,
                   shape: Sequence[int] | None = None) -> PartitionSpec:
  """PartitionSpec of an array whose dimensions carry these logical names.

  With `mesh`, names mapped to an axis the mesh lacks are replicated; with
  `shape` too, a dimension that does not divide its axis is replicated where
  the module docstring allows it, else a ValueError names it.
  """
  table = _TABLE
  for name in names:
    if name is not None and name not in table:
      raise ValueError(f'logical axis {name!r} has no rule; known: {sorted(table)}')
  if shape is not None and len(shape) != len(names):
    raise ValueError(f'logical axes {tuple(names)} do not match shape {tuple(shape)}')
  out = []
  for i, name in enumerate(names):
    axis = None if name is None else table[name]
    if axis is not None and mesh is not None:
      if axis not in mesh.shape:
        axis = None
      elif shape is not None and shape[i] % mesh.shape[axis]:
        if name not in _REPLICABLE:
          raise ValueError(f'dimension {name}={shape[i]} does not divide over the mesh axis '
                           f'{axis}={mesh.shape[axis]}')
        axis = None
    out.append(axis)
  return PartitionSpec(*out)


def named_sharding(mesh: Mesh, spec: Sequence[str | None]) -> NamedSharding:
  """`NamedSharding(mesh, spec)` in the one form jit gives its outputs: no trailing Nones.

  P('tp', None) and P('tp') place an array alike but are unequal shardings, so an array placed
  with the first and handed back by a jitted step with the second would compile the step again.
  Every placement here goes through this.
  """
  axes = list(spec)
  while axes and axes[-1] is None:
    axes.pop()
  return NamedSharding(mesh, PartitionSpec(*axes))


def sharding(names, mesh: Mesh, shape=None) -> NamedSharding:
  """The NamedSharding of an array with these logical axes on `mesh`."""
  return named_sharding(mesh, partition_spec(names, mesh=mesh, shape=shape))


def _names_of(v: nnx.Variable):
  names = v.get_metadata().get('logical_axes')
  shape = v.get_value().shape
  if names is None:
    raise ValueError(f'parameter of shape {shape} has no logical_axes metadata')
  if len(names) != len(shape):
    raise ValueError(f'logical_axes {names} do not match shape {shape}')
  return names, shape


def param_partition_specs(state: nnx.State, *, mesh: Mesh | None = None):
  """A tree like `state` (of `nnx.Variable`s) holding each parameter's PartitionSpec."""

  def spec(v):
    names, shape = _names_of(v)
    return partition_spec(names, mesh=mesh, shape=shape)

  return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def param_shardings(state: nnx.State, mesh: Mesh):
  """A tree like `state` holding each parameter's NamedSharding on `mesh`."""
  specs = param_partition_specs(state, mesh=mesh)
  return jax.tree.map(lambda s: named_sharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, PartitionSpec))


# ---------------------------------------------------------------------------
# Meshes and models


def auto_mesh(mesh: Mesh | None) -> Mesh | None:
  """The same devices and axis names with `AxisType.Auto` axes (what the model runs on).

  `jax.make_mesh` gives explicit axes by default in this JAX; the model's
  sharding constraints and its attention `shard_map` use automatic ones, so
  both kinds of mesh are accepted everywhere and converted here.
  """
  if mesh is None:
    return None
  auto = jax.sharding.AxisType.Auto
  if all(t == auto for t in mesh.axis_types):
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(auto,) * len(mesh.axis_names))


def kv_replication(num_heads: int, num_kv_heads: int, mesh: Mesh | None) -> int:
  """How many times the cache holds each kv head: tp / K when K < tp, else 1."""
  tp = axis_size(mesh, TP)
  return tp // num_kv_heads if num_kv_heads < tp else 1


def check_mesh(config, mesh: Mesh | None) -> None:
  """Raises ValueError, before any work, when `config` cannot run on `mesh`.

  Axis names must be those of `MESH_AXES`; query heads must divide over `tp`,
  and kv heads must divide over it or divide it.
  """
  if mesh is None:
    return
  unknown = [a for a in mesh.axis_names if a not in MESH_AXES]
  if unknown:
    raise ValueError(f'mesh axes {unknown} are not known; the axes are {MESH_AXES}')
  tp = axis_size(mesh, TP)
  n, k = config.num_heads, config.num_kv_heads
  if n % tp:
    raise ValueError(f'query heads N={n} do not divide over tp={tp} devices '
                     f'({config.name or "model"}); choose tp among {_divisors(n)}')
  if k % tp and tp % k:
    raise ValueError(f'kv heads K={k} must divide over tp={tp} devices or divide tp '
                     f'(then each kv head is replicated tp/K times)')


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def attention_axes() -> AttentionAxes:
  """The mesh axes of an attention call's rows and heads, from the table."""
  return AttentionAxes(batch=_TABLE[BATCH], heads=_TABLE[HEADS])


def constrain(x: jax.Array, names, mesh: Mesh | None) -> jax.Array:
  """`x` constrained to the sharding of its logical axes (a no-op without a mesh)."""
  if mesh is None:
    return x
  return jax.lax.with_sharding_constraint(x, sharding(names, mesh, x.shape))


def place_state(state: nnx.State, mesh: Mesh) -> nnx.State:
  """`state` with every parameter moved into its shards (one device_put per parameter)."""
  shardings = param_shardings(state, mesh)
  return jax.tree.map(
      lambda v, s: v.replace(jax.device_put(v.get_value(), s)), state, shardings,
      is_leaf=lambda x: isinstance(x, nnx.Variable))


def describe(state: nnx.State) -> dict[str, tuple[tuple[int, ...], str]]:
  """Path -> (shape, sharding spec) of every array in `state` (for logs and tests)."""
  out = {}
  for path, v in jax.tree_util.tree_leaves_with_path(state):
    spec = getattr(getattr(v, 'sharding', None), 'spec', None)
    out[jax.tree_util.keystr(path)] = (tuple(np.shape(v)), str(spec))
  return out


def to_host(x) -> np.ndarray:
  """`x` as a numpy array. An array spanning devices of other processes (a mesh over several
  hosts) is gathered from them first: every process gets the whole array."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)
