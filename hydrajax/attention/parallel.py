"""Tensor and data parallel tree attention: one `jax.shard_map` per attention call.

Mesh axes (see `models.sharding_rules` for the table that maps the model's
logical axes onto them):

* `tp` shards attention heads. Query heads are split into contiguous blocks,
  one per device; with K % tp == 0 each block's kv heads go with it (GQA groups
  never straddle a device). With K < tp (MQA, or 8 kv heads on 16 devices) the
  kv heads are replicated: `tree_attention_sharded` takes the replicated cache
  and each device reads the one kv head its query heads use; the model instead
  stores each kv head tp / K times in its cache so that each device holds only
  its own (`models.sharding_rules.kv_replication`).
* `dp` splits the rows of the batch into independent sharing groups: each shard
  has its own rows, its own part of the KV buffer (tokens [d * L/dp, (d+1) * L/dp)
  of the flat buffer) and its own layout over it (`split_plan`, `stack_layouts`),
  so that attention and cache writes never cross shards.

The layout is host-planned metadata: built once on the host (per shard with
dp), replicated over `tp`, and never recomputed per shard or per layer.

Meshes from `jax.make_mesh` (explicit axis types, the default in this JAX) and
meshes with `AxisType.Auto` axes both work.
"""

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hydrajax.attention.plan import attend, check_layout, tree_attention
from hydrajax.attention.dispatch import AttentionImpl
from hydrajax.layout import LayoutPolicy, SegmentGroup, SharingPlan, TreeLayout, host_layout
from hydrajax.partial_state import PartialState
from hydrajax.shapes import AttentionShapes
from hydrajax.validation import check_tree_attention_inputs

TP = 'tp'  # tensor parallelism: heads
DP = 'dp'  # data parallelism: independent sharing groups
MESH_AXES = (DP, TP)


# ---------------------------------------------------------------------------
# Meshes


def mesh_sizes(spec: str | None) -> dict[str, int]:
  """The axis sizes a mesh flag such as 'dp:2,tp:4' names ({} for '', 'none' or None).

  Raises ValueError for an unknown axis name, a size below 1 or a repeated axis.
  """
  if spec is None or spec.strip().lower() in ('', 'none', '1'):
    return {}
  sizes: dict[str, int] = {}
  for part in spec.split(','):
    name, sep, size = part.strip().partition(':')
    if not sep:
      raise ValueError(f'--mesh entry {part!r} must be axis:size (e.g. dp:2,tp:4)')
    if name not in MESH_AXES:
      raise ValueError(f'--mesh axis {name!r} is not known; the axes are {MESH_AXES}')
    if name in sizes:
      raise ValueError(f'--mesh names axis {name!r} twice')
    try:
      sizes[name] = int(size)
    except ValueError:
      raise ValueError(f'--mesh size of {name!r} must be an integer, got {size!r}') from None
    if sizes[name] < 1:
      raise ValueError(f'--mesh size of {name!r} must be >= 1, got {sizes[name]}')
  return sizes


def parse_mesh(spec: str | None, *, devices: Sequence[jax.Device] | None = None) -> Mesh | None:
  """A mesh from a flag such as 'dp:2,tp:4' ('tp:2', '' or 'none': one device, None).

  Axes are `dp` and `tp`, in that order in the mesh whatever order the flag
  gives. Raises ValueError, before any work, for a flag `mesh_sizes` refuses or
  a mesh larger than the devices.
  """
  sizes = mesh_sizes(spec)
  if not sizes:
    return None
  devices = list(jax.devices() if devices is None else devices)
  total = math.prod(sizes.values())
  if total > len(devices):
    raise ValueError(f'--mesh {spec!r} needs {total} devices; there are {len(devices)} '
                     f'({devices[0].platform})')
  names = tuple(a for a in MESH_AXES if a in sizes)
  shape = tuple(sizes[a] for a in names)
  auto = (jax.sharding.AxisType.Auto,) * len(names)
  return jax.make_mesh(shape, names, axis_types=auto, devices=devices[:total])


def _axis(mesh: Mesh, name: str | None) -> str | None:
  """The axis if the mesh has it (with more than one device), else None (replicated)."""
  return name if name is not None and mesh.shape.get(name, 1) > 1 else None


def _is_explicit(mesh: Mesh) -> bool:
  return any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def _to_specs(mesh: Mesh, args, specs):
  """With an explicit mesh, arguments must carry their sharding in their type: reshard them."""
  if not _is_explicit(mesh):
    return args
  return jax.tree.map(
      lambda x, s: jax.sharding.reshard(x, NamedSharding(mesh, s)), args, specs,
      is_leaf=lambda x: x is None)


# ---------------------------------------------------------------------------
# Attention alone


def tree_attention_sharded(
    q: jax.Array,  # [B, T, N, H]
    k_cache: jax.Array,  # [L, K, H]
    v_cache: jax.Array,  # [L, K, H]
    layout: TreeLayout,
    *,
    mesh: Mesh,
    head_axis: str = TP,
    impl: AttentionImpl | str = AttentionImpl.AUTO,
    scale: float | None = None,
) -> PartialState:
  """`hydrajax.tree_attention` with heads sharded over `mesh.shape[head_axis]` devices.

  K % tp == 0: each device takes its K/tp kv heads. K < tp with tp % K == 0
  (MQA, or 8 kv heads on 16 devices): the cache is replicated and each device
  reads the one kv head of its query heads.
  """
  if not isinstance(mesh, (Mesh, jax.sharding.AbstractMesh)):
    raise ValueError(f'mesh must be a jax.sharding.Mesh (jax.make_mesh), got {type(mesh).__name__}')
  # On the whole arrays, before sharding: inside shard_map the layout's host facts are gone.
  check_tree_attention_inputs(q, k_cache, v_cache, layout)
  check_layout(layout, AttentionShapes.of(q, k_cache))
  if head_axis not in mesh.shape:
    raise ValueError(f'head_axis {head_axis!r} is not an axis of the mesh {dict(mesh.shape)}')
  tp = mesh.shape[head_axis]
  n, kh = q.shape[2], k_cache.shape[1]
  if n % tp:
    raise ValueError(f'query heads N={n} must divide evenly over {head_axis}={tp} devices')
  if kh % tp and tp % kh:
    raise ValueError(f'kv heads K={kh} must divide evenly over {head_axis}={tp} devices, '
                     'or divide it (each kv head then replicated)')
  split_kv = kh % tp == 0
  q_spec = P(None, None, head_axis, None)
  kv_spec = P(None, head_axis, None) if split_kv else P()
  layout_spec = jax.tree.map(lambda _: P(), layout)

  def local(q, k, v, layout):
    if not split_kv:  # this device's query heads all read kv head d // (tp / K)
      head = jax.lax.axis_index(head_axis) // (tp // kh)
      k = jax.lax.dynamic_slice_in_dim(k, head, 1, axis=1)
      v = jax.lax.dynamic_slice_in_dim(v, head, 1, axis=1)
    return tree_attention(q, k, v, layout, impl=impl, scale=scale)

  specs = (q_spec, kv_spec, kv_spec, layout_spec)
  args = _to_specs(mesh, (q, k_cache, v_cache, layout), specs)
  fn = jax.shard_map(
      local, mesh=mesh, in_specs=specs,
      out_specs=PartialState(P(None, None, head_axis, None), P(None, None, head_axis)),
  )
  return fn(*args)


# ---------------------------------------------------------------------------
# Data parallelism: per-shard layouts


def split_plan(plan: SharingPlan, num_shards: int) -> list[SharingPlan]:
  """The per-shard plans of a plan whose rows and tokens split evenly into independent groups.

  Shard d owns rows [d * B/dp, (d+1) * B/dp) and tokens [d * L/dp, (d+1) * L/dp)
  of the flat buffer; its plan indexes its own buffer from 0. Raises ValueError
  when a segment or a private page of a shard lies outside its rows or tokens.
  """
  b, length, page = plan.num_rows, plan.kv_tokens, plan.page_size
  if num_shards < 1 or b % num_shards or length % (num_shards * page):
    raise ValueError(f'dp={num_shards} must divide the rows B={b}, and the tokens L={length} '
                     f'into whole pages of {page}')
  rows, tokens = b // num_shards, length // num_shards
  out = []
  for d in range(num_shards):
    r0, t0 = d * rows, d * tokens
    index = {}
    segments = []
    for j, s in enumerate(plan.segments):
      inside = r0 <= s.row_begin and s.row_end <= r0 + rows
      if not inside and (s.row_begin < r0 + rows and s.row_end > r0):
        raise ValueError(f'segment {j} (rows [{s.row_begin}, {s.row_end})) straddles dp shards '
                         f'of {rows} rows: sharing groups must not cross shards')
      if not inside:
        continue
      if s.kv_length and not (t0 <= s.kv_start and s.kv_start + s.kv_length <= t0 + tokens):
        raise ValueError(f'segment {j} (tokens [{s.kv_start}, {s.kv_start + s.kv_length})) is '
                         f'outside the buffer of its dp shard {d}, [{t0}, {t0 + tokens})')
      index[j] = len(segments)
      segments.append(dataclasses.replace(
          s, kv_start=s.kv_start - t0 if s.kv_length else 0, row_begin=s.row_begin - r0,
          row_end=s.row_end - r0, parent=index.get(s.parent, -1)))
    pages = []
    for r in range(r0, r0 + rows):
      used = plan.private_pages[r][: -(-plan.private_lengths[r] // page)]
      if any(not t0 <= p * page < t0 + tokens for p in used):
        raise ValueError(f'row {r}: private pages outside the buffer of its dp shard {d}')
      pages.append(tuple(max(p - t0 // page, 0) if t0 <= p * page < t0 + tokens else 0
                         for p in plan.private_pages[r]))
    out.append(SharingPlan(rows, tuple(segments), page, tuple(pages),
                           plan.private_lengths[r0 : r0 + rows], tokens))
  return out


def join_plans(plans: Sequence[SharingPlan]) -> SharingPlan:
  """One plan of independent groups side by side (the inverse of `split_plan`).

  Every plan must have the same rows, tokens and page size (pad them first).
  """
  first = plans[0]
  for p in plans:
    if (p.num_rows, p.kv_tokens, p.page_size) != (first.num_rows, first.kv_tokens, first.page_size):
      raise ValueError('join_plans needs plans of equal num_rows, kv_tokens and page_size, got '
                       f'{[(q.num_rows, q.kv_tokens, q.page_size) for q in plans]}')
  rows, tokens, page = first.num_rows, first.kv_tokens, first.page_size
  segments, pages, lengths = [], [], []
  for d, p in enumerate(plans):
    base = len(segments)
    segments += [dataclasses.replace(
        s, kv_start=s.kv_start + d * tokens, row_begin=s.row_begin + d * rows,
        row_end=s.row_end + d * rows, parent=s.parent + base if s.parent >= 0 else -1)
        for s in p.segments]
    pages += [tuple(x + d * tokens // page for x in row) for row in p.private_pages]
    lengths += list(p.private_lengths)
  return SharingPlan(rows * len(plans), tuple(segments), page, tuple(pages), tuple(lengths),
                     tokens * len(plans))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShardedLayout:
  """Per-dp-shard layouts (or prepared attention plans) with equal static shapes, stacked.

  Every leaf is [dp, ...]; shard d's layout indexes its own rows and its own
  part of the buffer from 0.
  """

  layouts: Any  # a TreeLayout or an AttentionPlan whose leaves are [dp, ...]
  num_shards: int = dataclasses.field(metadata=dict(static=True))

  @property
  def _layout(self) -> TreeLayout:
    return getattr(self.layouts, 'layout', self.layouts)

  @property
  def num_rows(self) -> int:
    return self._layout.num_rows * self.num_shards

  @property
  def page_size(self) -> int:
    return self._layout.page_size

  def with_private_lengths(self, lengths: jax.Array | np.ndarray, *,
                           check: bool = True) -> 'ShardedLayout':
    """Every row's private length replaced (lengths [B] int32, global row order); `check` as
    in `AttentionPlan.with_private_lengths`.

    The swap only replaces leaves (every backend's `with_private_lengths`), so the stacked
    leaves take the lengths as [dp, B/dp] directly; a host array stays on the host (no device
    op: the jitted step that takes the layout uploads it).
    """
    per_shard = (lengths.reshape(self.num_shards, -1) if isinstance(lengths, np.ndarray)
                 else jnp.reshape(lengths, (self.num_shards, -1)))
    if isinstance(self.layouts, TreeLayout):
      return ShardedLayout(dataclasses.replace(self.layouts, private_lengths=per_shard),
                           self.num_shards)
    return ShardedLayout(self.layouts.with_private_lengths(per_shard, check=check),
                         self.num_shards)

  def for_step(self) -> 'ShardedLayout':
    """Each shard's `AttentionPlan.for_step` (mapped over the stacked leaves); a layout of
    unprepared shards as it is."""
    if isinstance(self.layouts, TreeLayout):
      return self
    return ShardedLayout(jax.vmap(lambda plan: plan.for_step())(self.layouts), self.num_shards)


def stack_shards(values: Sequence[Any], sharding: jax.sharding.Sharding | None = None
                 ) -> ShardedLayout:
  """Per-shard pytrees of one structure (e.g. `AttentionPlan`s of each shard) stacked.

  With `sharding` (e.g. `NamedSharding(mesh, P('dp'))`) and concrete leaves, they are
  stacked on the host and put in their shards in one upload (stacking on the device costs
  an op per leaf, then a copy per leaf into the shards).
  """
  structures = {jax.tree.structure(v) for v in values}
  if len(structures) != 1:
    raise ValueError('per-shard plans must have one structure and equal static fields (pad the '
                     f'layouts to one shape first: stack_layouts), got {len(structures)}')
  leaves = jax.tree.leaves(list(values))
  if sharding is None or any(isinstance(x, jax.core.Tracer) for x in leaves):
    return ShardedLayout(jax.tree.map(lambda *xs: jnp.stack(xs), *values), len(values))
  stacked = jax.tree.map(lambda *xs: np.stack(xs), *jax.device_get(list(values)))
  return ShardedLayout(jax.device_put(stacked, sharding), len(values))


def stack_layouts(plans: Sequence[SharingPlan], *, bucket: bool = True,
                  max_private_pages: int | None = None,
                  policy: LayoutPolicy | None = None, upload: bool = True) -> ShardedLayout:
  """The device layouts of per-shard plans, padded to one static shape and stacked.

  `policy` (a `LayoutPolicy`, e.g. the engine's fixed shapes) shapes each shard's layout as
  `SharingPlan.to_device` does; the segment slots of each group are then padded to the most
  any shard has (with fixed shapes: J is the largest shard's J). `upload=False` keeps the
  leaves numpy arrays (for a plan prepared on the host, then uploaded once: `stack_shards`).
  """
  if policy is None:
    policy = LayoutPolicy.BUCKETED if bucket else LayoutPolicy.EXACT
  layouts = [host_layout(p, policy, max_private_pages=max_private_pages) for p in plans]
  caps = sorted({(g.row_capacity, g.kv_capacity) for lay in layouts for g in lay.groups})
  counts = {c: max(sum(g.num_segments for g in lay.groups
                       if (g.row_capacity, g.kv_capacity) == c) for lay in layouts) for c in caps}
  offsets = dict(zip(caps, np.cumsum([0] + [counts[c] for c in caps])[:-1].tolist()))
  pages = max(lay.private_pages.shape[1] for lay in layouts)
  depth = max(lay.row_segments.shape[1] for lay in layouts)
  shards = []
  for lay in layouts:
    remap = []  # old concatenated segment id -> new one
    by_cap = {(g.row_capacity, g.kv_capacity): g for g in lay.groups}
    for g in lay.groups:
      c = (g.row_capacity, g.kv_capacity)
      remap += [offsets[c] + i for i in range(g.num_segments)]
    groups = []
    for c in caps:
      g = by_cap.get(c)
      cols = [np.zeros(counts[c], np.int32) for _ in range(4)]
      if g is not None:
        for col, x in zip(cols, (g.kv_start, g.kv_length, g.row_begin, g.row_count)):
          col[: g.num_segments] = np.asarray(x)
      groups.append(SegmentGroup(*cols, row_capacity=c[0], kv_capacity=c[1]))
    table = np.asarray(lay.row_segments)
    remapped = np.where(table >= 0, np.asarray(remap + [0], np.int32)[table], -1)
    row_segments = np.full((lay.num_rows, depth), -1, np.int32)
    row_segments[:, : table.shape[1]] = remapped
    private = np.zeros((lay.num_rows, pages), np.int32)
    private[:, : lay.private_pages.shape[1]] = np.asarray(lay.private_pages)
    shards.append(TreeLayout(tuple(groups), private, np.asarray(lay.private_lengths),
                             lay.page_size, lay.num_rows, row_segments))
  stacked = jax.tree.map(lambda *xs: np.stack(xs), *shards)
  return ShardedLayout(jax.tree.map(jnp.asarray, stacked) if upload else stacked, len(plans))


# ---------------------------------------------------------------------------
# The model's attention call: cache write and attention in one shard_map


@dataclasses.dataclass(frozen=True)
class AttentionAxes:
  """Mesh axes of an attention call's dimensions (from the model's rules table)."""

  batch: str | None = DP  # rows (and the KV buffer's tokens): data parallel
  heads: str | None = TP  # query and kv heads: tensor parallel


def _shift(layout: TreeLayout, offset) -> TreeLayout:
  """The same layout over a buffer whose token 0 is at `offset` (a multiple of page_size)."""
  groups = tuple(dataclasses.replace(g, kv_start=g.kv_start + offset) for g in layout.groups)
  return dataclasses.replace(
      layout, groups=groups, private_pages=layout.private_pages + offset // layout.page_size)


def _write_and_attend_local(q, k_new, v_new, k_cache, v_cache, slots, layout, *, layer, impl,
                            scale, batch_axis):
  """One device's (or the whole unsharded) cache write and attention of a layer."""
  num_layers, length, kh, hd = k_cache.shape
  b, t = slots.shape
  if isinstance(layout, ShardedLayout):  # this shard's layout: leaves [1, ...]
    layout = jax.tree.map(lambda x: x[0], layout.layouts)
  if batch_axis is not None:  # global slots -> this shard's own buffer
    slots = slots - jax.lax.axis_index(batch_axis) * length
  offset = layer * length
  k_all = k_cache.reshape(num_layers * length, kh, hd)  # a bitcast
  v_all = v_cache.reshape(num_layers * length, kh, hd)
  slots = slots.reshape(-1).astype(jnp.int32)
  dest = jnp.where((slots >= 0) & (slots < length), slots + offset, num_layers * length)
  k_all = k_all.at[dest].set(k_new.reshape(b * t, kh, hd).astype(k_all.dtype), mode='drop')
  v_all = v_all.at[dest].set(v_new.reshape(b * t, kh, hd).astype(v_all.dtype), mode='drop')
  caches = k_all.reshape(k_cache.shape), v_all.reshape(v_cache.shape)
  if impl is None:
    return caches
  if hasattr(layout, 'prepared'):  # an AttentionPlan prepared for one shard's shapes
    out = attend(q, k_all, v_all, layout, kv_offset=offset, scale=scale)
  else:
    out = tree_attention(q, k_all, v_all, _shift(layout, offset), impl=impl, scale=scale)
  return (out.out.astype(q.dtype),) + caches


def write_and_attend(
    q: jax.Array,  # [B, T, N, H]
    k_new: jax.Array,  # [B, T, K, H]
    v_new: jax.Array,  # [B, T, K, H]
    k_cache: jax.Array,  # [num_layers, L, K, H]
    v_cache: jax.Array,  # [num_layers, L, K, H]
    slots: jax.Array,  # [B, T] int32: flat token index in [0, L); >= L drops the write
    layout: 'TreeLayout | ShardedLayout',
    *,
    layer: int,
    impl: AttentionImpl | str | None,
    mesh: Mesh | None = None,
    axes: AttentionAxes = AttentionAxes(),
    scale: float | None = None,
) -> tuple[jax.Array | None, jax.Array, jax.Array]:
  """Writes a layer's new K/V into the cache, then attends the layer's buffer.

  `layout` may also be an `AttentionPlan` prepared for one device's shapes
  (B/dp rows, N/tp heads, K/tp kv heads, L/dp tokens), or per-shard plans
  stacked by `stack_shards`: then nothing derived from the layout is rebuilt.
  Returns (out [B, T, N, H] in q.dtype, or None when `impl` is None: the
  write alone; k_cache, v_cache). With a mesh this is one `jax.shard_map`:
  heads over `axes.heads`, rows and the buffer's tokens over `axes.batch`
  (then `layout` is a `ShardedLayout` and each shard writes and reads only its
  own buffer); the layout is replicated over the heads axis. K must divide over
  the heads axis here (the model replicates kv heads beforehand).
  """
  local = functools.partial(_write_and_attend_local, layer=layer, impl=impl, scale=scale)
  if mesh is None or all(s == 1 for s in mesh.shape.values()):
    if isinstance(layout, ShardedLayout) and layout.num_shards != 1:
      raise ValueError(f'a layout of {layout.num_shards} dp shards needs a mesh with dp')
    out = local(q, k_new, v_new, k_cache, v_cache, slots, layout, batch_axis=None)
    return out if impl is not None else (None,) + out
  rows, heads = _axis(mesh, axes.batch), _axis(mesh, axes.heads)
  dp = mesh.shape[rows] if rows else 1
  if rows is not None and not (isinstance(layout, ShardedLayout) and layout.num_shards == dp):
    raise ValueError(f'with {rows}={dp}, the layout must be a ShardedLayout of {dp} shards '
                     '(hydrajax.attention.parallel.stack_layouts), got '
                     f'{type(layout).__name__}')
  if rows is None and isinstance(layout, ShardedLayout):
    if layout.num_shards != 1:
      raise ValueError(f'a layout of {layout.num_shards} dp shards needs a mesh with dp')
  kh = k_cache.shape[2]
  if heads is not None and (q.shape[2] % mesh.shape[heads] or kh % mesh.shape[heads]):
    raise ValueError(f'heads N={q.shape[2]} and kv heads K={kh} must divide over '
                     f'{heads}={mesh.shape[heads]} (replicate kv heads first)')
  act = P(rows, None, heads, None)
  cache = P(None, rows, heads, None)
  layout_spec = jax.tree.map(lambda _: P(rows) if rows else P(), layout)
  in_specs = (act, act, act, cache, cache, P(rows, None), layout_spec)
  out_specs = (act, cache, cache) if impl is not None else (cache, cache)
  args = _to_specs(mesh, (q, k_new, v_new, k_cache, v_cache, slots, layout), in_specs)
  fn = jax.shard_map(
      functools.partial(local, batch_axis=rows), mesh=mesh, in_specs=in_specs,
      out_specs=out_specs)
  out = fn(*args)
  return out if impl is not None else (None,) + out


def embedding_lookup(
    table: jax.Array,  # [V, D]
    ids: jax.Array,  # [B, T] int32
    *,
    mesh: Mesh | None = None,
    vocab_axis: str | None = TP,
    batch_axis: str | None = DP,
) -> jax.Array:
  """table[ids] -> [B, T, D]; with the vocabulary sharded, one local read and one psum.

  Each device reads the ids that fall in its slice of the vocabulary (zeros
  elsewhere) and the results are summed over `vocab_axis`: one all-reduce of
  [B, T, D], instead of gathering the whole table.
  """
  vocab = None if mesh is None else _axis(mesh, vocab_axis)
  if vocab is None:
    return table[ids]
  rows = _axis(mesh, batch_axis)
  per_device = table.shape[0] // mesh.shape[vocab]

  def local(table, ids):
    ids = ids - jax.lax.axis_index(vocab) * per_device
    inside = (ids >= 0) & (ids < per_device)
    x = jnp.where(inside[..., None], table[jnp.clip(ids, 0, per_device - 1)], 0)
    return jax.lax.psum(x, vocab)

  specs = (P(vocab, None), P(rows, None))
  args = _to_specs(mesh, (table, ids), specs)
  return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(rows, None, None))(*args)


# ---------------------------------------------------------------------------
# Multi-host start-up (see hydrajax/PARALLELISM.md)


def initialize_distributed(spec: str | None) -> None:
  """Starts JAX's multi-process runtime from a flag; call it first, before any JAX work.

  '' or None: one process (nothing to do). 'auto': `jax.distributed.initialize()`
  finds everything itself (Cloud TPU pod slices, SLURM, Open MPI, Kubernetes).
  'HOST:PORT,NUM_PROCESSES,PROCESS_ID': GPU hosts started by hand, the same
  command on every host with its own PROCESS_ID (0 on the host at HOST:PORT).
  After it, `jax.devices()` lists every host's devices and `parse_mesh` spans them.
  """
  if not spec:
    return
  if spec == 'auto':
    jax.distributed.initialize()
    return
  parts = spec.split(',')
  if len(parts) != 3 or ':' not in parts[0]:
    raise ValueError(f"--distributed must be 'auto' or 'HOST:PORT,NUM_PROCESSES,PROCESS_ID', "
                     f'got {spec!r}')
  try:
    num, index = int(parts[1]), int(parts[2])
  except ValueError:
    raise ValueError(f'--distributed {spec!r}: NUM_PROCESSES and PROCESS_ID must be integers'
                     ) from None
  if not 0 <= index < num:
    raise ValueError(f'--distributed {spec!r}: PROCESS_ID must be in [0, {num})')
  jax.distributed.initialize(coordinator_address=parts[0], num_processes=num, process_id=index)
