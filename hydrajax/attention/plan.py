"""Plan once per tree change, attend every layer: the prepared attention plan.

    plan = prepare_attention(layout, AttentionShapes.of(q, k_cache), impl=AUTO)  # per tree change
    step = plan.with_private_lengths(lengths).for_step()                       # every step
    for layer in range(num_layers):                                             # every layer
      out, lse = attend(q, k_all, v_all, step, kv_offset=layer * L)

`prepare_attention` resolves the implementation once (`dispatch`) and lets the backend
precompute what it derives from the layout (XLA: gather indices and masks; Mosaic TPU: the work
list; Mosaic GPU: packed segment tables and schedules). `attend` then only adds `kv_offset` (the
token where this layer's buffer starts in a flat `[layers * L, K, H]` buffer) where token
indices are formed. The plan is a jit pytree: arrays are leaves, the implementation, the shapes,
the backend config and `interpret` are static.

What changes every decode step without a tree change, the rows' private lengths, stays a plain
layout array: `plan.with_private_lengths(lengths)` swaps it (no backend work, so a host array
stays on the host). What a backend derives from them, once for all of a step's layers (the
Mosaic GPU private kernel's lane table), `plan.for_step()` builds, inside the jitted step; a
plan without it still attends correctly, deriving it in every call.

Backend protocol (`hydrajax.tree_attention` for XLA, `pallas_kernels.*.tree_attention`):

    DEFAULT_CONFIG                                       # the type of its config
    default_config(*, interpret) -> config               # for this machine (or abstract mesh)
    unsupported_reason(shapes, layout, *, interpret) -> str | None
    prepare(layout, shapes, config, *, interpret) -> pytree
    attend(q, k_cache, v_cache, prepared, *, shapes, config, kv_offset, scale, interpret)
    with_private_lengths(prepared, lengths) -> pytree    # leaves swapped, per-step work dropped
    for_step(prepared) -> pytree                         # per-step work from the lengths, once
"""

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hydrajax.attention import dispatch
from hydrajax.attention.xla import XlaConfig
from hydrajax.attention.dispatch import AttentionImpl
from hydrajax.layout import TreeLayout
from hydrajax.partial_state import PartialState
from hydrajax.shapes import AttentionShapes
from hydrajax.validation import check_tree_attention_inputs


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
  """A layout with its implementation resolved and its backend metadata precomputed.

  Built once per tree change by `prepare_attention`; a jit pytree (layout and prepared are
  leaves, the rest static).
  """

  layout: TreeLayout
  prepared: Any  # the backend's pytree of precomputed arrays
  impl: AttentionImpl  # resolved, never AUTO
  shapes: AttentionShapes
  config: Any  # the backend's frozen config
  interpret: bool

  def with_private_lengths(self, lengths: jax.Array, *, check: bool = True) -> 'AttentionPlan':
    """The plan with rows' private lengths [B] int32 replaced (e.g. one more decoded token):
    leaves swapped, nothing prepared again. A host (numpy) array stays on the host; concrete
    values are checked against the page table's capacity and T (`check_private_lengths`).
    `check=False` keeps the shape check but skips the values' (a caller whose lengths come
    from the cache that built the page table: the engine, every step)."""
    lengths = check_private_lengths(lengths, self.layout, self.shapes.query_tokens,
                                    check_values=check)
    layout = dataclasses.replace(self.layout, private_lengths=lengths)
    prepared = dispatch.backend(self.impl).with_private_lengths(self.prepared, lengths)
    return dataclasses.replace(self, layout=layout, prepared=prepared)

  def for_step(self) -> 'AttentionPlan':
    """The plan with what the backend derives from the private lengths built once, for every
    layer of a step (call it after `with_private_lengths`, before the layers; a no-op when
    already built or when the backend derives nothing)."""
    prepared = dispatch.backend(self.impl).for_step(self.prepared)
    return dataclasses.replace(self, prepared=prepared)


jax.tree_util.register_dataclass(
    AttentionPlan,
    data_fields=['layout', 'prepared'],
    meta_fields=['impl', 'shapes', 'config', 'interpret'],
)


def check_layout(layout: TreeLayout, shapes: AttentionShapes) -> None:
  """The layout fits these shapes; the host-checkable facts (`layout.host`) too."""
  if not isinstance(layout, TreeLayout):
    raise ValueError(
        f'layout must be a TreeLayout (SharingPlan.to_device()), got {type(layout).__name__}'
    )
  if layout.num_rows != shapes.num_rows:
    raise ValueError(f'q has B={shapes.num_rows} rows but the layout has {layout.num_rows}')
  if layout.private_pages.shape[1] * layout.page_size > 0 and shapes.kv_tokens < layout.page_size:
    raise ValueError(
        f'k_cache holds {shapes.kv_tokens} tokens, less than one page of {layout.page_size}'
    )
  host = layout.host
  if host is None:
    return
  if shapes.kv_tokens < host.kv_tokens:
    raise ValueError(
        f'the K/V buffer holds {shapes.kv_tokens} tokens per layer, but the layout indexes '
        f'{host.kv_tokens} (SharingPlan.kv_tokens)'
    )
  if 0 < host.min_private_length < shapes.query_tokens:
    raise ValueError(
        f'q has T={shapes.query_tokens} query tokens per row, but a row has only '
        f'{host.min_private_length} private tokens (the query tokens are the last T private '
        'tokens of their row)'
    )


def check_scale(scale) -> float | None:
  """None, or a finite Python float > 0 (ValueError naming `scale` otherwise)."""
  if scale is None:
    return None
  if isinstance(scale, jax.Array) and not isinstance(scale, jax.core.Tracer):
    scale = float(scale)
  if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
    raise ValueError(f'scale must be a Python float > 0 or None, got {type(scale).__name__}')
  scale = float(scale)
  if not math.isfinite(scale) or scale <= 0:
    raise ValueError(f'scale must be finite and > 0, got {scale}')
  return scale


def check_private_lengths(lengths, layout: TreeLayout, query_tokens: int, *,
                          check_values: bool = True):
  """`lengths` as an integer array of the layout's `private_lengths` shape ([B], or [dp, B/dp]
  for stacked shard plans; lists become numpy), else ValueError naming `lengths`. With
  `check_values`, concrete values (not traced) must be 0 (a padding row) or in [T, capacity]:
  the T query tokens are a row's last T private tokens, and no row holds more than its pages."""
  if isinstance(lengths, (list, tuple)):
    lengths = np.asarray(lengths)
  want = tuple(layout.private_lengths.shape)
  if getattr(lengths, 'shape', None) != want or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f'lengths must be an integer array of shape {want} (one per row), got '
                     f'{getattr(lengths, "dtype", type(lengths).__name__)}'
                     f'{list(getattr(lengths, "shape", ()))}')
  if not check_values or isinstance(lengths, jax.core.Tracer):
    return lengths
  values = np.asarray(lengths).reshape(-1)
  capacity = layout.private_pages.shape[-1] * layout.page_size
  bad = (values < 0) | ((values != 0) & ((values < query_tokens) | (values > capacity)))
  if bad.any():
    row = int(np.argmax(bad))
    raise ValueError(f'lengths must be 0 or in [T={query_tokens}, capacity={capacity}] (the '
                     f"page table's), got {int(values[row])} at row {row}")
  return lengths


def prepare_attention(
    layout: TreeLayout,
    shapes: AttentionShapes,
    *,
    impl: AttentionImpl | str = AttentionImpl.AUTO,
    config: Any = None,
    interpret: bool = False,
) -> AttentionPlan:
  """Resolves the implementation and precomputes its metadata; once per tree change.

  Args:
    layout: the device layout (`SharingPlan.to_device()`).
    shapes: the static shapes of the calls (`AttentionShapes.of(q, one_layer_k_cache)`).
    impl: AUTO (this machine's kernel where it supports the inputs, else XLA with a warning),
      or an explicit implementation (ValueError if it cannot run).
    config: the backend's frozen config (`XlaConfig`, the TPU `BlockSizes`, ...); None: its
      default for this machine's device (the TPU's: its generation's block sizes). With AUTO,
      a config of another backend than the one chosen is ignored. A tuple of configs: the
      chosen backend takes the one of its type, its default if none is.
    interpret: run the Mosaic kernels in interpret mode (any machine, e.g. CPU tests).
  """
  if not isinstance(shapes, AttentionShapes):
    raise ValueError(f'shapes must be an AttentionShapes, got {type(shapes).__name__}')
  check_layout(layout, shapes)
  if not isinstance(interpret, (bool, np.bool_)):
    raise ValueError(f'interpret must be True or False, got {interpret!r}')
  interpret = bool(interpret)
  requested = AttentionImpl(impl)
  impl, module = dispatch.resolve_backend(requested, shapes, layout, interpret=interpret)
  default = module.DEFAULT_CONFIG
  _check_config(config)
  if isinstance(config, tuple):
    config = next((c for c in config if isinstance(c, type(default))), None)
  if config is not None and default is not None and not isinstance(config, type(default)):
    if requested is not AttentionImpl.AUTO:
      raise ValueError(
          f'config must be a {type(default).__name__} for impl={impl.name}, got '
          f'{type(config).__name__}'
      )
    config = None  # AUTO chose another backend than the config's
  if config is None:
    config = module.default_config(interpret=interpret)
  prepared = module.prepare(layout, shapes, config, interpret=interpret)
  return AttentionPlan(layout, prepared, impl, shapes, config, interpret)


def _check_config(config) -> None:
  """A backend config is a frozen dataclass (`XlaConfig`, `BlockSizes`, `MosaicGpuConfig`),
  or a tuple of them: anything else is a mistake AUTO would otherwise ignore."""
  for c in config if isinstance(config, tuple) else (config,):
    if c is not None and not dataclasses.is_dataclass(c):
      raise ValueError(f'config must be a backend config (XlaConfig, MosaicGpuConfig, the TPU '
                       f'BlockSizes), a tuple of them, or None; got {c!r}')


def _check_call(q, k_cache, v_cache, plan: AttentionPlan, kv_offset) -> None:
  if not isinstance(plan, AttentionPlan):
    raise ValueError(
        f'plan must be an AttentionPlan (prepare_attention), got {type(plan).__name__}')
  s = plan.shapes
  for name, x in (('q', q), ('k_cache', k_cache), ('v_cache', v_cache)):
    if not hasattr(x, 'shape') or not hasattr(x, 'dtype'):
      raise ValueError(f'{name} must be an array, got {type(x).__name__}')
  expected_q = (s.num_rows, s.query_tokens, s.num_heads, s.head_dim)
  if tuple(q.shape) != expected_q:
    raise ValueError(f'q must be [B, T, N, H] = {expected_q} as planned, got {tuple(q.shape)}')
  for name, x in (('k_cache', k_cache), ('v_cache', v_cache)):
    if x.ndim != 3 or tuple(x.shape[1:]) != (s.num_kv_heads, s.head_dim):
      raise ValueError(
          f'{name} must be [S, K={s.num_kv_heads}, H={s.head_dim}] as planned, got {x.shape}'
      )
    if x.shape[0] < s.kv_tokens:
      raise ValueError(
          f'{name} holds {x.shape[0]} tokens, fewer than the planned kv_tokens L={s.kv_tokens}'
      )
  if q.dtype != s.dtype or k_cache.dtype != s.kv_dtype or v_cache.dtype != s.kv_dtype:
    raise ValueError(
        f'dtypes must be q {s.dtype} and k/v {s.kv_dtype} as planned, got q {q.dtype}, '
        f'k {k_cache.dtype}, v {v_cache.dtype}'
    )
  concrete_scalar = (isinstance(kv_offset, (np.ndarray, jax.Array)) and
                     not isinstance(kv_offset, jax.core.Tracer) and kv_offset.shape == () and
                     jnp.issubdtype(kv_offset.dtype, jnp.integer))
  if concrete_scalar:  # checked as its value (a host round trip for a device scalar)
    kv_offset = int(kv_offset)
  if isinstance(kv_offset, (int, np.integer)) and not isinstance(kv_offset, (bool, np.bool_)):
    page = plan.layout.page_size
    if kv_offset < 0 or kv_offset % page or kv_offset + s.kv_tokens > k_cache.shape[0]:
      raise ValueError(
          f'kv_offset must be a multiple of page_size={page} in [0, S - L] = '
          f'[0, {k_cache.shape[0] - s.kv_tokens}], got {kv_offset}'
      )
  elif getattr(kv_offset, 'shape', None) != () or not jnp.issubdtype(kv_offset.dtype, jnp.integer):
    raise ValueError(f'kv_offset must be a Python int or an int32 scalar array, got {kv_offset!r}')


def attend(
    q: jax.Array,  # [B, T, N, H]
    k_cache: jax.Array,  # [S, K, H], S >= kv_offset + L (e.g. the flat [layers * L, K, H] buffer)
    v_cache: jax.Array,  # [S, K, H]
    plan: AttentionPlan,
    *,
    kv_offset: int | jax.Array = 0,
    scale: float | None = None,
) -> PartialState:
  """Tree attention over `plan` of the layer whose buffer starts at token `kv_offset`.

  Returns (out [B, T, N, H] in q.dtype, lse [B, T, N] float32, natural log). Nothing derived
  from the layout is recomputed.
  """
  _check_call(q, k_cache, v_cache, plan, kv_offset)
  scale = check_scale(scale)
  if not isinstance(kv_offset, jax.Array):
    kv_offset = int(kv_offset)
  module = dispatch.backend(plan.impl)
  return module.attend(
      q, k_cache, v_cache, plan.prepared, shapes=plan.shapes, config=plan.config,
      kv_offset=kv_offset, scale=scale, interpret=plan.interpret,
  )


def tree_attention(
    q: jax.Array,  # [B, T, N, H]
    k_cache: jax.Array,  # [L, K, H]
    v_cache: jax.Array,  # [L, K, H]
    layout: TreeLayout,
    *,
    impl: AttentionImpl | str = AttentionImpl.AUTO,
    scale: float | None = None,
    config: Any = None,
    interpret: bool = False,
) -> PartialState:
  """Exact shared-prefix attention over a sharing layout.

  Row b's T query tokens attend every shared segment on b's root-to-leaf path and, causally,
  its private KV (the query tokens' own keys are its last T private tokens). Returns
  (out [B, T, N, H] in q.dtype, lse [B, T, N] float32). The same as
  `attend(q, k, v, prepare_attention(layout, AttentionShapes.of(q, k), ...))`; a model calling
  attention every layer prepares once instead.

  What only the host plan knows (the tokens its layout indexes, its shortest private row) is
  checked where the layout is the one `to_device()` returned; a layout traced by `jax.jit`
  has lost it, and a K/V buffer shorter than the plan's `kv_tokens` would be read out of
  range unnoticed. Under jit, prepare outside (`prepare_attention` checks these facts) and
  `attend` inside, as the models do, or call once without jit first.

  Args:
    q: [B, T, N, H] queries: row b's T tokens, N query heads of head dim H (float32, bfloat16
      or float16); the T tokens are the last T private tokens of row b.
    k_cache: [L, K, H] one layer's keys, K kv heads (N a multiple of K); the layout's pages
      and segments index its L tokens.
    v_cache: [L, K, H] the values, as k_cache.
    layout: the sharing layout of the B rows (`SharingPlan.to_device()`, e.g. of `plan_tree`
      or `plan_from_tokens`): the shared segments on each row's path and its private pages.
    impl: see `prepare_attention`.
    scale: softmax scale, H**-0.5 if None.
    config: the backend's frozen config (see `prepare_attention`).
    interpret: run the Mosaic kernels in interpret mode (on CPU).

  Returns:
    PartialState (out [B, T, N, H] in q.dtype, lse [B, T, N] float32, natural log).
  """
  check_tree_attention_inputs(q, k_cache, v_cache, layout)
  scale = check_scale(scale)
  plan = prepare_attention(
      layout, AttentionShapes.of(q, k_cache), impl=impl, config=config, interpret=interpret
  )
  return attend(q, k_cache, v_cache, plan, scale=scale)


def tree_attention_xla(
    q: jax.Array,  # [B, T, N, H]
    k_cache: jax.Array,  # [L, K, H]
    v_cache: jax.Array,  # [L, K, H]
    layout: TreeLayout,
    *,
    scale: float | None = None,
    kv_block: int = 4096,
) -> PartialState:
  """Exact attention of every row over its tree path and private KV (jit-compatible).

  `hydrajax.tree_attention(..., impl=XLA, config=XlaConfig(kv_block))`. Returns
  (out [B, T, N, H] in q.dtype, lse [B, T, N] float32, natural log).
  """
  return tree_attention(
      q, k_cache, v_cache, layout, impl='xla', scale=scale, config=XlaConfig(kv_block)
  )
