"""Tree attention on TPU with Pallas Mosaic TPU kernels: the public entry point.

Same contract as `hydrajax.tree_attention_xla` (the reference these kernels are
tested against): `tree_attention(q, k_cache, v_cache, layout)` returns
(out [B, T, N, H] in q.dtype, lse [B, T, N] float32, natural log).

Two launches per call, whatever the tree's depth or number of segment groups:

1. `private_attention`: each row over its own pages (causal in its last T
   tokens), giving a float32 partial state per row.
2. `shared_attention`: every shared segment of every group, as (row tile, kv
   block) matmuls whose M dimension is the covered rows x T x G; each row
   tile starts from its rows' private states and merges its segments in VMEM
   with an online softmax, so the LSE recombination is fused and no partial
   state per segment or per chunk reaches HBM.

The queries are laid out once as a [B*T*G, K, H] matrix (row b owns rows
[b*T*G, (b+1)*T*G), token-major, head-group-minor) and the kernels read the KV buffer as
[L, K*H] and [L/C, C, K*H]. With one kv head those are the buffer's own HBM layout, read in
place; with several, TPU tiles the (K, H) dims of [L, K, H], so the views are relayout copies
(a copy of the layer's K and V, which `_attend` cuts out first, before every call). A KV cache
stored lane-dense, [L, K*H], would be read in place at any head count.

No TPU is needed to test: pass `interpret=pltpu.InterpretParams()` (or True) to
run both kernels in TPU interpret mode on CPU.

The backend protocol of `hydrajax.attention.plan`: `prepare` builds the shared
kernel's work list (a device sort and scatter) and pads the page table, once
per tree change; `attend` passes the layer's `kv_offset` to the kernels as
scalar-prefetched SMEM scalars (first kv block, first page) that their index
maps add, so one work list serves every layer of a flat `[layers * L, K, H]`
buffer. The kv block is chosen to divide L where a multiple of 128 does; when
none does and the offset is not 0, the shared kernel reads a slice of the
layer's buffer (a copy).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from hydrajax import devices
from hydrajax.layout import TreeLayout
from hydrajax.partial_state import PartialState
from hydrajax.shapes import AttentionShapes
from hydrajax.validation import check_tree_attention_inputs
from pallas_kernels.tpu.block_sizes import (FALLBACK_BLOCK_SIZES, BlockSizes,
                                           block_sizes_for_device)
from pallas_kernels.tpu.online_softmax import LANES
from pallas_kernels.tpu.private_attention import private_attention
from pallas_kernels.tpu.shared_attention import shared_attention
from pallas_kernels.tpu.work_list import WorkList, build_work_list, work_list_size

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float32)
VMEM_BUDGET_BYTES = 48 * 2**20  # without vmem_limit_bytes: fits v5p's 64 MiB per TensorCore
SMEM_BUDGET_BYTES = 512 * 2**10  # half of the 1 MiB SMEM per TensorCore on v5e/v5p
DEFAULT_VMEM_LIMIT_BYTES = 32 * 2**20
MAX_VMEM_LIMIT_BYTES = 60 * 2**20  # below v5p's 64 MiB
MAX_PRIVATE_UNROLL = 64  # (row, page, head) bodies per private grid step


@dataclasses.dataclass(frozen=True)
class KernelPlan:
  """Static sizes of one call, derived from shapes, layout capacities and BlockSizes."""

  rows_per_query: int  # T*G
  block_rows: int  # bm, rows per row tile
  num_tiles: int
  padded_rows: int  # B_pad, query rows including padding: num_tiles * bm / (T*G)
  block_kv: int  # bk
  heads_per_block: int  # shared kernel
  num_splits: int  # shared kernel
  pages_per_block: int  # private kernel
  private_rows_per_block: int
  private_heads_per_block: int
  num_items: int  # E, work-list length per split
  vmem_bytes: int  # estimated VMEM footprint of the larger kernel
  smem_bytes: int  # scalar-prefetch footprint of the larger kernel
  vmem_limit_bytes: int


def _sublanes(dtype) -> int:
  return 8 * 4 // jnp.dtype(dtype).itemsize  # rows per (8, 128) 32-bit tile: 8 f32, 16 bf16


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def lane_aligned(heads: int, kv_heads: int, head_dim: int) -> bool:
  """Whether a block of `heads` kv heads is a legal Mosaic lane width: whole 128-lane vregs, or
  every kv head (the array's full width). Head dim 64 packs two heads in 128 lanes."""
  return (heads * head_dim) % LANES == 0 or heads == kv_heads


def _heads(kv_heads: int, head_dim: int, wanted: int | None, max_lanes: int) -> int:
  """`wanted`, else the most kv heads per block within `max_lanes` lanes, dividing K, on whole
  vregs (else the fewest heads that are; all K at worst)."""
  if wanted is not None:
    return wanted
  legal = [d for d in range(1, kv_heads + 1)
           if kv_heads % d == 0 and lane_aligned(d, kv_heads, head_dim)]
  fits = [d for d in legal if d * head_dim <= max_lanes]
  return max(fits) if fits else min(legal)


DEFAULT_CONFIG = FALLBACK_BLOCK_SIZES  # the config type of this backend, and interpret mode's


def default_config(*arrays, interpret=False) -> BlockSizes:
  """The block sizes of the TPU generation these inputs compile for (`block_sizes`'s table:
  the abstract mesh's device, else the inputs', else the default backend's); the fallback in
  interpret mode, whose speed the table says nothing about."""
  if interpret:
    return FALLBACK_BLOCK_SIZES
  return block_sizes_for_device(devices.target_device(*arrays))


def _block_kv(length: int, wanted: int) -> int:
  """kv tokens per block: L when it fits, else the largest multiple of 128 <= wanted that
  divides L (a layer then starts on a block boundary), else `wanted`."""
  if length <= wanted:
    return length
  for d in range(wanted, 127, -128):
    if length % d == 0:
      return d
  return wanted


def plan(q_shape, dtype, kv_shape, layout: TreeLayout, block_sizes: BlockSizes) -> KernelPlan:
  """The static tiling for inputs of these shapes (no arrays are read); kv_shape is one layer's."""
  b, t, n, h = q_shape
  length, kv_heads, _ = kv_shape
  tg = t * (n // kv_heads)
  sub = _sublanes(dtype)
  unit = math.lcm(tg, sub)
  bm = min(unit * max(1, block_sizes.block_rows // unit), _round_up(b * tg, unit))
  num_tiles = -(-b * tg // bm)
  padded_rows = num_tiles * bm // tg
  bk = _block_kv(length, block_sizes.block_kv)
  hb = _heads(kv_heads, h, block_sizes.heads_per_block, block_sizes.lanes_per_block)
  phb = _heads(kv_heads, h, block_sizes.private_heads_per_block, 1024)
  c, width = layout.page_size, layout.private_pages.shape[1]
  ppb = max(1, min(width, block_sizes.private_block_kv // c))
  isz = jnp.dtype(dtype).itemsize
  tgp, cp = _round_up(tg, sub), _round_up(c, sub)
  lanes, lse_lanes = phb * h, phb * LANES
  private_row_bytes = (  # VMEM of one row of a private step
      2 * tgp * lanes * isz  # q
      + 2 * 2 * ppb * cp * lanes * isz  # k, v pages
      + 2 * tgp * (lanes + 2 * lse_lanes) * 4 + tgp * (lanes + 2 * lse_lanes) * 4  # out, m, l, acc
  )
  # The private kernel unrolls rows x pages x heads bodies per step: keep that bounded, and its
  # rows within half the VMEM budget (many query tokens per row make a row megabytes).
  budget = block_sizes.vmem_limit_bytes or VMEM_BUDGET_BYTES
  rows_cap = min(block_sizes.private_rows_per_block, max(1, MAX_PRIVATE_UNROLL // (ppb * phb)),
                 max(1, budget // 2 // private_row_bytes))
  rp = max(d for d in range(1, min(padded_rows, rows_cap) + 1) if padded_rows % d == 0)
  private = rp * private_row_bytes + 4 * tgp * _round_up(c, LANES) * 4  # + score temporaries
  splits = min(block_sizes.core_splits, num_tiles)
  items = work_list_size(
      layout, rows_per_query=tg, block_rows=bm, block_kv=bk, num_tiles=num_tiles,
      kv_tokens=length, num_splits=splits,
  )
  lanes, lse_lanes = hb * h, hb * LANES
  shared = (
      2 * bm * lanes * isz  # q, double-buffered
      + 2 * 2 * bk * lanes * isz  # k, v
      + 2 * bm * (lanes + lse_lanes) * 4  # initial state
      + 2 * bm * lanes * isz + 2 * bm * lse_lanes * 4  # output
      + 2 * bm * lse_lanes * 4 + bm * lanes * 4  # m, l, acc
      + 4 * bm * bk * 4  # score-sized temporaries
  )
  vmem = max(shared if layout.groups else 0, private)
  smem = max(7 * splits * items * 4, 4 * padded_rows * (width + 1))
  limit = block_sizes.vmem_limit_bytes or max(
      DEFAULT_VMEM_LIMIT_BYTES, min(2 * vmem, MAX_VMEM_LIMIT_BYTES)
  )
  return KernelPlan(
      rows_per_query=tg, block_rows=bm, num_tiles=num_tiles, padded_rows=padded_rows,
      block_kv=bk, heads_per_block=hb, num_splits=splits, pages_per_block=ppb,
      private_rows_per_block=rp,
      private_heads_per_block=phb,
      num_items=items, vmem_bytes=vmem, smem_bytes=smem, vmem_limit_bytes=limit,
  )


def targets_tpu() -> bool:
  """True on a TPU backend, or under `jax.sharding.use_abstract_mesh` with a TPU device."""
  return devices.tpu_reason() is None


def _shapes_reason(q, k_cache, layout: TreeLayout, block_sizes: BlockSizes) -> str | None:
  """Why inputs of these shapes (one layer's k_cache) cannot run on these kernels, or None."""
  if q.dtype not in SUPPORTED_DTYPES or k_cache.dtype not in SUPPORTED_DTYPES:
    return f'dtypes must be bfloat16 or float32, got q {q.dtype} and kv {k_cache.dtype}'
  if q.dtype != k_cache.dtype:
    return f'q ({q.dtype}) and the KV cache ({k_cache.dtype}) must share a dtype'
  h = q.shape[-1]
  length = k_cache.shape[0]
  if length % layout.page_size:
    return f'the KV buffer length L={length} must be a multiple of page_size={layout.page_size}'
  kv_heads = k_cache.shape[1]
  for name in ('heads_per_block', 'private_heads_per_block'):
    heads = getattr(block_sizes, name)
    if heads is not None and kv_heads % heads:
      return f'{name}={heads} must divide K={kv_heads}'
    if heads is not None and not lane_aligned(heads, kv_heads, h):
      return (f'{name}={heads} heads of H={h} are {heads * h} lanes: a multiple of {LANES} '
              f'(TPU lanes) or all K={kv_heads} heads')
  p = plan(q.shape, q.dtype, k_cache.shape, layout, block_sizes)
  budget = block_sizes.vmem_limit_bytes or VMEM_BUDGET_BYTES
  if p.vmem_bytes > budget:
    return (
        f'blocks need ~{p.vmem_bytes / 2**20:.1f} MiB of VMEM (budget {budget / 2**20:.0f} MiB: '
        'vmem_limit_bytes, or the default on every TPU): lower block_rows, block_kv or the heads '
        'per block '
        f'(a row tile is {p.block_rows} rows for T*G={p.rows_per_query})'
    )
  if p.smem_bytes > SMEM_BUDGET_BYTES:
    return (
        f'scalar-prefetched metadata needs ~{p.smem_bytes / 2**10:.0f} KiB of SMEM (budget '
        f'{SMEM_BUDGET_BYTES / 2**10:.0f} KiB, {p.num_splits} x {p.num_items} work items): '
        'raise block_kv or block_rows, or use fewer private pages per row'
    )
  return None


def unsupported_reason(shapes, layout: TreeLayout, *, interpret=False,
                       config: BlockSizes | None = None) -> str | None:
  """Why calls of these `AttentionShapes` cannot run on these kernels, or None.

  Shapes, dtypes and block-size limits only: the device check is the dispatcher's.
  """
  config = config or default_config(interpret=interpret)
  return _shapes_reason(shapes.query_struct(), shapes.kv_struct(), layout, config)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TpuPrepared:
  """What `prepare` derives from the layout once per tree change."""

  work: WorkList | None  # the shared kernel's work list (None without shared segments)
  private_pages: jax.Array  # [B_pad, P] int32, padding rows zero
  private_lengths: jax.Array  # [B] int32, the layout's (swapped per decode step)
  kernel_plan: KernelPlan = dataclasses.field(metadata=dict(static=True))
  page_size: int = dataclasses.field(metadata=dict(static=True))


@functools.partial(jax.jit, static_argnames=('kernel_plan', 'kv_tokens'))
def _prepare(layout: TreeLayout, *, kernel_plan: KernelPlan, kv_tokens: int) -> TpuPrepared:
  p = kernel_plan
  work = None
  if layout.groups:
    work = build_work_list(
        layout, rows_per_query=p.rows_per_query, block_rows=p.block_rows, block_kv=p.block_kv,
        num_tiles=p.num_tiles, kv_tokens=kv_tokens, num_splits=p.num_splits,
    )
  extra = p.padded_rows - layout.num_rows
  pages = jnp.pad(layout.private_pages, ((0, extra), (0, 0)))
  return TpuPrepared(work, pages, layout.private_lengths, p, layout.page_size)


def prepare(layout: TreeLayout, shapes, config: BlockSizes, *, interpret=False) -> TpuPrepared:
  """The work list and padded page table of `layout` (ValueError if the config does not fit)."""
  del interpret
  reason = unsupported_reason(shapes, layout, config=config)
  if reason is not None:
    raise ValueError(f'pallas_kernels.tpu.tree_attention does not support these inputs: {reason}')
  kernel_plan = plan(
      (shapes.num_rows, shapes.query_tokens, shapes.num_heads, shapes.head_dim), shapes.dtype,
      (shapes.kv_tokens, shapes.num_kv_heads, shapes.head_dim), layout, config,
  )
  return _prepare(layout, kernel_plan=kernel_plan, kv_tokens=shapes.kv_tokens)


def with_private_lengths(prepared: TpuPrepared, lengths: jax.Array) -> TpuPrepared:
  return dataclasses.replace(prepared, private_lengths=lengths)


def for_step(prepared: TpuPrepared) -> TpuPrepared:
  return prepared  # the kernels read the (padded) lengths themselves: nothing to hoist


def _interpret_arg(interpret):
  if interpret is True:
    return pltpu.InterpretParams()
  return interpret or False


def attend(q, k_cache, v_cache, prepared: TpuPrepared, *, shapes, config, kv_offset, scale,
           interpret=False) -> PartialState:
  """Attention of every row over its tree path and private KV, in the layer at `kv_offset`."""
  del config
  scale = shapes.head_dim**-0.5 if scale is None else float(scale)
  return _attend(
      q, k_cache, v_cache, prepared, jnp.asarray(kv_offset, jnp.int32),
      static_zero_offset=isinstance(kv_offset, int) and kv_offset == 0, kv_tokens=shapes.kv_tokens,
      scale=scale, interpret=_interpret_arg(interpret),
  )


def tree_attention(
    q: jax.Array,  # [B, T, N, H]
    k_cache: jax.Array,  # [L, K, H]
    v_cache: jax.Array,  # [L, K, H]
    layout: TreeLayout,
    *,
    scale: float | None = None,
    interpret: pltpu.InterpretParams | bool | None = None,
    block_sizes: BlockSizes | None = None,
) -> PartialState:
  """Exact attention of every row over its tree path and private KV, on Mosaic TPU.

  Args:
    q: [B, T, N, H] queries; row b's T tokens are its last T private tokens.
    k_cache, v_cache: [L, K, H] flat KV buffer of the batch (one layer).
    layout: the device `TreeLayout` of the batch.
    scale: softmax scale, H**-0.5 if None.
    interpret: a `pltpu.InterpretParams` (or True) runs the kernels in TPU
      interpret mode, e.g. on CPU; None/False compiles them for the TPU.
    block_sizes: tuning knobs; None: the table's entry for the TPU generation of the inputs'
      device (`block_sizes.BLOCK_SIZES_BY_GENERATION`), the fallback in interpret mode.

  Returns:
    (out [B, T, N, H] in q.dtype, lse [B, T, N] float32, natural log).

  Raises:
    ValueError: bad inputs (see `hydrajax.validation`), or inputs these kernels
      do not support (see `unsupported_reason`).
  """
  check_tree_attention_inputs(q, k_cache, v_cache, layout)
  interpret = _interpret_arg(interpret)
  block_sizes = block_sizes or default_config(q, k_cache, interpret=bool(interpret))
  reason = devices.with_interpret_hint(devices.tpu_reason(), interpret=bool(interpret))
  reason = reason or _shapes_reason(q, k_cache, layout, block_sizes)
  if reason is not None:
    raise ValueError(f'pallas_kernels.tpu.tree_attention does not support these inputs: {reason}')
  shapes = AttentionShapes.of(q, k_cache)
  prepared = prepare(layout, shapes, block_sizes)
  scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
  return _attend(
      q, k_cache, v_cache, prepared, jnp.zeros((), jnp.int32), static_zero_offset=True,
      kv_tokens=shapes.kv_tokens, scale=scale, interpret=interpret,
  )


@functools.partial(
    jax.jit, static_argnames=('static_zero_offset', 'kv_tokens', 'scale', 'interpret')
)
def _attend(q, k_cache, v_cache, prepared: TpuPrepared, kv_offset, *, static_zero_offset,
            kv_tokens, scale, interpret):
  b, t, n, h = q.shape
  total, kv_heads, _ = k_cache.shape
  g = n // kv_heads
  p = prepared.kernel_plan
  tg, extra = p.rows_per_query, p.padded_rows - b
  knobs = dict(vmem_limit_bytes=p.vmem_limit_bytes, interpret=interpret)

  # [B, T, N, H] -> [B_pad, T*G, K, H]: row (t, g) of query row b, per kv head.
  qg = q.reshape(b, t, kv_heads, g, h).transpose(0, 1, 3, 2, 4).reshape(b, tg, kv_heads, h)
  qg = jnp.pad(qg, ((0, extra), (0, 0), (0, 0), (0, 0)))
  lengths = jnp.pad(prepared.private_lengths, (0, extra))  # padding rows: length 0, (0, -inf)
  pages = prepared.private_pages
  c = prepared.page_size
  if kv_heads > 1 and total > kv_tokens:
    # The kernels read [L, K*H] views. With one kv head that view is the buffer's own HBM layout;
    # with several, TPU tiles (K, H) and the view is a relayout copy, which XLA makes of whatever
    # the kernel is given: of the whole multi-layer buffer in every layer. Given the layer alone,
    # each copy is one layer's.
    k_cache = jax.lax.dynamic_slice_in_dim(k_cache, kv_offset, kv_tokens)
    v_cache = jax.lax.dynamic_slice_in_dim(v_cache, kv_offset, kv_tokens)
    total, kv_offset, static_zero_offset = kv_tokens, jnp.zeros((), jnp.int32), True
  paged = lambda x: x.reshape(total // c, c, kv_heads, h)
  out, lse = private_attention(
      qg, paged(k_cache), paged(v_cache), lengths, pages, kv_offset // c,
      num_queries=t, scale=scale, pages_per_block=p.pages_per_block,
      rows_per_block=p.private_rows_per_block, heads_per_block=p.private_heads_per_block, **knobs,
  )
  rows = p.padded_rows * tg
  out, lse = out.reshape(rows, kv_heads, h), lse.reshape(rows, kv_heads, LANES)
  if prepared.work is not None:
    k_layer, v_layer, block_offset = k_cache, v_cache, kv_offset // p.block_kv
    if not static_zero_offset and kv_tokens % p.block_kv:  # a layer does not start on a block
      k_layer = jax.lax.dynamic_slice_in_dim(k_cache, kv_offset, kv_tokens)
      v_layer = jax.lax.dynamic_slice_in_dim(v_cache, kv_offset, kv_tokens)
      block_offset = jnp.zeros((), jnp.int32)
    out, lse = shared_attention(
        qg.reshape(rows, kv_heads, h), k_layer, v_layer, out, lse, prepared.work, block_offset,
        scale=scale, block_rows=p.block_rows, block_kv=p.block_kv,
        heads_per_block=p.heads_per_block, num_splits=p.num_splits, **knobs,
    )

  # [B*T*G, K, H] -> [B, T, N, H] and [B*T*G, K, 128] -> [B, T, N].
  out = out[: b * tg].reshape(b, t, g, kv_heads, h).transpose(0, 1, 3, 2, 4).reshape(b, t, n, h)
  lse = lse[: b * tg, :, 0].reshape(b, t, g, kv_heads).transpose(0, 1, 3, 2).reshape(b, t, n)
  return PartialState(out.astype(q.dtype), lse)
