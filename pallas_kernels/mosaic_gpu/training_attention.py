"""Forward and backward of training attention on Hopper (Pallas Mosaic GPU): a shared
segment, and Z independent causal sequences.

A shared segment (a prompt) is attended, non-causally, by all M query rows of
every sample that shares it: q [M, N, H] (rows x T tokens flattened), k, v
[S, K, H] (the segment's tokens; positions >= kv_length are masked), GQA with
N = K * G. `segment_forward` returns the segment's partial state (out, natural
log lse); `segment_backward` takes the MERGED row statistics (lse over all of a
row's keys, delta = rowsum(dO * O) - dlse), so that P = exp(S - lse) on this
segment is the row's global probability there and the per-part gradients are
exact (see `hydrajax/attention/training/tree_attention_vjp.py`):

    dV = P^T dO    dS = P * (dO V^T - delta)    dK = scale dS^T Q    dQ = scale dS K

`causal_forward` / `causal_backward` are the batched causal mode of the same
kernels, for the private parts (each completion over its own tokens, each
prompt over itself): q [Z, T, N, H] against k, v [Z, S, K, H] and lengths [Z],
query t of row z seeing keys < lengths[z] - T + t + 1 (bottom-right aligned, as
in `_parts` of tree_attention_vjp.py). A leading grid axis runs the rows; the
forward and dQ kernels stream only the kv blocks up to their tile's diagonal,
and the dK/dV kernel only the query blocks from its tile's diagonal on (a traced
pipeline grid), so the square's upper half is never loaded nor multiplied.

Three kernels, after JAX's FlashAttention-3 for Hopper
(`jax/experimental/pallas/ops/gpu/attention_mgpu.py`, Copyright 2024 The JAX
Authors, Apache License 2.0): the forward and dQ kernels run one program per
(query head, tile of query rows, row z) and stream K/V blocks (causal: a program runs
two tiles, a short and a long one, `pair_causal_tiles`); the dK/dV kernel
runs one program per (kv block, kv head, row z) and streams the query blocks of
all G query heads of the kv head's group, so the GQA sum and the sum over all M
rows happen in its float32 accumulators (nothing per row or per query head is
written). A shared segment's backward runs the dK/dV kernel alone by default
(`TrainingKernelConfig.fused_dq`): it also computes dQ = dS K from the dS it stages in
shared memory and TMA-reduce-adds it into a float32 dQ, so the dQ kernel's recomputed
QK^T and dO V^T are not run (5 matmuls instead of 7). On the GPU each kernel is
warp-specialised: `compute_wgs` compute warpgroups and one memory warpgroup that feeds
them by TMA (`emit_pipeline_warp_specialized`). Differences from the JAX kernels: the
input dtype everywhere (bf16 or f16; its scratch is float16), dynamic lengths (scores
past them masked by a where), the in-kernel GQA reduction, natural-log lse at the
interface, a causal backward, the fused dQ.

The forward and dQ kernels mask (a where: length and, causal, the diagonal) only the
blocks that hold an invisible pair, the others taking an unmasked branch (a uniform
`lax.cond`); the dK/dV kernel masks every block, where the branch costs more than the
where saves (`TrainingKernelConfig.mask_all_steps`, `mask_all_steps_dkv`).

Interpret mode (`interpret=True`, CPU) runs the same step functions pipelined by
one warpgroup (`emit_pipeline`) and stages register operands of wgmma through
shared memory (interpret mode takes wgmma operands from shared memory only);
several warpgroups waiting on each other's barriers can starve a two-core CPU.

K/V rows past the length may hold anything (NaN included): the wrappers zero
them (one pass over K/V) before the kernels, so 0 * NaN never reaches P @ V,
dS K or dP = dO V^T; scores there are masked by a where. Query rows are padded
to the row tile (zeros, lse = +inf so P = 0) and dropped.
"""

import dataclasses
import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.mosaic_gpu import profiling
from pallas_kernels.mosaic_gpu import online_softmax as osm
from pallas_kernels.mosaic_gpu.online_softmax import LOG2E
from pallas_kernels.mosaic_gpu.schedule import device_num_sms, row_parts
from pallas_kernels.softmax_state import normalized

_TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
_TILED_F32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))  # 128-byte rows
_ROWS = plgpu.Layout.WGMMA.reduce(1)  # per-row vectors of a [rows, cols] wgmma result
_COLS = plgpu.Layout.WGMMA.reduce(0)  # per-column vectors


@dataclasses.dataclass(frozen=True)
class TrainingKernelConfig:
  """Block sizes (rows per compute warpgroup) and switches of the three kernels; the defaults
  were swept on an H200 (bf16, 32/8 heads, H=128); NOTES.md has the sweep."""

  block_q: int = 64  # forward: query rows per warpgroup
  block_kv: int = 128  # forward: kv tokens per step (64 was slower)
  block_q_dq: int = 64
  block_kv_dq: int = 64  # 128 made the causal backward about 25% slower
  block_q_dkv: int = 64  # dK/dV: query rows per step
  block_kv_dkv: int = 64  # dK/dV: kv tokens per warpgroup
  max_concurrent_steps: int = 2
  compute_wgs: int = 2
  # A shared segment's dQ in the dK/dV kernel, and no dQ kernel: 5 matmuls a backward instead
  # of 7. Each step stages its dS in shared memory and TMA-reduce-adds a [bq, H/2] partial into
  # a float32 dQ, in any order, so dQ may differ in its last bits from run to run: False is the
  # deterministic backward. Needs H a multiple of 64 per warpgroup; causal kernels keep the dQ
  # kernel (fused, they were slower).
  fused_dq: bool = True
  # Query-row parts of a shared segment's fused dK/dV kernel (`_dkv`), each writing a float32
  # partial dK/dV summed after, so a short prompt still fills the chip. None: the count whose
  # launch ends first (`schedule.row_parts`). A count that does not divide the query blocks, or
  # block_kv_dkv != block_q_dkv, runs as 1.
  row_parts: int | None = None
  # False: only the steps whose block holds an invisible (query, key) pair (past the segment's
  # length, or above the causal diagonal) build and apply the mask in the forward and dQ
  # kernels; the others take an unmasked branch.
  mask_all_steps: bool = False
  # The same for the dK/dV kernel, where the branch costs more than the mask saves.
  mask_all_steps_dkv: bool = True
  # Causal forward and dQ programs run two query tiles each: tile p, then tile n - 1 - p of the
  # n tiles (`_Tiles`), so every program streams about n + 1 kv blocks and pays its prologue and
  # epilogue once a pair. Blocks too large for two slots of Q (and dO) run one tile a program.
  pair_causal_tiles: bool = True
  # The prefill's completions (`hydrajax.attention.training.prefill_vjp`): their causal dQ
  # kernel writes float32 first, and the shared prompt's fused dK/dV kernel reduce-adds its dQ
  # onto it (`segments_backward`'s dq_init), saving two XLA passes over dQ.
  prefill_dq_in_place: bool = True

  def __post_init__(self):
    for name in ('block_q', 'block_kv', 'block_q_dq', 'block_kv_dq', 'block_q_dkv',
                 'block_kv_dkv'):
      if getattr(self, name) % 64:
        raise ValueError(f'{name} must be a multiple of 64, got {getattr(self, name)}')
    if self.max_concurrent_steps < 2:
      raise ValueError(f'max_concurrent_steps must be >= 2, got {self.max_concurrent_steps}')
    if self.compute_wgs not in (1, 2):
      raise ValueError(f'compute_wgs must be 1 or 2, got {self.compute_wgs}')
    if self.row_parts is not None and not 1 <= self.row_parts <= 8:
      raise ValueError(f'row_parts must be None or in [1, 8], got {self.row_parts}')


INTERPRET_CONFIG = TrainingKernelConfig(64, 64, 64, 64, 64, 64, 2, 1)


def config_or_default(config, interpret):
  """config, or the default of the mode (`INTERPRET_CONFIG` in interpret mode)."""
  if config is not None:
    return config
  return INTERPRET_CONFIG if interpret else TrainingKernelConfig()


def unsupported_reason(dtypes, head_dim: int) -> str | None:
  """Why the kernels cannot take inputs of these dtypes (q, k, v, ...) and head dim, or None
  (what `hydrajax.attention.training.prepare_training_attention` asks before it picks them)."""
  if head_dim % 64:
    return f'head dim must be a multiple of 64, got {head_dim}'
  names = [jnp.dtype(d).name for d in dtypes]
  if len(set(names)) != 1 or names[0] not in ('bfloat16', 'float16'):
    return f'q, k, v (and do) must share one dtype, bfloat16 or float16 (wgmma); got {names}'
  return None


def _check(q, k, v, *others, batched=False):
  want = 'q [Z, T, N, H] and k, v [Z, S, K, H]' if batched else 'q [M, N, H] and k, v [S, K, H]'
  ndim = 3 + batched
  if (q.ndim != ndim or k.ndim != ndim or k.shape != v.shape or q.shape[-1] != k.shape[-1]
      or (batched and q.shape[0] != k.shape[0])):
    raise ValueError(f'expected {want}; got q {q.shape}, k {k.shape}, v {v.shape}')
  if q.shape[-2] % k.shape[-2]:
    raise ValueError(f'query heads ({q.shape[-2]}) must be a multiple of kv heads '
                     f'({k.shape[-2]})')
  reason = unsupported_reason([x.dtype for x in (q, k, v, *others)], q.shape[-1])
  if reason is not None:
    raise ValueError(reason)


def _pad_to(x, axis, multiple, value=0):
  extra = -x.shape[axis] % multiple
  if not extra:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, extra)
  return jnp.pad(x, pad, constant_values=value)


def _prepare_kv(k, v, lengths, multiple):
  """k, v [Z, S, K, H] -> (lengths [Z] int32 clamped to [0, S], k, v with tokens >= the row's
  length zeroed, padded along S to `multiple`). A Python int length >= S (the prefill's
  completions and prompts) has no such token: no pass over K/V then."""
  z, s = k.shape[:2]
  length = jnp.clip(jnp.broadcast_to(jnp.asarray(lengths, jnp.int32).reshape(-1), (z,)), 0, s)
  if not (isinstance(lengths, int) and lengths >= s):
    seen = (jnp.arange(s)[None, :] < length[:, None])[:, :, None, None]
    k, v = (jnp.where(seen, x, jnp.zeros((), x.dtype)) for x in (k, v))
  return length, _pad_to(k, 1, multiple), _pad_to(v, 1, multiple)


def _lcm(*xs):
  return functools.reduce(math.lcm, xs)


def _mma(acc, lhs, rhs, stage):
  """acc + lhs @ rhs: lhs [M, K] in registers, rhs in shared memory.

  `stage` (interpret mode): a shared-memory buffer for lhs, since interpret mode feeds
  wgmma from shared memory only. On the GPU lhs goes from registers, accumulated in place.
  """
  if stage is None:
    return pl.run_state(lambda ref: plgpu.wgmma(ref, lhs, rhs))(plgpu.ACC.init(acc))
  stage[...] = lhs
  plgpu.commit_smem()

  def run(ref):
    plgpu.wgmma(ref, stage, rhs)
    return ref[...]

  return acc + pl.run_scoped(run, plgpu.ACC(acc.shape, jnp.float32))


def _matmul(lhs, rhs, shape):
  """lhs @ rhs, both in shared memory, as a new float32 [M, N] value."""
  def run(ref):
    plgpu.wgmma(ref, lhs, rhs)
    return ref[...]

  return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _arrive(barrier):
  if barrier is not None:  # warp-specialised: tell the memory warpgroup the slot is free
    plgpu.barrier_arrive(barrier)


def _pipeline(step, context, *, interpret, config, grid, in_specs):
  """Runs `step(indices, *in_smem, *consumed_barriers, carry) -> carry` over `grid`.

  `context(pipeline)` is the compute warpgroup's prologue and epilogue; it calls
  `pipeline(carry)` once. On the GPU the memory warpgroup streams `in_specs`; in
  interpret mode one warpgroup does both and the consumed barriers are None.
  """
  if not interpret:
    return plgpu.emit_pipeline_warp_specialized(
        step, grid=grid, max_concurrent_steps=config.max_concurrent_steps,
        num_compute_wgs=config.compute_wgs, memory_registers=40, wg_axis='wg',
        manual_consumed_barriers=True, compute_context=context, in_specs=in_specs)

  def run(*refs):
    def pipeline(carry):
      body = lambda idx, *a: step(idx, *a[:-1], *(None,) * len(in_specs), a[-1])
      return plgpu.emit_pipeline(body, grid=grid, in_specs=in_specs, init_carry=carry,
                                 max_concurrent_steps=config.max_concurrent_steps)(*refs)

    context(pipeline)

  return run


def _launch(kernel, *, interpret, config, grid, grid_names, out_type, scratch):
  mesh = {} if interpret else dict(num_threads=config.compute_wgs + 1, thread_name='wg')
  return plgpu.kernel(
      kernel, out_type=out_type, scratch_types=scratch, grid=grid, grid_names=grid_names,
      compiler_params=profiling.compiler_params(),
      interpret=plgpu.InterpretGPUParams() if interpret else None, **mesh)


def _wg(interpret):
  return jnp.int32(0) if interpret else lax.axis_index('wg')


def _schedule(barrier):
  """FA3's ping-pong: the two compute warpgroups take turns at the tensor cores."""
  if barrier is not None:
    plgpu.barrier_arrive(barrier)
    plgpu.barrier_wait(barrier)


def _check_lengths(lengths, z):
  if jnp.shape(lengths) not in ((), (z,)):
    raise ValueError(f'lengths must be a scalar or [Z] = [{z}], got shape {jnp.shape(lengths)}')


def _visible(shape, keys_axis, kv_len, key0, query0, causal_t):
  """[rows, cols] bool (wgmma layout): key key0 + i is visible to query query0 + j.

  i runs along `keys_axis`, j along the other. Keys >= kv_len are never visible;
  causal (bottom-right aligned): query j sees keys < kv_len - T + j + 1, T = causal_t.
  """
  iota = lambda axis: plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)
  keys = iota(keys_axis)
  visible = keys < kv_len - key0
  if causal_t is not None:
    visible &= keys - iota(1 - keys_axis) < kv_len - causal_t + 1 + query0 - key0
  return visible


def _masked(mask_all, shape, keys_axis, kv_len, key0, query0, causal_t, apply):
  """apply(visible): the step's result with its [rows, cols] visibility (`_visible`), or with
  None (every pair visible) when the block holds no invisible pair: keys [key0, key0 + bk) are
  below kv_len and, causal, below the first query's diagonal, kv_len - T + 1 + query0. A
  uniform branch (scalars only): the unmasked steps skip the iota, compares and selects."""
  masked = lambda: apply(_visible(shape, keys_axis, kv_len, key0, query0, causal_t))
  if mask_all:
    return masked()
  end = key0 + shape[keys_axis]
  limit = kv_len if causal_t is None else jnp.minimum(kv_len, kv_len - causal_t + 1 + query0)
  return lax.cond(end <= limit, lambda: apply(None), masked)


def _kv_steps(kv_len, queries_end, causal_t, bk, s):
  """kv blocks a query tile streams: all S / bk, or (causal) those up to its last query's diagonal.

  The causal count is traced (a dynamic pipeline grid): blocks above the diagonal are
  never loaded. At least 1 (a pipeline needs a step; a tile that sees no key masks it).
  """
  if causal_t is None:
    return s // bk
  seen = jnp.minimum(kv_len, kv_len - causal_t + queries_end)
  return jnp.clip(lax.div(seen + (bk - 1), jnp.int32(bk)), 1, s // bk)


class _Tiles:
  """The query tiles of one forward or dQ program, and which one a pipeline step is in.

  Unpaired: one tile (causal: the last, longest tiles get the first program ids, so that short
  tiles fill the launch's tail). Paired (`TrainingKernelConfig.pair_causal_tiles`, causal only):
  program p runs tile p, then tile n - 1 - p (none when they coincide, the middle of an odd n);
  its pipeline's steps are tile p's kv blocks, then the other's. Slot 0 or 1 of the program's
  shared-memory buffers holds a tile's rows (Q, dO, lse, ...).
  """

  def __init__(self, rows_per_tile, num_tiles, causal_t, paired, kv_steps):
    """kv_steps(first row after the tile) -> kv blocks the tile streams."""
    self.paired = paired
    p = lax.axis_index('q_tiles')
    if paired:
      self.first, second = p, num_tiles - 1 - p
      self.has_second = second > p
      self.steps_first = kv_steps((p + 1) * rows_per_tile)
      self.steps = self.steps_first + jnp.where(
          self.has_second, kv_steps((second + 1) * rows_per_tile), 0)
      self.second = second
    else:
      self.first = num_tiles - 1 - p if causal_t is not None else p
      self.steps = kv_steps((self.first + 1) * rows_per_tile)
    self.rows = rows_per_tile

  @staticmethod
  def programs(num_tiles, paired):
    return (num_tiles + 1) // 2 if paired else num_tiles

  def at(self, step):
    """(slot, first query row of the tile, the step's kv block within the tile)."""
    if not self.paired:
      return 0, self.first * self.rows, step
    later = step >= self.steps_first
    tile = jnp.where(later, self.second, self.first)
    return later.astype(jnp.int32), tile * self.rows, step - jnp.where(later, self.steps_first, 0)

  def switches_after(self, step):
    """Whether `step` is the first tile's last with a second tile to follow (traced bool)."""
    return self.has_second & (step == self.steps_first - 1)

  def last(self):
    """(slot, first query row) of the program's last tile."""
    if not self.paired:
      return 0, self.first * self.rows
    return (self.has_second.astype(jnp.int32),
            jnp.where(self.has_second, self.second, self.first) * self.rows)

  def both(self):
    """[(slot, first query row, whether the tile exists)] of the program's tiles."""
    if not self.paired:
      return [(0, self.first * self.rows, None)]
    return [(0, self.first * self.rows, None), (1, self.second * self.rows, self.has_second)]


_SMEM_BYTES = 232448  # shared memory a Hopper block may take (227 KiB)
_SMEM_SLACK = 4096  # barriers and alignment beside the buffers (2.6 KiB measured)


def _paired(cfg, causal_t, slot_bytes, stream_bytes):
  """Whether a causal program runs two query tiles (`TrainingKernelConfig.pair_causal_tiles`):
  only when a second slot of the tile's buffers (slot_bytes) fits in shared memory beside the
  K/V pipeline (stream_bytes); a config with larger blocks runs one tile a program."""
  fits = 2 * slot_bytes + stream_bytes + _SMEM_SLACK <= _SMEM_BYTES
  return cfg.pair_causal_tiles and causal_t is not None and fits


def _paired_forward(cfg, causal_t, h, dtype):
  item = jnp.dtype(dtype).itemsize
  return _paired(cfg, causal_t, slot_bytes=cfg.compute_wgs * cfg.block_q * (h * item + 4),
                 stream_bytes=cfg.max_concurrent_steps * 2 * cfg.block_kv * h * item)  # Q, lse


def _paired_dq(cfg, causal_t, h, dtype):
  item = jnp.dtype(dtype).itemsize  # Q, dO, lse, delta
  return _paired(cfg, causal_t, slot_bytes=cfg.compute_wgs * cfg.block_q_dq * (2 * h * item + 8),
                 stream_bytes=cfg.max_concurrent_steps * 2 * cfg.block_kv_dq * h * item)


def _when(exists, fn):
  """fn() when `exists` is None (always), else under pl.when(exists)."""
  if exists is None:
    fn()
  else:
    pl.when(exists)(fn)


# Forward.

def _forward(q, k, v, length, *, scale, causal_t, interpret, cfg):
  """out [Z, Mp, N, H], lse [Z, N, Mp] (natural log) of prepared, padded inputs."""
  z, mp, n, h = q.shape
  s, kh = k.shape[1:3]
  g = n // kh
  wgs, bq, bk = cfg.compute_wgs, cfg.block_q, cfg.block_kv
  dtype = q.dtype
  scale_log2 = scale * LOG2E
  paired = _paired_forward(cfg, causal_t, h, dtype)
  slots = 2 if paired else 1
  num_tiles = mp // (wgs * bq)

  def training_fwd_kernel(q_ref, k_ref, v_ref, len_ref, out_ref, lse_ref, qo_smem3, lse_smem3,
                          stage, q_barriers, schedule_barrier):
    head, seq = lax.axis_index('heads'), lax.axis_index('rows')
    wg = _wg(interpret)
    kv_len = len_ref[seq]
    tiles = _Tiles(wgs * bq, num_tiles, causal_t, paired,
                   lambda end: _kv_steps(kv_len, end, causal_t, bk, s))
    rows_of = lambda tile_row: pl.ds(tile_row + wg * bq, bq)

    def finish(acc, m_i, l_i, slot, tile_row):
      """The tile's normalised out and lse to HBM, staged in its Q buffer (Q is done)."""
      qo_smem, lse_smem = qo_smem3.at[slot, wg], lse_smem3.at[slot, wg]
      osm.finish(acc, m_i, l_i, qo_smem, lse_smem, dtype)
      plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[seq, rows_of(tile_row), head])
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[seq, head, rows_of(tile_row)])

    def context(pipeline):
      for slot, tile_row, exists in tiles.both():
        _when(exists, lambda slot=slot, tile_row=tile_row: plgpu.copy_gmem_to_smem(
            q_ref.at[seq, rows_of(tile_row), head], qo_smem3.at[slot, wg],
            q_barriers.at[slot * wgs + wg]))
      for slot, _, exists in tiles.both():
        _when(exists, lambda slot=slot: plgpu.barrier_wait(q_barriers.at[slot * wgs + wg]))
      if wgs == 2:
        pl.when(wg == 1)(lambda: _schedule(schedule_barrier))
      acc, m_i, l_i = pipeline(osm.init(bq, h))
      if wgs == 2:
        pl.when(wg == 0)(lambda: _schedule(schedule_barrier))
      finish(acc, m_i, l_i, *tiles.last())
      plgpu.wait_smem_to_gmem(0)

    def step(idx, k_smem, v_smem, k_consumed, v_consumed, carry):
      acc, m_i, l_i = carry
      slot, tile_row, block = tiles.at(idx[0])
      qo_smem = qo_smem3.at[slot, wg]

      def qk(ref):
        plgpu.wgmma(ref, qo_smem, k_smem.transpose((1, 0)))
        _schedule(schedule_barrier)
        return ref[...]

      s_blk = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
      _arrive(k_consumed)
      acc, m_i, l_i, p16 = _masked(
          cfg.mask_all_steps, (bq, bk), 1, kv_len, block * bk, tile_row + wg * bq, causal_t,
          lambda visible: osm.step(s_blk, acc, m_i, l_i, scale_log2=scale_log2, dtype=dtype,
                                   visible=visible))
      _schedule(schedule_barrier)
      acc = _mma(acc, p16, v_smem, stage)
      _arrive(v_consumed)
      if not paired:
        return acc, m_i, l_i
      switch = tiles.switches_after(idx[0])
      pl.when(switch)(lambda: finish(acc, m_i, l_i, 0, tile_row))
      # The second tile starts from the empty state: m = -inf is enough, as the next step
      # rescales acc and l by 2^(m - m_new) = 0 (both are finite).
      return acc, m_i + jnp.where(switch, -jnp.inf, 0.0), l_i

    kv_spec = plgpu.BlockSpec((bk, h), lambda i: (tiles.at(i)[2], 0), transforms=_TILED)
    kv_head = lax.div(head, jnp.int32(g))
    _pipeline(step, context, interpret=interpret, config=cfg, grid=(tiles.steps,),
              in_specs=[kv_spec, kv_spec])(k_ref.at[seq, :, kv_head], v_ref.at[seq, :, kv_head])

  scratch = [
      plgpu.SMEM((slots, wgs, bq, h), dtype, transforms=_TILED),  # Q, then the output
      plgpu.SMEM((slots, wgs, bq), jnp.float32),
      plgpu.SMEM((bq, bk), dtype, transforms=_TILED) if interpret else None,
      plgpu.Barrier(num_barriers=slots * wgs),
      plgpu.Barrier(num_arrivals=wgs) if wgs == 2 else None,
  ]
  return _launch(
      training_fwd_kernel, interpret=interpret, config=cfg,
      grid=(n, _Tiles.programs(num_tiles, paired), z), grid_names=('heads', 'q_tiles', 'rows'),
      out_type=(jax.ShapeDtypeStruct(q.shape, dtype),
                jax.ShapeDtypeStruct((z, n, mp), jnp.float32)),  # rows minor: 1D TMA per head
      scratch=scratch)(q, k, v, length)


def segment_forward(q, k, v, kv_length, *, scale: float, interpret: bool = False,
                    config: TrainingKernelConfig | None = None):
  """(out [M, N, H] in q.dtype, lse [M, N] float32 natural log, -inf for no key)."""
  _check(q, k, v)
  out, lse = segments_forward(q[None], k[None], v[None], kv_length, scale=scale,
                              interpret=interpret, config=config)
  return out[0], lse[0]


def segments_forward(q, k, v, kv_lengths, *, scale: float, interpret: bool = False,
                     config: TrainingKernelConfig | None = None):
  """Z segments in one launch, each attended by its own rows: q [Z, M, N, H], k, v
  [Z, S, K, H], kv_lengths [Z] (or a scalar) -> (out [Z, M, N, H], lse [Z, M, N])."""
  _check(q, k, v, batched=True)
  _check_lengths(kv_lengths, q.shape[0])
  cfg = config_or_default(config, interpret)
  m = q.shape[1]
  length, k, v = _prepare_kv(k, v, kv_lengths, cfg.block_kv)
  out, lse = _forward(_pad_to(q, 1, cfg.compute_wgs * cfg.block_q), k, v, length,
                      scale=float(scale), causal_t=None, interpret=interpret, cfg=cfg)
  return out[:, :m], jnp.swapaxes(lse[:, :, :m], 1, 2)


def causal_forward(q, k, v, lengths, *, scale: float, interpret: bool = False,
                   config: TrainingKernelConfig | None = None):
  """Z causal sequences: (out [Z, T, N, H] in q.dtype, lse [Z, T, N] float32 natural log).

  q [Z, T, N, H] are the queries of the last T of each row's lengths[z] keys in
  k, v [Z, S, K, H]: query t sees keys < lengths[z] - T + t + 1 (lse -inf for none).
  """
  _check(q, k, v, batched=True)
  _check_lengths(lengths, q.shape[0])
  cfg = config_or_default(config, interpret)
  t = q.shape[1]
  length, k, v = _prepare_kv(k, v, lengths, cfg.block_kv)
  out, lse = _forward(_pad_to(q, 1, cfg.compute_wgs * cfg.block_q), k, v, length,
                      scale=float(scale), causal_t=t, interpret=interpret, cfg=cfg)
  return out[:, :t], jnp.swapaxes(lse[:, :, :t], 1, 2)


def _reference_inputs(q, k, v, lengths, causal):
  """float32 q [Z, M, K, G, H], k, v [Z, S, K, H] (zeroed where no query looks), and the
  visibility [Z, M, 1, 1, S] of the batched kernels (`causal_forward`'s convention)."""
  z, m, n, h = q.shape
  s, kh = k.shape[1:3]
  lengths = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32).reshape(-1), (z,))[:, None, None]
  keys = jnp.arange(s)[None, None, :]
  visible = keys < lengths  # [Z, 1 or M, S]
  if causal:
    visible = visible & (keys < lengths - m + jnp.arange(m)[None, :, None] + 1)
  seen = jnp.any(visible, axis=1)[:, :, None, None]
  kf, vf = (jnp.where(seen, x.astype(jnp.float32), 0.0) for x in (k, v))
  return q.astype(jnp.float32).reshape(z, m, kh, n // kh, h), kf, vf, visible[:, :, None, None]


def _forward_reference(q, k, v, lengths, scale, causal):
  z, m, n, h = q.shape
  qf, kf, vf, visible = _reference_inputs(q, k, v, lengths, causal)
  sc = jnp.einsum('zmkgh,zskh->zmkgs', qf, kf, precision=lax.Precision.HIGHEST) * scale
  sc = jnp.where(visible, sc, -jnp.inf)
  mx = jnp.max(sc, axis=-1, keepdims=True)
  mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
  p = jnp.exp(sc - mx)
  l = p.sum(-1)
  o = jnp.einsum('zmkgs,zskh->zmkgh', p, vf, precision=lax.Precision.HIGHEST)
  out, lse = normalized(o, l, mx[..., 0])
  return out.reshape(z, m, n, h).astype(q.dtype), lse.reshape(z, m, n)


def segment_forward_reference(q, k, v, kv_length, *, scale: float, interpret: bool = False,
                              config=None):
  """`segment_forward` in jnp, float32 math; same arguments and outputs."""
  del interpret, config
  out, lse = _forward_reference(q[None], k[None], v[None], kv_length, scale, False)
  return out[0], lse[0]


def segments_forward_reference(q, k, v, kv_lengths, *, scale: float, interpret: bool = False,
                               config=None):
  """`segments_forward` in jnp, float32 math; same arguments and outputs."""
  del interpret, config
  return _forward_reference(q, k, v, kv_lengths, scale, False)


def causal_forward_reference(q, k, v, lengths, *, scale: float, interpret: bool = False,
                             config=None):
  """`causal_forward` in jnp, float32 math; same arguments and outputs."""
  del interpret, config
  return _forward_reference(q, k, v, lengths, scale, True)


# Backward.

def _backward(q, k, v, do, lse, delta, lengths, *, scale, causal_t, interpret, cfg,
              dq_dtype=None, dq_init=None):
  """(dq [Z, M, N, H] in dq_dtype (default q's), dk, dv [Z, S, K, H]) of q [Z, M, N, H],
  k, v [Z, S, K, H] and merged lse, delta [Z, M, N]; pads and prepares, then runs the dQ and
  dK/dV kernels. dq_init [Z, M, N, H] float32: dq is dq_init plus this part's (the fused
  kernel reduce-adds onto it, in place of a zeroed buffer)."""
  if dq_dtype is not None and jnp.dtype(dq_dtype) not in (jnp.dtype(q.dtype), jnp.float32):
    raise ValueError(f'dq_dtype must be None, q\'s dtype ({jnp.dtype(q.dtype).name}) or float32, '
                     f'got {jnp.dtype(dq_dtype).name}')
  z, m = q.shape[:2]
  s_in = k.shape[1]
  length, k, v = _prepare_kv(
      k, v, lengths, _lcm(cfg.block_kv_dq, cfg.compute_wgs * cfg.block_kv_dkv))
  rows = _lcm(cfg.compute_wgs * cfg.block_q_dq, cfg.block_q_dkv)
  qp, dop = _pad_to(q, 1, rows), _pad_to(do, 1, rows)
  # Base-2 lse, rows minor (1D TMA per head); padded rows get +inf: P = 0 there.
  lse2 = jnp.swapaxes(_pad_to(lse.astype(jnp.float32) * LOG2E, 1, rows, jnp.inf), 1, 2)
  delta_t = jnp.swapaxes(_pad_to(delta.astype(jnp.float32), 1, rows), 1, 2)
  args = (qp, k, v, dop, lse2, delta_t, length)
  kw = dict(scale=float(scale), causal_t=causal_t, interpret=interpret, cfg=cfg)
  if dq_init is not None:
    dq_init = _pad_to(dq_init.astype(jnp.float32), 1, rows)
  if _fused_dq(cfg, causal_t, k.shape[-1]):
    parts = _row_parts(cfg, z * k.shape[1], k.shape[2], qp.shape[1], interpret)
    dq, dk, dv = _dkv(*args, **kw, fused=True, parts=parts, dq_init=dq_init)  # dq float32
  else:
    f32 = dq_init is not None or jnp.dtype(dq_dtype or q.dtype) == jnp.float32
    dq = _dq(*args, **kw, out_dtype=jnp.float32 if f32 else None)
    dq = dq if dq_init is None else dq + dq_init
    dk, dv = _dkv(*args, **kw)
  return dq[:, :m].astype(dq_dtype or q.dtype), dk[:, :s_in], dv[:, :s_in]


def segment_backward(q, k, v, do, lse, delta, kv_length, *, scale: float,
                     interpret: bool = False, config: TrainingKernelConfig | None = None,
                     dq_dtype=None):
  """(dq [M, N, H] in dq_dtype (default q.dtype), dk, dv [S, K, H] in k.dtype) of one segment.

  lse [M, N] (natural log) and delta [M, N] = rowsum(dO * O) - dlse are the rows'
  MERGED statistics over all their keys, not this segment's. dq_dtype=float32 keeps the
  fused dQ's float32 sums (no rounding to q.dtype and back when the caller adds more to it).
  """
  _check(q, k, v, do)
  if lse.shape != q.shape[:2] or delta.shape != q.shape[:2]:
    raise ValueError(f'lse and delta must be [M, N] = {q.shape[:2]}, got {lse.shape}, '
                     f'{delta.shape}')
  grads = segments_backward(q[None], k[None], v[None], do[None], lse[None], delta[None],
                            kv_length, scale=scale, interpret=interpret, config=config,
                            dq_dtype=dq_dtype)
  return tuple(x[0] for x in grads)


def segments_backward(q, k, v, do, lse, delta, kv_lengths, *, scale: float,
                      interpret: bool = False, config: TrainingKernelConfig | None = None,
                      dq_dtype=None, dq_init=None):
  """`segment_backward` of Z segments in one launch (`segments_forward`'s shapes): dq
  [Z, M, N, H] in dq_dtype (default q.dtype), dk, dv [Z, S, K, H]; lse, delta [Z, M, N].

  dq_init [Z, M, N, H] (float32 best): the rows' dQ from their other parts; the returned dq
  is it plus this segment's, the fused kernel reduce-adding onto it (no zeroed buffer and no
  separate sum)."""
  _check(q, k, v, do, batched=True)
  _check_lengths(kv_lengths, q.shape[0])
  if lse.shape != q.shape[:3] or delta.shape != q.shape[:3]:
    raise ValueError(f'lse and delta must be [Z, M, N] = {q.shape[:3]}, got {lse.shape}, '
                     f'{delta.shape}')
  if dq_init is not None and dq_init.shape != q.shape:
    raise ValueError(f'dq_init must be q\'s shape {q.shape}, got {dq_init.shape}')
  return _backward(q, k, v, do, lse, delta, kv_lengths, scale=scale, causal_t=None,
                   interpret=interpret, cfg=config_or_default(config, interpret),
                   dq_dtype=dq_dtype, dq_init=dq_init)


def causal_backward(q, k, v, do, lse, delta, lengths, *, scale: float, interpret: bool = False,
                    config: TrainingKernelConfig | None = None, dq_dtype=None):
  """(dq [Z, T, N, H] in dq_dtype (default q.dtype), dk, dv [Z, S, K, H] in k.dtype) of
  `causal_forward`. dq_dtype=float32: the dQ kernel writes float32 (for a caller that adds
  more to it, e.g. `segments_backward`'s dq_init).

  lse, delta [Z, T, N]: the rows' MERGED statistics (as in `segment_backward`). Each
  row's dK / dV is summed over its queries and the G heads of a kv head in the kernel.
  """
  _check(q, k, v, do, batched=True)
  _check_lengths(lengths, q.shape[0])
  if lse.shape != q.shape[:3] or delta.shape != q.shape[:3]:
    raise ValueError(f'lse and delta must be [Z, T, N] = {q.shape[:3]}, got {lse.shape}, '
                     f'{delta.shape}')
  return _backward(q, k, v, do, lse, delta, lengths, scale=scale, causal_t=q.shape[1],
                   interpret=interpret, cfg=config_or_default(config, interpret),
                   dq_dtype=dq_dtype)


def _dq(q, k, v, do, lse2, delta, length, *, scale, causal_t, interpret, cfg, out_dtype=None):
  """dq [Z, Mp, N, H] in out_dtype (default q's). A float32 dQ is staged in the finished tile's
  Q and dO buffers (a `plgpu.RefUnion`: [bq, H] float32 is their bytes)."""
  z, mp, n, h = q.shape
  s, kh = k.shape[1:3]
  g = n // kh
  wgs, bq, bk = cfg.compute_wgs, cfg.block_q_dq, cfg.block_kv_dq
  dtype = q.dtype
  out_dtype = jnp.dtype(out_dtype or dtype)
  f32_out = out_dtype == jnp.float32
  paired = _paired_dq(cfg, causal_t, h, dtype)
  slots = 2 if paired else 1
  num_tiles = mp // (wgs * bq)

  def training_dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, len_ref, dq_ref,
                         rows_smem, lse_smem3, delta_smem3, stage, barriers):
    if f32_out:
      qdo_smem5, dq_smem4 = rows_smem
    else:
      qdo_smem5, dq_smem4 = rows_smem, None
    q_smem3, do_smem3 = qdo_smem5.at[:, :, 0], qdo_smem5.at[:, :, 1]
    head, seq = lax.axis_index('heads'), lax.axis_index('rows')
    wg = _wg(interpret)
    kv_len = len_ref[seq]
    tiles = _Tiles(wgs * bq, num_tiles, causal_t, paired,
                   lambda end: _kv_steps(kv_len, end, causal_t, bk, s))
    rows_of = lambda tile_row: pl.ds(tile_row + wg * bq, bq)
    bar = lambda slot, i: barriers.at[(slot * 4 + i) * wgs + wg]  # i: q, do, lse, delta

    def finish(dq, slot, tile_row):
      # The tile's Q (and dO) are no longer needed: their buffers stage dQ.
      stage_ = dq_smem4.at[slot, wg] if f32_out else q_smem3.at[slot, wg]
      stage_[...] = (dq * scale).astype(out_dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(stage_, dq_ref.at[seq, rows_of(tile_row), head])

    def context(pipeline):
      for slot, tile_row, exists in tiles.both():
        def load(slot=slot, tile_row=tile_row):
          rows = rows_of(tile_row)
          plgpu.copy_gmem_to_smem(q_ref.at[seq, rows, head], q_smem3.at[slot, wg], bar(slot, 0))
          plgpu.copy_gmem_to_smem(do_ref.at[seq, rows, head], do_smem3.at[slot, wg],
                                  bar(slot, 1))
          plgpu.copy_gmem_to_smem(lse_ref.at[seq, head, rows], lse_smem3.at[slot, wg],
                                  bar(slot, 2))
          plgpu.copy_gmem_to_smem(delta_ref.at[seq, head, rows], delta_smem3.at[slot, wg],
                                  bar(slot, 3))

        _when(exists, load)
      for slot, _, exists in tiles.both():
        def wait(slot=slot):
          for i in range(4):
            plgpu.barrier_wait(bar(slot, i))

        _when(exists, wait)
      zeros = plgpu.layout_cast(jnp.zeros((bq, h), jnp.float32), plgpu.Layout.WGMMA)
      finish(pipeline(zeros), *tiles.last())
      plgpu.wait_smem_to_gmem(0)

    def step(idx, k_smem, v_smem, k_consumed, v_consumed, dq):
      slot, tile_row, block = tiles.at(idx[0])
      q_smem, do_smem = q_smem3.at[slot, wg], do_smem3.at[slot, wg]
      lse = plgpu.load(lse_smem3.at[slot, wg], layout=_ROWS)
      delta = plgpu.load(delta_smem3.at[slot, wg], layout=_ROWS)
      s_blk = _matmul(q_smem, k_smem.transpose((1, 0)), (bq, bk))
      p = jnp.exp2(s_blk * (scale * LOG2E) - lax.broadcast_in_dim(lse, (bq, bk), [0]))
      p = _masked(cfg.mask_all_steps, (bq, bk), 1, kv_len, block * bk, tile_row + wg * bq,
                  causal_t, lambda visible: p if visible is None else jnp.where(visible, p, 0.0))
      dp = _matmul(do_smem, v_smem.transpose((1, 0)), (bq, bk))
      _arrive(v_consumed)
      ds = p * (dp - lax.broadcast_in_dim(delta, (bq, bk), [0]))
      dq = _mma(dq, ds.astype(dtype), k_smem, stage)
      _arrive(k_consumed)
      if not paired:
        return dq
      switch = tiles.switches_after(idx[0])
      pl.when(switch)(lambda: finish(dq, 0, tile_row))
      return lax.cond(switch, lambda: dq * 0.0, lambda: dq)  # dq is finite

    kv_spec = plgpu.BlockSpec((bk, h), lambda i: (tiles.at(i)[2], 0), transforms=_TILED)
    kv_head = lax.div(head, jnp.int32(g))
    _pipeline(step, context, interpret=interpret, config=cfg, grid=(tiles.steps,),
              in_specs=[kv_spec, kv_spec])(k_ref.at[seq, :, kv_head], v_ref.at[seq, :, kv_head])

  # Q and dO of a (slot, warpgroup), side by side: [bq, H] float32 takes exactly their bytes,
  # so a tile's float32 dQ staging overlays only its own, finished, Q and dO.
  rows_smem = plgpu.SMEM((slots, wgs, 2, bq, h), dtype, transforms=_TILED)
  if f32_out:
    rows_smem = plgpu.RefUnion(
        rows_smem, plgpu.SMEM((slots, wgs, bq, h), jnp.float32, transforms=_TILED_F32))
  scratch = [
      rows_smem,
      plgpu.SMEM((slots, wgs, bq), jnp.float32),
      plgpu.SMEM((slots, wgs, bq), jnp.float32),
      plgpu.SMEM((bq, bk), dtype, transforms=_TILED) if interpret else None,
      plgpu.Barrier(num_barriers=slots * 4 * wgs),
  ]
  return _launch(training_dq_kernel, interpret=interpret, config=cfg,
                 grid=(n, _Tiles.programs(num_tiles, paired), z),
                 grid_names=('heads', 'q_tiles', 'rows'),
                 out_type=jax.ShapeDtypeStruct(q.shape, out_dtype),
                 scratch=scratch)(q, k, v, do, lse2, delta, length)


def _first_q_block(kv_len, first_key, causal_t, bq, num_q_blocks):
  """The first query block that sees key `first_key`: 0, or (causal) its diagonal block.

  Query m sees key p iff p < kv_len - T + m + 1, i.e. m >= p - (kv_len - T). Traced;
  at most the last block (a tile no query sees streams one block and masks it).
  """
  if causal_t is None:
    return 0
  first = jnp.maximum(first_key - (kv_len - causal_t), 0)
  return jnp.minimum(lax.div(first, jnp.int32(bq)), num_q_blocks - 1)


def _row_parts(cfg, s, kh, mp, interpret) -> int:
  """Query-row parts of the fused dK/dV kernel (`TrainingKernelConfig.row_parts`): S kv
  tokens in all (rows x tokens), kh kv heads, mp padded query rows. Parts stage their
  float32 dK/dV through the dQ buffer, which needs block_kv_dkv == block_q_dkv."""
  blocks = mp // cfg.block_q_dkv
  if cfg.block_kv_dkv != cfg.block_q_dkv:
    return 1
  if cfg.row_parts is not None:
    return cfg.row_parts if blocks % cfg.row_parts == 0 else 1
  programs = s // (cfg.compute_wgs * cfg.block_kv_dkv) * kh
  return row_parts(programs, blocks, num_sms=device_num_sms(interpret))


def _fused_dq(cfg, causal_t, h) -> bool:
  """Whether the dK/dV kernel computes dQ (`TrainingKernelConfig.fused_dq`): shared segments,
  with H split into 64-column halves (H a multiple of 64 per compute warpgroup)."""
  return cfg.fused_dq and causal_t is None and h % (64 * cfg.compute_wgs) == 0


def _dkv(q, k, v, do, lse2, delta, length, *, scale, causal_t, interpret, cfg, fused=False,
         parts=1, dq_init=None):
  """dk, dv [Z, S, K, H]; fused (`_fused_dq`): dq [Z, M, N, H] float32 (dq_init plus this
  segment's dQ; dq_init None: zeros), dk, dv.

  parts > 1 (fused only): each kv tile's program is `parts` programs, part r streaming query
  blocks [r, r + 1) * (M / bq / parts) and writing its float32 dK/dV, [bk, H] a warpgroup,
  through its dQ staging buffer ([bq, H / W] float32, so bk == bq) in W column pieces; XLA
  sums the parts. The grid's third axis is then Z * parts.

  Fused, step f stages its dS^T in shared memory (double-buffered by step parity), and step
  f + 1 (the last one after the loop) adds step f's dQ: warpgroup w multiplies every
  warpgroup's dS by that warpgroup's K, columns [w H / W, (w + 1) H / W), and TMA-reduce-adds
  the float32 partial into dQ, a zeroed buffer passed as a `jax.new_ref` (the kernel's aliased
  output). A barrier (W arrivals) per step says both dS are staged; a warpgroup reads step
  f's buffer before it writes step f + 1's, so the buffer it writes next (f + 2's) was last
  read at step f + 1 by a warpgroup that has since arrived for f + 1. Interpret mode has no
  TMA reduction: there each kv tile writes its partials into a slab of its own, summed after.
  """
  z, mp, n, h = q.shape
  s, kh = k.shape[1:3]
  g = n // kh
  wgs, bq, bk = cfg.compute_wgs, cfg.block_q_dkv, cfg.block_kv_dkv
  dtype = k.dtype
  hq = h // wgs  # dQ columns a warpgroup adds
  tiles = s // (wgs * bk)
  if parts > 1 and not (fused and causal_t is None and bk == bq and (mp // bq) % parts == 0):
    raise ValueError(f'row parts ({parts}) need the fused, non-causal kernel, block_kv_dkv == '
                     f'block_q_dkv and {mp // bq} query blocks divisible by them')
  per_part = mp // bq // parts

  def training_dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, len_ref, *refs):
    if fused:
      dq_ref, dk_ref, dv_ref, k_smem2, v_smem2, stage_p, stage_ds, barriers, ds_smem2, \
          dq_smem2, ds_ready = refs
    else:
      dk_ref, dv_ref, k_smem2, v_smem2, stage_p, stage_ds, barriers = refs
    kv_head, seq, part = lax.axis_index('kv_heads'), lax.axis_index('rows'), 0
    if parts > 1:
      seq, part = lax.div(seq, jnp.int32(parts)), lax.rem(seq, jnp.int32(parts))
    wg = _wg(interpret)
    kv_len = len_ref[seq]
    tile = lax.axis_index('kv_tiles') * (wgs * bk)
    first = tile + wg * bk
    if parts > 1:
      q0, nq = part * per_part, per_part
    else:
      q0 = _first_q_block(kv_len, tile, causal_t, bq, mp // bq)
      nq = mp // bq - q0  # query blocks of each head this tile streams
    k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
    bar = lambda i: barriers.at[i * wgs + wg]  # i: k, v

    def context(pipeline):
      toks = pl.ds(first, bk)
      plgpu.copy_gmem_to_smem(k_ref.at[seq, toks, kv_head], k_smem, bar(0))
      plgpu.copy_gmem_to_smem(v_ref.at[seq, toks, kv_head], v_smem, bar(1))
      plgpu.barrier_wait(bar(0))
      plgpu.barrier_wait(bar(1))
      zeros = plgpu.layout_cast(jnp.zeros((bk, h), jnp.float32), plgpu.Layout.WGMMA)
      dk, dv = pipeline((zeros, zeros))
      if fused:
        add_dq(g * nq - 1)  # the last step's
      if parts > 1:
        _store_part(dk * scale, dk_ref.at[seq, part, toks, kv_head], dq_smem2.at[wg])
        _store_part(dv, dv_ref.at[seq, part, toks, kv_head], dq_smem2.at[wg])
        return
      k_smem[...] = (dk * scale).astype(dtype)  # K and V are no longer needed: they stage dK, dV
      v_smem[...] = dv.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[seq, toks, kv_head])
      plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[seq, toks, kv_head])
      plgpu.wait_smem_to_gmem(0)

    def stage_ds_for_dq(ds16, flat):
      ds_smem2.at[lax.rem(flat, 2), wg][...] = ds16
      plgpu.commit_smem()
      if ds_ready is not None:
        plgpu.barrier_arrive(ds_ready)

    def add_dq(flat):
      """dQ of step `flat`'s query block and head += scale * dS K, this warpgroup's columns."""
      if ds_ready is not None:
        plgpu.barrier_wait(ds_ready)
      buf = ds_smem2.at[lax.rem(flat, 2)]
      cols = pl.ds(wg * hq, hq)

      def run(ref):
        for w in range(wgs):  # dS^T [bk, bq] read transposed, times K [bk, hq]
          plgpu.wgmma(ref, buf.at[w].transpose((1, 0)), k_smem2.at[w, :, cols])
        return ref[...]

      part = pl.run_scoped(run, plgpu.ACC((bq, hq), jnp.float32))
      rows, head = pl.ds((q0 + lax.rem(flat, nq)) * bq, bq), kv_head * g + lax.div(flat, nq)
      dq_smem = dq_smem2.at[wg]
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous partial has left
      dq_smem[...] = part * scale
      plgpu.commit_smem()
      if interpret:
        dq_dst = dq_ref.at[lax.axis_index('kv_tiles'), seq, rows, head, cols]
        plgpu.copy_smem_to_gmem(dq_smem, dq_dst)
        plgpu.wait_smem_to_gmem(0)
      else:
        plgpu.copy_smem_to_gmem(dq_smem, dq_ref.at[seq, rows, head, cols], reduction_op='add')

    def step(idx, q_smem, do_smem, lse_smem, delta_smem, q_consumed, do_consumed, lse_consumed,
             delta_consumed, carry):
      dk, dv = carry
      # Transposed scores [bk, bq]: this warpgroup's kv tokens are the wgmma rows.
      s_t = _matmul(k_smem, q_smem.transpose((1, 0)), (bk, bq))
      lse = plgpu.load(lse_smem, layout=_COLS)
      _arrive(lse_consumed)
      p_t = jnp.exp2(s_t * (scale * LOG2E) - lax.broadcast_in_dim(lse, (bk, bq), [1]))
      p_t = _masked(cfg.mask_all_steps_dkv, (bk, bq), 0, kv_len, first, (q0 + idx[1]) * bq,
                    causal_t,
                    lambda visible: p_t if visible is None else jnp.where(visible, p_t, 0.0))
      dv = _mma(dv, p_t.astype(dtype), do_smem, stage_p)
      dp_t = _matmul(v_smem, do_smem.transpose((1, 0)), (bk, bq))
      _arrive(do_consumed)
      delta = plgpu.load(delta_smem, layout=_COLS)
      _arrive(delta_consumed)
      ds_t = p_t * (dp_t - lax.broadcast_in_dim(delta, (bk, bq), [1]))
      ds16 = ds_t.astype(dtype)
      dk = _mma(dk, ds16, q_smem, stage_ds)
      _arrive(q_consumed)
      if fused:
        flat = idx[0] * nq + idx[1]
        pl.when(flat > 0)(lambda: add_dq(flat - 1))
        stage_ds_for_dq(ds16, flat)
      return dk, dv

    # Steps walk the G query heads of this kv head, and the query blocks of each from q0 on
    # (causal: the blocks above the diagonal see none of this tile's keys).
    head = lambda j: kv_head * g + j
    row_spec = plgpu.BlockSpec((bq, None, h), lambda j, i: (q0 + i, head(j), 0),
                               transforms=_TILED)
    stat_spec = plgpu.BlockSpec((None, bq), lambda j, i: (head(j), q0 + i))
    _pipeline(step, context, interpret=interpret, config=cfg, grid=(g, nq),
              in_specs=[row_spec, row_spec, stat_spec, stat_spec])(
                  q_ref.at[seq], do_ref.at[seq], lse_ref.at[seq], delta_ref.at[seq])

  scratch = _dkv_scratch(cfg, h, dtype, fused=fused, interpret=interpret)
  kv_type = (jax.ShapeDtypeStruct(k.shape, dtype) if parts == 1 else
             jax.ShapeDtypeStruct((z, parts, *k.shape[1:]), jnp.float32))
  launch = _launch(training_dkv_kernel, interpret=interpret, config=cfg,
                   grid=(tiles, kh, z * parts), grid_names=('kv_tiles', 'kv_heads', 'rows'),
                   out_type=(kv_type, kv_type), scratch=scratch)
  args = (q, k, v, do, lse2, delta, length)
  if not fused:
    return launch(*args)
  return _launch_fused_dq(launch, args, tiles, parts, dq_init, interpret=interpret)


def _store_part(x, dst, dq_smem):
  """x [bk, H] float32 -> dst, through a warpgroup's dQ staging buffer `dq_smem` ([bq, H / W]),
  H / W columns at a time (each after the previous copy has read the buffer)."""
  hq = dq_smem.shape[-1]
  for c in range(x.shape[-1] // hq):
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    dq_smem[...] = x[:, c * hq:(c + 1) * hq]
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dq_smem, dst.at[:, pl.ds(c * hq, hq)])
  plgpu.wait_smem_to_gmem(0)


def _dkv_scratch(cfg, h: int, dtype, *, fused: bool, interpret: bool):
  """The dK/dV kernel's shared memory and barriers: K, V (then dK, dV), the staged P and dS
  (interpret mode), the K/V barriers; fused, the dS buffers, the dQ staging and dS barrier."""
  wgs, bq, bk = cfg.compute_wgs, cfg.block_q_dkv, cfg.block_kv_dkv
  scratch = [
      plgpu.SMEM((wgs, bk, h), dtype, transforms=_TILED),
      plgpu.SMEM((wgs, bk, h), dtype, transforms=_TILED),
      plgpu.SMEM((bk, bq), dtype, transforms=_TILED) if interpret else None,
      plgpu.SMEM((bk, bq), dtype, transforms=_TILED) if interpret else None,
      plgpu.Barrier(num_barriers=2 * wgs),
  ]
  if fused:
    scratch += [plgpu.SMEM((2, wgs, bk, bq), dtype, transforms=_TILED),
                plgpu.SMEM((wgs, bq, h // wgs), jnp.float32, transforms=_TILED_F32),
                plgpu.Barrier(num_arrivals=wgs) if wgs > 1 else None]
  return scratch


def _launch_fused_dq(launch, args, tiles: int, parts: int, dq_init, *, interpret: bool):
  """(dq float32, dk, dv) of the fused dK/dV kernel: dQ reduce-added into dq_init (zeros if
  None); interpret mode (no TMA reduction) sums each kv tile's slab after."""
  q, k = args[0], args[1]
  z, mp, n, h = q.shape
  init = jnp.zeros((z, mp, n, h), jnp.float32) if dq_init is None else dq_init
  if interpret:
    slabs = jax.new_ref(jnp.zeros((tiles, z, mp, n, h), jnp.float32))
    dk, dv = launch(*args, slabs)
    dq = init + slabs[...].sum(0)
  else:
    dq = jax.new_ref(init)
    dk, dv = launch(*args, dq)
    dq = dq[...]
  if parts > 1:
    dk, dv = (x.sum(1).astype(k.dtype) for x in (dk, dv))
  return dq, dk, dv


def _backward_reference(q, k, v, do, lse, delta, lengths, scale, causal, dq_dtype=None,
                        dq_init=None):
  z, m, n, h = q.shape
  s, kh = k.shape[1:3]
  g = n // kh
  qf, kf, vf, visible = _reference_inputs(q, k, v, lengths, causal)
  dof = do.astype(jnp.float32).reshape(z, m, kh, g, h)
  hi = lax.Precision.HIGHEST
  sc = jnp.einsum('zmkgh,zskh->zmkgs', qf, kf, precision=hi) * scale
  p = jnp.where(visible, jnp.exp(sc - lse.reshape(z, m, kh, g)[..., None]), 0.0)
  dp = jnp.einsum('zmkgh,zskh->zmkgs', dof, vf, precision=hi)
  ds = p * (dp - delta.reshape(z, m, kh, g)[..., None])
  dv = jnp.einsum('zmkgs,zmkgh->zskh', p, dof, precision=hi)
  dk = jnp.einsum('zmkgs,zmkgh->zskh', ds, qf, precision=hi) * scale
  dq = jnp.einsum('zmkgs,zskh->zmkgh', ds, kf, precision=hi).reshape(z, m, n, h) * scale
  if dq_init is not None:
    dq = dq + dq_init.astype(jnp.float32)
  return dq.astype(dq_dtype or q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def segment_backward_reference(q, k, v, do, lse, delta, kv_length, *, scale: float,
                               interpret: bool = False, config=None, dq_dtype=None):
  """`segment_backward` in jnp, float32 math; same arguments and outputs."""
  del interpret, config
  grads = _backward_reference(q[None], k[None], v[None], do[None], lse[None], delta[None],
                              kv_length, scale, False, dq_dtype)
  return tuple(x[0] for x in grads)


def segments_backward_reference(q, k, v, do, lse, delta, kv_lengths, *, scale: float,
                                interpret: bool = False, config=None, dq_dtype=None,
                                dq_init=None):
  """`segments_backward` in jnp, float32 math; same arguments and outputs."""
  del interpret, config
  return _backward_reference(q, k, v, do, lse, delta, kv_lengths, scale, False, dq_dtype,
                             dq_init)


def causal_backward_reference(q, k, v, do, lse, delta, lengths, *, scale: float,
                              interpret: bool = False, config=None, dq_dtype=None):
  """`causal_backward` in jnp, float32 math; same arguments and outputs."""
  del interpret, config
  return _backward_reference(q, k, v, do, lse, delta, lengths, scale, True, dq_dtype)
