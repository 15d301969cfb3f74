"""The causal prefill of a token tree: rollout trees for training, any depth.

RL rollouts that branch (a prompt, several partial continuations, each continued several
ways: AReaL-DTA's rollout trees) form a forest of token runs, the nodes. In training every
node's tokens are queries: each attends every ancestor's tokens and its own, causally. The
prefill layout (`prefill_layout`) is the two-level case (prompts, completions); this is any
depth, every ancestor attended once by all the queries below it.

A `TreePrefillPlan` lays the nodes out level by level (depth d: its B_d nodes, each right-padded
to the level's capacity C_d) in one flat buffer [L, K, H]:

    [level 0 | pad to a page of C_1 | level 1 | pad to a page of C_2 | level 2 | ...]

and one `TreeLayout` a level indexes it: the level's nodes are its rows, with T = C_d queries
each, causal over the node's own page (private KV, padding after the real tokens, so a real
query never reaches it), and every ancestor a shared segment (its real tokens only) of the rows
below it. A level's rows are in their parents' order, so the nodes below any ancestor are
contiguous rows at every level: each ancestor is one segment.

Node x's token j sits at sequence position `offset(x) + j` (RoPE), offset(x) the real lengths
of its ancestors. A model attends every level every layer: `prepare_tree_prefill` once (one
`TrainingAttentionPlan` a level), then `attend_tree_prefill` per layer. An ancestor's dK / dV
sums over every level below it, inside a level over all its rows in one matmul per kv block.

On the Mosaic GPU kernels a uniform tree (every node of a level with the same number of
children, as a sampler that branches a fixed number of ways makes) runs on slices of the
buffer, all levels in one custom VJP with one dK / dV buffer (`prefill_vjp`). Any other tree,
and any tree on XLA, walks each level's `TreeLayout` (`tree_attention_vjp`: gathers and
scatter-adds), all levels in one custom VJP too, with one float32 dK / dV of the buffer.
"""

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hydrajax.shapes import AttentionShapes
from hydrajax.attention.dispatch import AttentionImpl
from hydrajax.layout import LayoutPolicy, Segment, SharingPlan, TreeLayout, as_int
from hydrajax.attention.parallel import ShardedLayout, stack_shards
from hydrajax.partial_state import PartialState
from hydrajax.attention.training.prefill_vjp import (
    LevelsPlan, attend_levels, join_levels, level_starts, prepare_levels, split_levels,
)
from hydrajax.attention.training.training_plan import (
    TrainingAttentionPlan, attend_levels_differentiable,
)

# Capacities rounded by quarters (at most 25% padding), segments never split: a training
# prompt is attended whole by each of its rows' queries (a split would add partial states).
DEFAULT_POLICY = LayoutPolicy(kv_piece=None, rounding='quarter')


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreePrefillLayout:
  """Device form of a tree prefill plan (a jit pytree); see the module docstring."""

  layouts: tuple[TreeLayout, ...]  # one a level
  positions: tuple[jax.Array, ...]  # [B_d, C_d] int32 a level: sequence positions (RoPE)
  lengths: tuple[jax.Array, ...]  # [B_d] int32 a level: each node's real tokens
  path_tokens: jax.Array  # [paths, sum C_d] int32: each root-to-leaf path's buffer indices
  path_lengths: jax.Array  # [paths] int32: its real tokens (the indices past them are 0)
  parent_rows: tuple[jax.Array, ...]  # [B_d] int32 a level from 1: the parent's row above
  capacities: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))  # C_d
  kv_tokens: int = dataclasses.field(metadata=dict(static=True))  # L
  # Every node of a level has the same number of children (`TreePrefillPlan.uniform`).
  uniform: bool = dataclasses.field(default=False, metadata=dict(static=True))

  @property
  def level_shapes(self) -> tuple[tuple[int, int], ...]:
    """(B_d, C_d) of every level: the [B_d, C_d, ...] shape of its queries and K/V."""
    return tuple((layout.num_rows, c) for layout, c in zip(self.layouts, self.capacities))

  @property
  def starts(self) -> tuple[int, ...]:
    """Each level's first slot in the buffer (`level_starts`, as the plan laid them out)."""
    return level_starts(self.level_shapes)[0]


@dataclasses.dataclass(frozen=True)
class TreePrefillPlan:
  """Host side: the nodes' levels and rows, the buffer, and one sharing plan a level."""

  parents: tuple[int, ...]  # per node (the caller's numbering), -1 at a root
  lengths: tuple[int, ...]  # per node: its real tokens
  levels: tuple[tuple[int, ...], ...]  # the node of each row of each level
  capacities: tuple[int, ...]  # C_d
  starts: tuple[int, ...]  # buffer index of each level's first slot
  offsets: tuple[int, ...]  # per node: sequence position of its first token
  leaves: tuple[int, ...]  # nodes without children, level by level and row by row
  kv_tokens: int  # L
  plans: tuple[SharingPlan, ...]  # one a level
  depths: tuple[int, ...]  # per node: its level
  rows: tuple[int, ...]  # per node: its row in its level

  def slot(self, node: int) -> int:
    """Buffer index of `node`'s first token."""
    d = self.depths[node]
    return self.starts[d] + self.rows[node] * self.capacities[d]

  def depth(self, node: int) -> int:
    return self.depths[node]

  @property
  def uniform(self) -> bool:
    """Whether every node of a level has the same number of children (no leaf above the last
    level): then the nodes below any node are equally many consecutive rows of every level
    below, and the kernels run on slices of the buffer (`prefill_vjp`)."""
    children = [0] * len(self.parents)
    for p in self.parents:
      if p >= 0:
        children[p] += 1
    return all(len({children[x] for x in level}) == 1 for level in self.levels[:-1])

  def path(self, node: int) -> tuple[int, ...]:
    """The nodes from `node`'s root down to it."""
    path = [node]
    while self.parents[path[-1]] >= 0:
      path.append(self.parents[path[-1]])
    return tuple(reversed(path))

  def shards(self, num_shards: int) -> tuple['TreePrefillPlan', ...]:
    """The plans of `num_shards` data-parallel shards: shard d holds roots [d R / dp,
    (d + 1) R / dp) and their trees, with this plan's capacities. Every shard's level d is
    then block d of this plan's level d, and (every leaf at the last level) its leaves block d
    of the leaves, so a batch's arrays split along their first axis."""
    roots = self.levels[0]
    if as_int(num_shards, 'num_shards') < 1 or len(roots) % num_shards:
      raise ValueError(f'num_shards (dp) must be >= 1 and divide the {len(roots)} roots, got '
                       f'{num_shards}')
    deepest = len(self.levels) - 1
    if any(self.depths[x] != deepest for x in self.leaves):
      raise ValueError('a tree plan splits into dp shards only with every leaf at the last '
                       'level (the batch\'s leaves are then each shard\'s, in order)')
    root_of = list(range(len(self.parents)))
    for x, p in enumerate(self.parents):  # parents come first
      if p >= 0:
        root_of[x] = root_of[p]
    per = len(roots) // num_shards
    plans = []
    for d in range(num_shards):
      mine = set(roots[d * per:(d + 1) * per])
      nodes = [x for x in range(len(self.parents)) if root_of[x] in mine]
      index = {x: i for i, x in enumerate(nodes)}
      plans.append(plan_tree_prefill(
          [index[self.parents[x]] if self.parents[x] >= 0 else -1 for x in nodes],
          [self.lengths[x] for x in nodes], capacities=self.capacities))
    if len({tuple(len(level) for level in p.levels) for p in plans}) != 1:
      raise ValueError('the dp shards\' trees must have equal level sizes, got '
                       f'{[tuple(len(level) for level in p.levels) for p in plans]}')
    return tuple(plans)

  def to_device_sharded(self, num_shards: int, sharding=None,
                        policy: LayoutPolicy = DEFAULT_POLICY) -> ShardedLayout:
    """The shards' layouts (`shards`) stacked, every leaf [dp, ...] (`stack_shards`)."""
    layouts = [plan.to_device(policy) for plan in self.shards(num_shards)]
    shape = lambda lay: (jax.tree.structure(lay), [np.shape(x) for x in jax.tree.leaves(lay)])
    for d, lay in enumerate(layouts[1:], 1):
      if shape(lay) != shape(layouts[0]):
        raise ValueError(
            f'dp shard {d}\'s trees share their tokens differently from shard 0\'s (other '
            'segment groups or level shapes), so the shards cannot run as one program: give '
            'every shard\'s roots trees of one shape, or train with fewer dp shards')
    return stack_shards(layouts, sharding)

  def to_device(self, policy: LayoutPolicy = DEFAULT_POLICY) -> TreePrefillLayout:
    """The device layout; `policy` rounds each level's segment groups (`LayoutPolicy`)."""
    positions, lengths = [], []
    parent_rows = tuple(jnp.asarray(np.asarray([self.rows[self.parents[x]] for x in level],
                                                np.int32))
                        for level in self.levels[1:])
    for level, c in zip(self.levels, self.capacities):
      first = np.asarray([self.offsets[x] for x in level], np.int32)
      positions.append(jnp.asarray(first[:, None] + np.arange(c, dtype=np.int32)[None, :]))
      lengths.append(jnp.asarray(np.asarray([self.lengths[x] for x in level], np.int32)))
    path_tokens = np.zeros((len(self.leaves), sum(self.capacities)), np.int32)
    path_lengths = np.zeros(len(self.leaves), np.int32)
    for i, leaf in enumerate(self.leaves):
      tokens = [self.slot(x) + np.arange(self.lengths[x]) for x in self.path(leaf)]
      tokens = np.concatenate(tokens)
      path_tokens[i, :tokens.size] = tokens
      path_lengths[i] = tokens.size
    return TreePrefillLayout(
        layouts=tuple(p.to_device(policy=policy) for p in self.plans),
        positions=tuple(positions), lengths=tuple(lengths),
        path_tokens=jnp.asarray(path_tokens), path_lengths=jnp.asarray(path_lengths),
        parent_rows=parent_rows,
        capacities=self.capacities, kv_tokens=self.kv_tokens,
        uniform=self.uniform)


def _levels(parents: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
  """Each depth's nodes, in their parents' order (then the caller's)."""
  children = [[] for _ in parents]
  level = []
  for x, p in enumerate(parents):
    (children[p] if p >= 0 else level).append(x)
  levels = []
  while level:
    levels.append(tuple(level))
    level = [c for x in level for c in children[x]]
  return tuple(levels)


def plan_tree_prefill(
    parents: Sequence[int],
    lengths: Sequence[int],
    *,
    capacities: Sequence[int] | None = None,
) -> TreePrefillPlan:
  """Plans the causal prefill of a forest of token runs (the nodes).

  Args:
    parents: each node's parent, an earlier node (parents[x] < x), or -1 at a root.
    lengths: each node's real tokens (>= 1).
    capacities: C_d, the padded width of each depth's nodes (default: the depth's longest).

  Example, a prompt of 100 tokens, two branches of 30, each continued twice (20 tokens):
  `plan_tree_prefill([-1, 0, 0, 1, 1, 2, 2], [100, 30, 30, 20, 20, 20, 20])`.
  """
  parents = tuple(as_int(p, f'parents[{x}]') for x, p in enumerate(parents))
  lengths = tuple(as_int(n, f'lengths[{x}]') for x, n in enumerate(lengths))
  if not parents or len(parents) != len(lengths):
    raise ValueError(f'parents and lengths need one entry per node (>= 1 node), got '
                     f'{len(parents)} and {len(lengths)}')
  for x, (p, n) in enumerate(zip(parents, lengths)):
    if not -1 <= p < x:
      raise ValueError(f'parents[{x}] must be -1 or an earlier node (0..{x - 1}), got {p}')
    if n < 1:
      raise ValueError(f'lengths[{x}] must be >= 1, got {n}')
  levels = _levels(parents)
  longest = tuple(max(lengths[x] for x in level) for level in levels)
  if capacities is None:
    capacities = longest
  capacities = tuple(as_int(c, f'capacities[{d}]') for d, c in enumerate(capacities))
  if len(capacities) != len(levels) or any(c < n for c, n in zip(capacities, longest)):
    raise ValueError(f'capacities must be one per depth ({len(levels)}), each at least the '
                     f'depth\'s longest node {longest}, got {capacities}')
  starts, end = level_starts([(len(level), c) for level, c in zip(levels, capacities)])
  offsets = [0] * len(parents)
  for x, p in enumerate(parents):  # parents come first
    offsets[x] = offsets[p] + lengths[p] if p >= 0 else 0
  row, depth = [0] * len(parents), [0] * len(parents)
  for d, level in enumerate(levels):
    for r, x in enumerate(level):
      row[x], depth[x] = r, d
  slot = lambda x: starts[depth[x]] + row[x] * capacities[depth[x]]
  has_children = {p for p in parents if p >= 0}
  leaves = tuple(x for level in levels for x in level if x not in has_children)

  def level_plan(d: int) -> SharingPlan:
    level, c = levels[d], capacities[d]
    below = {}  # ancestor -> [first row, last row] of its level-d descendants
    for r, x in enumerate(level):
      a = parents[x]
      while a >= 0:
        first, _ = below.get(a, (r, r))
        below[a] = (first, r)
        a = parents[a]
    segments, index = [], {}
    for a in sorted(below, key=lambda a: (depth[a], row[a])):  # parents before children
      first, last = below[a]
      index[a] = len(segments)
      segments.append(Segment(
          kv_start=slot(a), kv_length=lengths[a], row_begin=first, row_end=last + 1,
          parent=index[parents[a]] if parents[a] >= 0 else -1, position=offsets[a],
          label=f'node{a}', kv_capacity=capacities[depth[a]]))
    return SharingPlan(
        num_rows=len(level), segments=tuple(segments), page_size=c,
        private_pages=tuple((starts[d] // c + r,) for r in range(len(level))),
        private_lengths=(c,) * len(level), kv_tokens=end)

  return TreePrefillPlan(parents, lengths, levels, capacities, starts, tuple(offsets),
                         leaves, end, tuple(level_plan(d) for d in range(len(levels))),
                         tuple(depth), tuple(row))


def plan_rollout_tree(prompt: int, branches: int, branch_length: int, leaves: int,
                      leaf_length: int) -> TreePrefillPlan:
  """A sampler's two-stage rollout tree: one prompt of `prompt` tokens, `branches` branches of
  `branch_length` tokens under it, and `leaves` leaves of `leaf_length` tokens, `leaves /
  branches` under each branch (node 0 the prompt, then the branches, then the leaves)."""
  sizes = dict(prompt=prompt, branches=branches, branch_length=branch_length, leaves=leaves,
               leaf_length=leaf_length)
  for name, x in sizes.items():
    if as_int(x, name) < 1:
      raise ValueError(f'{name} must be >= 1, got {x}')
  if leaves % branches:
    raise ValueError(f'leaves must be a multiple of branches ({branches}), got {leaves}')
  parents = [-1] + [0] * branches + [1 + i // (leaves // branches) for i in range(leaves)]
  lengths = [prompt] + [branch_length] * branches + [leaf_length] * leaves
  return plan_tree_prefill(parents, lengths)


def write_tree_kv(layout: TreePrefillLayout, level_kv: Sequence[jax.Array]) -> jax.Array:
  """Each level's [B_d, C_d, ...] (e.g. its K or V [B_d, C_d, K, H]) -> the buffer [L, ...].

  The buffer's order is the levels' (`plan_tree_prefill`), so this is a concatenation and its
  transpose slices every token's dK / dV back (no scatter, no gather). Works for any per-token
  array in the buffer's order (queries too, e.g. for `path_sequences`).
  """
  shapes = layout.level_shapes
  if len(level_kv) != len(shapes):
    raise ValueError(f'level_kv must hold one array a level ({len(shapes)}), got '
                     f'{len(level_kv)}')
  rest = level_kv[0].shape[2:]
  for d, (x, shape) in enumerate(zip(level_kv, shapes)):
    if x.shape != shape + rest:
      raise ValueError(f'level_kv[{d}] must be [{shape[0]}, {shape[1]}, ...] (trailing dims '
                       f'as level_kv[0]\'s {rest}), got {x.shape}')
  return join_levels(level_kv)


def tree_levels(layout: TreePrefillLayout, buffer: jax.Array) -> list[jax.Array]:
  """`write_tree_kv`'s inverse: the buffer [L, ...] -> each level's [B_d, C_d, ...] (slices)."""
  if buffer.shape[0] != layout.kv_tokens:
    raise ValueError(f'buffer must be [L = {layout.kv_tokens}, ...], got {buffer.shape}')
  return split_levels(buffer, layout.level_shapes)


def path_sequences(layout: TreePrefillLayout, buffer: jax.Array) -> jax.Array:
  """Each root-to-leaf path's own sequence [paths, sum C_d, ...]: its real tokens, then 0s.

  buffer [L, ...] in the buffer's order (`write_tree_kv`). What a model without sharing sees:
  every leaf's whole sequence, its ancestors copied into each.
  """
  if buffer.shape[0] != layout.kv_tokens:
    raise ValueError(f'buffer must be [L = {layout.kv_tokens}, ...], got {buffer.shape}')
  seq = buffer[layout.path_tokens]
  real = jnp.arange(seq.shape[1])[None, :] < layout.path_lengths[:, None]
  return jnp.where(real.reshape(real.shape + (1,) * (buffer.ndim - 1)), seq, 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreePrefillAttentionPlan:
  """A tree prefill's prepared attention (a jit pytree): a uniform tree on the Mosaic GPU
  kernels, `sliced`, all levels on slices of the buffer in one custom VJP (`prefill_vjp`);
  any other tree one walked `TrainingAttentionPlan` a level (`levels`)."""

  levels: tuple[TrainingAttentionPlan, ...]  # () when sliced
  sliced: LevelsPlan | None

  @property
  def on_slices(self) -> bool:
    return self.sliced is not None

  @property
  def num_levels(self) -> int:
    return len(self.sliced.shapes) if self.on_slices else len(self.levels)


def prepare_tree_prefill(
    layout: TreePrefillLayout,
    level_q: Sequence,  # [B_d, C_d, N, H] a level: arrays or jax.ShapeDtypeStructs
    k_buffer,  # [L, K, H]: an array or a jax.ShapeDtypeStruct
    *,
    impl: AttentionImpl | str = AttentionImpl.AUTO,
    kv_block: int = 1024,
    interpret=False,
    kernel_config=None,
    slices: bool = True,
) -> TreePrefillAttentionPlan:
  """The tree's attention plan, once per batch layout (every layer reuses it).

  impl, kv_block, interpret, kernel_config: as in `prepare_training_attention` (MOSAIC_GPU:
  every level's ancestors and its nodes' causal self-attention on the Hopper kernels, forward
  and backward; a uniform tree's on slices of the buffer, one launch a level and ancestor
  level, `prefill_vjp`; any other's one launch per segment group and one for the level's
  causal parts). slices=False walks a uniform tree's levels too (to compare the two).
  """
  if not isinstance(layout, TreePrefillLayout):
    raise ValueError('layout must be a TreePrefillLayout (plan_tree_prefill(...).to_device()), '
                     f'got {type(layout).__name__}')
  _check_levels('level_q', level_q, layout)
  sliced, walked = prepare_levels(
      layout.layouts, [AttentionShapes.of(q, k_buffer) for q in level_q], layout.lengths[:-1],
      on_slices=slices and layout.uniform, impl=impl, kv_block=kv_block,
      kernel_config=kernel_config, interpret=interpret)
  return TreePrefillAttentionPlan(walked, sliced)


def _check_levels(name, level_x, layout: TreePrefillLayout) -> None:
  shapes = layout.level_shapes
  if len(level_x) != len(shapes):
    raise ValueError(f'{name} must hold one array a level ({len(shapes)}), got {len(level_x)}')
  for d, (x, shape) in enumerate(zip(level_x, shapes)):
    if len(x.shape) != 4 or tuple(x.shape[:2]) != shape:
      raise ValueError(f'{name}[{d}] must be [{shape[0]}, {shape[1]}, N, H], got '
                       f'{tuple(x.shape)}')


def attend_tree_prefill(
    level_q: Sequence[jax.Array],  # [B_d, C_d, N, H] a level
    k_buffer: jax.Array,  # [L, K, H] from `write_tree_kv`
    v_buffer: jax.Array,  # [L, K, H]
    plan: TreePrefillAttentionPlan,
    *,
    scale: float | None = None,
) -> tuple[PartialState, ...]:
  """Every level's causal tree attention: (out [B_d, C_d, N, H], lse [B_d, C_d, N]) a level.

  Differentiable in every array. A padding query (past its node's real tokens) sees its node's
  padding; mask its outputs out of the loss.
  """
  if not isinstance(plan, TreePrefillAttentionPlan):
    raise ValueError('plan must be a TreePrefillAttentionPlan (prepare_tree_prefill), got '
                     f'{type(plan).__name__}')
  if len(level_q) != plan.num_levels:
    raise ValueError(f'level_q must hold one array a level ({plan.num_levels}), got '
                     f'{len(level_q)}')
  if plan.on_slices:
    return attend_levels(level_q, k_buffer, v_buffer, plan.sliced, scale)
  return attend_levels_differentiable(level_q, k_buffer, v_buffer, plan.levels, scale=scale)


def tree_prefill_attention(
    level_q: Sequence[jax.Array],
    k_buffer: jax.Array,
    v_buffer: jax.Array,
    layout: TreePrefillLayout,
    *,
    scale: float | None = None,
    kv_block: int = 1024,
    impl: AttentionImpl | str = AttentionImpl.XLA,
    interpret=False,
    kernel_config=None,
) -> tuple[PartialState, ...]:
  """`attend_tree_prefill` with its plan prepared in the call: the one-call form (impl XLA by
  default; a model calling it every layer prepares once instead)."""
  plan = prepare_tree_prefill(layout, level_q, k_buffer, impl=impl, kv_block=kv_block,
                              interpret=interpret, kernel_config=kernel_config)
  return attend_tree_prefill(level_q, k_buffer, v_buffer, plan, scale=scale)
