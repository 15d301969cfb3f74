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
    PrivateProblem, lane_heads_for, lane_steps, lane_table, pad_page_table, stage_pages,
    token_frame_rows,
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
  """Tuning knobs of the Mosaic GPU kernels (static under jit).

  Attributes:
    block_kv: kv tokens per step of the shared kernel (multiple of 64; 64 was slower on
      every H200 shape measured). 192 (the most that fits with two slots) took the shared
      kernel alone 414.2 -> 400.7 µs at B=1024, P=16K, 32/8, but 109.4 -> 111.3 at B=256, and
      the 7B decode step's attention kernels 4.18 -> 4.34 ms at B=1024, P=1K
      (`mosaic_gpu_check/s29`); 128 stays the default.
    max_concurrent_steps: shared-memory slots of the shared kernel's K/V pipeline (>= 2;
      3 was slower on an H200 at every P=16K shape, s29).
    max_splits: most kv splits per shared segment (8 measured best at B=32, P=2K on an
      H200: 25.9 us against 29.8 with 16 and 26.1 with 4; larger batches use 1-2).
    num_sms: multiprocessors to fill (None: the device's; 132 off the GPU).
    private_slots: K/V steps in flight in the private kernel, 2..MAX_PRIVATE_SLOTS (None: 3
      when its programs fit one a multiprocessor, else 2). Each slot is 32 KiB of shared memory
      at H=128: two programs share a multiprocessor with 2 slots each, one with 3 or more.
    private_pair_copies: the private kernel copies two 8-token chunks that follow each other in
      the buffer (a short row's two chunks, at decode) with one 16-token copy, halving a decode
      step's copies. Off: no faster on the H200 (run 8: 188.3 against 187.5 µs at B=1024,
      P=1K, 9 tokens a row), and neither were 3 slots (266.6 µs: one program a multiprocessor).
    private_staged_pages: the private kernel copies its frame's rows of the page table to
      shared memory once (when they fit `private_problem.MAX_STAGED_PAGE_BYTES`), so each
      step's plan reads page ids there instead of from global memory. H200, B=1024, 9 private
      tokens a row, 32/32 heads: the private kernel 145 -> 131 µs alone, and 7-13% less time
      in the CodeLlama-7B decode step (`experiments/results/mosaic_gpu_check/run8`). None:
      only when the plans are walked (with the lane table the kernel reads no page id, so the
      copy and its wait at every program's start are skipped).
    private_lane_table: the private kernel reads each step's plan (its chunks' first tokens,
      contiguity, valid counts) from a table built by XLA from the rows' private lengths and
      pages (`private_problem.lane_table`; the same for every layer of a step: `for_step`
      builds it once) instead of walking 8 dependent lanes in the kernel. The walk was the
      largest region of a decode step at short rows (1.89 of about 5.8 µs, run 8). H200,
      B=1024, P=1K, 9 private tokens a row, 32/32 heads: the private kernel 132 -> 112 µs
      alone; in the CodeLlama-7B decode step 14% less private-kernel time at B=1024, 31% at
      B=32 (`experiments/results/throughput/lane_table_s23`).
    shared_overlap: the shared kernel issues each step's QK^T wgmma with the previous step's
      PV and runs the softmax under PV, its warpgroups taking one-sided turns at issuing
      (`SegmentKernelConfig.overlap`). None: on for programs of 16 kv blocks or more, off
      with `block_kv` over 128, where it spills registers (`segment_attention.overlaps`).
      H200, shared kernel alone: 410.0 -> 400.9 µs at B=1024, P=16K, 32/8; 108.9 -> 108.6 at
      B=256; 9.5 -> 10.2 at B=32, P=2K (`mosaic_gpu_check/s29`). With s28's rendezvous turns
      it was 12-16% slower; with 192-token steps 1.6x slower (s30).
    private_zero_unseen: the private kernel zeroes the V rows of a step's partial chunks
      past their valid tokens, so that NaN or inf there never meets a zero probability
      (0 * inf). False skips that, and is right only when every unattended slot of the cache
      is finite (a recycled page can hold another request's values). H200, private kernel
      alone, B=1024, P=1K, 32/32: 95.2 -> 88.8 µs at 9 tokens a row, 317.1 -> 299.8 at 65
      (`mosaic_gpu_check/s30`, call 4). On by default.
    q_by_row: with one query head per kv head (G = 1), T a power of two (no padded rows) and
      B*T a multiple of 8, the kernels read q's [B*T, K, H] view in place instead of a
      folded copy (`segment_attention.q_tile`): no per-layer pad and transpose of q (7.8 µs
      of 163 at B=1024, P=1K, 32/32 heads on an H200, `throughput/s24`).
    q_by_row_groups: `q_by_row` also for G = 2, 4 or 8 (T*G rows a query row, none padded):
      each kernel copies a Q tile's [64/G, G, H] rows from q's [B*T, K, G, H] view into an
      untiled buffer and from there, through registers, into the tiled one wgmma reads. It
      takes out the per-layer fold of q at GQA shapes, but on an H200 the kernels spend what
      the fold cost (`mosaic_gpu_check/s29`, call 1, 32/8 heads): B=256, P=16K 128.1 -> 129.2
      µs a call, B=1024 455.6 -> 455.0, B=32, P=2K 27.3 -> 26.2. Correct on every check
      layout; off.
    private_token_lanes: a private-kernel lane is 8/h tokens of h kv heads (one 8-row tile of
      the cache's flat [L*K, H] view: one token of 8 kv heads when K is a multiple of 8, two
      tokens of 4 or four of 2 when K is 4 or 2) instead of 8 tokens of one kv head, and a
      program takes h kv heads' rows of 64/h folded rows (`private_problem.lane_heads_for`:
      T*G <= 64/h and B*TGp a multiple of 64/h; other shapes keep chunk lanes). A step then
      copies fewer tokens the rows do not hold: at 9 private tokens a row chunk lanes read 16
      tokens' bytes (h = 8: 9), and at 1 token 8 (h = 8: 1; h = 4: 2). Needs
      `private_lane_table`; with token lanes q is read folded at G > 1 (`q_by_row_groups` off)
      and `private_staged_pages` and `private_pair_copies` do not apply. None (the default):
      token lanes where they fit and make at least `TOKEN_LANES_MIN_PROGRAMS` programs, or
      `TOKEN_LANES_LONG_ROW_MIN_PROGRAMS` where a row may hold more than
      `TOKEN_LANES_MAX_CAPACITY` private tokens (the page table's width). H200, the private kernel alone in a layer of a decode step
      (`mosaic_gpu_check/s46`): 32/8 heads, 1 token a row: B=1024 28.0 -> 17.8 µs, B=256
      11.5 -> 8.9, but B=32 (16 programs) 10.2 -> 11.5; 16/4 (a tensor-parallel shard) B=1024
      14.8 -> 10.5, B=256 (64 programs) 12.4 -> 10.5; 32/32 B=1024 at 9 tokens 94.7 -> 54.1,
      at 8 56.4 -> 50.7; but 128 tokens a row at B=256, 32/8, 40.6 -> 50.3 (chunk lanes copy
      a row's 64 contiguous tokens at once, or too few programs). In the CodeLlama-7B decode
      step at B=1024, about 7 private tokens a row (a capacity of 128), the two kernels 4326
      -> 3593 µs a step at P=1K, 17444 -> 16311 at 16K. Long rows at 512 programs (H100,
      `mosaic_gpu_check/s49`): B=1024, 32/32, 9, 65 and 128 tokens a row, 156.0 -> 109.5,
      460.3 -> 417.2 and 765.7 -> 767.8 µs; 32/8 at 128, 596.8 -> 606.8 (no step-plan time).
    private_token_runs: with token lanes of every kv head (K = 8, 4 or 2: a lane is a whole
      token's tile), a step of 8 lanes of one row's consecutive tokens is one 64-row copy of
      the flat view instead of 8 (`PrivateProblem.token_runs`), as chunk lanes copy a row's 64
      contiguous tokens. Long rows are where token lanes lost to chunk lanes (B=256, 32/8, 128
      tokens a row: 16 copies a step against 2). Off: at B=1024, 32/8, 128 tokens a row it
      did not pay (H100, `mosaic_gpu_check/s49`: 597.5 µs, token lanes alone 606.8 and chunk
      lanes 596.8 in one run).
  """

  block_kv: int = 128
  max_concurrent_steps: int = 2
  max_splits: int = 8
  num_sms: int | None = None
  private_slots: int | None = None
  private_pair_copies: bool = False
  private_staged_pages: bool | None = None
  private_lane_table: bool = True
  q_by_row: bool = True
  q_by_row_groups: bool = False
  shared_overlap: bool | None = None
  private_zero_unseen: bool = True
  private_token_lanes: bool | None = None
  private_token_runs: bool = False

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

  private_pages: jax.Array  # [B, P] int32; [staged_rows, P4] when problem.staged_pages
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
  stage = (not config.private_lane_table if config.private_staged_pages is None
           else config.private_staged_pages)
  staged = stage and not token and stage_pages(problem, layout.private_pages.shape[1])
  steps = lane_steps(problem, layout.private_pages.shape[1]) if config.private_lane_table else 0
  by_row = _reads_q_by_row(config, b, t, g, tgp) and not (token and g > 1)
  runs = config.private_token_runs and token and kh == heads
  problem = dataclasses.replace(problem, slots=slots, token_runs=runs,
                                pair_copies=config.private_pair_copies and not token,
                                zero_unseen=config.private_zero_unseen,
                                staged_pages=staged, lane_steps=steps, q_by_row=by_row)
  sched = shared_schedule(
      layout, rows_per_query=tgp, num_kv_heads=kh, block_kv=config.block_kv, num_sms=num_sms,
      max_splits=config.max_splits,
  )
  pages = pad_page_table(layout.private_pages, problem) if staged else layout.private_pages
  return Prepared(
      pages, layout.private_lengths, layout.row_segments, pack_segments(layout.groups), sched,
      problem,
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
  """Whether the kernels read q's rows in place (`MosaicGpuConfig.q_by_row`).

  Folded row r is q[r // TGp, (r % TGp) // G, k*G + r % G]: in place only without padded
  rows (TGp == T*G). A TMA copy of a [B*T, K, ...] view needs whole 8-row tiles of it
  (B*T a multiple of 8), and with G > 1 a tile's first row must be a whole (b, t) row (G
  divides ALIGN).
  """
  groups_ok = g == 1 or (config.q_by_row_groups and ALIGN % g == 0)
  return config.q_by_row and groups_ok and tgp == t * g and b * t % ALIGN == 0


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
  # did before every layer of the CodeLlama-7B step: `experiments/results/xla_programs/`);
  # a barrier's result cannot be recomputed.
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
  if by_row:  # [B*T, K, H] (G = 1) or [B*T, K, G, H]
    g = n // kh
    qf = q.reshape(b * tgp // g, kh, *((g,) if g > 1 else ()), q.shape[-1])
    if interpret:  # interpret mode clamps reads past the end; TMA reads them as zeros
      qf = jnp.pad(qf, ((0, (rows - b * tgp) // g),) + ((0, 0),) * (qf.ndim - 1))
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
