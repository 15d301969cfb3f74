"""The causal "prefill" (training) layout: prompts once, G completions each.

A training batch of GRPO-style groups holds `num_prompts` prompts (right-padded
to one capacity P) and G completions of T tokens per prompt. Every token's
K/V is written once into one flat buffer [L, K, H]:

    [prompt 0 | ... | prompt Bp-1 | pad to a page of T | completion 0 | ... | completion Bp*G-1]

and two `TreeLayout`s index it:

* `prompt_layout`: Bp rows of T = P queries, each causal over its own prompt
  (private KV of one page of P tokens). A prompt's padding sits after its
  real tokens, so it never reaches them.
* `completion_layout`: Bp * G rows of T queries: prompt i is a shared segment
  (its real tokens only) of its G rows, and each completion is causal over
  itself (private KV of one page of T tokens). Completions are right-padded to
  T; padding queries come after the real ones and are masked out of the loss.

Completion row r belongs to prompt r // G; its token j sits at sequence
position `prompt_lengths[r // G] + j` (RoPE).

A model attends both every layer: `prepare_prefill_attention` once (the two layouts'
`TrainingAttentionPlan`s), then `attend_prefill` per layer; `prefill_attention` is the
one-call form.
"""

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hydrajax.shapes import AttentionShapes
from hydrajax.attention.dispatch import AttentionImpl
from hydrajax.layout import Segment, SharingPlan, TreeLayout, as_int
from hydrajax.attention.parallel import ShardedLayout, stack_shards
from hydrajax.partial_state import PartialState
from hydrajax.attention.training.prefill_vjp import (
    LevelsPlan, attend_levels, join_levels, prepare_levels,
)
from hydrajax.attention.training.training_plan import (
    TrainingAttentionPlan, attend_levels_differentiable,
)
from hydrajax.validation import check_tree_attention_inputs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillLayout:
  """Device form of a prefill plan (a jit pytree); see the module docstring."""

  prompt_layout: TreeLayout
  completion_layout: TreeLayout
  prompt_slots: jax.Array  # [Bp, P] int32: buffer index of each prompt token
  completion_slots: jax.Array  # [Bp * G, T] int32
  prompt_lengths: jax.Array  # [Bp] int32
  completion_positions: jax.Array  # [Bp * G, T] int32: sequence positions (RoPE)
  group_size: int = dataclasses.field(metadata=dict(static=True))
  kv_tokens: int = dataclasses.field(metadata=dict(static=True))  # L

  @property
  def num_prompts(self) -> int:
    return self.prompt_slots.shape[0]


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
  """Host side: the two sharing plans and where every token lives."""

  prompt_plan: SharingPlan
  completion_plan: SharingPlan
  prompt_lengths: tuple[int, ...]
  prompt_capacity: int  # P
  group_size: int  # G
  completion_length: int  # T

  @property
  def kv_tokens(self) -> int:
    return self.completion_plan.kv_tokens

  def shards(self, num_shards: int) -> tuple['PrefillPlan', ...]:
    """The plans of `num_shards` data-parallel shards: shard d holds prompts [d Bp / dp,
    (d + 1) Bp / dp) and their completions, with this plan's P, G and T (one static shape)."""
    bp = len(self.prompt_lengths)
    if as_int(num_shards, 'num_shards') < 1 or bp % num_shards:
      raise ValueError(f'num_shards (dp) must be >= 1 and divide the {bp} prompts, got '
                       f'{num_shards}')
    per = bp // num_shards
    return tuple(plan_prefill(self.prompt_lengths[d * per:(d + 1) * per], self.group_size,
                              self.completion_length, prompt_capacity=self.prompt_capacity)
                 for d in range(num_shards))

  def to_device_sharded(self, num_shards: int, sharding=None) -> ShardedLayout:
    """The shards' layouts (`shards`) stacked, every leaf [dp, ...] (`stack_shards`;
    `sharding`, e.g. `NamedSharding(mesh, P('dp'))`, places them in one upload)."""
    return stack_shards([plan.to_device() for plan in self.shards(num_shards)], sharding)

  def to_device(self) -> PrefillLayout:
    bp, p = len(self.prompt_lengths), self.prompt_capacity
    g, t = self.group_size, self.completion_length
    first_page = -(-bp * p // t)
    prompt_slots = np.arange(bp * p, dtype=np.int32).reshape(bp, p)
    completion_slots = (first_page * t + np.arange(bp * g * t, dtype=np.int32)).reshape(bp * g, t)
    lengths = np.asarray(self.prompt_lengths, np.int32)
    positions = np.repeat(lengths, g)[:, None] + np.arange(t, dtype=np.int32)[None, :]
    return PrefillLayout(
        prompt_layout=self.prompt_plan.to_device(bucket=False),
        completion_layout=self.completion_plan.to_device(bucket=False),
        prompt_slots=jnp.asarray(prompt_slots),
        completion_slots=jnp.asarray(completion_slots),
        prompt_lengths=jnp.asarray(lengths),
        completion_positions=jnp.asarray(positions.astype(np.int32)),
        group_size=g,
        kv_tokens=self.kv_tokens,
    )


def plan_prefill(
    prompt_lengths: Sequence[int],
    group_size: int,
    completion_length: int,
    *,
    prompt_capacity: int | None = None,
) -> PrefillPlan:
  """Plans Bp = len(prompt_lengths) prompts with `group_size` completions of T tokens each.

  Args:
    prompt_lengths: real tokens of each prompt (>= 1).
    group_size: G, completions per prompt.
    completion_length: T, tokens per completion (completions are right-padded to it).
    prompt_capacity: P, the padded prompt width (default: the longest prompt).
  """
  lengths = tuple(int(n) for n in prompt_lengths)
  if not lengths or min(lengths) < 1:
    raise ValueError(f'prompt_lengths must be a non-empty list of ints >= 1, got {lengths}')
  if group_size < 1:
    raise ValueError(f'group_size must be >= 1, got {group_size}')
  if completion_length < 1:
    raise ValueError(f'completion_length must be >= 1, got {completion_length}')
  p = max(lengths) if prompt_capacity is None else int(prompt_capacity)
  if p < max(lengths):
    raise ValueError(f'prompt_capacity={p} is below the longest prompt ({max(lengths)})')
  bp, g, t = len(lengths), group_size, completion_length
  first_page = -(-bp * p // t)
  kv_tokens = (first_page + bp * g) * t
  prompt_plan = SharingPlan(
      num_rows=bp, segments=(), page_size=p, private_pages=tuple((i,) for i in range(bp)),
      private_lengths=(p,) * bp, kv_tokens=kv_tokens,
  )
  segments = tuple(
      Segment(kv_start=i * p, kv_length=n, row_begin=i * g, row_end=(i + 1) * g,
              label=f'prompt{i}', kv_capacity=p)
      for i, n in enumerate(lengths)
  )
  completion_plan = SharingPlan(
      num_rows=bp * g, segments=segments, page_size=t,
      private_pages=tuple((first_page + r,) for r in range(bp * g)),
      private_lengths=(t,) * (bp * g), kv_tokens=kv_tokens,
  )
  return PrefillPlan(prompt_plan, completion_plan, lengths, p, g, t)


def write_kv(layout: PrefillLayout, prompt_kv: jax.Array, completion_kv: jax.Array) -> jax.Array:
  """prompt_kv [Bp, P, K, H] and completion_kv [Bp * G, T, K, H] -> the flat buffer [L, K, H].

  The slots are the buffer's order (`PrefillPlan.to_device`), so this is a concatenation and
  its transpose slices every token's dK / dV back (no scatter, no gather).
  """
  for name, kv, slots in (('prompt_kv', prompt_kv, layout.prompt_slots),
                          ('completion_kv', completion_kv, layout.completion_slots)):
    if kv.ndim != 4 or kv.shape[:2] != slots.shape or kv.shape[2:] != prompt_kv.shape[2:]:
      raise ValueError(f'{name} must be [{", ".join(map(str, slots.shape))}, K, H] (K, H as '
                       f'prompt_kv\'s), got {kv.shape}')
  return join_levels((prompt_kv, completion_kv))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillAttentionPlan:
  """The prefill's prepared attention (a jit pytree): on the Mosaic GPU kernels, `sliced`,
  both levels on slices of the buffer (`prefill_vjp`); else the prompts' and the completions'
  walked plans (`prompt`, `completion`)."""

  prompt: TrainingAttentionPlan | None
  completion: TrainingAttentionPlan | None
  sliced: LevelsPlan | None

  @property
  def on_slices(self) -> bool:
    return self.sliced is not None


def prepare_prefill_attention(
    layout: PrefillLayout,
    q_prompt,  # [Bp, P, N, H]: an array or a jax.ShapeDtypeStruct (its shape and dtype)
    q_completion,  # [Bp * G, T, N, H]
    k_buffer,  # [L, K, H]
    *,
    impl: AttentionImpl | str = AttentionImpl.AUTO,
    kv_block: int = 1024,
    interpret: bool = False,
    kernel_config=None,
) -> PrefillAttentionPlan:
  """The plan of `attend_prefill`, once per batch layout (every layer reuses it).

  impl, kv_block, interpret, kernel_config: as in `prepare_training_attention` (MOSAIC_GPU:
  all of it on the Hopper kernels: the completions' shared prompts, each completion's causal
  self-attention and each prompt's own causal attention, called on slices of the buffer
  (`prefill_vjp`); only the LSE merge and the gradient sums stay on XLA).
  """
  if not isinstance(layout, PrefillLayout):
    raise ValueError(
        f'layout must be a PrefillLayout (plan_prefill(...).to_device()), got '
        f'{type(layout).__name__}'
    )
  trees = (layout.prompt_layout, layout.completion_layout)
  for q, tree in zip((q_prompt, q_completion), trees):
    check_tree_attention_inputs(q, k_buffer, k_buffer, tree)
  sliced, walked = prepare_levels(
      trees, [AttentionShapes.of(q, k_buffer) for q in (q_prompt, q_completion)],
      (layout.prompt_lengths,), on_slices=True, impl=impl, kv_block=kv_block,
      kernel_config=kernel_config, interpret=interpret)
  return PrefillAttentionPlan(*(walked or (None, None)), sliced=sliced)


def attend_prefill(
    q_prompt: jax.Array,  # [Bp, P, N, H]
    q_completion: jax.Array,  # [Bp * G, T, N, H]
    k_buffer: jax.Array,  # [L, K, H] from `write_kv`
    v_buffer: jax.Array,  # [L, K, H]
    plan: PrefillAttentionPlan,
    *,
    scale: float | None = None,
) -> tuple[PartialState, PartialState]:
  """Causal attention of the prompts and of the completions (over their shared prompt).

  Differentiable in every array. Returns the prompt state (out [Bp, P, N, H], lse [Bp, P, N])
  and the completion state (out [Bp * G, T, N, H], ...).
  """
  if not isinstance(plan, PrefillAttentionPlan):
    raise ValueError('plan must be a PrefillAttentionPlan (prepare_prefill_attention), got '
                     f'{type(plan).__name__}')
  if plan.on_slices:
    return attend_levels((q_prompt, q_completion), k_buffer, v_buffer, plan.sliced, scale)
  return attend_levels_differentiable((q_prompt, q_completion), k_buffer, v_buffer,
                                      (plan.prompt, plan.completion), scale=scale)


def prefill_attention(
    q_prompt: jax.Array,  # [Bp, P, N, H]
    q_completion: jax.Array,  # [Bp * G, T, N, H]
    k_buffer: jax.Array,  # [L, K, H] from `write_kv`
    v_buffer: jax.Array,  # [L, K, H]
    layout: PrefillLayout,
    *,
    scale: float | None = None,
    kv_block: int = 1024,
    impl: AttentionImpl | str = AttentionImpl.XLA,
    interpret: bool = False,
    kernel_config=None,
) -> tuple[PartialState, PartialState]:
  """`attend_prefill` with its plan prepared in the call: the one-call form.

  impl (XLA by default), kv_block, interpret, kernel_config: as in
  `prepare_prefill_attention`. A model calling it every layer prepares once instead.
  """
  plan = prepare_prefill_attention(layout, q_prompt, q_completion, k_buffer, impl=impl,
                                   kv_block=kv_block, interpret=interpret,
                                   kernel_config=kernel_config)
  return attend_prefill(q_prompt, q_completion, k_buffer, v_buffer, plan, scale=scale)


def unshared_sequences(prompts: jax.Array, completions: jax.Array, prompt_lengths: jax.Array,
                       group_size: int) -> jax.Array:
  """Each sample's own sequence [Bp * G, P + T]: its prompt's real tokens, its completion, 0s.

  prompts [Bp, P], completions [Bp * G, T] (any trailing dims, e.g. [..., K, H] of K/V).
  What a model without sharing sees; the padding sits at the end (causal: harmless).
  """
  p, t = prompts.shape[1], completions.shape[1]
  lengths = jnp.repeat(prompt_lengths, group_size)  # [B]
  pos = jnp.arange(p + t)[None, :]  # [1, P + T]
  in_prompt = pos < lengths[:, None]
  in_completion = (pos >= lengths[:, None]) & (pos < lengths[:, None] + t)
  prompt_part = jnp.repeat(prompts, group_size, axis=0)[
      jnp.arange(lengths.shape[0])[:, None], jnp.minimum(pos, p - 1)]
  completion_part = completions[
      jnp.arange(lengths.shape[0])[:, None], jnp.clip(pos - lengths[:, None], 0, t - 1)]
  expand = lambda m: m.reshape(m.shape + (1,) * (completions.ndim - 2))
  zeros = jnp.zeros_like(completion_part)
  return jnp.where(expand(in_prompt), prompt_part,
                   jnp.where(expand(in_completion), completion_part, zeros))
