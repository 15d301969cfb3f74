"""Plan once per batch layout, attend every layer: the prepared plan of the differentiable path.

    plan = prepare_training_attention(layout, AttentionShapes.of(q, k_layer))  # per batch
    for layer in range(num_layers):                                          # every layer
      out, lse = attend_differentiable(q, k_layer, v_layer, plan)            # custom VJP

`prepare_training_attention` resolves the kernels once (`dispatch.resolve_training`: its
device check and its fallback warning), and derives from the layout what both passes of the
custom VJP (`tree_attention_vjp`) walk: each part's rows, kv tokens and causal limits, and the
rows' index into the segments' states (`path_item_index`). Without a plan, every layer's
forward and backward derived them again. The plan is a jit pytree: the
layout and those arrays are leaves; the resolved kernels, the shapes, `kv_block`, the kernel
config and `interpret` are static.

Unlike `hydrajax.attend` there is no `kv_offset`: the training path attends one layer's buffer
[L, K, H] (the dK, dV it returns have that shape), e.g. `prefill_layout.write_kv`'s.
"""

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from hydrajax.attention import dispatch
from hydrajax.attention.plan import check_scale
from hydrajax.attention.dispatch import AttentionImpl
from hydrajax.layout import TreeLayout
from hydrajax.shapes import AttentionShapes
from hydrajax.partial_state import PartialState
from hydrajax.attention.training.tree_attention_vjp import (
    _Kernels, _levels_attention, _Part, _parts,
)
from hydrajax.attention.xla import path_item_index
from hydrajax.validation import check_tree_attention_inputs
from pallas_kernels.mosaic_gpu import training_attention as gpu_training
from pallas_kernels.tpu import training_attention as tpu_training

@dataclasses.dataclass(frozen=True)
class TrainingAttentionPlan:
  """A layout with its training kernels resolved and its part index arrays derived.

  Built once per batch layout by `prepare_training_attention`; a jit pytree (layout, parts and
  index are leaves, the rest static).
  """

  layout: TreeLayout
  parts: tuple[_Part, ...]  # the private part (if any), then one per segment group
  index: jax.Array | None  # [B, D] int32 `path_item_index` (None: a layout without paths)
  impl: AttentionImpl  # every part's forward, the private parts' backward: XLA or MOSAIC_GPU
  shared_backward: AttentionImpl  # the shared segments' backward: XLA, MOSAIC_GPU or MOSAIC_TPU
  shapes: AttentionShapes
  kv_block: int
  kernel_config: Any  # TrainingKernelConfig (Mosaic GPU), TrainingBlockSizes (TPU), or None
  interpret: Any  # the kernels' interpret mode (False when only XLA runs)

  @property
  def kernels(self) -> _Kernels:
    return _Kernels(self.impl, self.shared_backward, self.interpret, self.kernel_config)


jax.tree_util.register_dataclass(
    TrainingAttentionPlan,
    data_fields=['layout', 'parts', 'index'],
    meta_fields=['impl', 'shared_backward', 'shapes', 'kv_block', 'kernel_config', 'interpret'],
)


def _kernel_config_backend(config) -> AttentionImpl | None:
  """The kernels `config` tunes (None without one); TypeError for anything else."""
  if config is None:
    return None
  if isinstance(config, gpu_training.TrainingKernelConfig):
    return AttentionImpl.MOSAIC_GPU
  if isinstance(config, tpu_training.TrainingBlockSizes):
    return AttentionImpl.MOSAIC_TPU
  raise TypeError('kernel_config must be a TrainingKernelConfig (Mosaic GPU) or a '
                  f'TrainingBlockSizes (Mosaic TPU), got {type(config).__name__}')


def prepare_training_attention(
    layout: TreeLayout,
    shapes: AttentionShapes,
    *,
    impl: AttentionImpl | str = AttentionImpl.AUTO,
    shared_backward: AttentionImpl | str | None = None,
    kv_block: int = 1024,
    kernel_config=None,
    interpret=False,
) -> TrainingAttentionPlan:
  """Resolves the training kernels and derives the part index arrays; once per batch layout.

  Args:
    layout: the device layout (`SharingPlan.to_device()`).
    shapes: the static shapes of the calls (`AttentionShapes.of(q, one_layer_k_cache)`).
    impl: an `AttentionImpl` or its value. AUTO: MOSAIC_GPU on a Hopper GPU where the kernels
      support the shapes, else XLA (with an `AttentionFallbackWarning` naming the reason when
      the Hopper kernels were the candidate); on a TPU AUTO keeps XLA (the Mosaic TPU training
      kernels are tested in interpret mode only). XLA: all of it on XLA. MOSAIC_GPU: every
      part's forward and backward on the Hopper kernels of
      `pallas_kernels.mosaic_gpu.training_attention` (bf16 / f16 q and K/V, head dim a multiple
      of 64); only the merge of the parts stays on XLA. MOSAIC_TPU: the same on the Mosaic TPU
      kernels of `pallas_kernels.tpu.training_attention` (tested in interpret mode only).
      An explicit kernel that cannot run raises ValueError with the reason.
    shared_backward: the shared segments' dQ, dK, dV only: XLA, MOSAIC_GPU or MOSAIC_TPU
      (None: as `impl`).
    kv_block: kv tokens per block of scores in both passes of the XLA parts (bounds memory).
    kernel_config: the Mosaic GPU kernels' `TrainingKernelConfig` (None: its default, or in
      interpret mode its small `INTERPRET_CONFIG`), or the Mosaic TPU kernels'
      `pallas_kernels.tpu.training_attention.TrainingBlockSizes`; ignored when AUTO chose XLA.
    interpret: run the kernels in interpret mode (any machine, e.g. CPU tests): True, or for
      Mosaic TPU e.g. `pltpu.InterpretParams()`.
  """
  kv_block = checked_kv_block(kv_block)
  kernels = resolve_training_kernels(layout, shapes, impl=impl, shared_backward=shared_backward,
                                     kernel_config=kernel_config, interpret=interpret)
  return plan_resolved(layout, shapes, kernels, kv_block)


def plan_resolved(layout: TreeLayout, shapes: AttentionShapes, kernels: _Kernels,
                  kv_block: int) -> TrainingAttentionPlan:
  """The plan of kernels `resolve_training_kernels` chose for this layout and shapes (it
  checked them), with a checked kv_block: the part index arrays derived, nothing resolved or
  checked again."""
  return TrainingAttentionPlan(layout, _parts(layout, shapes, kv_block), path_item_index(layout),
                               kernels.impl, kernels.shared_backward, shapes, kv_block,
                               kernels.config, kernels.interpret)


def checked_kv_block(kv_block) -> int:
  """kv_block as an int, or ValueError unless it is an integer >= 1."""
  if isinstance(kv_block, bool) or not isinstance(kv_block, (int, np.integer)) or kv_block < 1:
    raise ValueError(f'kv_block must be an integer >= 1, got {kv_block!r}')
  return int(kv_block)


def resolve_training_kernels(
    layout: TreeLayout,
    shapes: AttentionShapes,
    *,
    impl: AttentionImpl | str = AttentionImpl.AUTO,
    shared_backward: AttentionImpl | str | None = None,
    kernel_config=None,
    interpret=False,
) -> _Kernels:
  """`prepare_training_attention`'s checks and choice of kernels (arguments as there), without
  deriving the layout's index arrays: for callers that run the kernels on slices of the buffer
  (`prefill_vjp.prepare_levels`)."""
  if not isinstance(shapes, AttentionShapes):
    raise ValueError(f'shapes must be an AttentionShapes, got {type(shapes).__name__}')
  kv = shapes.kv_struct()
  check_tree_attention_inputs(shapes.query_struct(), kv, kv, layout)
  tuned = _kernel_config_backend(kernel_config)
  forward, backward = dispatch.resolve_training(impl, shared_backward, shapes,
                                                interpret=interpret)
  if tuned is not None and tuned not in (forward, backward):
    if AttentionImpl(impl) is not AttentionImpl.AUTO:
      name = 'Mosaic GPU' if tuned is AttentionImpl.MOSAIC_GPU else 'Mosaic TPU'
      raise ValueError(f'kernel_config tunes the {name} kernels: pass it with impl or '
                       f'shared_backward {tuned.name}, got {forward.name} and {backward.name}')
    kernel_config = None  # AUTO chose XLA: the config of the kernels it did not choose
  if tuned is AttentionImpl.MOSAIC_TPU and AttentionImpl.MOSAIC_GPU in (forward, backward):
    raise ValueError('kernel_config (TrainingBlockSizes) tunes the Mosaic TPU kernels only; '
                     f'this plan runs {forward.name} and {backward.name}')
  if forward is AttentionImpl.XLA and backward is AttentionImpl.XLA:
    interpret = False  # one static form for all-XLA plans
  return _Kernels(forward, backward, interpret, kernel_config)


def check_call(q, k_cache, v_cache, plan: TrainingAttentionPlan) -> None:
  """ValueError naming the argument unless q, k_cache, v_cache have the planned shapes."""
  if not isinstance(plan, TrainingAttentionPlan):
    raise ValueError('plan must be a TrainingAttentionPlan (prepare_training_attention), got '
                     f'{type(plan).__name__}')
  check_planned_shapes(q, k_cache, v_cache, plan.shapes)


def check_planned_shapes(q, k_cache, v_cache, s: AttentionShapes) -> None:
  """ValueError naming the argument unless q, k_cache, v_cache have the shapes `s`."""
  expected_q = (s.num_rows, s.query_tokens, s.num_heads, s.head_dim)
  if tuple(q.shape) != expected_q:
    raise ValueError(f'q must be [B, T, N, H] = {expected_q} as planned, got {tuple(q.shape)}')
  expected_kv = (s.kv_tokens, s.num_kv_heads, s.head_dim)
  for name, x in (('k_cache', k_cache), ('v_cache', v_cache)):
    if tuple(x.shape) != expected_kv:  # one layer's buffer: its dK / dV have its shape
      raise ValueError(
          f'{name} must be one layer\'s [L, K, H] = {expected_kv} as planned, got '
          f'{tuple(x.shape)}'
      )
  if q.dtype != s.dtype or k_cache.dtype != s.kv_dtype or v_cache.dtype != s.kv_dtype:
    raise ValueError(
        f'dtypes must be q {s.dtype} and k/v {s.kv_dtype} as planned, got q {q.dtype}, '
        f'k {k_cache.dtype}, v {v_cache.dtype}'
    )


def attend_differentiable(
    q: jax.Array,  # [B, T, N, H]
    k_cache: jax.Array,  # [L, K, H]: one layer's buffer
    v_cache: jax.Array,  # [L, K, H]
    plan: TrainingAttentionPlan,
    *,
    scale: float | None = None,
) -> PartialState:
  """Tree attention over `plan`, differentiable in q, k_cache and v_cache (custom VJP).

  Returns (out [B, T, N, H] in q.dtype, lse [B, T, N] float32, natural log), differentiable
  through both. scale: softmax scale, H**-0.5 if None. Nothing derived from the layout is
  recomputed, in the forward or the backward.
  """
  check_call(q, k_cache, v_cache, plan)
  scale = check_scale(scale)
  scale = plan.shapes.head_dim**-0.5 if scale is None else scale
  return _levels_attention((q,), k_cache, v_cache, (plan.parts,), (plan.index,), scale,
                           (plan.kernels,))[0]


def attend_levels_differentiable(
    level_q: Sequence[jax.Array],  # one [B_d, T_d, N, H] a plan
    k_cache: jax.Array,  # [L, K, H]: one layer's buffer, shared by every plan
    v_cache: jax.Array,
    plans: Sequence[TrainingAttentionPlan],
    *,
    scale: float | None = None,
) -> tuple[PartialState, ...]:
  """`attend_differentiable` of several plans over one buffer (a prefill's levels), in one
  custom VJP: the backward adds every plan's dK, dV into one float32 buffer, not one a plan."""
  if len(level_q) != len(plans):
    raise ValueError(f'level_q must hold one array a plan ({len(plans)}), got {len(level_q)}')
  for q, plan in zip(level_q, plans):
    check_call(q, k_cache, v_cache, plan)
  scale = check_scale(scale)
  scale = plans[0].shapes.head_dim**-0.5 if scale is None else scale
  return _levels_attention(tuple(level_q), k_cache, v_cache, tuple(p.parts for p in plans),
                           tuple(p.index for p in plans), scale, tuple(p.kernels for p in plans))


def tree_attention_differentiable(
    q: jax.Array,  # [B, T, N, H]
    k_cache: jax.Array,  # [L, K, H]
    v_cache: jax.Array,  # [L, K, H]
    layout: TreeLayout,
    *,
    scale: float | None = None,
    kv_block: int = 1024,
    shared_backward: AttentionImpl | str | None = None,
    impl: AttentionImpl | str = 'xla',
    interpret=False,
    kernel_config=None,
) -> PartialState:
  """`hydrajax.tree_attention` (same semantics) with a flash-style custom VJP: the one-call form.

  The same as `attend_differentiable(q, k, v, prepare_training_attention(layout,
  AttentionShapes.of(q, k), ...))`; a model calling it
  every layer prepares once instead. Differentiable in q, k_cache, v_cache (and through both
  outputs: out and lse). Returns (out [B, T, N, H] in q.dtype, lse [B, T, N] float32, natural
  log).

  Args:
    scale: softmax scale, H**-0.5 if None.
    kv_block: kv tokens per block of scores in both passes (bounds memory).
    impl: XLA (the default), AUTO, MOSAIC_GPU (the shared segments' and the private (causal)
      parts' forward and backward by the Hopper kernels of
      `pallas_kernels.mosaic_gpu.training_attention`; bf16 / f16, head dim a multiple of 64;
      `interpret=True` runs them in Pallas interpret mode, e.g. on CPU; only the merge of the
      parts stays on XLA) or MOSAIC_TPU; an `AttentionImpl` or its value ('xla', ...). See
      `prepare_training_attention`.
    shared_backward: the shared segments' dQ, dK, dV only (None: as `impl`): XLA, MOSAIC_GPU
      or MOSAIC_TPU (the Mosaic TPU kernels of `pallas_kernels.tpu.training_attention`;
      `interpret`: their interpret mode, e.g. `pltpu.InterpretParams()` on CPU).
    kernel_config: the Mosaic GPU kernels' block sizes, a
      `pallas_kernels.mosaic_gpu.training_attention.TrainingKernelConfig` (None: its default,
      or in interpret mode its small `INTERPRET_CONFIG`), or the Mosaic TPU kernels', a
      `pallas_kernels.tpu.training_attention.TrainingBlockSizes`.
  """
  check_tree_attention_inputs(q, k_cache, v_cache, layout)
  plan = prepare_training_attention(
      layout, AttentionShapes.of(q, k_cache), impl=impl, shared_backward=shared_backward,
      kv_block=kv_block, kernel_config=kernel_config, interpret=interpret)
  return attend_differentiable(q, k_cache, v_cache, plan, scale=scale)
