"""The registry of tree-attention implementations and the one place where one is chosen.

`IMPLEMENTATIONS` maps each concrete `AttentionImpl` to its inference backend (a module with
the protocol of `hydrajax.attention.plan`); `TRAINING_KERNELS` maps the implementations that
have their own training kernels (the differentiable path's XLA runs anything). One resolver
serves both: `resolve_backend` for inference, `resolve_training` for the custom VJP's forward
and shared backward.

AUTO picks the kernel of this machine's accelerator (`default_kernel`) where it supports the
inputs, else XLA; such a fallback is visible: an `AttentionFallbackWarning` once per (kernel,
reason), a log line, and the plan's `impl` says what runs. An explicit kernel that cannot run
raises ValueError with the reason; with `interpret=True` the Mosaic kernels run on any
machine (interpret mode).

A backend's protocol: `DEFAULT_CONFIG`, `default_config(*, interpret)`,
`unsupported_reason(shapes, layout, *, interpret)`, `prepare(layout, shapes, config, *, interpret)`,
`attend(q, k_cache, v_cache, prepared, *, shapes, config, kv_offset, scale, interpret)`,
`with_private_lengths(prepared, lengths)` and `for_step(prepared)`.
"""

import enum
import logging
import types
import warnings

from hydrajax import devices
from hydrajax.attention import xla
from hydrajax.layout import TreeLayout
from hydrajax.shapes import AttentionShapes
from pallas_kernels.mosaic_gpu import training_attention as gpu_training
from pallas_kernels.mosaic_gpu import tree_attention as mosaic_gpu
from pallas_kernels.tpu import training_attention as tpu_training
from pallas_kernels.tpu import tree_attention as mosaic_tpu

log = logging.getLogger(__name__)


class AttentionImpl(enum.Enum):
  AUTO = 'auto'  # the kernel for this backend where it supports the shapes, else XLA
  XLA = 'xla'  # pure jnp, any backend
  MOSAIC_GPU = 'mosaic_gpu'  # Pallas Mosaic GPU kernels (Hopper)
  MOSAIC_TPU = 'mosaic_tpu'  # Pallas Mosaic TPU kernels

  @classmethod
  def _missing_(cls, value):
    """Names in any case ('XLA'); else a ValueError listing the names."""
    if isinstance(value, str):
      for member in cls:
        if member.value == value.lower():
          return member
    raise ValueError(
        f'impl must be an AttentionImpl or one of {[m.value for m in cls]}, got {value!r}')


class AttentionFallbackWarning(UserWarning):
  """AUTO could not use this machine's kernel and runs XLA instead (the message says why)."""


IMPLEMENTATIONS: dict[AttentionImpl, types.ModuleType] = {
    AttentionImpl.XLA: xla,
    AttentionImpl.MOSAIC_GPU: mosaic_gpu,
    AttentionImpl.MOSAIC_TPU: mosaic_tpu,
}

TRAINING_KERNELS: dict[AttentionImpl, types.ModuleType] = {
    AttentionImpl.MOSAIC_GPU: gpu_training,
    AttentionImpl.MOSAIC_TPU: tpu_training,
}

# The kernels of the shared segments' backward of the differentiable path.
SHARED_BACKWARDS = (AttentionImpl.XLA, AttentionImpl.MOSAIC_GPU, AttentionImpl.MOSAIC_TPU)


def device_reason(impl: AttentionImpl, *, interpret: bool = False) -> str | None:
  """Why `impl` cannot run on this machine, or None (interpret mode runs anywhere)."""
  impl = AttentionImpl(impl)
  if impl is AttentionImpl.XLA:
    return None
  if impl is AttentionImpl.MOSAIC_GPU:
    return devices.with_interpret_hint(devices.hopper_reason(), interpret=interpret)
  if impl is AttentionImpl.MOSAIC_TPU:
    return devices.with_interpret_hint(devices.tpu_reason(), interpret=interpret)
  raise ValueError(f'device_reason needs a concrete implementation, got {impl}')


def default_kernel() -> AttentionImpl | None:
  """The kernel AUTO tries on this machine, or None (then AUTO is XLA)."""
  if devices.tpu_reason() is None:
    return AttentionImpl.MOSAIC_TPU
  if devices.is_hopper():
    return AttentionImpl.MOSAIC_GPU
  return None


def backend(impl: AttentionImpl) -> types.ModuleType:
  """The inference backend of a concrete implementation."""
  return IMPLEMENTATIONS[AttentionImpl(impl)]


_warned: set[tuple[AttentionImpl, str]] = set()


def fallback(kernel: AttentionImpl, reason: str, *, source: str = 'tree_attention') -> None:
  """AUTO's visible fallback from `kernel` to XLA: a log line, and an `AttentionFallbackWarning`
  once per (kernel, reason). `source` names the caller's path (e.g. 'training attention')."""
  message = f'{source}: falling back to XLA from {kernel.name}: {reason}'
  log.info(message)
  if (kernel, reason) not in _warned:
    _warned.add((kernel, reason))
    warnings.warn(message, AttentionFallbackWarning, stacklevel=4)


def training_unsupported_reason(
    impl: AttentionImpl | str, shapes: AttentionShapes, *, interpret=False
) -> str | None:
  """Why `impl`'s training kernels cannot run `shapes` here, or None (XLA runs anything).

  The device check is `device_reason`'s; the Mosaic GPU kernels' own limits (dtype, head dim)
  are their module's `unsupported_reason`.
  """
  impl = AttentionImpl(impl)
  reason = device_reason(impl, interpret=interpret)
  if reason is not None or impl is not AttentionImpl.MOSAIC_GPU:
    return reason
  return gpu_training.unsupported_reason(
      (shapes.dtype, shapes.kv_dtype, shapes.kv_dtype), shapes.head_dim)


def _reason(kernel, shapes, layout, *, interpret, training) -> str | None:
  if training:
    return training_unsupported_reason(kernel, shapes, interpret=interpret)
  return device_reason(kernel, interpret=interpret) or backend(kernel).unsupported_reason(
      shapes, layout, interpret=interpret)


def _choose(impl: AttentionImpl, shapes, layout, *, interpret, training,
            name: str = 'impl') -> AttentionImpl:
  """The one resolver: an explicit kernel runs or raises, AUTO tries this machine's kernel and
  falls back to XLA visibly. Training's AUTO tries the Mosaic GPU kernels only (the Mosaic TPU
  training kernels are tested in interpret mode only)."""
  if impl is AttentionImpl.XLA:
    return impl
  explicit = impl is not AttentionImpl.AUTO
  kernel = impl if explicit else default_kernel()
  if not explicit and training and kernel is not AttentionImpl.MOSAIC_GPU:
    kernel = None
  if kernel is None:
    return AttentionImpl.XLA
  reason = _reason(kernel, shapes, layout, interpret=interpret, training=training)
  if reason is None:
    return kernel
  if explicit:
    raise ValueError(f'{name}={kernel.name} does not support these inputs: {reason}')
  fallback(kernel, reason, source='training attention' if training else 'tree_attention')
  return AttentionImpl.XLA


def resolve_backend(
    impl: AttentionImpl | str, shapes: AttentionShapes, layout: TreeLayout, *,
    interpret: bool = False,
) -> tuple[AttentionImpl, types.ModuleType]:
  """(the implementation that will run, its inference backend): see the module docstring."""
  chosen = _choose(AttentionImpl(impl), shapes, layout, interpret=interpret, training=False)
  return chosen, backend(chosen)


def resolve(
    impl: AttentionImpl | str, q, k_cache, v_cache, layout: TreeLayout, *, interpret: bool = False
) -> tuple[AttentionImpl, types.ModuleType]:
  """`resolve_backend` for arrays (or ShapeDtypeStructs) q [B, T, N, H], k_cache [L, K, H]."""
  del v_cache
  return resolve_backend(impl, AttentionShapes.of(q, k_cache), layout, interpret=interpret)


def _as_impl(name: str, value, allowed) -> AttentionImpl:
  try:
    impl = AttentionImpl(value)
  except ValueError:
    impl = None
  if impl not in allowed:
    names = ', '.join(i.name for i in allowed)
    raise ValueError(f'{name} must be one of {names} (an AttentionImpl or its value), '
                     f'got {value!r}')
  return impl


def resolve_training(
    impl: AttentionImpl | str,
    shared_backward: AttentionImpl | str | None,
    shapes: AttentionShapes,
    *,
    interpret=False,
) -> tuple[AttentionImpl, AttentionImpl]:
  """(forward, shared backward) of the differentiable path that will run (see
  `hydrajax.attention.training.prepare_training_attention`): MOSAIC_TPU's kernels run the
  shared segments (forward and backward); `shared_backward` None is the forward's."""
  requested = _as_impl('impl', impl, tuple(AttentionImpl))
  forward = _choose(requested, shapes, None, interpret=interpret, training=True)
  if shared_backward is None:
    return forward, forward
  backward = _as_impl('shared_backward', shared_backward, SHARED_BACKWARDS)
  backward = _choose(backward, shapes, None, interpret=interpret, training=True,
                     name='shared_backward')
  return forward, backward
