"""Shared-segment attention on Hopper: Pallas Mosaic GPU, one launch for every segment.

Each program takes one work item (a row tile of one kv split of one segment,
see `schedule.py`) for one kv head: the segment's rows times the GQA group are
the M dimension of two wgmma matrix products per kv block (QK^T and PV), as in
FlashAttention-3: two compute warpgroups of 64 rows each and one memory
warpgroup that streams K and V blocks with TMA through `max_concurrent_steps`
shared-memory slots. On long programs each warpgroup also overlaps its softmax with its own
PV product (`SegmentKernelConfig.overlap`). Scores are kept in base 2 (scale * log2(e) folded into
one multiply); the written lse is natural-log.

Output: per item a normalised partial state, out `[K, PAD + W*TILE_M + PAD, H]`
in the input dtype and lse `[K, PAD + W*TILE_M + PAD]` float32 (item w at rows
`PAD + [w*TILE_M, (w+1)*TILE_M)`, PAD = `PARTIAL_PAD` unwritten rows at each end
so that the private kernel's 64-row windows never leave the buffer), with
(0, -inf) for a split that holds no tokens. Items whose row tile lies past the
segment's rows write nothing (nobody reads them).

Token indices are `kv_offset` (an operand: the layer's first token in a flat
multi-layer buffer) plus the segment's. Blocks that are all inside the segment
run unmasked; the first and last (boundary) blocks mask the scores and zero the
V rows outside the segment in shared memory (`online_softmax.zero_rows`), so
NaN or inf in neighbouring tokens never reaches an output.
"""

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.mosaic_gpu import profiling
from pallas_kernels.mosaic_gpu import online_softmax as osm
from pallas_kernels.mosaic_gpu.online_softmax import LOG2E
from pallas_kernels.mosaic_gpu.schedule import ALIGN, PARTIAL_PAD, TILE_M, WG_M, SharedSchedule
from pallas_kernels.softmax_state import normalized

if TYPE_CHECKING:  # annotations only: hydrajax imports these kernels (the registry)
  from hydrajax.layout import SegmentGroup

SEGMENT_FIELDS = ('kv_start', 'kv_length', 'row_begin', 'row_count')  # rows of pack_segments


def floor_div(x, d: int):
  """x // d for a non-negative int32 array below 2**20, in float math (exact there)."""
  return (x.astype(jnp.float32) * (1.0 / d) + 0.5 / d).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class SegmentKernelConfig:
  """Block sizes and schedule of the shared-segment kernel.

  Attributes:
    block_kv: kv tokens per step (a multiple of 64).
    max_concurrent_steps: shared-memory slots of the K/V pipeline (>= 2).
    overlap: each step issues its QK^T wgmma and the previous step's PV wgmma together and
      runs the softmax while PV is on the tensor cores (FlashAttention-3's intra-warpgroup
      overlap), the two warpgroups taking one-sided turns at issuing. Off: a step waits for
      QK^T, runs the softmax, then issues and waits for PV, the warpgroups meeting twice a
      step (`_warp_specialized_kernel`). None: on when a program may run OVERLAP_MIN_BLOCKS
      kv blocks or more of at most OVERLAP_MAX_BLOCK_KV tokens (`overlaps`).
  """

  block_kv: int = 128
  max_concurrent_steps: int = 2
  overlap: bool | None = None

  def __post_init__(self):
    if self.block_kv % 64:
      raise ValueError(f'block_kv must be a multiple of 64, got {self.block_kv}')
    if self.max_concurrent_steps < 2:
      raise ValueError(f'max_concurrent_steps must be >= 2, got {self.max_concurrent_steps}')
    if self.overlap not in (None, True, False):
      raise ValueError(f'overlap must be None, True or False, got {self.overlap!r}')


# The overlap pays where a program has many kv blocks (2% faster at 128 blocks a program),
# changes nothing at 9-64, and costs at 2 (its first and last steps are extra).
OVERLAP_MIN_BLOCKS = 16
# With 192-token steps the overlap's two score tiles do not fit the consumer's registers
# (ptxas spills about 1 KB; 1.6x slower than in order). None leaves it off there.
OVERLAP_MAX_BLOCK_KV = 128


def overlaps(config: SegmentKernelConfig, sched: SharedSchedule) -> bool:
  """Whether the shared kernel runs the overlapped schedule (`SegmentKernelConfig.overlap`)."""
  if config.overlap is not None:
    return config.overlap
  if config.block_kv > OVERLAP_MAX_BLOCK_KV:
    return False
  longest = max((g.split_tokens for g in sched.groups), default=0) // sched.block_kv
  return longest >= OVERLAP_MIN_BLOCKS


def _align_down(x):
  return x - lax.rem(x, jnp.int32(ALIGN))


@dataclasses.dataclass(frozen=True)
class SegmentFields:
  """Scalars of one segment, selected from the group arrays at a dynamic global index."""

  valid: jax.Array  # bool: the index names a segment
  kv_start: jax.Array
  kv_length: jax.Array
  row_begin: jax.Array
  row_count: jax.Array
  item_base: jax.Array  # first work item of the segment
  row_tiles: jax.Array  # row tiles per (segment, split) of its group
  split_tokens: jax.Array  # kv tokens per split of its group


def pack_segments(groups: Sequence['SegmentGroup']) -> jax.Array:
  """[4, J] int32 (kv_start, kv_length, row_begin, row_count) over the concatenated groups.

  Packed on the host when the group arrays are concrete (a layout built by
  `SharingPlan.to_device`), so the result is one transfer; traced arrays (a layout
  made inside jit) are packed on the device.
  """
  try:
    host = [np.concatenate([np.asarray(getattr(g, f)) for g in groups]) for f in SEGMENT_FIELDS]
  except jax.errors.TracerArrayConversionError:
    return jnp.stack([
        jnp.concatenate([getattr(g, f) for g in groups]) for f in SEGMENT_FIELDS
    ]).astype(jnp.int32)
  return jnp.asarray(np.stack(host).astype(np.int32))


def segment_fields(sched: SharedSchedule, seg_ref, index) -> SegmentFields:
  """Reads segment `index` (into the concatenation of the groups) from `pack_segments` in GMEM.

  The group's static tiling is found by a static loop over the groups.
  """
  zero = jnp.int32(0)
  valid, item_base, row_tiles, split_tokens = jnp.bool_(False), zero, zero, zero
  for gs in sched.groups:
    local = index - gs.segment_offset
    inside = (local >= 0) & (local < gs.num_segments)
    valid = valid | inside
    first_item = gs.item_offset + local * (gs.num_splits * gs.row_tiles)
    item_base = jnp.where(inside, first_item, item_base)
    row_tiles = jnp.where(inside, gs.row_tiles, row_tiles)
    split_tokens = jnp.where(inside, gs.split_tokens, split_tokens)
  j = jnp.minimum(jnp.maximum(index, 0), sched.num_segments - 1)
  return SegmentFields(
      valid=valid, kv_start=seg_ref[0, j], kv_length=seg_ref[1, j], row_begin=seg_ref[2, j],
      row_count=seg_ref[3, j], item_base=item_base, row_tiles=row_tiles, split_tokens=split_tokens,
  )


def _item_segment(sched: SharedSchedule, item):
  """Global segment index, split and row tile of work item `item`."""
  index = split = tile = jnp.int32(0)
  for gs in sched.groups:
    local = item - gs.item_offset
    inside = (local >= 0) & (local < gs.num_items)
    local = jnp.minimum(jnp.maximum(local, 0), gs.num_items - 1)
    per_segment = gs.num_splits * gs.row_tiles
    j = lax.div(local, jnp.int32(per_segment))
    rest = lax.rem(local, jnp.int32(per_segment))
    index = jnp.where(inside, gs.segment_offset + j, index)
    split = jnp.where(inside, lax.div(rest, jnp.int32(gs.row_tiles)), split)
    tile = jnp.where(inside, lax.rem(rest, jnp.int32(gs.row_tiles)), tile)
  return index, split, tile


@dataclasses.dataclass(frozen=True)
class _Item:
  """Scalars of one work item (see the module docstring of `schedule`)."""

  active: jax.Array  # the row tile holds some of the segment's rows
  tile_row: jax.Array  # first query row of the tile (a multiple of ALIGN)
  split_tok: jax.Array  # first kv token of the split's frame (a multiple of ALIGN)
  lo: jax.Array  # the segment's tokens are [lo, hi) relative to split_tok
  hi: jax.Array
  num_blocks: jax.Array
  num_head: jax.Array  # 1 if the first block needs the lo mask
  num_tail: jax.Array  # 1 if the last (other) block needs the hi mask


def _decode_item(sched: SharedSchedule, seg_ref, item, bk: int, kv_offset) -> _Item:
  index, split, tile = _item_segment(sched, item)
  seg = segment_fields(sched, seg_ref, index)
  tg = sched.rows_per_query
  first_row = seg.row_begin * tg
  frame_row = _align_down(first_row)
  frame_tok = _align_down(seg.kv_start)
  head = seg.kv_start - frame_tok
  lo = jnp.maximum(head - split * seg.split_tokens, 0)
  hi = jnp.minimum(head + seg.kv_length - split * seg.split_tokens, seg.split_tokens)
  num_blocks = jnp.where(hi > lo, lax.div(hi + (bk - 1), jnp.int32(bk)), 0)
  num_head = jnp.where((lo > 0) & (num_blocks > 0), 1, 0)
  num_tail = jnp.where((lax.rem(hi, jnp.int32(bk)) != 0) & (num_blocks > num_head), 1, 0)
  return _Item(
      active=tile * TILE_M < (first_row - frame_row) + seg.row_count * tg,
      tile_row=frame_row + tile * TILE_M,
      split_tok=kv_offset + frame_tok + split * seg.split_tokens,
      lo=lo, hi=hi, num_blocks=num_blocks, num_head=num_head, num_tail=num_tail,
  )


def _visible(shape, it: _Item, step, bk: int):
  """[M, bk] bool: the block's columns inside the segment (a boundary block's mask)."""
  cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) + step * bk
  return (cols >= it.lo) & (cols < it.hi)


def _zero_outside(v_smem, it: _Item, step, bk: int):
  """Zeroes the boundary block's V rows outside the segment (no 0 * inf in p @ V)."""
  first_tok = step * bk
  osm.zero_rows(
      v_smem,
      lambda r: (r + first_tok >= it.lo) & (r + first_tok < it.hi),
      lambda first: (first_tok + first < it.lo) | (first_tok + first + WG_M > it.hi),
  )


def _softmax_step(qk, carry, it: _Item, step, bk: int, masked: bool, qk_scale: float, dtype):
  acc, m_i, l_i = carry
  visible = _visible(qk.shape, it, step, bk) if masked else None
  # Every row of a tile sees the block's visible columns: no row is empty.
  return osm.step(
      qk, acc, m_i, l_i, scale_log2=qk_scale, dtype=dtype, visible=visible, may_be_empty=False
  )


def _three_sections(step_fn, it: _Item, carry):
  """Runs step_fn over the item's blocks: masked head, unmasked middle, masked tail."""
  carry = lax.fori_loop(0, it.num_head, lambda i, c: step_fn(i, c, True), carry)
  carry = lax.fori_loop(
      it.num_head, it.num_blocks - it.num_tail, lambda i, c: step_fn(i, c, False), carry
  )
  return lax.fori_loop(
      it.num_blocks - it.num_tail, it.num_blocks, lambda i, c: step_fn(i, c, True), carry
  )


def segment_attention(
    qf: jax.Array,  # [K, M_pad, H]: queries folded per kv head, M_pad a multiple of ALIGN
    k_cache: jax.Array,  # [L, K, H], L a multiple of ALIGN
    v_cache: jax.Array,  # [L, K, H]
    segments: jax.Array,  # [4, J] int32, pack_segments(layout.groups)
    sched: SharedSchedule,
    *,
    scale: float,
    config: SegmentKernelConfig = SegmentKernelConfig(),
    kv_offset: jax.Array | int = 0,
    q_by_row: bool = False,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Partial states of every (segment, split, row tile), rows as in the module docstring.

  `kv_offset` (int32 scalar, a multiple of ALIGN) is added to every kv token
  index: the segments index one layer's buffer that starts there in k_cache.
  `q_by_row`: qf is a G = 1 query's [M, K, H] view, read in place (`q_tile`).

  On the GPU this is the warp-specialised kernel. With `interpret=True` it is
  the single-warpgroup kernel: the same items, masks, softmax and epilogue,
  pipelined by one warpgroup (interpret mode runs each warpgroup as an XLA CPU
  computation, and three that wait on each other's barriers can starve a CPU
  thread pool of two cores).
  """
  kh, h = (qf.shape[1] if q_by_row else qf.shape[0]), qf.shape[-1]
  rows = PARTIAL_PAD + sched.num_items * TILE_M + PARTIAL_PAD
  out_type = (
      jax.ShapeDtypeStruct((kh, rows, h), qf.dtype),
      jax.ShapeDtypeStruct((kh, rows), jnp.float32),
  )
  build = _single_warpgroup_kernel if interpret else _warp_specialized_kernel
  kernel, scratch, mesh = build(qf, sched, scale=scale, config=config, q_by_row=q_by_row,
                                interpret=interpret)
  return plgpu.kernel(
      kernel,
      out_type=out_type,
      scratch_types=scratch,
      grid=(sched.num_items, kh),
      grid_names=('item', 'kv_head'),
      # Row reductions of the WGMMA layout stay within a warp: no cross-warp scratch (2 KiB,
      # which 192-token kv steps need).
      compiler_params=profiling.compiler_params(reduction_scratch_bytes=0),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
      **mesh,
  )(segments, offset_operand(kv_offset), qf, k_cache, v_cache)


def q_tile(q_ref, kv_head, first_row, q_by_row: bool, size: int = WG_M):
  """`size` folded query rows from `first_row` at kv_head, as a ref for one TMA copy.

  q is folded, [K, M, H], or by row: a G = 1 query's [B*T, K, H] view, folded row r at
  (r, k), so no fold is written per layer (a 16 MB pad and transpose at B=1024, 32 heads).
  Rows past its end read as zeros (TMA), as the fold's padding did.
  """
  rows = pl.ds(pl.multiple_of(first_row, ALIGN), size)
  return q_ref.at[rows, kv_head] if q_by_row else q_ref.at[kv_head, rows]


def start_q(q_ref, kv_head, first_row, q_by_row: bool, q_smem, barrier):
  """Issues the TMA copy of the Q tile into q_smem (`barrier` says when it has landed)."""
  plgpu.copy_gmem_to_smem(q_tile(q_ref, kv_head, first_row, q_by_row, q_smem.shape[0]), q_smem,
                          barrier)


def as_folded(q, q_by_row: bool):
  """q as [K, M, H] (the references' layout), whichever layout the kernels read."""
  return q.transpose(1, 0, 2) if q_by_row else q


def offset_operand(kv_offset) -> jax.Array:
  """kv_offset as the kernels' [1] int32 operand (read once per program)."""
  return jnp.asarray(kv_offset, jnp.int32).reshape(1)


_TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


class _WsProgram(NamedTuple):
  """A compute warpgroup's view of its program in the warp-specialised kernel."""

  it: Any  # the item (`_decode_item`)
  wg: Any  # the warpgroup, 0 or 1
  qo_smem2: Any  # [2, 64, H]: each warpgroup's Q, then its output
  k_smem: Any
  v_smem: Any
  k_barriers: Any
  v_barriers: Any
  k_consumed: Any
  v_consumed: Any
  schedule_barrier: Any
  turns: Any  # the overlap's turns (None in order)
  h: int
  dtype: Any
  bk: int  # kv tokens a step
  steps: int  # K/V slots
  qk_scale: float  # scores in base 2


# In order: both compute warpgroups arrive on `schedule_barrier` and wait for it, so each such
# point is a rendezvous; warpgroup 1 passes one more at its start (and 0 at its end), which puts
# one's wgmmas under the other's softmax.
def _schedule(c: _WsProgram):
  plgpu.barrier_arrive(c.schedule_barrier)
  plgpu.barrier_wait(c.schedule_barrier)


def _qk(c: _WsProgram, slot):
  return lambda s_ref: plgpu.wgmma(s_ref, c.qo_smem2.at[c.wg], c.k_smem.at[slot].transpose((1, 0)))


def _steps_in_order(c: _WsProgram):
  """The kv steps with the two compute warpgroups taking turns at rendezvous (`_schedule`).
  Returns (acc, m_i, l_i)."""
  it, wg, h, dtype, bk, steps, qk_scale = c.it, c.wg, c.h, c.dtype, c.bk, c.steps, c.qk_scale
  k_barriers, v_barriers, k_consumed, v_consumed = (c.k_barriers, c.v_barriers, c.k_consumed,
                                                    c.v_consumed)
  schedule_barrier, v_smem = c.schedule_barrier, c.v_smem
  schedule, qk = functools.partial(_schedule, c), functools.partial(_qk, c)
  carry = osm.init(WG_M, h)

  @pl.when(it.num_blocks > 0)
  def _():
    plgpu.barrier_wait(k_barriers.at[0])

  pl.when(wg == 1)(schedule)

  def kv_step(step, carry, masked: bool):
    slot = lax.rem(step, jnp.int32(steps))

    def compute_qk(s_ref):
      qk(slot)(s_ref)
      schedule()
      return s_ref[...]

    s = pl.run_scoped(compute_qk, plgpu.ACC((WG_M, bk), jnp.float32))
    plgpu.barrier_arrive(k_consumed.at[slot])
    acc, m_i, l_i, p16 = _softmax_step(s, carry, it, step, bk, masked, qk_scale, dtype)
    acc, l_i, m_i, p16 = lax.optimization_barrier((acc, l_i, m_i, p16))
    plgpu.barrier_arrive(schedule_barrier)
    plgpu.barrier_wait(v_barriers.at[slot])
    plgpu.barrier_wait(schedule_barrier)
    if masked:  # both warpgroups zero the same rows: their writes agree
      _zero_outside(v_smem.at[slot], it, step, bk)

    def wait_next_k():
      nxt = step + 1

      @pl.when(nxt < it.num_blocks)
      def _():
        plgpu.barrier_wait(k_barriers.at[lax.rem(nxt, jnp.int32(steps))])

    def compute_pv(acc_ref):  # P from registers, accumulated in place
      plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
      wait_next_k()

    acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
    plgpu.barrier_arrive(v_consumed.at[slot])
    return acc, m_i, l_i

  acc, m_i, l_i = _three_sections(kv_step, it, carry)
  pl.when(wg == 0)(schedule)
  return acc, m_i, l_i


# Overlapped: one-sided turns, as FlashAttention-3's. A warpgroup waits for its turn only to
# issue its wgmmas and hands the turn over right after, so it never waits for the other one's
# softmax (a rendezvous did: both softmaxes then ran while the tensor cores idled). Warpgroup 1
# opens warpgroup 0's first turn.
def _steps_overlapped(c: _WsProgram):
  """Step s issues QK^T of block s, rescales acc to block s - 1's maximum under it,
  issues PV of block s - 1, and runs block s's softmax while PV is on the tensor cores
  (FlashAttention-3's order). The carry's acc still awaits its last alpha."""
  it, wg, h, dtype, bk, steps, qk_scale = c.it, c.wg, c.h, c.dtype, c.bk, c.steps, c.qk_scale
  k_barriers, v_barriers, k_consumed, v_consumed = (c.k_barriers, c.v_barriers, c.k_consumed,
                                                    c.v_consumed)
  v_smem, qk = c.v_smem, functools.partial(_qk, c)

  def take_turn():
    plgpu.barrier_wait(c.turns.at[wg])

  def pass_turn():
    plgpu.barrier_arrive(c.turns.at[1 - wg])

  softmax = lambda s, m, l, step, masked: osm.step_deferred(
      s, m, l, scale_log2=qk_scale, may_be_empty=False,
      visible=_visible(s.shape, it, step, bk) if masked else None)

  def boundary(step):  # the item's first or last block, which may hold tokens outside it
    return (step < it.num_head) | (step >= it.num_blocks - it.num_tail)

  def add_pv(acc_ref, p16, step):
    slot = lax.rem(step, jnp.int32(steps))
    plgpu.barrier_wait(v_barriers.at[slot])
    # Both warpgroups zero the same rows: their writes agree.
    pl.when(boundary(step))(lambda: _zero_outside(v_smem.at[slot], it, step, bk))
    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

  def first():  # block 0: QK^T and its softmax, no PV yet
    plgpu.barrier_wait(k_barriers.at[0])

    def compute_qk(s_ref):
      take_turn()
      qk(0)(s_ref)
      pass_turn()
      return s_ref[...]

    s = pl.run_scoped(compute_qk, plgpu.ACC((WG_M, bk), jnp.float32))
    plgpu.barrier_arrive(k_consumed.at[0])
    alpha, m_i, l_i, p = softmax(s, *osm.init(WG_M, h)[1:], 0, True)
    return osm.init(WG_M, h)[0], m_i, l_i, p.astype(dtype), alpha

  def kv_step(step, carry, masked: bool):
    acc, m_i, l_i, p16, alpha = carry
    slot = lax.rem(step, jnp.int32(steps))
    plgpu.barrier_wait(k_barriers.at[slot])

    def products(refs):
      acc_ref, alpha_ref, m_ref, l_ref, p_ref = refs

      def compute_qk(s_ref):
        take_turn()
        qk(slot)(s_ref)
        # No wgmma writes acc now: read without a wait, rescale under QK^T.
        acc_ref[...] = osm.rescale(plgpu.wgmma_accumulator_load(acc_ref, wait_n=None), alpha)
        add_pv(acc_ref, p16, step - 1)
        pass_turn()
        return plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # PV may still run

      s = pl.run_scoped(compute_qk, plgpu.ACC((WG_M, bk), jnp.float32))
      plgpu.barrier_arrive(k_consumed.at[slot])
      alpha_ref[...], m_ref[...], l_ref[...], p_ref[...] = softmax(
          s, m_ref[...], l_ref[...], step, masked)

    scores = plgpu.layout_cast(jnp.zeros((WG_M, bk), jnp.float32), plgpu.Layout.WGMMA)
    acc, alpha, m_i, l_i, p = pl.run_state(products)(
        (plgpu.ACC.init(acc), m_i, m_i, l_i, scores))
    plgpu.barrier_arrive(v_consumed.at[lax.rem(step - 1, jnp.int32(steps))])
    return acc, m_i, l_i, p.astype(dtype), alpha

  def last(carry):  # PV of the last block
    acc, m_i, l_i, p16, alpha = carry
    step = it.num_blocks - 1

    def compute_pv(acc_ref):
      take_turn()
      add_pv(acc_ref, p16, step)
      pass_turn()

    acc = pl.run_state(compute_pv)(plgpu.ACC.init(osm.rescale(acc, alpha)))
    plgpu.barrier_arrive(v_consumed.at[lax.rem(step, jnp.int32(steps))])
    return acc, m_i, l_i

  pl.when(wg == 1)(lambda: plgpu.barrier_arrive(c.turns.at[0]))
  empty = osm.init(WG_M, h)
  zero_p = plgpu.layout_cast(jnp.zeros((WG_M, bk), dtype), plgpu.Layout.WGMMA)
  carry = lax.cond(it.num_blocks > 0, first, lambda: (*empty, zero_p, empty[2]))
  split = jnp.maximum(it.num_blocks - it.num_tail, 1)
  carry = lax.fori_loop(1, split, lambda i, c: kv_step(i, c, False), carry)
  carry = lax.fori_loop(split, it.num_blocks, lambda i, c: kv_step(i, c, True), carry)
  return lax.cond(it.num_blocks > 0, last, lambda c: c[:3], carry)


def _warp_specialized_kernel(qf, sched, *, scale, config, q_by_row, interpret):
  """FlashAttention-3 style: two compute warpgroups of 64 rows and one TMA warpgroup."""
  del interpret
  h = qf.shape[-1]
  dtype = qf.dtype
  bk = config.block_kv
  steps = config.max_concurrent_steps
  qk_scale = scale * LOG2E  # scores in base 2
  overlap = overlaps(config, sched)

  def shared_segment_kernel(seg_ref, offset_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, smem,
                            barriers, consumed, schedule_barrier, turns):
    qo_smem2, k_smem, v_smem, lse_smem2 = smem
    k_barriers, v_barriers, q_barriers = barriers
    k_consumed, v_consumed = consumed
    item = lax.axis_index('item')
    kv_head = lax.axis_index('kv_head')
    wg = lax.axis_index('wg')
    it = _decode_item(sched, seg_ref, item, bk, offset_ref[0])

    program = _WsProgram(it, wg, qo_smem2, k_smem, v_smem, k_barriers, v_barriers, k_consumed,
                         v_consumed, schedule_barrier, turns, h, dtype, bk, steps, qk_scale)

    @pl.when(it.active & (wg < 2))
    def _compute():
      plgpu.set_max_registers(232, action='increase')
      qo_smem = qo_smem2.at[wg]
      start_q(q_ref, kv_head, it.tile_row + wg * WG_M, q_by_row, qo_smem, q_barriers.at[wg])
      plgpu.barrier_wait(q_barriers.at[wg])
      acc, m_i, l_i = (_steps_overlapped if overlap else _steps_in_order)(program)
      osm.finish(acc, m_i, l_i, qo_smem, lse_smem2.at[wg], dtype)
      out_row = pl.multiple_of(PARTIAL_PAD + item * TILE_M + wg * WG_M, ALIGN)
      plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[kv_head, pl.ds(out_row, WG_M)])
      plgpu.copy_smem_to_gmem(lse_smem2.at[wg], lse_ref.at[kv_head, pl.ds(out_row, WG_M)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(it.active & (wg == 2))
    def _memory():
      plgpu.set_max_registers(40, action='decrease')

      def issue(step, slot):
        tok = pl.multiple_of(it.split_tok + step * bk, ALIGN)
        rows = pl.ds(tok, bk)
        plgpu.copy_gmem_to_smem(k_ref.at[rows, kv_head], k_smem.at[slot], k_barriers.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[rows, kv_head], v_smem.at[slot], v_barriers.at[slot])

      for i in range(steps):
        pl.when(i < it.num_blocks)(lambda i=i: issue(i, i))

      @pl.loop(0, jnp.maximum(it.num_blocks - steps, 0))
      def _(step):
        slot = lax.rem(step, jnp.int32(steps))
        rows = pl.ds(pl.multiple_of(it.split_tok + (step + steps) * bk, ALIGN), bk)
        plgpu.barrier_wait(k_consumed.at[slot])
        plgpu.copy_gmem_to_smem(k_ref.at[rows, kv_head], k_smem.at[slot], k_barriers.at[slot])
        plgpu.barrier_wait(v_consumed.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[rows, kv_head], v_smem.at[slot], v_barriers.at[slot])

  scratch = [
      (
          plgpu.SMEM((2, WG_M, h), dtype, transforms=_TILED),  # Q, then the output
          plgpu.SMEM((steps, bk, h), dtype, transforms=_TILED),
          plgpu.SMEM((steps, bk, h), dtype, transforms=_TILED),
          plgpu.SMEM((2, WG_M), jnp.float32),
      ),
      (
          plgpu.Barrier(num_barriers=steps),
          plgpu.Barrier(num_barriers=steps),
          plgpu.Barrier(num_barriers=2),
      ),
      (plgpu.Barrier(num_arrivals=2, num_barriers=steps),) * 2,
      plgpu.Barrier(num_arrivals=2),
      plgpu.Barrier(num_barriers=2) if overlap else None,  # the warpgroups' turns
  ]
  return shared_segment_kernel, scratch, dict(num_threads=3, thread_name='wg')


def _single_warpgroup_kernel(qf, sched, *, scale, config, q_by_row, interpret):
  """One warpgroup: TILE_M rows, K/V through two slots it fills and drains itself."""
  h = qf.shape[-1]
  dtype = qf.dtype
  bk = config.block_kv
  qk_scale = scale * LOG2E

  def shared_segment_kernel(seg_ref, offset_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, smem,
                            barriers):
    qo_smem, k_smem, v_smem, lse_smem, p_smem = smem
    q_bar, k_bars, v_bars = barriers
    item = lax.axis_index('item')
    kv_head = lax.axis_index('kv_head')
    it = _decode_item(sched, seg_ref, item, bk, offset_ref[0])

    @pl.when(it.active)
    def _():
      start_q(q_ref, kv_head, it.tile_row, q_by_row, qo_smem, q_bar.at[0])

      def issue(step, slot):
        tok = pl.multiple_of(it.split_tok + step * bk, ALIGN)
        plgpu.copy_gmem_to_smem(k_ref.at[pl.ds(tok, bk), kv_head], k_smem.at[slot], k_bars.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[pl.ds(tok, bk), kv_head], v_smem.at[slot], v_bars.at[slot])

      for i in range(2):
        pl.when(i < it.num_blocks)(lambda i=i: issue(i, i))
      plgpu.barrier_wait(q_bar.at[0])

      def kv_step(step, carry, masked: bool):
        slot = lax.rem(step, jnp.int32(2))
        plgpu.barrier_wait(k_bars.at[slot])

        def compute_qk(acc_ref):
          plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
          return acc_ref[...]

        qk = pl.run_scoped(compute_qk, plgpu.ACC((TILE_M, bk), jnp.float32))
        acc, m_i, l_i, p16 = _softmax_step(qk, carry, it, step, bk, masked, qk_scale, dtype)
        plgpu.barrier_wait(v_bars.at[slot])
        if masked:
          _zero_outside(v_smem.at[slot], it, step, bk)
        acc = osm.add_pv(acc, p16, v_smem.at[slot], p_smem)

        @pl.when(step + 2 < it.num_blocks)
        def _():
          issue(step + 2, slot)

        return acc, m_i, l_i

      acc, m_i, l_i = _three_sections(kv_step, it, osm.init(TILE_M, h))
      osm.finish(acc, m_i, l_i, qo_smem, lse_smem, dtype)
      out_row = pl.multiple_of(PARTIAL_PAD + item * TILE_M, ALIGN)
      plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[kv_head, pl.ds(out_row, TILE_M)])
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[kv_head, pl.ds(out_row, TILE_M)])
      plgpu.wait_smem_to_gmem(0)

  scratch = [
      (
          plgpu.SMEM((TILE_M, h), dtype, transforms=_TILED),
          plgpu.SMEM((2, bk, h), dtype, transforms=_TILED),
          plgpu.SMEM((2, bk, h), dtype, transforms=_TILED),
          plgpu.SMEM((TILE_M,), jnp.float32),
          plgpu.SMEM((TILE_M, bk), dtype, transforms=_TILED),
      ),
      (plgpu.Barrier(num_barriers=1), plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2)),
  ]
  return shared_segment_kernel, scratch, {}


def segment_attention_reference(
    qf, k_cache, v_cache, segments, sched: SharedSchedule, *, scale: float,
    config: SegmentKernelConfig = SegmentKernelConfig(), kv_offset=0, q_by_row: bool = False,
    interpret: bool = False,
):
  """`segment_attention` in jnp (float32 math), item by item; same arguments and outputs.

  Not jitted, and `segments` must be concrete (it loops over them): for tests.
  `config` and `interpret` are accepted so that a test swaps one for the other.
  """
  del config, interpret
  qf = as_folded(qf, q_by_row)
  _, m_pad, _ = qf.shape
  tg = sched.rows_per_query
  outs, lses = [], []
  segments = np.asarray(segments)
  for gs in sched.groups:
    for j in range(gs.num_segments):
      kv_start, kv_length, row_begin, _ = (int(x) for x in segments[:, gs.segment_offset + j])
      for s in range(gs.num_splits):
        for t in range(gs.row_tiles):
          first_row = row_begin * tg
          rows = first_row - first_row % ALIGN + t * TILE_M + jnp.arange(TILE_M)
          q = qf[:, jnp.minimum(rows, m_pad - 1)].astype(jnp.float32)
          q = jnp.where((rows < m_pad)[None, :, None], q, 0.0)
          frame = kv_start - kv_start % ALIGN
          pos = s * gs.split_tokens + jnp.arange(gs.split_tokens)
          tok = frame + pos
          visible = (tok >= kv_start) & (tok < kv_start + kv_length)
          tok = jnp.minimum(tok + kv_offset, k_cache.shape[0] - 1)
          k = k_cache[tok].astype(jnp.float32).transpose(1, 0, 2)
          v = v_cache[tok].astype(jnp.float32).transpose(1, 0, 2)
          v = jnp.where(visible[None, :, None], v, 0.0)  # what no row sees may be garbage
          sc = jnp.einsum('kmh,ksh->kms', q, k, precision=jax.lax.Precision.HIGHEST) * scale
          sc = jnp.where(visible[None, None, :], sc, -jnp.inf)
          mx = jnp.max(sc, axis=-1, keepdims=True)
          mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
          p = jnp.exp(sc - mx)
          l = p.sum(-1)
          o = jnp.einsum('kms,ksh->kmh', p, v, precision=jax.lax.Precision.HIGHEST)
          out, lse = normalized(o, l, mx[..., 0])
          outs.append(out)
          lses.append(lse)
  out = jnp.concatenate(outs, axis=1).astype(qf.dtype)
  lse = jnp.concatenate(lses, axis=1)
  pad = ((0, 0), (PARTIAL_PAD, PARTIAL_PAD))
  return jnp.pad(out, (*pad, (0, 0))), jnp.pad(lse, pad, constant_values=-jnp.inf)
