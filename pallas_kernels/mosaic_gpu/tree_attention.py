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
padded to TGp: `schedule.padded_rows_per_query`) and the unfold of the result,
and one concatenation of the segment arrays. A layout with no shared segment
(plain paged decode) is one launch of `paged_decode` instead, one program per
row. Same contract as `hydrajax.tree_attention_xla`, which is the reference.

Limits (`unsupported_reason` says which, and AUTO then uses XLA): Hopper only;
bfloat16/float16 (same dtype for q and the caches); head dim 64 or 128; the
KV buffer length and the page size multiples of 8 (TMA into tiled shared
memory reads 8-row tiles); `layout.row_segments` present (every builder fills
it). Segment starts and lengths, row ranges and private lengths are arbitrary. `interpret=True` runs on CPU; there the shared kernel
is its single-warpgroup variant (see `segment_attention`).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from hydrajax.layout import TreeLayout
from hydrajax.partial_state import PartialState
from hydrajax.validation import check_tree_attention_inputs
from pallas_kernels.mosaic_gpu.paged_decode import PagedProblem, lse_index, paged_attention
from pallas_kernels.mosaic_gpu.private_attention import PrivateProblem, private_attention
from pallas_kernels.mosaic_gpu.schedule import (
    ALIGN, TILE_M, WG_M, padded_rows_per_query, private_frame_rows, round_up, shared_schedule,
)
from pallas_kernels.mosaic_gpu.segment_attention import (
    SegmentKernelConfig, pack_segments, segment_attention,
)

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
SUPPORTED_HEAD_DIMS = (64, 128)
DEFAULT_NUM_SMS = 132  # H100 / H200 SXM


def _shape_reason(q, k_cache, v_cache, layout: TreeLayout) -> str | None:
  """Why these shapes/dtypes are outside what the kernels handle, or None."""
  if q.dtype not in SUPPORTED_DTYPES:
    return f'q dtype {q.dtype} is not bfloat16 or float16'
  if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
    return f'q ({q.dtype}) and k/v caches ({k_cache.dtype}) must share one dtype'
  if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
    return f'head dim {q.shape[-1]} is not one of {SUPPORTED_HEAD_DIMS}'
  if k_cache.shape[0] % ALIGN:
    return f'KV buffer length L={k_cache.shape[0]} is not a multiple of {ALIGN} (TMA tiling)'
  if layout.page_size % ALIGN:
    return f'page size {layout.page_size} is not a multiple of {ALIGN} (TMA tiling)'
  if layout.row_segments is None:
    return 'layout.row_segments is None (the kernels merge along each row\'s path)'
  if layout.row_segments.shape[0] != q.shape[0]:
    return f'layout.row_segments has {layout.row_segments.shape[0]} rows, q has {q.shape[0]}'
  return None


def _hopper_reason() -> str | None:
  if jax.default_backend() != 'gpu':
    return f'needs a Hopper GPU, the default backend is {jax.default_backend()}'
  device = jax.devices()[0]
  capability = getattr(device, 'compute_capability', None)
  if capability is not None:
    if str(capability) not in ('9.0', '9.0a'):
      return (
          f'needs a Hopper GPU (compute capability 9.0), found {device.device_kind} ({capability})'
      )
    return None
  kind = device.device_kind.lower()
  if not any(name in kind for name in ('h100', 'h200', 'h800', 'gh200')):
    return f'needs a Hopper GPU, found {device.device_kind}'
  return None


def unsupported_reason(q, k_cache, v_cache, layout: TreeLayout) -> str | None:
  """None when these kernels run the inputs on this machine, else why not (AUTO then uses XLA)."""
  return _hopper_reason() or _shape_reason(q, k_cache, v_cache, layout)


def _num_sms() -> int:
  if jax.default_backend() == 'gpu':
    return int(getattr(jax.devices()[0], 'core_count', DEFAULT_NUM_SMS) or DEFAULT_NUM_SMS)
  return DEFAULT_NUM_SMS


def _fold_queries(q, num_kv_heads: int, tgp: int, rows: int):
  """q [B, T, N, H] -> qf [K, rows, H]: row b*TGp + t*G + g = q[b, t, k*G + g], zero padded."""
  b, t, n, h = q.shape
  g = n // num_kv_heads
  qf = q.reshape(b, t, num_kv_heads, g, h).transpose(2, 0, 1, 3, 4).reshape(num_kv_heads, b, t * g, h)
  qf = jnp.pad(qf, ((0, 0), (0, 0), (0, tgp - t * g), (0, 0))).reshape(num_kv_heads, b * tgp, h)
  return jnp.pad(qf, ((0, 0), (0, rows - b * tgp), (0, 0)))


def _unfold(out_f, lse_f, lse_rows: np.ndarray, q_shape, tgp: int):
  """Folded outputs back to out [B, T, N, H] and lse [B, T, N].

  out_f [K, >= B*TGp, H] holds folded row b*TGp + t*G + g at that index;
  `lse_rows` [B*T*G] is where each unpadded folded row's lse is in lse_f [K, ...].
  """
  b, t, n, h = q_shape
  kh = out_f.shape[0]
  g = n // kh
  out = out_f[:, : b * tgp].reshape(kh, b, tgp, h)[:, :, : t * g]
  out = out.reshape(kh, b, t, g, h).transpose(1, 2, 0, 3, 4).reshape(b, t, n, h)
  lse = lse_f[:, lse_rows].reshape(kh, b, t, g).transpose(1, 2, 0, 3).reshape(b, t, n)
  return out, lse


def _frame_lse_rows(b: int, tg: int, problem: PrivateProblem) -> np.ndarray:
  """Place of each unpadded folded row's lse in the private kernel's per-frame lse tiles."""
  tgp, f = problem.rows_per_query, problem.frame_rows
  rows = np.arange(b * tgp).reshape(b, tgp)[:, :tg].reshape(-1)
  return (rows // f) * WG_M + rows % f


def _paged_decode(q, k_cache, v_cache, layout: TreeLayout, *, scale: float, interpret: bool):
  b, t, n, _ = q.shape
  kh = k_cache.shape[1]
  tg = t * (n // kh)
  problem = PagedProblem(b, t, n // kh, layout.page_size, scale)
  qf = _fold_queries(q, kh, tg, round_up(b * tg + TILE_M, ALIGN))
  out_f, lse_tiles = paged_attention(
      qf, k_cache, v_cache, layout.private_pages, layout.private_lengths, problem,
      interpret=interpret,
  )
  return PartialState(*_unfold(out_f, lse_tiles, lse_index(b, tg), q.shape, tg))


@functools.partial(
    jax.jit,
    static_argnames=(
        'scale', 'block_kv', 'max_concurrent_steps', 'max_splits', 'num_sms', 'interpret'
    ),
)
def tree_attention(
    q: jax.Array,  # [B, T, N, H]
    k_cache: jax.Array,  # [L, K, H]
    v_cache: jax.Array,  # [L, K, H]
    layout: TreeLayout,
    *,
    scale: float | None = None,
    block_kv: int = 128,
    max_concurrent_steps: int = 2,
    max_splits: int = 8,
    num_sms: int | None = None,
    interpret: bool = False,
) -> PartialState:
  """Exact attention of every row over its tree path and private KV (see the module docstring).

  Args:
    q, k_cache, v_cache, layout, scale: as `hydrajax.tree_attention_xla`.
    block_kv: kv tokens per step of the shared kernel (multiple of 64).
    max_concurrent_steps: shared-memory slots of the shared kernel's K/V pipeline.
    max_splits: most kv splits per shared segment (8 measured best at B=32, P=2K on an
      H200: 25.9 us against 29.8 with 16 and 26.1 with 4; larger batches use 1-2).
    num_sms: multiprocessors to fill (default: the device's; 132 on CPU).
    interpret: run both kernels in Mosaic GPU interpret mode (CPU tests).

  Returns:
    (out [B, T, N, H] in q.dtype, lse [B, T, N] float32, natural log).
  """
  check_tree_attention_inputs(q, k_cache, v_cache, layout)
  reason = _shape_reason(q, k_cache, v_cache, layout)
  if reason is not None:
    raise ValueError(f'Mosaic GPU tree attention does not support these inputs: {reason}')
  b, t, n, h = q.shape
  kh = k_cache.shape[1]
  g = n // kh
  tg = t * g
  scale = h**-0.5 if scale is None else float(scale)
  if scale <= 0:
    raise ValueError(f'scale must be > 0, got {scale}')
  config = SegmentKernelConfig(block_kv=block_kv, max_concurrent_steps=max_concurrent_steps)
  num_sms = num_sms or _num_sms()
  if not layout.groups:  # no shared segment: plain paged decode, one program per row
    return _paged_decode(q, k_cache, v_cache, layout, scale=scale, interpret=interpret)
  tgp = padded_rows_per_query(tg)
  frame = private_frame_rows(b, tgp, kh, num_sms)
  problem = PrivateProblem(
      num_rows=b, query_tokens=t, group_size=g, rows_per_query=tgp, frame_rows=frame,
      page_size=layout.page_size, scale=scale,
  )
  frames = problem.num_frames
  # One program per multiprocessor or fewer: a third K/V slot (shared memory allows it).
  problem = dataclasses.replace(problem, slots=3 if frames * kh <= num_sms else 2)
  qf = _fold_queries(q, kh, tgp, round_up(max(b * tgp, frames * frame) + TILE_M, ALIGN))

  sched = partial_out = partial_lse = segments = None
  if layout.groups:
    sched = shared_schedule(
        layout, rows_per_query=tgp, num_kv_heads=kh, block_kv=block_kv, num_sms=num_sms,
        max_splits=max_splits,
    )
    segments = pack_segments(layout.groups)
    partial_out, partial_lse = segment_attention(
        qf, k_cache, v_cache, segments, sched, scale=scale, config=config, interpret=interpret
    )
  out_f, lse_f = private_attention(
      qf, k_cache, v_cache, layout.private_pages, layout.private_lengths, layout.row_segments,
      segments, sched, partial_out, partial_lse, problem, interpret=interpret,
  )
  return PartialState(*_unfold(out_f, lse_f, _frame_lse_rows(b, tg, problem), q.shape, tgp))
