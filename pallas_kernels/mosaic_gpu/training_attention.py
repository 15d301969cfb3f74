"""Forward and backward of one shared segment for training, on Hopper (Pallas Mosaic GPU).

A shared segment (a prompt) is attended, non-causally, by all M query rows of
every sample that shares it: q [M, N, H] (rows x T tokens flattened), k, v
[S, K, H] (the segment's tokens; positions >= kv_length are masked), GQA with
N = K * G. `segment_forward` returns the segment's partial state (out, natural
log lse); `segment_backward` takes the MERGED row statistics (lse over all of a
row's keys, delta = rowsum(dO * O) - dlse), so that P = exp(S - lse) on this
segment is the row's global probability there and the per-part gradients are
exact (see `hydrajax/training/tree_attention_vjp.py`):

    dV = P^T dO    dS = P * (dO V^T - delta)    dK = scale dS^T Q    dQ = scale dS K

Three kernels, after JAX's FlashAttention-3 for Hopper
(`jax/experimental/pallas/ops/gpu/attention_mgpu.py`, Copyright 2024 The JAX
Authors, Apache License 2.0): the forward and dQ kernels run one program per
(query head, tile of query rows) and stream K/V blocks; the dK/dV kernel runs
one program per (kv block, kv head) and streams the query blocks of all G query
heads of the kv head's group, so the GQA sum and the sum over all M rows happen
in its float32 accumulators (nothing per row or per query head is written).
On the GPU each kernel is warp-specialised: `compute_wgs` compute warpgroups
and one memory warpgroup that feeds them by TMA (`emit_pipeline_warp_specialized`).
Differences from the JAX kernels: the input dtype everywhere (bf16 or f16; its
scratch is float16), a dynamic kv_length (scores past it masked by a where),
the in-kernel GQA reduction, natural-log lse at the interface.

Interpret mode (`interpret=True`, CPU) runs the same step functions pipelined by
one warpgroup (`emit_pipeline`) and stages register operands of wgmma through
shared memory (interpret mode takes wgmma operands from shared memory only);
several warpgroups waiting on each other's barriers can starve a two-core CPU.

K/V rows past kv_length may hold anything (NaN included): the wrappers zero
them (one pass over the segment's K/V) before the kernels, so 0 * NaN never
reaches P @ V, dS K or dP = dO V^T; scores there are masked by a where.
Query rows are padded to the row tile (zeros, lse = +inf so P = 0) and dropped.
"""

import dataclasses
import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.mosaic_gpu import online_softmax as osm
from pallas_kernels.mosaic_gpu.online_softmax import LOG2E

_TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
_ROWS = plgpu.Layout.WGMMA.reduce(1)  # per-row vectors of a [rows, cols] wgmma result
_COLS = plgpu.Layout.WGMMA.reduce(0)  # per-column vectors


@dataclasses.dataclass(frozen=True)
class TrainingKernelConfig:
  """Block sizes (rows per compute warpgroup) of the three kernels."""

  block_q: int = 64  # forward: query rows per warpgroup
  block_kv: int = 128  # forward: kv tokens per step
  block_q_dq: int = 64
  block_kv_dq: int = 128
  block_q_dkv: int = 64  # dK/dV: query rows per step
  block_kv_dkv: int = 64  # dK/dV: kv tokens per warpgroup
  max_concurrent_steps: int = 2
  compute_wgs: int = 2

  def __post_init__(self):
    for name in ('block_q', 'block_kv', 'block_q_dq', 'block_kv_dq', 'block_q_dkv',
                 'block_kv_dkv'):
      if getattr(self, name) % 64:
        raise ValueError(f'{name} must be a multiple of 64, got {getattr(self, name)}')
    if self.max_concurrent_steps < 2:
      raise ValueError(f'max_concurrent_steps must be >= 2, got {self.max_concurrent_steps}')
    if self.compute_wgs not in (1, 2):
      raise ValueError(f'compute_wgs must be 1 or 2, got {self.compute_wgs}')


INTERPRET_CONFIG = TrainingKernelConfig(64, 64, 64, 64, 64, 64, 2, 1)


def _config(config, interpret):
  if config is not None:
    return config
  return INTERPRET_CONFIG if interpret else TrainingKernelConfig()


def _check(q, k, v, *others):
  if q.ndim != 3 or k.ndim != 3 or k.shape != v.shape or q.shape[2] != k.shape[2]:
    raise ValueError(f'q must be [M, N, H] and k, v [S, K, H]; got q {q.shape}, k {k.shape}, '
                     f'v {v.shape}')
  if q.shape[1] % k.shape[1]:
    raise ValueError(f'query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})')
  if q.shape[2] % 64:
    raise ValueError(f'head dim must be a multiple of 64, got {q.shape[2]}')
  dtypes = {jnp.dtype(x.dtype) for x in (q, k, v, *others)}
  if len(dtypes) != 1 or dtypes.pop() not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError('q, k, v (and do) must share one dtype, bfloat16 or float16 (wgmma); got '
                     f'{[jnp.dtype(x.dtype).name for x in (q, k, v, *others)]}')


def _pad_to(x, axis, multiple, value=0):
  extra = -x.shape[axis] % multiple
  if not extra:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, extra)
  return jnp.pad(x, pad, constant_values=value)


def _prepare_kv(k, v, kv_length, multiple):
  """Clamped kv_length [1] int32; k, v with rows >= kv_length zeroed, padded to `multiple`."""
  length = jnp.clip(jnp.asarray(kv_length, jnp.int32).reshape(()), 0, k.shape[0])
  seen = (jnp.arange(k.shape[0]) < length)[:, None, None]
  k, v = (_pad_to(jnp.where(seen, x, jnp.zeros((), x.dtype)), 0, multiple) for x in (k, v))
  return length.reshape(1), k, v


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
      compiler_params=plgpu.CompilerParams(
          approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
      interpret=plgpu.InterpretGPUParams() if interpret else None, **mesh)


def _wg(interpret):
  return jnp.int32(0) if interpret else lax.axis_index('wg')


def _schedule(barrier):
  """FA3's ping-pong: the two compute warpgroups take turns at the tensor cores."""
  if barrier is not None:
    plgpu.barrier_arrive(barrier)
    plgpu.barrier_wait(barrier)


# Forward.

def segment_forward(q, k, v, kv_length, *, scale: float, interpret: bool = False,
                    config: TrainingKernelConfig | None = None):
  """(out [M, N, H] in q.dtype, lse [M, N] float32 natural log, -inf for no key)."""
  _check(q, k, v)
  cfg = _config(config, interpret)
  m, n, h = q.shape
  kh = k.shape[1]
  g = n // kh
  wgs, bq, bk = cfg.compute_wgs, cfg.block_q, cfg.block_kv
  dtype = q.dtype
  length, k, v = _prepare_kv(k, v, kv_length, bk)
  qp = _pad_to(q, 0, wgs * bq)
  mp, s = qp.shape[0], k.shape[0]
  scale_log2 = float(scale) * LOG2E

  def segment_fwd_kernel(q_ref, k_ref, v_ref, len_ref, out_ref, lse_ref, qo_smem2, lse_smem2,
                         stage, q_barriers, schedule_barrier):
    head = lax.axis_index('heads')
    wg = _wg(interpret)
    kv_len = len_ref[0]
    row = lax.axis_index('q_tiles') * (wgs * bq) + wg * bq
    qo_smem = qo_smem2.at[wg]

    def context(pipeline):
      plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row, bq), head], qo_smem, q_barriers.at[wg])
      plgpu.barrier_wait(q_barriers.at[wg])
      if wgs == 2:
        pl.when(wg == 1)(lambda: _schedule(schedule_barrier))
      acc, m_i, l_i = pipeline(osm.init(bq, h))
      if wgs == 2:
        pl.when(wg == 0)(lambda: _schedule(schedule_barrier))
      osm.finish(acc, m_i, l_i, qo_smem, lse_smem2.at[wg], dtype)
      plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[pl.ds(row, bq), head])
      plgpu.copy_smem_to_gmem(lse_smem2.at[wg], lse_ref.at[head, pl.ds(row, bq)])
      plgpu.wait_smem_to_gmem(0)

    def step(idx, k_smem, v_smem, k_consumed, v_consumed, carry):
      acc, m_i, l_i = carry

      def qk(ref):
        plgpu.wgmma(ref, qo_smem, k_smem.transpose((1, 0)))
        _schedule(schedule_barrier)
        return ref[...]

      s_blk = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
      _arrive(k_consumed)
      cols = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=plgpu.Layout.WGMMA)
      acc, m_i, l_i, p16 = osm.step(s_blk, acc, m_i, l_i, scale_log2=scale_log2, dtype=dtype,
                                    visible=cols < kv_len - idx[0] * bk)
      _schedule(schedule_barrier)
      acc = _mma(acc, p16, v_smem, stage)
      _arrive(v_consumed)
      return acc, m_i, l_i

    kv_spec = plgpu.BlockSpec((bk, h), lambda i: (i, 0), transforms=_TILED)
    kv_head = lax.div(head, jnp.int32(g))
    _pipeline(step, context, interpret=interpret, config=cfg, grid=(s // bk,),
              in_specs=[kv_spec, kv_spec])(k_ref.at[:, kv_head], v_ref.at[:, kv_head])

  scratch = [
      plgpu.SMEM((wgs, bq, h), dtype, transforms=_TILED),  # Q, then the output
      plgpu.SMEM((wgs, bq), jnp.float32),
      plgpu.SMEM((bq, bk), dtype, transforms=_TILED) if interpret else None,
      plgpu.Barrier(num_barriers=wgs),
      plgpu.Barrier(num_arrivals=wgs) if wgs == 2 else None,
  ]
  out, lse = _launch(
      segment_fwd_kernel, interpret=interpret, config=cfg, grid=(n, mp // (wgs * bq)),
      grid_names=('heads', 'q_tiles'),
      out_type=(jax.ShapeDtypeStruct((mp, n, h), dtype),
                jax.ShapeDtypeStruct((n, mp), jnp.float32)),  # rows minor: 1D TMA per head
      scratch=scratch)(qp, k, v, length)
  return out[:m], lse[:, :m].T


def segment_forward_reference(q, k, v, kv_length, *, scale: float, interpret: bool = False,
                              config=None):
  """`segment_forward` in jnp, float32 math; same arguments and outputs."""
  del interpret, config
  m, n, h = q.shape
  s, kh, _ = k.shape
  seen = jnp.arange(s) < jnp.asarray(kv_length, jnp.int32)
  kf, vf = (jnp.where(seen[:, None, None], x.astype(jnp.float32), 0.0) for x in (k, v))
  qf = q.astype(jnp.float32).reshape(m, kh, n // kh, h)
  sc = jnp.einsum('mkgh,skh->mkgs', qf, kf, precision=lax.Precision.HIGHEST) * scale
  sc = jnp.where(seen, sc, -jnp.inf)
  mx = jnp.max(sc, axis=-1, keepdims=True)
  mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
  p = jnp.exp(sc - mx)
  l = p.sum(-1)
  o = jnp.einsum('mkgs,skh->mkgh', p, vf, precision=lax.Precision.HIGHEST)
  out = (o / jnp.where(l > 0, l, 1.0)[..., None]).reshape(m, n, h).astype(q.dtype)
  lse = jnp.where(l > 0, mx[..., 0] + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
  return out, lse.reshape(m, n)


# Backward.

def segment_backward(q, k, v, do, lse, delta, kv_length, *, scale: float,
                     interpret: bool = False, config: TrainingKernelConfig | None = None):
  """(dq [M, N, H] in q.dtype, dk, dv [S, K, H] in k.dtype) of one segment.

  lse [M, N] (natural log) and delta [M, N] = rowsum(dO * O) - dlse are the rows'
  MERGED statistics over all their keys, not this segment's.
  """
  _check(q, k, v, do)
  if lse.shape != q.shape[:2] or delta.shape != q.shape[:2]:
    raise ValueError(f'lse and delta must be [M, N] = {q.shape[:2]}, got {lse.shape}, '
                     f'{delta.shape}')
  cfg = _config(config, interpret)
  s_in = k.shape[0]
  length, k, v = _prepare_kv(
      k, v, kv_length, _lcm(cfg.block_kv_dq, cfg.compute_wgs * cfg.block_kv_dkv))
  rows = _lcm(cfg.compute_wgs * cfg.block_q_dq, cfg.block_q_dkv)
  m = q.shape[0]
  qp, dop = _pad_to(q, 0, rows), _pad_to(do, 0, rows)
  # Base-2 lse, rows minor (1D TMA per head); padded rows get +inf: P = 0 there.
  lse2 = _pad_to(lse.astype(jnp.float32) * LOG2E, 0, rows, jnp.inf).T
  delta_t = _pad_to(delta.astype(jnp.float32), 0, rows).T
  args = (qp, k, v, dop, lse2, delta_t, length)
  dq = _dq(*args, scale=float(scale), interpret=interpret, cfg=cfg)
  dk, dv = _dkv(*args, scale=float(scale), interpret=interpret, cfg=cfg)
  return dq[:m], dk[:s_in], dv[:s_in]


def _dq(q, k, v, do, lse2, delta, length, *, scale, interpret, cfg):
  mp, n, h = q.shape
  s, kh, _ = k.shape
  g = n // kh
  wgs, bq, bk = cfg.compute_wgs, cfg.block_q_dq, cfg.block_kv_dq
  dtype = q.dtype

  def segment_dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, len_ref, dq_ref,
                        q_smem2, do_smem2, lse_smem2, delta_smem2, stage, barriers):
    head = lax.axis_index('heads')
    wg = _wg(interpret)
    kv_len = len_ref[0]
    row = lax.axis_index('q_tiles') * (wgs * bq) + wg * bq
    q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
    bar = lambda i: barriers.at[i * wgs + wg]  # i: q, do, lse, delta

    def context(pipeline):
      rows = pl.ds(row, bq)
      plgpu.copy_gmem_to_smem(q_ref.at[rows, head], q_smem, bar(0))
      plgpu.copy_gmem_to_smem(do_ref.at[rows, head], do_smem, bar(1))
      plgpu.copy_gmem_to_smem(lse_ref.at[head, rows], lse_smem2.at[wg], bar(2))
      plgpu.copy_gmem_to_smem(delta_ref.at[head, rows], delta_smem2.at[wg], bar(3))
      for i in range(4):
        plgpu.barrier_wait(bar(i))
      lse = plgpu.load(lse_smem2.at[wg], layout=_ROWS)
      delta = plgpu.load(delta_smem2.at[wg], layout=_ROWS)
      zeros = plgpu.layout_cast(jnp.zeros((bq, h), jnp.float32), plgpu.Layout.WGMMA)
      dq, _, _ = pipeline((zeros, lse, delta))
      q_smem[...] = (dq * scale).astype(dtype)  # Q is no longer needed: its buffer stages dQ
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows, head])
      plgpu.wait_smem_to_gmem(0)

    def step(idx, k_smem, v_smem, k_consumed, v_consumed, carry):
      dq, lse, delta = carry
      s_blk = _matmul(q_smem, k_smem.transpose((1, 0)), (bq, bk))
      cols = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=plgpu.Layout.WGMMA)
      p = jnp.exp2(s_blk * (scale * LOG2E) - lax.broadcast_in_dim(lse, (bq, bk), [0]))
      p = jnp.where(cols < kv_len - idx[0] * bk, p, 0.0)
      dp = _matmul(do_smem, v_smem.transpose((1, 0)), (bq, bk))
      _arrive(v_consumed)
      ds = p * (dp - lax.broadcast_in_dim(delta, (bq, bk), [0]))
      dq = _mma(dq, ds.astype(dtype), k_smem, stage)
      _arrive(k_consumed)
      return dq, lse, delta

    kv_spec = plgpu.BlockSpec((bk, h), lambda i: (i, 0), transforms=_TILED)
    kv_head = lax.div(head, jnp.int32(g))
    _pipeline(step, context, interpret=interpret, config=cfg, grid=(s // bk,),
              in_specs=[kv_spec, kv_spec])(k_ref.at[:, kv_head], v_ref.at[:, kv_head])

  scratch = [
      plgpu.SMEM((wgs, bq, h), dtype, transforms=_TILED),
      plgpu.SMEM((wgs, bq, h), dtype, transforms=_TILED),
      plgpu.SMEM((wgs, bq), jnp.float32),
      plgpu.SMEM((wgs, bq), jnp.float32),
      plgpu.SMEM((bq, bk), dtype, transforms=_TILED) if interpret else None,
      plgpu.Barrier(num_barriers=4 * wgs),
  ]
  return _launch(segment_dq_kernel, interpret=interpret, config=cfg,
                 grid=(n, mp // (wgs * bq)),
                 grid_names=('heads', 'q_tiles'), out_type=jax.ShapeDtypeStruct(q.shape, dtype),
                 scratch=scratch)(q, k, v, do, lse2, delta, length)


def _dkv(q, k, v, do, lse2, delta, length, *, scale, interpret, cfg):
  mp, n, h = q.shape
  s, kh, _ = k.shape
  g = n // kh
  wgs, bq, bk = cfg.compute_wgs, cfg.block_q_dkv, cfg.block_kv_dkv
  dtype = k.dtype

  def segment_dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, len_ref, dk_ref,
                         dv_ref, k_smem2, v_smem2, stage_p, stage_ds, barriers):
    kv_head = lax.axis_index('kv_heads')
    wg = _wg(interpret)
    kv_len = len_ref[0]
    first = lax.axis_index('kv_tiles') * (wgs * bk) + wg * bk
    k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
    bar = lambda i: barriers.at[i * wgs + wg]  # i: k, v

    def context(pipeline):
      toks = pl.ds(first, bk)
      plgpu.copy_gmem_to_smem(k_ref.at[toks, kv_head], k_smem, bar(0))
      plgpu.copy_gmem_to_smem(v_ref.at[toks, kv_head], v_smem, bar(1))
      plgpu.barrier_wait(bar(0))
      plgpu.barrier_wait(bar(1))
      zeros = plgpu.layout_cast(jnp.zeros((bk, h), jnp.float32), plgpu.Layout.WGMMA)
      dk, dv = pipeline((zeros, zeros))
      k_smem[...] = (dk * scale).astype(dtype)  # K and V are no longer needed: they stage dK, dV
      v_smem[...] = dv.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[toks, kv_head])
      plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[toks, kv_head])
      plgpu.wait_smem_to_gmem(0)

    def step(idx, q_smem, do_smem, lse_smem, delta_smem, q_consumed, do_consumed, lse_consumed,
             delta_consumed, carry):
      dk, dv = carry
      # Transposed scores [bk, bq]: this warpgroup's kv tokens are the wgmma rows.
      s_t = _matmul(k_smem, q_smem.transpose((1, 0)), (bk, bq))
      lse = plgpu.load(lse_smem, layout=_COLS)
      _arrive(lse_consumed)
      p_t = jnp.exp2(s_t * (scale * LOG2E) - lax.broadcast_in_dim(lse, (bk, bq), [1]))
      toks = plgpu.broadcasted_iota(jnp.int32, (bk, bq), 0, layout=plgpu.Layout.WGMMA)
      p_t = jnp.where(toks < kv_len - first, p_t, 0.0)
      dv = _mma(dv, p_t.astype(dtype), do_smem, stage_p)
      dp_t = _matmul(v_smem, do_smem.transpose((1, 0)), (bk, bq))
      _arrive(do_consumed)
      delta = plgpu.load(delta_smem, layout=_COLS)
      _arrive(delta_consumed)
      ds_t = p_t * (dp_t - lax.broadcast_in_dim(delta, (bk, bq), [1]))
      dk = _mma(dk, ds_t.astype(dtype), q_smem, stage_ds)
      _arrive(q_consumed)
      return dk, dv

    # Steps walk the G query heads of this kv head, and the query blocks of each.
    head = lambda j: kv_head * g + j
    row_spec = plgpu.BlockSpec((bq, None, h), lambda j, i: (i, head(j), 0), transforms=_TILED)
    stat_spec = plgpu.BlockSpec((None, bq), lambda j, i: (head(j), i))
    _pipeline(step, context, interpret=interpret, config=cfg, grid=(g, mp // bq),
              in_specs=[row_spec, row_spec, stat_spec, stat_spec])(q_ref, do_ref, lse_ref,
                                                                   delta_ref)

  scratch = [
      plgpu.SMEM((wgs, bk, h), dtype, transforms=_TILED),
      plgpu.SMEM((wgs, bk, h), dtype, transforms=_TILED),
      plgpu.SMEM((bk, bq), dtype, transforms=_TILED) if interpret else None,
      plgpu.SMEM((bk, bq), dtype, transforms=_TILED) if interpret else None,
      plgpu.Barrier(num_barriers=2 * wgs),
  ]
  kv_type = jax.ShapeDtypeStruct(k.shape, dtype)
  return _launch(segment_dkv_kernel, interpret=interpret, config=cfg,
                 grid=(s // (wgs * bk), kh),
                 grid_names=('kv_tiles', 'kv_heads'), out_type=(kv_type, kv_type),
                 scratch=scratch)(q, k, v, do, lse2, delta, length)


def segment_backward_reference(q, k, v, do, lse, delta, kv_length, *, scale: float,
                               interpret: bool = False, config=None):
  """`segment_backward` in jnp, float32 math; same arguments and outputs."""
  del interpret, config
  m, n, h = q.shape
  s, kh, _ = k.shape
  g = n // kh
  f32 = lambda x: x.astype(jnp.float32)
  seen = jnp.arange(s) < jnp.asarray(kv_length, jnp.int32)
  kf, vf = (jnp.where(seen[:, None, None], f32(x), 0.0) for x in (k, v))
  qf, dof = f32(q).reshape(m, kh, g, h), f32(do).reshape(m, kh, g, h)
  hi = lax.Precision.HIGHEST
  sc = jnp.einsum('mkgh,skh->mkgs', qf, kf, precision=hi) * scale
  p = jnp.where(seen, jnp.exp(sc - lse.reshape(m, kh, g)[..., None]), 0.0)
  dp = jnp.einsum('mkgh,skh->mkgs', dof, vf, precision=hi)
  ds = p * (dp - delta.reshape(m, kh, g)[..., None])
  dv = jnp.einsum('mkgs,mkgh->skh', p, dof, precision=hi)
  dk = jnp.einsum('mkgs,mkgh->skh', ds, qf, precision=hi) * scale
  dq = jnp.einsum('mkgs,skh->mkgh', ds, kf, precision=hi) * scale
  return dq.reshape(m, n, h).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
