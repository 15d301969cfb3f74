"""The one place where an attention implementation is chosen, and the one device check.

`resolve_backend` turns an `AttentionImpl` (AUTO included) into the backend that will run,
given the static shapes of a call (`AttentionShapes`) and its layout. AUTO picks the kernel of
this machine's accelerator (`default_kernel`) where it supports the inputs, else XLA; such a
fallback is visible: a `AttentionFallbackWarning` once per (kernel, reason), a log line, and
`AttentionPlan.impl` says what runs. An explicit kernel that cannot run raises ValueError with
the reason; with `interpret=True` the Mosaic kernels run on any machine (interpret mode).

A backend is a module (or object) with the protocol of `hydrajax.attention_plan`:
`DEFAULT_CONFIG`, `unsupported_reason(shapes, layout, *, interpret)`,
`prepare(layout, shapes, config, *, interpret)`,
`attend(q, k_cache, v_cache, prepared, *, shapes, config, kv_offset, scale, interpret)`,
`with_private_lengths(prepared, lengths)` and `for_step(prepared)`.
"""

import enum
import importlib
import logging
import warnings
from typing import Any

import jax

from hydrajax.layout import TreeLayout

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


# Kernel implementations live in `pallas_kernels` (which imports hydrajax, not the reverse).
_BACKEND_MODULES = {
    AttentionImpl.XLA: 'hydrajax.tree_attention',
    AttentionImpl.MOSAIC_GPU: 'pallas_kernels.mosaic_gpu.tree_attention',
    AttentionImpl.MOSAIC_TPU: 'pallas_kernels.tpu.tree_attention',
}
_KERNEL_MODULES = _BACKEND_MODULES  # the old name

HOPPER_KINDS = ('h100', 'h200', 'h800', 'gh200')


# ---------------------------------------------------------------------------
# The device check


def hopper_reason() -> str | None:
  """None on a Hopper GPU (compute capability 9.0), else why not.

  On a host with no GPU, under `jax.sharding.use_abstract_mesh` with a GPU device, that device
  decides (by its kind: an abstract device has no compute capability), as in `tpu_reason`: the
  host lowers for that GPU (`experiments.xla_programs`). A host with a GPU checks its own.
  """
  device = jax.sharding.get_abstract_mesh().abstract_device
  if jax.default_backend() == 'gpu' or device is None:
    if jax.default_backend() != 'gpu':
      return f'needs a Hopper GPU, the default backend is {jax.default_backend()}'
    device = jax.devices()[0]
  elif device.platform not in ('gpu', 'cuda'):
    return f'needs a Hopper GPU, the mesh\'s device is {device.device_kind} ({device.platform})'
  capability = getattr(device, 'compute_capability', None)
  if capability is not None:
    if str(capability) not in ('9.0', '9.0a'):
      return (
          f'needs a Hopper GPU (compute capability 9.0), found {device.device_kind} ({capability})'
      )
    return None
  kind = device.device_kind.lower()
  if not any(name in kind for name in HOPPER_KINDS):
    return f'needs a Hopper GPU, found {device.device_kind}'
  return None


def is_hopper() -> bool:
  return hopper_reason() is None


def tpu_reason() -> str | None:
  """None on a TPU backend, or under `jax.sharding.use_abstract_mesh` with a TPU device.

  The second form lets a CPU host lower (e.g. `jax.export` with platforms=['tpu']) for a
  named TPU generation.
  """
  device = jax.sharding.get_abstract_mesh().abstract_device
  platform = device.platform if device is not None else jax.default_backend()
  if platform == 'tpu':
    return None
  return f'Mosaic TPU kernels need a TPU (the default backend is {platform})'


def device_reason(impl: AttentionImpl, *, interpret: bool = False) -> str | None:
  """Why `impl` cannot run on this machine, or None (interpret mode runs anywhere)."""
  impl = AttentionImpl(impl)
  if interpret or impl is AttentionImpl.XLA:
    return None
  if impl is AttentionImpl.MOSAIC_GPU:
    reason = hopper_reason()
  elif impl is AttentionImpl.MOSAIC_TPU:
    reason = tpu_reason()
  else:
    raise ValueError(f'device_reason needs a concrete implementation, got {impl}')
  return None if reason is None else f'{reason}; pass interpret=True to run it in interpret mode'


def default_kernel() -> AttentionImpl | None:
  """The kernel AUTO tries on this machine, or None (then AUTO is XLA)."""
  if tpu_reason() is None:
    return AttentionImpl.MOSAIC_TPU
  if is_hopper():
    return AttentionImpl.MOSAIC_GPU
  return None


_default_kernel = default_kernel  # the name tests patch


# ---------------------------------------------------------------------------
# Backends


def backend(impl: AttentionImpl) -> Any:
  """The backend module of a concrete implementation, or the ImportError that stops it."""
  try:
    module = importlib.import_module(_BACKEND_MODULES[impl])
  except ImportError as e:
    return e
  return module


# ---------------------------------------------------------------------------
# The resolver

_warned: set[tuple[AttentionImpl, str]] = set()


def fallback(kernel: AttentionImpl, reason: str, *, source: str = 'tree_attention') -> None:
  """AUTO's visible fallback from `kernel` to XLA: a log line, and an `AttentionFallbackWarning`
  once per (kernel, reason). `source` names the caller's path (e.g. 'training attention')."""
  message = f'{source}: falling back to XLA from {kernel.name}: {reason}'
  log.info(message)
  if (kernel, reason) not in _warned:
    _warned.add((kernel, reason))
    warnings.warn(message, AttentionFallbackWarning, stacklevel=3)


def resolve_backend(
    impl: AttentionImpl | str, shapes, layout: TreeLayout, *, interpret: bool = False
) -> tuple[AttentionImpl, Any]:
  """(the implementation that will run, its backend): see the module docstring."""
  impl = AttentionImpl(impl)
  if impl is AttentionImpl.XLA:
    return impl, backend(impl)
  explicit = impl is not AttentionImpl.AUTO
  kernel = impl if explicit else default_kernel()
  if kernel is None:
    return AttentionImpl.XLA, backend(AttentionImpl.XLA)
  module = backend(kernel)
  if isinstance(module, Exception):
    reason = f'cannot import {_BACKEND_MODULES[kernel]}: {module}'
  else:
    reason = device_reason(kernel, interpret=interpret) or module.unsupported_reason(
        shapes, layout, interpret=interpret
    )
  if reason is None:
    return kernel, module
  if explicit:
    raise ValueError(f'impl={kernel.name} does not support these inputs: {reason}')
  fallback(kernel, reason)
  return AttentionImpl.XLA, backend(AttentionImpl.XLA)


def resolve(
    impl: AttentionImpl | str, q, k_cache, v_cache, layout: TreeLayout, *, interpret: bool = False
) -> tuple[AttentionImpl, Any]:
  """`resolve_backend` for arrays (or ShapeDtypeStructs) q [B, T, N, H], k_cache [L, K, H]."""
  from hydrajax.attention_plan import AttentionShapes  # a cycle at import time otherwise

  del v_cache
  return resolve_backend(impl, AttentionShapes.of(q, k_cache), layout, interpret=interpret)
