"""The public entry point and the one place where an implementation is chosen."""

import enum
import importlib
import logging
from typing import Callable

import jax

from hydrajax.layout import TreeLayout
from hydrajax.partial_state import PartialState
from hydrajax.tree_attention import tree_attention_xla
from hydrajax.validation import check_tree_attention_inputs

log = logging.getLogger(__name__)


class AttentionImpl(enum.Enum):
  AUTO = 'auto'  # the kernel for this backend where it supports the shapes, else XLA
  XLA = 'xla'  # pure jnp, any backend
  MOSAIC_GPU = 'mosaic_gpu'  # Pallas Mosaic GPU kernels (Hopper)
  MOSAIC_TPU = 'mosaic_tpu'  # Pallas Mosaic TPU kernels


# Kernel implementations live in `pallas_kernels` (which imports hydrajax, not
# the reverse); each module exposes `tree_attention(q, k, v, layout, *, scale)`
# and `unsupported_reason(q, k, v, layout) -> str | None`.
_KERNEL_MODULES = {
    AttentionImpl.MOSAIC_GPU: 'pallas_kernels.mosaic_gpu.tree_attention',
    AttentionImpl.MOSAIC_TPU: 'pallas_kernels.tpu.tree_attention',
}


def _kernel_module(impl: AttentionImpl):
  try:
    return importlib.import_module(_KERNEL_MODULES[impl])
  except ImportError as e:
    return e


def _default_kernel() -> AttentionImpl | None:
  backend = jax.default_backend()
  if backend == 'tpu':
    return AttentionImpl.MOSAIC_TPU
  if backend == 'gpu':
    kind = jax.devices()[0].device_kind.lower()
    if any(name in kind for name in ('h100', 'h200', 'h800', 'gh200')):
      return AttentionImpl.MOSAIC_GPU
  return None


def resolve(impl: AttentionImpl | str, q, k_cache, v_cache, layout) -> tuple[AttentionImpl, Callable]:
  """Returns the implementation that will run and its function."""
  impl = AttentionImpl(impl)
  if impl is AttentionImpl.XLA:
    return impl, tree_attention_xla
  explicit = impl is not AttentionImpl.AUTO
  kernel = impl if explicit else _default_kernel()
  if kernel is None:
    return AttentionImpl.XLA, tree_attention_xla
  module = _kernel_module(kernel)
  reason = (
      f'cannot import {_KERNEL_MODULES[kernel]}: {module}'
      if isinstance(module, Exception)
      else module.unsupported_reason(q, k_cache, v_cache, layout)
  )
  if reason is None:
    return kernel, module.tree_attention
  if explicit:
    raise ValueError(f'impl={kernel.name} does not support these inputs: {reason}')
  log.info('tree_attention: falling back to XLA from %s: %s', kernel.name, reason)
  return AttentionImpl.XLA, tree_attention_xla


def tree_attention(
    q: jax.Array,  # [B, T, N, H]
    k_cache: jax.Array,  # [L, K, H]
    v_cache: jax.Array,  # [L, K, H]
    layout: TreeLayout,
    *,
    impl: AttentionImpl | str = AttentionImpl.AUTO,
    scale: float | None = None,
) -> PartialState:
  """Exact shared-prefix attention over a sharing layout.

  Row b's T query tokens attend every shared segment on b's root-to-leaf path
  and, causally, its private KV (the query tokens' own keys are its last T
  private tokens). Returns (out [B, T, N, H] in q.dtype, lse [B, T, N] float32).
  """
  check_tree_attention_inputs(q, k_cache, v_cache, layout)
  _, fn = resolve(impl, q, k_cache, v_cache, layout)
  return fn(q, k_cache, v_cache, layout, scale=scale)
