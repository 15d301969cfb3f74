"""The causal prefill of a uniform token tree on the Mosaic GPU kernels, on slices of the buffer.

D levels of nodes, level d holding B_d nodes right-padded to a capacity C_d, lie in one buffer
in order (`join_levels`):

    [level 0 | pad to a page of C_1 | level 1 | pad to a page of C_2 | level 2 | ...]

Each node attends its ancestors' real tokens and itself, causally. The tree is uniform when
every node of a level has the same number of children (no leaf above the last level): then
the level-d nodes below a level-a node are B_d / B_a consecutive rows, and each part of the
attention is a static slice or a reshape of its inputs, with no gather:

* each level's own causal attention: one batched causal call, q [B_d, C_d] against its slice
  [B_d, C_d] of the buffer;
* level d over its ancestors at level a < d: one batched segment call, level-a node i against
  the queries of its descendants at level d, [B_d / B_a * C_d] rows (a reshape of q).

The prefill layout (`prefill_layout`: prompts, G completions each) is the two-level case; a
rollout tree (`tree_prefill`) any depth. Each level's states are LSE-merged on XLA. The
backward runs the same calls' backward kernels from the merged (lse, delta). A level's dK/dV
sums its own causal part and its segment parts below it, in float32, into one buffer (the
concatenation, which `join_levels`'s transpose slices back). With
`TrainingKernelConfig.prefill_dq_in_place`, a level's causal dQ is written in float32 and each
ancestor's segment kernel reduce-adds its own onto it; off, the parts are summed on XLA.

The general custom VJP (`tree_attention_vjp`) walks any tree: it gathers each part's queries
and K/V by index (copies), pads a dump row, and scatter-adds dK/dV and dQ back (all levels one
VJP with one float32 dK/dV buffer, `training_plan.attend_levels_differentiable`); this module's
contiguous slices cost a two-level prefill a fraction of that time outside the kernels.
Tested against the XLA path (`tests/test_gpu_training.py`).
"""

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hydrajax.attention.plan import check_scale
from hydrajax.attention.dispatch import AttentionImpl
from hydrajax.layout import TreeLayout
from hydrajax.shapes import AttentionShapes
from hydrajax.partial_state import PartialState, merge_many
from hydrajax.attention.training.training_plan import (
    TrainingAttentionPlan, check_planned_shapes, checked_kv_block, plan_resolved,
    resolve_training_kernels,
)
from hydrajax.attention.training.tree_attention_vjp import _Kernels
from pallas_kernels.mosaic_gpu import training_attention as gpu_training


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LevelsPlan:
  """A uniform tree whose every part resolved to the Mosaic GPU kernels (a jit pytree): what
  `attend_levels` needs. No index arrays: every part is a slice of the buffer."""

  segment_lengths: tuple[jax.Array, ...]  # [B_a] int32 real tokens, every level but the last
  shapes: tuple[AttentionShapes, ...] = dataclasses.field(metadata=dict(static=True))
  kernels: _Kernels = dataclasses.field(metadata=dict(static=True))


def prepare_levels(
    layouts: Sequence[TreeLayout],
    shapes: Sequence[AttentionShapes],
    segment_lengths: Sequence[jax.Array],
    *,
    on_slices: bool,
    impl: AttentionImpl | str,
    kv_block: int,
    kernel_config,
    interpret,
) -> tuple[LevelsPlan | None, tuple[TrainingAttentionPlan, ...]]:
  """Resolves each level's kernels once (`resolve_training_kernels`; level d: `layouts[d]`,
  `shapes[d]`). (LevelsPlan, ()) when `on_slices` (the caller's tree is uniform) and every part
  resolved to MOSAIC_GPU; else (None, each level's `TrainingAttentionPlan`), to walk."""
  kv_block = checked_kv_block(kv_block)
  kernels = [resolve_training_kernels(layout, s, impl=impl, kernel_config=kernel_config,
                                      interpret=interpret) for layout, s in zip(layouts, shapes)]
  if on_slices and all(k.impl is k.shared_backward is AttentionImpl.MOSAIC_GPU for k in kernels):
    return LevelsPlan(tuple(segment_lengths), tuple(shapes), kernels[-1]), ()
  return None, tuple(plan_resolved(layout, s, k, kv_block)
                     for layout, s, k in zip(layouts, shapes, kernels))


def attend_levels(level_q: Sequence[jax.Array], k_buffer: jax.Array, v_buffer: jax.Array,
                  plan: LevelsPlan, scale: float | None) -> tuple[PartialState, ...]:
  """`levels_attention_kernels` over `plan`, the call's shapes checked against it first."""
  for q, s in zip(level_q, plan.shapes):
    check_planned_shapes(q, k_buffer, v_buffer, s)
  scale = check_scale(scale)
  scale = level_q[0].shape[-1]**-0.5 if scale is None else scale
  return levels_attention_kernels(tuple(level_q), k_buffer, v_buffer, plan.segment_lengths,
                                  scale, plan.kernels)


def level_starts(level_shapes: Sequence[tuple[int, int]]) -> tuple[tuple[int, ...], int]:
  """(buffer index of each level's first slot, the buffer's length L) for levels of (B_d,
  C_d): a level starts at the first page of its capacity after the one above."""
  starts, end = [], 0
  for b, c in level_shapes:
    starts.append(-(-end // c) * c)
    end = starts[-1] + b * c
  return tuple(starts), end


def join_levels(levels: Sequence[jax.Array]) -> jax.Array:
  """Each level's [B_d, C_d, ...] -> the buffer [L, ...] in the levels' order (zeros between
  levels), in levels[0]'s dtype."""
  rest = levels[0].shape[2:]
  starts, _ = level_starts([x.shape[:2] for x in levels])
  pieces, end = [], 0
  for x, start in zip(levels, starts):
    if start > end:
      pieces.append(jnp.zeros((start - end,) + rest, levels[0].dtype))
    pieces.append(x.reshape((-1,) + rest).astype(levels[0].dtype))
    end = start + x.shape[0] * x.shape[1]
  return jnp.concatenate(pieces)


def split_levels(buffer: jax.Array, level_shapes: Sequence[tuple[int, int]]) -> list[jax.Array]:
  """`join_levels`'s inverse: buffer [L, ...] -> each level's [B_d, C_d, ...] (static slices)."""
  starts, _ = level_starts(level_shapes)
  return [buffer[s:s + b * c].reshape((b, c) + buffer.shape[1:])
          for (b, c), s in zip(level_shapes, starts)]


def _under(x, nodes):
  """A level's [B_d, C_d, ...] -> [nodes, B_d / nodes * C_d, ...]: the rows below each of an
  upper level's `nodes` nodes (a uniform tree keeps them consecutive)."""
  return x.reshape((nodes, -1) + x.shape[2:])


def _shapes(level_q):
  return [tuple(q.shape[:2]) for q in level_q]


def _forward(level_q, k_buffer, v_buffer, segment_lengths, scale, kernels):
  kw = dict(scale=scale, interpret=kernels.interpret, config=kernels.config)
  shapes = _shapes(level_q)
  ks, vs = split_levels(k_buffer, shapes), split_levels(v_buffer, shapes)
  states = []
  for d, q in enumerate(level_q):
    ancestors = []
    for a in range(d):  # every level above: each of its nodes one segment of its rows below
      out, lse = gpu_training.segments_forward(_under(q, shapes[a][0]), ks[a], vs[a],
                                               segment_lengths[a], **kw)
      ancestors.append(PartialState(out.reshape(q.shape), lse.reshape(q.shape[:3])))
    own = PartialState(*gpu_training.causal_forward(q, ks[d], vs[d], shapes[d][1], **kw))
    states.append(merge_many(ancestors + [own], out_dtype=q.dtype) if ancestors else own)
  return tuple(states)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def levels_attention_kernels(level_q, k_buffer, v_buffer, segment_lengths, scale, kernels):
  """Every level's state (out [B_d, C_d, N, H], lse [B_d, C_d, N]) of a uniform tree.

  level_q: a tuple of each level's queries [B_d, C_d, N, H]; k_buffer, v_buffer [L, K, H] in
  the levels' order (`join_levels`); segment_lengths: a tuple of [B_a] int32, the real tokens
  of every level's nodes but the last (what the levels below attend); kernels: the resolved
  `tree_attention_vjp._Kernels` (their interpret mode and config). A padding query (past its
  node's real tokens) sees its node's padding.
  """
  return _forward(level_q, k_buffer, v_buffer, segment_lengths, scale, kernels)


def _fwd(level_q, k_buffer, v_buffer, segment_lengths, scale, kernels):
  states = _forward(level_q, k_buffer, v_buffer, segment_lengths, scale, kernels)
  return states, (level_q, k_buffer, v_buffer, segment_lengths, states)


def _delta(state, cotangent):
  """rowsum(dO * O) - dlse [.., N] float32, and dO in the output's dtype."""
  d_out, d_lse = cotangent
  delta = jnp.sum(d_out.astype(jnp.float32) * state.out.astype(jnp.float32), axis=-1)
  return delta - d_lse.astype(jnp.float32), d_out.astype(state.out.dtype)


def _sum_parts(parts, dtype):
  """One level's dK (or dV) parts summed in float32 (a single part as it is)."""
  if len(parts) == 1:
    return parts[0].astype(dtype)
  return sum(x.astype(jnp.float32) for x in parts).astype(dtype)


def _bwd(scale, kernels, residuals, cotangents):
  kw = dict(scale=scale, interpret=kernels.interpret, config=kernels.config)
  in_place = gpu_training.config_or_default(kernels.config, kernels.interpret).prefill_dq_in_place
  level_q, k_buffer, v_buffer, segment_lengths, states = residuals
  shapes = _shapes(level_q)
  ks, vs = split_levels(k_buffer, shapes), split_levels(v_buffer, shapes)
  dk_parts, dv_parts = [[] for _ in shapes], [[] for _ in shapes]
  dqs = []
  for d, (q, state, cotangent) in enumerate(zip(level_q, states, cotangents)):
    delta, do = _delta(state, cotangent)
    lse = state.lse
    # The own causal part first: its dQ in float32 when segment kernels add onto it.
    dq, dk, dv = gpu_training.causal_backward(q, ks[d], vs[d], do, lse, delta, shapes[d][1],
                                    dq_dtype=jnp.float32 if d and in_place else None, **kw)
    dk_parts[d].append(dk)
    dv_parts[d].append(dv)
    summed = [] if in_place else [dq.astype(jnp.float32)]
    for a in range(d):
      rows = lambda x: _under(x, shapes[a][0])
      last = a == d - 1
      dq_a, dk, dv = gpu_training.segments_backward(
          rows(q), ks[a], vs[a], rows(do), rows(lse), rows(delta), segment_lengths[a], **kw,
          **(dict(dq_init=rows(dq), dq_dtype=q.dtype if last else jnp.float32) if in_place
             else dict(dq_dtype=jnp.float32)))
      if in_place:
        dq = dq_a.reshape(q.shape)
      else:
        summed.append(dq_a.reshape(q.shape))
      dk_parts[a].append(dk)
      dv_parts[a].append(dv)
    dqs.append(dq if in_place or not d else sum(summed).astype(q.dtype))
  dk = join_levels([_sum_parts(p, k_buffer.dtype) for p in dk_parts])
  dv = join_levels([_sum_parts(p, v_buffer.dtype) for p in dv_parts])
  no_grad = tuple(np.zeros(x.shape, jax.dtypes.float0) for x in segment_lengths)
  return tuple(dqs), dk, dv, no_grad


levels_attention_kernels.defvjp(_fwd, _bwd)
