"""Data parallel generation: a prompt forest's sharing groups split over the `dp` shards.

A sharing group is a root of the forest (a system prompt and everything under
it, or a token list's radix tree root): its rows attend only its own KV, so a
group never crosses shards. `assign_groups` balances the groups over the
shards by KV tokens (then rows), largest first. Each shard plans its own
groups as one device would (`plan_forest`), then every shard is padded to one
static shape: the same rows (a padding group of one token whose rows are
dropped from the output; a shard without groups gets only that) and the same
KV buffer length L_s. Shard d owns rows [d R, (d+1) R) and tokens
[d L_s, (d+1) L_s) of the one KV buffer, whose token axis is sharded over
`dp` by the rules table; the per-shard layouts are stacked into a
`hydrajax.attention.parallel.ShardedLayout`, so prefill and decode are each one program
over the mesh.
"""

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from hydrajax import SharingPolicy
from hydrajax.attention import parallel
from models.prompt_plan import (PREFILL_PAGE, ForestNode, PrefillCall, RowSpec, TreePrompts,
                                plan_forest, prefill_call, prefill_rounds, prefill_shape,
                                private_capacity, tree_rows)


def assign_groups(sizes: Sequence[tuple[int, int]], num_shards: int) -> list[list[int]]:
  """Group indices per shard, balanced by (KV tokens, rows): largest group first, to the
  least loaded shard. sizes: (KV tokens, rows) per group. Each shard's groups in input order."""
  if num_shards < 1:
    raise ValueError(f'num_shards (dp) must be >= 1, got {num_shards}')
  load = [(0, 0)] * num_shards
  shards: list[list[int]] = [[] for _ in range(num_shards)]
  for g in sorted(range(len(sizes)), key=lambda g: (-sizes[g][0], -sizes[g][1], g)):
    d = min(range(num_shards), key=lambda d: (load[d], d))
    shards[d].append(g)
    load[d] = (load[d][0] + sizes[g][0], load[d][1] + sizes[g][1])
  return [sorted(s) for s in shards]


def _size(root: ForestNode, capacity: int) -> tuple[int, int]:
  """(KV tokens, rows) of a group: its nodes' tokens plus a private region per row."""
  tokens, rows, stack = 0, 0, [root]
  while stack:
    n = stack.pop()
    tokens += len(n.tokens)
    rows += 0 if n.children else n.num_samples
    stack += n.children
  return tokens + rows * capacity, rows


@dataclasses.dataclass(frozen=True)
class ShardedPrompts:
  """A forest planned per dp shard; every shard has the same rows and KV tokens (L_s)."""

  shards: tuple[TreePrompts, ...]

  @property
  def num_shards(self) -> int:
    return len(self.shards)

  @property
  def num_rows(self) -> int:
    return sum(s.num_rows for s in self.shards)

  @property
  def kv_tokens(self) -> int:
    """The whole buffer: dp x L_s."""
    return sum(s.kv_tokens for s in self.shards)

  @property
  def prompt_ids(self) -> np.ndarray:
    """[B] global rows' prompts; -1 for padding rows."""
    return np.concatenate([s.prompt_ids for s in self.shards])

  @property
  def sample_ids(self) -> np.ndarray:
    return np.concatenate([s.sample_ids for s in self.shards])

  @property
  def row_node(self) -> np.ndarray:
    """Per global row, its last prompt node as a global node id (`node_offsets`)."""
    return np.concatenate([s.row_node + o for s, o in zip(self.shards, self.node_offsets())])

  def node_offsets(self) -> list[int]:
    return np.cumsum([0] + [len(s.nodes) for s in self.shards])[:-1].tolist()


def plan_shards(forest: list[ForestNode], num_shards: int, max_new_tokens: int) -> ShardedPrompts:
  """The forest's groups assigned to `num_shards` shards, each planned, padded to one shape.

  Fewer groups than shards is allowed: the idle shards run padding rows only.
  """
  capacity = private_capacity(max_new_tokens)
  sizes = [_size(root, capacity) for root in forest]
  groups = assign_groups(sizes, num_shards)
  rows = max(sum(sizes[g][1] for g in gs) for gs in groups)
  planned = []
  for gs in groups:
    roots = [forest[g] for g in gs]
    pad = rows - sum(sizes[g][1] for g in gs)
    if pad:  # padding rows (prompt -1): one token, dropped from the output
      roots.append(ForestNode((0,), [], pad))
    planned.append(plan_forest(roots, max_new_tokens))
  length = max(tp.kv_tokens for tp in planned)
  length = -(-length // capacity) * capacity  # whole decode pages per shard
  return ShardedPrompts(tuple(
      dataclasses.replace(tp, plan=dataclasses.replace(tp.plan, kv_tokens=length))
      for tp in planned))


def prefill_calls(sp: ShardedPrompts, chunk: int
                  ) -> list[tuple[PrefillCall, parallel.ShardedLayout]]:
  """Prefill rounds of every shard at once: (the joined call, its per-shard layouts).

  Every shard's calls have one shape (T, rows, private width); a shard with fewer rounds
  runs empty ones. Write slots are global (shard d's tokens start at d L_s), node ids too.
  """
  t, width = prefill_shape(sp.shards, chunk)
  rounds = [prefill_rounds(tp, t) for tp in sp.shards]
  num_rows = max(len(work) for r in rounds for work in r)
  offsets = sp.node_offsets()
  out = []
  for i in range(max(len(r) for r in rounds)):
    calls = [prefill_call(tp, r[i] if i < len(r) else [], t, width, num_rows)
             for tp, r in zip(sp.shards, rounds)]
    base = [d * tp.kv_tokens for d, tp in enumerate(sp.shards)]
    joined = PrefillCall(
        tokens=np.concatenate([c.tokens for c in calls]),
        positions=np.concatenate([c.positions for c in calls]),
        write_slots=np.concatenate([c.write_slots + b for c, b in zip(calls, base)]),
        plan=parallel.join_plans([c.plan for c in calls]),
        max_private_pages=width // PREFILL_PAGE,
        last_index=np.concatenate([c.last_index for c in calls]),
        segment_ids=np.concatenate([np.where(c.segment_ids >= 0, c.segment_ids + o, -1)
                                    for c, o in zip(calls, offsets)]),
    )
    layout = parallel.stack_layouts([c.plan for c in calls],
                                    max_private_pages=width // PREFILL_PAGE)
    out.append((joined, layout))
  return out


def decode_layout(sp: ShardedPrompts, policy: SharingPolicy, *, group_size: int,
                  sequence_ids: np.ndarray) -> tuple[parallel.ShardedLayout, RowSpec]:
  """The decode tree of every shard (after `policy`), stacked, and the global rows."""
  plans = [policy.apply(tp.plan, group_size=group_size) for tp in sp.shards]
  rows = [tree_rows(tp, p) for tp, p in zip(sp.shards, plans)]
  cat = lambda field: jnp.concatenate([getattr(r, field) for r in rows])
  base = np.repeat([d * tp.kv_tokens for d, tp in enumerate(sp.shards)],
                   [tp.num_rows for tp in sp.shards]).astype(np.int32)  # shard d's tokens
  spec = RowSpec(positions=cat('positions'), write_base=cat('write_base') + base,
                 private_base=cat('private_base'), sequence_ids=jnp.asarray(sequence_ids))
  return parallel.stack_layouts(plans), spec
