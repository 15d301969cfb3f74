"""Tree attention on Hopper GPUs with Pallas Mosaic GPU kernels: the public entry point.

One call is two kernel launches whatever the tree's depth or width:

1. `segment_attention`: every shared segment of every capacity group, its
   covered rows times the GQA group as the M dimension of wgmma products,
   kv split so that small batches still fill the chip; writes one normalised
   partial state per (segment, split, row tile).
2. `private_attention`: per frame of folded query rows (several whole rows at
   decode), flash-decoding over the rows' own pages packed in 8-token chunks
   (causal for T > 1), then the LSE merge of the rows' shared partial states
   (all depths, all splits) read straight into registers; writes the final
   (out, lse).

plus XLA's fold of the queries to `[K, B*TGp, H]` (T*G rows per query row,
padded to TGp: `schedule.padded_rows_per_query`). The private kernel writes
`[B, T, N, H]` and `[B, T, N]` itself when T*G == TGp (lse: when G is a
multiple of 4), else XLA unfolds its folded result.
A layout with no shared segment (plain paged decode) is one launch of
`paged_decode` instead, one program per row. Same contract as
`hydrajax.tree_attention_xla`, which is the reference.

The backend protocol of `hydrajax.attention.plan`: `prepare` runs once per tree
change (packed segment table, schedule, frame sizes: host work), `for_step`
once per decode step (the private kernel's lane table, from the rows' private
lengths), `attend` once per layer with `kv_offset`, the token where this
layer's buffer starts in a flat `[layers * L, K, H]` cache; the offset is a
kernel operand added where TMA indices are formed, so no per-layer op rebuilds
the layout's arrays.
K/V that no row attends (padding, unwritten private slots, stale chunks) may
hold NaN or inf: no output depends on it (`online_softmax.zero_rows`).

Limits (`unsupported_reason` says which, and AUTO then uses XLA): Hopper only;
bfloat16/float16 (same dtype for q and the caches); head dim 64 or 128; the
KV buffer length and the page size multiples of 8 (TMA into tiled shared
memory reads 8-row tiles); `layout.row_segments` present (every builder fills
it). Segment starts and lengths, row ranges and private lengths are arbitrary.
`interpret=True` runs on CPU; there the shared kernel
is its single-warpgroup variant (see `segment_attention`).
"""

import dataclasses
from collections.abc import Sequence
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hydrajax import devices
from hydrajax.layout import TreeLayout
from hydrajax.partial_state import PartialState
from hydrajax.validation import check_tree_attention_inputs
from pallas_kernels.knobs import config_from_knobs
from pallas_kernels.mosaic_gpu.paged_decode import PagedProblem, paged_attention
from pallas_kernels.mosaic_gpu.paged_decode import unfold_states as paged_unfold_states
from pallas_kernels.mosaic_gpu.private_attention import private_attention
from pallas_kernels.mosaic_gpu.private_problem import (
    PrivateProblem, lane_heads_for, lane_steps, lane_table, token_frame_rows,
)
from pallas_kernels.mosaic_gpu.private_problem import unfold_states as private_unfold_states
from pallas_kernels.mosaic_gpu.schedule import (
    ALIGN, TILE_M, SharedSchedule, device_num_sms, padded_rows_per_query, private_frame_rows,
    round_up, shared_schedule,
)
from pallas_kernels.mosaic_gpu.segment_attention import (
    SegmentKernelConfig, pack_segments, segment_attention,
)

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
SUPPORTED_HEAD_DIMS = (64, 128)
MAX_PRIVATE_SLOTS = 5  # 160 KiB of K/V slots at H=128, with Q and the output rows 192 of 227 KiB


@dataclasses.dataclass(frozen=True)
class MosaicGpuConfig:
  """Tuning knobs of the Mosaic GPU kernels (static under jit). `TUNED_CONFIGS` holds the
  measured defaults per device; NOTES.md the measurements and what lost."""

  block_kv: int = 128  # kv tokens a shared-kernel step (a multiple of 64): 64 and 192 lost
  max_concurrent_steps: int = 2  # the shared kernel's K/V slots (>= 2): 3 lost at P=16K
  max_splits: int = 8  # most kv splits of a shared segment: small batches fill the chip
  num_sms: int | None = None  # multiprocessors to fill (None: the device's; 132 off the GPU)
  # The private kernel's K/V steps in flight (None: 3 when its programs fit one a
  # multiprocessor, else 2, so that two programs share one).
  private_slots: int | None = None
  # Step plans read from a table XLA builds once a decode step (`for_step`) instead of walked
  # in the kernel: the walk was a decode step's largest region at short rows.
  private_lane_table: bool = True
  q_by_row: bool = True  # G = 1: q's [B*T, K, H] view read in place, no per-layer fold of q
  # The shared kernel's QK^T of a step under the previous step's PV (None: for programs of 16
  # kv blocks or more, never over 128-token steps, where it spills registers).
  shared_overlap: bool | None = None
  # Zero V past a chunk's valid tokens, so NaN or inf there never meets a zero probability;
  # False only for caches whose unattended slots are finite (a recycled page may not be).
  private_zero_unseen: bool = True
  # A private lane is 8/h tokens of h kv heads instead of 8 tokens of one (fewer copied tokens
  # at decode). None: where they fit and make enough programs (`TOKEN_LANES_*`).
  private_token_lanes: bool | None = None

  def __post_init__(self):
    for name in _SWITCHES + _OPTIONAL_SWITCHES:
      value = getattr(self, name)
      if not (isinstance(value, bool) or (value is None and name in _OPTIONAL_SWITCHES)):
        allowed = 'None, True or False' if name in _OPTIONAL_SWITCHES else 'True or False'
        raise ValueError(f'{name} must be {allowed}, got {value!r}')
    self.segment_kernel  # validates its fields
    if self.max_splits < 1:
      raise ValueError(f'max_splits must be >= 1, got {self.max_splits}')
    if self.num_sms is not None and self.num_sms < 1:
      raise ValueError(f'num_sms must be >= 1 or None, got {self.num_sms}')
    if self.private_slots is not None and not 2 <= self.private_slots <= MAX_PRIVATE_SLOTS:
      raise ValueError(
          f'private_slots must be None or in [2, {MAX_PRIVATE_SLOTS}], got {self.private_slots}')
    if self.private_token_lanes and not self.private_lane_table:
      raise ValueError('private_token_lanes=True needs private_lane_table=True (token lanes '
                       'read their plans from the lane table)')

  @classmethod
  def from_knobs(cls, knobs: Sequence[str]) -> 'MosaicGpuConfig':
    """A config from 'name=value' items (a flag such as --mosaic_gpu_knobs): values true,
    false, none or an integer; other fields keep their defaults."""
    return config_from_knobs(cls, knobs)

  @property
  def segment_kernel(self) -> SegmentKernelConfig:
    return SegmentKernelConfig(self.block_kv, self.max_concurrent_steps,
                               overlap=self.shared_overlap)


# The on/off fields, from their annotations: `bool`, or `bool | None` (None: resolved per call).
_SWITCHES = tuple(f.name for f in dataclasses.fields(MosaicGpuConfig) if f.type is bool)
_OPTIONAL_SWITCHES = tuple(
    f.name for f in dataclasses.fields(MosaicGpuConfig) if f.type == bool | None)
DEFAULT_CONFIG = MosaicGpuConfig()

# The measured defaults, per device the kernels were timed on (decode and prefill shapes of
# `experiments.mosaic_gpu.check_on_device` and the CodeLlama-7B decode step): both Hopper parts
# keep the same knobs; a device not listed takes the H100's.
TUNED_CONFIGS: dict[str, MosaicGpuConfig] = {
    'H100': DEFAULT_CONFIG,
    'H200': DEFAULT_CONFIG,
}


def tuned_config(device_kind: str) -> MosaicGpuConfig:
  """The measured defaults of a device kind (e.g. 'NVIDIA H200'), the H100's if not listed."""
  for name, config in TUNED_CONFIGS.items():
    if name.lower() in device_kind.lower():
      return config
  return TUNED_CONFIGS['H100']


def default_config(*, interpret: bool = False) -> MosaicGpuConfig:
  """The measured defaults of the device the kernels compile for (the abstract mesh's, else
  this machine's); the H100's in interpret mode."""
  if interpret:
    return DEFAULT_CONFIG
  return tuned_config(devices.target_device().device_kind)


@dataclasses.dataclass(frozen=True)
class KernelShapes:
  """The static facts of one call that the kernels need (the fields of
  `hydrajax.shapes.AttentionShapes`; any object with them will do)."""

  num_rows: int  # B
  query_tokens: int  # T
  num_heads: int  # N
  num_kv_heads: int  # K
  head_dim: int  # H
  kv_tokens: int  # L, one layer's buffer
  dtype: Any
  kv_dtype: Any = None  # the caches' (None: dtype)

  @classmethod
  def of(cls, q, k_cache) -> 'KernelShapes':
    b, t, n, h = q.shape
    return cls(b, t, n, k_cache.shape[1], h, k_cache.shape[0], jnp.dtype(q.dtype),
               jnp.dtype(k_cache.dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prepared:
  """What `attend` needs of a layout, computed once per tree change (a jit pytree).

  `problem` is a `PrivateProblem` when the layout has shared segments (then
  `schedule` and `segments` are set), else a `PagedProblem` (plain paged decode).
  """

  private_pages: jax.Array  # [B, P] int32
  private_lengths: jax.Array  # [B] int32
  row_segments: jax.Array | None  # [B, D] int32 (TreeLayout.row_segments)
  segments: jax.Array | None  # [4, J] int32, pack_segments(layout.groups)
  schedule: SharedSchedule | None = dataclasses.field(metadata=dict(static=True))
  problem: PrivateProblem | PagedProblem = dataclasses.field(metadata=dict(static=True))
  # The private kernel's lane table of these private lengths (`for_step`), or None: each
  # `attend` then builds it. Swap the lengths with `with_private_lengths`, which drops it.
  lanes: jax.Array | None = None


def _shape_reason(shapes, layout: TreeLayout) -> str | None:
  """Why these shapes/dtypes are outside what the kernels handle, or None."""
  dtype = jnp.dtype(shapes.dtype)
  if dtype not in SUPPORTED_DTYPES:
    return f'dtype {dtype} is not bfloat16 or float16'
  kv_dtype = jnp.dtype(getattr(shapes, 'kv_dtype', None) or dtype)
  if kv_dtype != dtype:
    return f'q ({dtype}) and k/v caches ({kv_dtype}) must share one dtype'
  if shapes.head_dim not in SUPPORTED_HEAD_DIMS:
    return f'head dim {shapes.head_dim} is not one of {SUPPORTED_HEAD_DIMS}'
  if shapes.kv_tokens % ALIGN:
    return f'KV buffer length L={shapes.kv_tokens} is not a multiple of {ALIGN} (TMA tiling)'
  if layout.page_size % ALIGN:
    return (f'page size {layout.page_size} is not a multiple of {ALIGN} (TMA tiling; plan_tree: '
            f'a private_capacity that is a multiple of {ALIGN})')
  if layout.row_segments is None:
    return 'layout.row_segments is None (the kernels merge along each row\'s path)'
  if layout.row_segments.shape[0] != shapes.num_rows:
    return f'layout.row_segments has {layout.row_segments.shape[0]} rows, q has {shapes.num_rows}'
  return None


def _hopper_reason() -> str | None:
  return devices.hopper_reason()  # the one device check


def unsupported_reason(shapes, layout, *, interpret: bool = False) -> str | None:
  """None when the kernels handle these shapes and layout, else why not (dtype/shape limits
  only: the device check is the dispatcher's)."""
  del interpret  # interpret mode has the same limits
  return _shape_reason(shapes, layout)


def _num_sms(config: MosaicGpuConfig, interpret: bool) -> int:
  return config.num_sms if config.num_sms is not None else device_num_sms(interpret)


def prepare(layout: TreeLayout, shapes, config: MosaicGpuConfig = DEFAULT_CONFIG, *,
            interpret: bool = False) -> Prepared:
  """Everything layer-independent, once per tree change: the schedule and frame sizes
  (static), the packed segment table (packed on the host when the layout is concrete)."""
  reason = _shape_reason(shapes, layout)
  if reason is not None:
    raise ValueError(f'Mosaic GPU tree attention does not support these inputs: {reason}')
  if layout.num_rows != shapes.num_rows:
    raise ValueError(f'layout has {layout.num_rows} rows, shapes.num_rows={shapes.num_rows}')
  b, t, kh = shapes.num_rows, shapes.query_tokens, shapes.num_kv_heads
  g = shapes.num_heads // kh
  tg = t * g
  if not layout.groups:  # no shared segment: plain paged decode, one program per row
    return Prepared(
        layout.private_pages, layout.private_lengths, None, None, None,
        PagedProblem(b, t, g, layout.page_size),
    )
  num_sms = _num_sms(config, interpret)
  tgp = padded_rows_per_query(tg)
  heads = _lane_heads(config, layout, b, tgp, kh)
  token = heads > 1
  frame = token_frame_rows(heads) if token else private_frame_rows(b, tgp, kh, num_sms)
  problem = PrivateProblem(
      num_rows=b, query_tokens=t, group_size=g, rows_per_query=tgp, frame_rows=frame,
      page_size=layout.page_size, lane_heads=heads,
  )
  # One program per multiprocessor or fewer: a third K/V slot (shared memory allows it).
  programs = problem.num_frames * kh // problem.heads_per_program
  slots = config.private_slots or (3 if programs <= num_sms else 2)
  steps = lane_steps(problem, layout.private_pages.shape[1]) if config.private_lane_table else 0
  by_row = _reads_q_by_row(config, b, t, g, tgp)
  problem = dataclasses.replace(problem, slots=slots, zero_unseen=config.private_zero_unseen,
                                lane_steps=steps, q_by_row=by_row)
  sched = shared_schedule(
      layout, rows_per_query=tgp, num_kv_heads=kh, block_kv=config.block_kv, num_sms=num_sms,
      max_splits=config.max_splits,
  )
  return Prepared(
      layout.private_pages, layout.private_lengths, layout.row_segments,
      pack_segments(layout.groups), sched, problem,
  )


# `private_token_lanes=None`: token lanes only where the measured points favour them (see there).
TOKEN_LANES_MIN_PROGRAMS = 64  # programs at least: half an H200's multiprocessors
# Rows longer than one chunk-lane step (64 tokens) need more programs: at 128 tokens a row
# token lanes lost at B=256 (128 programs) and tied at B=1024 (512).
TOKEN_LANES_MAX_CAPACITY = 64
TOKEN_LANES_LONG_ROW_MIN_PROGRAMS = 512


def _lane_heads(config: MosaicGpuConfig, layout: TreeLayout, b: int, tgp: int, kh: int) -> int:
  """kv heads of a private-kernel lane: `private_problem.lane_heads_for`, or 1 (chunk lanes)."""
  if config.private_token_lanes is False or not config.private_lane_table:
    return 1
  heads = lane_heads_for(b, tgp, kh)
  if config.private_token_lanes or heads == 1:  # forced, or no fit
    return heads
  capacity = layout.private_pages.shape[1] * layout.page_size
  programs = b * tgp // token_frame_rows(heads) * (kh // heads)
  least = (TOKEN_LANES_MIN_PROGRAMS if capacity <= TOKEN_LANES_MAX_CAPACITY
           else TOKEN_LANES_LONG_ROW_MIN_PROGRAMS)
  return heads if programs >= least else 1


def _reads_q_by_row(config: MosaicGpuConfig, b: int, t: int, g: int, tgp: int) -> bool:
  """Whether the kernels read q's rows in place (`MosaicGpuConfig.q_by_row`): at G = 1
  folded row r is q[r // T, r % T, k], and a TMA copy of the [B*T, K, H] view needs whole
  8-row tiles of it (B*T a multiple of 8). At G > 1 reading in place cost the kernels what
  the fold of q saves."""
  return config.q_by_row and g == 1 and tgp == t and b * t % ALIGN == 0


def with_private_lengths(prepared: Prepared, lengths: jax.Array) -> Prepared:
  """The rows' private lengths swapped. The lane table derived from the old ones is dropped
  (`for_step` builds the new one), so a plan never carries a table of other lengths."""
  return dataclasses.replace(prepared, private_lengths=lengths, lanes=None)


def for_step(prepared: Prepared) -> Prepared:
  """What a decode step derives from its private lengths, built once for all its layers: the
  private kernel's lane table (`private_problem.lane_table`, a few small XLA fusions, 4-6
  µs on an H200). Without it every `attend` builds the table itself; a model's Python loop
  over layers gets one copy through XLA's CSE; under a `lax.scan` over layers only XLA's
  loop-invariant motion would save the per-layer copies."""
  problem = prepared.problem  # a PagedProblem (no shared segment) reads no lane table
  if prepared.lanes is not None or not (isinstance(problem, PrivateProblem) and
                                         problem.lane_steps):
    return prepared
  lanes = lane_table(prepared.private_lengths, prepared.private_pages, problem)
  # XLA's rematerialization pass may otherwise build the table again before each layer (it
  # did before every layer of the CodeLlama-7B step); a barrier's result cannot be recomputed.
  lanes = jax.lax.optimization_barrier(lanes)
  return dataclasses.replace(prepared, lanes=lanes)


def _fold_queries(q, num_kv_heads: int, tgp: int, rows: int):
  """q [B, T, N, H] -> qf [K, rows, H]: row b*TGp + t*G + g = q[b, t, k*G + g], zero padded."""
  b, t, n, h = q.shape
  g = n // num_kv_heads
  qf = q.reshape(b, t, num_kv_heads, g, h).transpose(2, 0, 1, 3, 4)
  qf = qf.reshape(num_kv_heads, b, t * g, h)
  qf = jnp.pad(qf, ((0, 0), (0, 0), (0, tgp - t * g), (0, 0))).reshape(num_kv_heads, b * tgp, h)
  return jnp.pad(qf, ((0, 0), (0, rows - b * tgp), (0, 0)))


def _check_attend_args(q, k_cache, v_cache, prepared, shapes, kv_offset):
  want_q = (shapes.num_rows, shapes.query_tokens, shapes.num_heads, shapes.head_dim)
  if tuple(q.shape) != want_q:
    raise ValueError(f'q must be [B, T, N, H] = {want_q} (the prepared shapes), got {q.shape}')
  for name, x in (('k_cache', k_cache), ('v_cache', v_cache)):
    if x.ndim != 3 or tuple(x.shape[1:]) != (shapes.num_kv_heads, shapes.head_dim):
      raise ValueError(
          f'{name} must be [S, K={shapes.num_kv_heads}, H={shapes.head_dim}], got {x.shape}'
      )
    if x.dtype != q.dtype:
      raise ValueError(f'{name} dtype {x.dtype} differs from q dtype {q.dtype}')
  total = k_cache.shape[0]
  if v_cache.shape[0] != total or total % ALIGN:
    raise ValueError(
        f'k_cache and v_cache must hold the same number of tokens, a multiple of {ALIGN}; got '
        f'{total} and {v_cache.shape[0]}'
    )
  if total < shapes.kv_tokens:
    raise ValueError(
        f'the KV buffer holds {total} tokens, fewer than the layout\'s L={shapes.kv_tokens}'
    )
  if isinstance(kv_offset, (int, np.integer)):  # a traced offset is the caller's to check
    page = prepared.problem.page_size
    if kv_offset < 0 or kv_offset % page or kv_offset + shapes.kv_tokens > total:
      raise ValueError(
          f'kv_offset must be a multiple of the page size {page} in [0, {total - shapes.kv_tokens}]'
          f' (the KV buffer holds {total} tokens, a layer L={shapes.kv_tokens}), got {kv_offset}'
      )


def attend(
    q: jax.Array,  # [B, T, N, H]
    k_cache: jax.Array,  # [S, K, H], e.g. the flat [layers * L, K, H] buffer
    v_cache: jax.Array,  # [S, K, H]
    prepared: Prepared,
    *,
    shapes,
    config: MosaicGpuConfig = DEFAULT_CONFIG,
    kv_offset: jax.Array | int = 0,
    scale: float | None = None,
    interpret: bool = False,
) -> PartialState:
  """Exact attention of every row over its tree path and private KV, for one layer.

  Args:
    q, k_cache, v_cache, scale: as `hydrajax.tree_attention_xla`, except that the
      caches may hold several layers' buffers of L = shapes.kv_tokens tokens.
    prepared: `prepare(layout, shapes, config)`.
    shapes, config: the ones `prepared` was made with.
    kv_offset: int32 scalar (python int or array), a multiple of the page size: the
      token where this layer's buffer starts. A traced value is not range-checked.
    interpret: run the kernels in Mosaic GPU interpret mode (CPU tests).

  Returns:
    (out [B, T, N, H] in q.dtype, lse [B, T, N] float32, natural log).
  """
  _check_attend_args(q, k_cache, v_cache, prepared, shapes, kv_offset)
  scale = shapes.head_dim**-0.5 if scale is None else float(scale)
  if not 0 < scale < float('inf'):
    raise ValueError(f'scale must be a finite number > 0, got {scale}')
  return _attend(
      q, k_cache, v_cache, prepared, jnp.asarray(kv_offset, jnp.int32), shapes=shapes,
      config=config, scale=scale, interpret=interpret,
  )


@functools.partial(jax.jit, static_argnames=('shapes', 'config', 'scale', 'interpret'))
def _attend(q, k_cache, v_cache, prepared: Prepared, kv_offset, *, shapes, config, scale,
            interpret) -> PartialState:
  b, _, n, _ = q.shape
  kh = shapes.num_kv_heads
  problem = prepared.problem
  if isinstance(problem, PagedProblem):
    tg = problem.rows_per_query
    qf = _fold_queries(q, kh, tg, round_up(b * tg + TILE_M, ALIGN))
    out, lse = paged_attention(
        qf, k_cache, v_cache, prepared.private_pages, prepared.private_lengths, problem,
        scale=scale, kv_offset=kv_offset, interpret=interpret,
    )
    return PartialState(*paged_unfold_states(out, lse, problem, n))
  tgp, frame, frames = problem.rows_per_query, problem.frame_rows, problem.num_frames
  rows = round_up(max(b * tgp, frames * frame) + TILE_M, ALIGN)
  by_row = problem.q_by_row
  if by_row:  # [B*T, K, H] (G = 1)
    qf = q.reshape(b * tgp, kh, q.shape[-1])
    if interpret:  # interpret mode clamps reads past the end; TMA reads them as zeros
      qf = jnp.pad(qf, ((0, rows - b * tgp), (0, 0), (0, 0)))
  else:
    qf = _fold_queries(q, kh, tgp, rows)
  partial_out, partial_lse = segment_attention(
      qf, k_cache, v_cache, prepared.segments, prepared.schedule, scale=scale,
      config=config.segment_kernel, kv_offset=kv_offset, q_by_row=by_row, interpret=interpret,
  )
  out, lse = private_attention(
      qf, k_cache, v_cache, prepared.private_pages, prepared.private_lengths,
      prepared.row_segments, prepared.segments, prepared.schedule, partial_out, partial_lse,
      problem, scale=scale, kv_offset=kv_offset, lanes=for_step(prepared).lanes,
      interpret=interpret,
  )
  # Reshapes when the kernel wrote [B, T, N, ...] order (`PrivateProblem.direct_out`).
  return PartialState(*private_unfold_states(out, lse, problem, n))


def tree_attention(
    q: jax.Array,  # [B, T, N, H]
    k_cache: jax.Array,  # [L, K, H]
    v_cache: jax.Array,  # [L, K, H]
    layout: TreeLayout,
    *,
    scale: float | None = None,
    interpret: bool = False,
    **knobs,
) -> PartialState:
  """`attend(q, k, v, prepare(layout, ...))` in one call; `knobs` are `MosaicGpuConfig`'s
  fields (block_kv=64, private_slots=3, ...).

  Returns:
    (out [B, T, N, H] in q.dtype, lse [B, T, N] float32, natural log).
  """
  return _tree_attention(q, k_cache, v_cache, layout, scale=scale, config=MosaicGpuConfig(**knobs),
                         interpret=interpret)


@functools.partial(jax.jit, static_argnames=('scale', 'config', 'interpret'))
def _tree_attention(q, k_cache, v_cache, layout, *, scale, config, interpret):
  check_tree_attention_inputs(q, k_cache, v_cache, layout)
  shapes = KernelShapes.of(q, k_cache)
  reason = _shape_reason(shapes, layout)
  if reason is None and k_cache.dtype != q.dtype:
    reason = f'q ({q.dtype}) and k/v caches ({k_cache.dtype}) must share one dtype'
  if reason is not None:
    raise ValueError(f'Mosaic GPU tree attention does not support these inputs: {reason}')
  prepared = prepare(layout, shapes, config, interpret=interpret)
  return attend(
      q, k_cache, v_cache, prepared, shapes=shapes, config=config, scale=scale,
      interpret=interpret,
  )
