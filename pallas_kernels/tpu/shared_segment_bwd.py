"""Mosaic TPU kernels: the backward pass of a group of shared segments' attention.

The shared-segment part of `hydrajax.training.tree_attention_differentiable`'s
backward: for each segment z of a group (the outermost grid axis: one launch
for the group), the queries of every row it covers, times their T tokens and
the GQA group, are one matrix of M rows per kv head. With the rows' merged lse
and delta = rowsum(dO * O) - dlse (flash attention's recomputation):

    P = exp(Q K^T * scale - lse)      dS = P * (dO V^T - delta)
    dV = P^T dO      dK = scale * dS^T Q      dQ = scale * dS K

`_dkv_kernel` walks the M row blocks as the innermost (reduction) grid axis and
accumulates the segment's dK and dV in VMEM: the prompt's gradient is reduced
over all of its rows inside the kernel and written once per kv block, never per
row. `_dq_kernel` is the transposed walk (kv blocks innermost) for dQ.

Tokens at or past `kv_lengths[z]` are masked and their keys / values zeroed in
the kernel (they may hold anything); blocks wholly past it are skipped. The
custom VJP runs them for its segment groups with `shared_backward='mosaic_tpu'`;
tested in TPU interpret mode only (no TPU here). The default blocks are chosen
on paper (`ROOFLINE.md`, "Training"): with 128 the dK/dV kernel's streamed rows
(q, dO and the lane-replicated lse and delta, 1.5 KiB a row a kv block) would
make it memory bound; 512-token kv blocks and 512-row tiles leave both kernels
compute bound on v5e and v5p.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu.shared_segment_fwd import check_segments

LANES = 128  # lse and delta are stored lane-replicated at this width, as in the forward kernels


def _probs(kv_length, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, kv_block, scale):
  """(P, dS [bm, bs] float32, k, v with the masked tokens zeroed)."""
  block_s = k_ref.shape[0]
  token = kv_block * block_s + jax.lax.broadcasted_iota(jnp.int32, k_ref.shape, 0)
  k = jnp.where(token < kv_length, k_ref[...], jnp.zeros((), k_ref.dtype))
  v = jnp.where(token < kv_length, v_ref[...], jnp.zeros((), v_ref.dtype))
  contract_h = (((1,), (1,)), ((), ()))
  s = jax.lax.dot_general(q_ref[...], k, contract_h, preferred_element_type=jnp.float32) * scale
  col = kv_block * block_s + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
  p = jnp.where(col < kv_length, jnp.exp(s - lse_ref[:, :1]), 0.0)
  dp = jax.lax.dot_general(do_ref[...], v, contract_h, preferred_element_type=jnp.float32)
  return p, p * (dp - delta_ref[:, :1]), k, v


def _dkv_kernel(len_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, dk_ref, dv_ref,
                dk_acc, dv_acc, *, scale):
  # q_ref, do_ref [bm, H]; lse_ref, delta_ref [bm, 128]; k_ref, v_ref [bs, H];
  # dk_ref, dv_ref [bs, H] float32; dk_acc, dv_acc [bs, H] float32 scratch.
  kv_length = len_ref[pl.program_id(0)]
  kv_block, row_block = pl.program_id(2), pl.program_id(3)

  @pl.when(row_block == 0)
  def _init():
    dk_acc[...] = jnp.zeros_like(dk_acc)
    dv_acc[...] = jnp.zeros_like(dv_acc)

  @pl.when(kv_block * k_ref.shape[0] < kv_length)  # a block past the length stays zero
  def _accumulate():
    p, ds, _, _ = _probs(kv_length, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, kv_block,
                         scale)
    contract_m = (((0,), (0,)), ((), ()))
    dv_acc[...] += jax.lax.dot_general(p.astype(do_ref.dtype), do_ref[...], contract_m,
                                       preferred_element_type=jnp.float32)
    dk_acc[...] += jax.lax.dot_general(ds.astype(q_ref.dtype), q_ref[...], contract_m,
                                       preferred_element_type=jnp.float32) * scale

  @pl.when(row_block == pl.num_programs(3) - 1)
  def _finish():
    dk_ref[...] = dk_acc[...]
    dv_ref[...] = dv_acc[...]


def _dq_kernel(len_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, dq_ref, dq_acc, *,
               scale):
  # dq_ref [bm, H] float32; dq_acc [bm, H] float32 scratch.
  kv_length = len_ref[pl.program_id(0)]
  kv_block = pl.program_id(3)

  @pl.when(kv_block == 0)
  def _init():
    dq_acc[...] = jnp.zeros_like(dq_acc)

  @pl.when(kv_block * k_ref.shape[0] < kv_length)
  def _accumulate():
    _, ds, k, _ = _probs(kv_length, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, kv_block,
                         scale)
    dq_acc[...] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale

  @pl.when(kv_block == pl.num_programs(3) - 1)
  def _finish():
    dq_ref[...] = dq_acc[...]


def _check(q, k_cache, v_cache, d_out, lse, delta, kv_lengths):
  check_segments(q, k_cache, v_cache, kv_lengths)
  z, m, kh, _ = q.shape
  if d_out.shape != q.shape:
    raise ValueError(f'd_out must be [Z, M, K, H] = {q.shape}, got {d_out.shape}')
  for name, x in (('lse', lse), ('delta', delta)):
    if x.shape != (z, m, kh):
      raise ValueError(f'{name} must be [Z, M, K] = {(z, m, kh)}, got {x.shape}')


@functools.partial(jax.jit, static_argnames=('scale', 'block_rows', 'block_kv', 'interpret'))
def shared_segments_bwd(
    q: jax.Array,  # [Z, M, K, H]: each segment's rows x T x G query matrix rows per kv head
    k_cache: jax.Array,  # [Z, S, K, H]: each segment's keys
    v_cache: jax.Array,  # [Z, S, K, H]
    d_out: jax.Array,  # [Z, M, K, H]
    lse: jax.Array,  # [Z, M, K] float32: each row's merged lse (+inf on padding rows)
    delta: jax.Array,  # [Z, M, K] float32: rowsum(dO * O) - dlse
    kv_lengths: jax.Array,  # [Z] int32: tokens of each segment (<= S)
    *,
    scale: float,
    block_rows: int = 512,
    block_kv: int = 512,
    interpret=False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Returns (dq [Z, M, K, H], dk [Z, S, K, H], dv [Z, S, K, H]), all float32; tokens past a
  segment's length get zero dK, dV. Blocks larger than the problem shrink to it (rounded up to
  8 rows)."""
  _check(q, k_cache, v_cache, d_out, lse, delta, kv_lengths)
  z, m, kh, h = q.shape
  s = k_cache.shape[1]
  block_rows, block_kv = min(block_rows, -(-m // 8) * 8), min(block_kv, -(-s // 8) * 8)
  mp, sp = -(-m // block_rows) * block_rows, -(-s // block_kv) * block_kv
  heads_first = lambda x, n: jnp.pad(jnp.swapaxes(x, 1, 2),
                                     ((0, 0), (0, 0), (0, n - x.shape[1]), (0, 0)))
  lanes = lambda x, value: jnp.pad(
      jnp.broadcast_to(jnp.swapaxes(x, 1, 2)[..., None], (z, kh, m, LANES)),
      ((0, 0), (0, 0), (0, mp - m), (0, 0)), constant_values=value)
  args = (kv_lengths.astype(jnp.int32),
          heads_first(q, mp), heads_first(d_out.astype(q.dtype), mp),
          lanes(lse, jnp.inf), lanes(delta, 0.0),
          heads_first(k_cache, sp), heads_first(v_cache, sp))
  params = pltpu.CompilerParams(
      dimension_semantics=('parallel', 'parallel', 'parallel', 'arbitrary'))
  # dK, dV: a kv block's sums over every row block (the innermost axis).
  rows_spec = lambda width: pl.BlockSpec((None, None, block_rows, width),
                                         lambda z, k, i, j, *_: (z, k, j, 0))
  kv_spec = pl.BlockSpec((None, None, block_kv, h), lambda z, k, i, j, *_: (z, k, i, 0))
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, scale=scale),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(z, kh, sp // block_kv, mp // block_rows),
          in_specs=[rows_spec(h), rows_spec(h), rows_spec(LANES), rows_spec(LANES), kv_spec,
                    kv_spec],
          out_specs=[kv_spec, kv_spec],
          scratch_shapes=[pltpu.VMEM((block_kv, h), jnp.float32)] * 2,
      ),
      out_shape=[jax.ShapeDtypeStruct((z, kh, sp, h), jnp.float32)] * 2,
      compiler_params=params,
      interpret=interpret,
      name='hydrajax_shared_segment_dkv',
  )(*args)
  # dQ: the same products with the kv blocks innermost.
  rows_spec = lambda width: pl.BlockSpec((None, None, block_rows, width),
                                         lambda z, k, i, j, *_: (z, k, i, 0))
  kv_spec = pl.BlockSpec((None, None, block_kv, h), lambda z, k, i, j, *_: (z, k, j, 0))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, scale=scale),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(z, kh, mp // block_rows, sp // block_kv),
          in_specs=[rows_spec(h), rows_spec(h), rows_spec(LANES), rows_spec(LANES), kv_spec,
                    kv_spec],
          out_specs=rows_spec(h),
          scratch_shapes=[pltpu.VMEM((block_rows, h), jnp.float32)],
      ),
      out_shape=jax.ShapeDtypeStruct((z, kh, mp, h), jnp.float32),
      compiler_params=params,
      interpret=interpret,
      name='hydrajax_shared_segment_dq',
  )(*args)
  back = lambda x, n: jnp.swapaxes(x[:, :, :n], 1, 2)
  return back(dq, m), back(dk, s), back(dv, s)


def shared_segments_bwd_reference(q, k_cache, v_cache, d_out, lse, delta, kv_lengths, *, scale,
                                  block_rows: int = 512, block_kv: int = 512, interpret=False):
  """The same products in jnp (block sizes and interpret ignored)."""
  del block_rows, block_kv, interpret
  _check(q, k_cache, v_cache, d_out, lse, delta, kv_lengths)
  visible = jnp.arange(k_cache.shape[1])[None, :] < kv_lengths[:, None]  # [Z, S]
  zero = lambda x: jnp.where(visible[:, :, None, None], x, jnp.zeros((), x.dtype))
  k, v = zero(k_cache), zero(v_cache)
  hi = jax.lax.Precision.HIGHEST
  s = jnp.einsum('zmkh,zskh->zkms', q, k, preferred_element_type=jnp.float32,
                 precision=hi) * scale
  seen = visible[:, None, None, :]
  p = jnp.where(seen, jnp.exp(s - jnp.swapaxes(lse, 1, 2)[..., None]), 0.0)
  dp = jnp.einsum('zmkh,zskh->zkms', d_out, v, preferred_element_type=jnp.float32, precision=hi)
  ds = p * (dp - jnp.swapaxes(delta, 1, 2)[..., None])
  f32 = lambda x: x.astype(jnp.float32)
  dv = jnp.einsum('zkms,zmkh->zskh', p, f32(d_out), precision=hi)
  dk = jnp.einsum('zkms,zmkh->zskh', ds, f32(q), precision=hi) * scale
  dq = jnp.einsum('zkms,zskh->zmkh', ds, f32(k), precision=hi) * scale
  return dq, dk, dv
