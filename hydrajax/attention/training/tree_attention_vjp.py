"""Tree attention differentiable in q, k and v (`jax.custom_vjp`), the XLA path.

The forward pass is Hydragen's algorithm over a `TreeLayout` (as in
`hydrajax.tree_attention`): every shared segment is one GEMM whose M dimension
is its rows x T query tokens x the GQA group G, each row's private KV is
masked causal attention, and the partial states are LSE-merged into the rows.
It saves only (out, lse).

The backward pass recomputes the probabilities from the merged lse, as flash
attention does. Since a row's key sets are disjoint, the row's global
probabilities over one part (a segment or its private KV) are
`P = exp(S - lse)` on that part alone, and with `delta = rowsum(dO * O) - dlse`:

    dV_part = P^T dO        dS = P * (dO V^T - delta)
    dK_part = scale * dS^T Q      dQ += scale * dS K

A shared segment's dK and dV contract the M = rows x T x G dimension away in one
matmul per kv block: the prompt's gradient is accumulated once, never per row.
Both passes walk long segments in kv blocks (a scan), so memory is bounded by
one block of scores.

The index arrays both passes walk (`_parts`: each part's rows, kv tokens and causal limits;
`path_item_index`) are derived from the layout once, by `prepare_training_attention`
(`training_plan`), which also resolves the kernels (`_Kernels`); the custom
VJP (`_levels_attention`) takes them from its plans: one, or several over one K/V buffer (a tree
prefill's levels), whose dK / dV it sums in one float32 buffer.

`impl=MOSAIC_GPU` computes the shared segments' partial states (forward) and
their dQ, dK, dV (backward) with the Hopper kernels of
`pallas_kernels.mosaic_gpu.training_attention`, one call per segment group (its segments a
grid axis), and the private part (each row causal over its own pages) with their batched
causal mode, one call for all rows; the merge stays on XLA: each row gathers the states (and,
backward, the dQ) of the segments on its path and merges them with its own in one pass
(`hydrajax.tree_attention.path_item_index`). The private K/V are gathered into
[B, pages * page_size] first (`k_cache[part.tokens]`, one copy of the private K/V),
so any page layout works, contiguous or not, and T or page sizes that are no
block multiple are padded and masked in the kernels' wrappers.

`impl=MOSAIC_TPU` runs every part, forward and backward, in the Mosaic TPU kernels of
`pallas_kernels.tpu.training_attention`: a segment group's segments in one launch, and the
private part's rows in one launch, causal; the merge stays on XLA.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from hydrajax.shapes import AttentionShapes
from hydrajax.attention.dispatch import AttentionImpl
from hydrajax.layout import TreeLayout
from hydrajax.partial_state import PartialState, empty_state, merge_many, normalized
from hydrajax.attention.xla import merge_along_paths, merge_into_rows, sum_along_paths
from pallas_kernels.mosaic_gpu import training_attention as gpu_training
from pallas_kernels.tpu import training_attention as tpu_training


@dataclasses.dataclass(frozen=True)
class _Kernels:
  """Which kernels run (static; resolved by `prepare_training_attention`)."""

  # The parts' forward and the private (causal, per-row) part's backward: XLA, MOSAIC_GPU or
  # MOSAIC_TPU.
  impl: AttentionImpl
  # The shared segments' backward: XLA, MOSAIC_GPU or MOSAIC_TPU.
  shared_backward: AttentionImpl
  interpret: object  # the kernels' interpret mode (see prepare_training_attention)
  # The Mosaic GPU kernels' TrainingKernelConfig or the Mosaic TPU kernels' TrainingBlockSizes
  # (None: their defaults).
  config: object


def _precision(dtype):
  return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Part:
  """Queries of Z items (R rows each) against S kv tokens each, walked in blocks of `block`.

  rows [Z, R] int32 (B is the dump row), tokens [Z, S] int32 (indices into the buffer,
  S a multiple of `block`), limit [Z, M or 1] int32 (key position p is visible to query
  row m when p < limit[z, m]; M = R * T). A jit pytree (a plan's leaves; block, shared static).
  """

  rows: jax.Array
  tokens: jax.Array
  limit: jax.Array
  block: int = dataclasses.field(metadata=dict(static=True))
  # A segment group (limit [Z, 1]: the segments' lengths); else the private part, whose item z
  # is row z (rows [B, 1] = arange(B)).
  shared: bool = dataclasses.field(metadata=dict(static=True))


def _parts(layout: TreeLayout, shapes: AttentionShapes, kv_block: int) -> tuple[_Part, ...]:
  """The parts of a layout (`prepare_training_attention` derives them once per plan)."""
  b, t, length = shapes.num_rows, shapes.query_tokens, shapes.kv_tokens
  parts = []
  c = layout.page_size
  pages = layout.private_pages.shape[1]
  if pages * c > 0:
    # Private KV: one item per row, causal (the T queries are the last T tokens).
    tokens = (layout.private_pages[:, :, None] * c + jnp.arange(c)).reshape(b, -1)
    n = layout.private_lengths[:, None]
    limit = jnp.minimum(n - t + jnp.arange(t)[None, :] + 1, n)  # [B, T]
    parts.append(_blocked(jnp.arange(b)[:, None], tokens, limit, kv_block, length, False))
  for group in layout.groups:
    r = group.row_capacity
    rows = group.row_begin[:, None] + jnp.arange(r)[None, :]
    rows = jnp.where(jnp.arange(r)[None, :] < group.row_count[:, None], rows, b)  # [J, R]
    tokens = group.kv_start[:, None] + jnp.arange(group.kv_capacity)[None, :]
    parts.append(_blocked(rows, tokens, group.kv_length[:, None], kv_block, length, True))
  return tuple(parts)


def _blocked(rows, tokens, limit, kv_block, length, shared) -> _Part:
  s = tokens.shape[1]
  block = min(kv_block, s)
  padded = -(-s // block) * block
  tokens = jnp.pad(tokens, ((0, 0), (0, padded - s)))  # padding positions are >= limit
  return _Part(rows, jnp.clip(tokens, 0, length - 1), limit, block, shared)


def _fold(x, rows, kh):
  """x [B + 1, T, N, ...] at rows [Z, R] -> [Z, R * T, K, G, ...]."""
  y = x[rows]
  z, r, t, n = y.shape[:4]
  return y.reshape((z, r * t, kh, n // kh) + y.shape[4:])


def _block_kv(k_cache, v_cache, part: _Part, i):
  """Block i of a part: k, v [Z, S_b, K, H], tokens [Z, S_b], visible [Z, M or 1, 1, 1, S_b].

  Keys / values no query of the block sees are zeroed: padding may hold anything,
  NaN included, and 0 * NaN = NaN.
  """
  tok = jax.lax.dynamic_slice_in_dim(part.tokens, i * part.block, part.block, axis=1)
  pos = i * part.block + jnp.arange(part.block)
  visible = pos[None, None, :] < part.limit[..., None]  # [Z, M or 1, S_b]
  seen = jnp.any(visible, axis=1)[:, :, None, None]  # [Z, S_b, 1, 1]
  zero = lambda x: jnp.where(seen, x, jnp.zeros((), x.dtype))
  return zero(k_cache[tok]), zero(v_cache[tok]), tok, visible[:, :, None, None, :]


def _scores(qz, k, scale):
  return jnp.einsum('zmkgh,zskh->zmkgs', qz, k, preferred_element_type=jnp.float32,
                    precision=_precision(qz.dtype)) * scale


def _part_forward(q_pad, k_cache, v_cache, part: _Part, scale):
  """(out [Z, M, K, G, H] f32, lse [Z, M, K, G]) of one part, merged over its kv blocks."""
  kh = k_cache.shape[1]
  qz = _fold(q_pad, part.rows, kh)
  num_blocks = part.tokens.shape[1] // part.block

  def block(carry, i):
    out_a, lse_a = carry
    k, v, _, visible = _block_kv(k_cache, v_cache, part, i)
    s = jnp.where(visible, _scores(qz, k, scale), -jnp.inf)
    m = jnp.maximum(jnp.max(s, axis=-1), lse_a)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m[..., None])
    l = jnp.sum(p, axis=-1) + jnp.exp(lse_a - m)
    o = jnp.einsum('zmkgs,zskh->zmkgh', p.astype(v.dtype), v,
                   preferred_element_type=jnp.float32, precision=_precision(v_cache.dtype))
    o = o + jnp.exp(lse_a - m)[..., None] * out_a
    return normalized(o, l, m), None

  init = (jnp.zeros(qz.shape, jnp.float32), jnp.full(qz.shape[:-1], -jnp.inf, jnp.float32))
  if num_blocks == 1:
    (out, lse), _ = block(init, 0)
  else:
    (out, lse), _ = jax.lax.scan(block, init, jnp.arange(num_blocks))
  return out, lse


def _segments_args(x, kh):
  """x [Z, M, K, G, ...] (`_fold`) -> the segments' [Z, M, N, ...], N = K * G (kv-head major)."""
  return x.reshape(x.shape[:2] + (kh * x.shape[3],) + x.shape[4:])


def _part_forward_mosaic_gpu(q_pad, k_cache, v_cache, part: _Part, scale, kernels: _Kernels):
  """`_part_forward` of a segment group with the Mosaic GPU kernel, all its segments in one
  launch (`segments_forward`: the segments are a grid axis)."""
  kh = k_cache.shape[1]
  qz = _fold(q_pad, part.rows, kh)  # [Z, M, K, G, H]
  out, lse = gpu_training.segments_forward(
      _segments_args(qz, kh), k_cache[part.tokens], v_cache[part.tokens], part.limit[:, 0],
      scale=scale, interpret=kernels.interpret, config=kernels.config)
  return out.reshape(qz.shape), lse.reshape(qz.shape[:-1])  # merged in float32


def _tpu_args(q_pad, part: _Part, kh, *per_row):
  """A part's items for `pallas_kernels.tpu.training_attention`: q and each of `per_row`
  ([B + 1, T, N, ...]) folded to [Z, M * G, K, ...] (token-major, then the GQA group), the
  items' lengths [Z], and causal (T, G) for the private part (None for a segment group)."""
  folded = [_fold(x, part.rows, kh) for x in (q_pad,) + per_row]  # [Z, M, K, G, ...]
  z, m, _, g = folded[0].shape[:4]
  rows_first = lambda x: jnp.swapaxes(x, 2, 3).reshape((z, m * g, kh) + x.shape[4:])
  causal = None if part.shared else (m, g)  # the private part: one row an item, M = T
  return [rows_first(x) for x in folded], part.limit[:, -1], causal


def _from_tpu(x, part: _Part, kh, t):
  """[Z, M * G, K, ...] -> `_fold`'s [Z, M, K, G, ...] (M = R * T)."""
  z, mg = x.shape[:2]
  m = part.rows.shape[1] * t
  return jnp.swapaxes(x.reshape((z, m, mg // m, kh) + x.shape[3:]), 2, 3)


def _tpu_blocks(kernels: _Kernels) -> dict:
  """The TPU kernels' block sizes from the plan's config (their defaults without one)."""
  config = kernels.config if isinstance(kernels.config, tpu_training.TrainingBlockSizes) else None
  return {} if config is None else dataclasses.asdict(config)


def _part_forward_mosaic_tpu(q_pad, k_cache, v_cache, part: _Part, scale, kernels: _Kernels):
  """`_part_forward` with the Mosaic TPU kernel, all of the part's items in one launch: a
  segment group's segments, or the private part's rows, causal."""
  kh, t = k_cache.shape[1], q_pad.shape[1]
  (q,), lengths, causal = _tpu_args(q_pad, part, kh)
  out, lse = tpu_training.segments_forward(q, k_cache[part.tokens], v_cache[part.tokens], lengths,
                              scale=scale, causal=causal, interpret=kernels.interpret,
                              **_tpu_blocks(kernels))
  return _from_tpu(out, part, kh, t), _from_tpu(lse, part, kh, t)


def _private_args(q_pad, part: _Part):
  """Queries [B, T, N, H] of a private part (one row per item) and each row's length [B].

  The last query's causal limit is the row's private length (see `_parts`).
  """
  return q_pad[part.rows[:, 0]], part.limit[:, -1]


def _private_forward_mosaic_gpu(q_pad, k_cache, v_cache, part: _Part, scale, kernels: _Kernels):
  """`_part_forward` of the private part with the batched causal kernel, all rows in one call."""
  q, lengths = _private_args(q_pad, part)
  b, t, n, h = q.shape
  kh = k_cache.shape[1]
  out, lse = gpu_training.causal_forward(q, k_cache[part.tokens], v_cache[part.tokens], lengths,
                                         scale=scale, interpret=kernels.interpret,
                                         config=kernels.config)
  return out.reshape(b, t, kh, n // kh, h), lse.reshape(b, t, kh, n // kh)


def _forward(q, k_cache, v_cache, parts, index, scale, kernels: _Kernels):
  b, t, n, h = q.shape
  q_pad = jnp.concatenate([q, jnp.zeros((1,) + q.shape[1:], q.dtype)])
  gpu = kernels.impl is AttentionImpl.MOSAIC_GPU
  tpu = kernels.impl is AttentionImpl.MOSAIC_TPU
  if not parts:  # no keys at all
    return PartialState(jnp.zeros(q.shape, q.dtype), jnp.full(q.shape[:-1], -jnp.inf))
  # The private state is each row's own; the groups' states are gathered along each row's
  # path (`path_item_index`) and merged with it in one pass, or, in a layout without paths,
  # scattered into their rows.
  states, rows, outs, lses = [], [], [], []
  for part in parts:
    if gpu and part.shared:
      out, lse = _part_forward_mosaic_gpu(q_pad, k_cache, v_cache, part, scale, kernels)
    elif gpu:
      out, lse = _private_forward_mosaic_gpu(q_pad, k_cache, v_cache, part, scale, kernels)
    elif tpu:
      out, lse = _part_forward_mosaic_tpu(q_pad, k_cache, v_cache, part, scale, kernels)
    else:
      out, lse = _part_forward(q_pad, k_cache, v_cache, part, scale)
    if not part.shared:  # row z's own: merged elementwise, not scattered
      states.append(PartialState(out.reshape(b, t, n, h), lse.reshape(b, t, n)))
      continue
    z, r = part.rows.shape
    rows.append(part.rows.reshape(-1))
    outs.append(out.reshape(z * r, t, n, h))
    lses.append(lse.reshape(z * r, t, n))
  if rows and index is not None:
    private = states[0] if states else empty_state(q.shape)
    return merge_along_paths(private, index, jnp.concatenate(outs), jnp.concatenate(lses),
                             out_dtype=q.dtype)
  if rows:
    states.append(merge_into_rows(b, jnp.concatenate(rows), jnp.concatenate(outs),
                                  jnp.concatenate(lses)))
  return merge_many(states, out_dtype=q.dtype)


def _part_backward(q_pad, do_pad, lse_pad, delta_pad, k_cache, v_cache, part: _Part, scale,
                   dk, dv):
  """dQ [Z, M, K, G, H] f32 of one part; adds the part's dK, dV into dk, dv [L, K, H] f32."""
  kh = k_cache.shape[1]
  qz = _fold(q_pad, part.rows, kh)
  doz = _fold(do_pad, part.rows, kh)
  lsez = _fold(lse_pad, part.rows, kh)  # [Z, M, K, G]
  deltaz = _fold(delta_pad, part.rows, kh)
  num_blocks = part.tokens.shape[1] // part.block
  prec = _precision(q_pad.dtype)

  def block(carry, i):
    dq, dk, dv = carry
    k, v, tok, visible = _block_kv(k_cache, v_cache, part, i)
    s = _scores(qz, k, scale)
    # Rows without keys have lse = -inf and no visible key; the dump row has lse = +inf.
    p = jnp.where(visible, jnp.exp(s - lsez[..., None]), 0.0)  # [Z, M, K, G, S_b]
    dp = jnp.einsum('zmkgh,zskh->zmkgs', doz, v, preferred_element_type=jnp.float32,
                    precision=prec)
    ds = p * (dp - deltaz[..., None])
    # One matmul per part and block: M (rows x T) and G are contracted away.
    dv_b = jnp.einsum('zmkgs,zmkgh->zskh', p.astype(doz.dtype), doz,
                      preferred_element_type=jnp.float32, precision=prec)
    dk_b = jnp.einsum('zmkgs,zmkgh->zskh', ds.astype(qz.dtype), qz,
                      preferred_element_type=jnp.float32, precision=prec) * scale
    dq = dq + jnp.einsum('zmkgs,zskh->zmkgh', ds.astype(k.dtype), k,
                         preferred_element_type=jnp.float32, precision=prec) * scale
    # Padding positions carry zero gradient (p = 0), so their clamped indices add nothing.
    dk = dk.at[tok].add(dk_b)
    dv = dv.at[tok].add(dv_b)
    return (dq, dk, dv), None

  init = (jnp.zeros(qz.shape, jnp.float32), dk, dv)
  if num_blocks == 1:
    (dq, dk, dv), _ = block(init, 0)
  else:
    (dq, dk, dv), _ = jax.lax.scan(block, init, jnp.arange(num_blocks))
  return dq, dk, dv


def _part_backward_mosaic_tpu(q_pad, do_pad, lse_pad, delta_pad, k_cache, v_cache, part: _Part,
                              scale, dk, dv, kernels: _Kernels):
  """`_part_backward` with the Mosaic TPU kernels, all of the part's items in one call, which
  reduces each item's dK, dV over its rows and GQA heads in the kernel."""
  kh, t = k_cache.shape[1], q_pad.shape[1]
  (q, do, lse, delta), lengths, causal = _tpu_args(q_pad, part, kh, do_pad, lse_pad, delta_pad)
  dq, dk_z, dv_z = tpu_training.segments_backward(
      q, k_cache[part.tokens], v_cache[part.tokens], do, lse, delta, lengths, scale=scale,
      causal=causal, interpret=kernels.interpret, **_tpu_blocks(kernels))
  # Tokens no query sees (past a length, the blocks' clamped padding) get exact zeros.
  dk = dk.at[part.tokens].add(dk_z)
  dv = dv.at[part.tokens].add(dv_z)
  return _from_tpu(dq, part, kh, t), dk, dv


def _part_backward_mosaic_gpu(q_pad, do_pad, lse_pad, delta_pad, k_cache, v_cache, part: _Part,
                              scale, dk, dv, kernels: _Kernels):
  """`_part_backward` of a segment group with the Mosaic GPU kernels, all its segments in one
  call (`segments_backward`: the segments a grid axis), which reduces dK, dV over each
  segment's rows and GQA heads in the kernel."""
  kh = k_cache.shape[1]
  folded = [_fold(x, part.rows, kh) for x in (q_pad, do_pad, lse_pad, delta_pad)]  # [Z, M, K, G..]
  q, do, lse, delta = [_segments_args(x, kh) for x in folded]
  dq, dk_z, dv_z = gpu_training.segments_backward(
      q, k_cache[part.tokens], v_cache[part.tokens], do, lse, delta, part.limit[:, 0],
      scale=scale, interpret=kernels.interpret, config=kernels.config, dq_dtype=jnp.float32)
  # Positions past a segment's length get exact zeros (their tokens belong to others).
  dk = dk.at[part.tokens].add(dk_z.astype(jnp.float32))
  dv = dv.at[part.tokens].add(dv_z.astype(jnp.float32))
  return dq.reshape(folded[0].shape), dk, dv


def _private_backward_mosaic_gpu(q_pad, do_pad, lse_pad, delta_pad, k_cache, v_cache,
                                 part: _Part, scale, dk, dv, kernels: _Kernels):
  """`_part_backward` of the private part with the batched causal kernels, all rows in one call.

  Each row's dK, dV are summed over its queries and GQA heads in the kernel.
  """
  q, lengths = _private_args(q_pad, part)
  rows = part.rows[:, 0]
  b, t, n, h = q.shape
  kh = k_cache.shape[1]
  dq, dk_b, dv_b = gpu_training.causal_backward(
      q, k_cache[part.tokens], v_cache[part.tokens], do_pad[rows], lse_pad[rows],
      delta_pad[rows], lengths, scale=scale, interpret=kernels.interpret, config=kernels.config)
  # Positions past a row's length (and the block padding's clamped tokens) get exact zeros.
  dk = dk.at[part.tokens].add(dk_b.astype(jnp.float32))
  dv = dv.at[part.tokens].add(dv_b.astype(jnp.float32))
  return dq.astype(jnp.float32).reshape(b, t, kh, n // kh, h), dk, dv


def _backward(q, k_cache, v_cache, parts, index, out, lse, d_out, d_lse, scale,
              kernels: _Kernels, dk, dv):
  """(dQ in q's dtype, dk, dv): this plan's dK, dV added into dk, dv [L, K, H] float32."""
  b, t, n, h = q.shape
  pad = lambda x, value: jnp.concatenate([x, jnp.full((1,) + x.shape[1:], value, x.dtype)])
  # The forward wrote `out`: read it. Without the barrier XLA fused the forward's merge into
  # this reduction, recomputing it there.
  out = jax.lax.optimization_barrier(out)
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, N]
  if d_lse is not None:
    delta = delta - d_lse
  q_pad, do_pad = pad(q, 0), pad(d_out.astype(q.dtype), 0)
  lse_pad, delta_pad = pad(lse, jnp.inf), pad(delta, 0)
  dq = None  # [B, T, N, H] float32: the private part's, then each group's added at its rows
  dq_items = []  # with paths: the groups' dq, gathered by each row after the loop
  for part in parts:
    if part.shared and kernels.shared_backward is AttentionImpl.MOSAIC_TPU:
      dq_z, dk, dv = _part_backward_mosaic_tpu(q_pad, do_pad, lse_pad, delta_pad, k_cache,
                                               v_cache, part, scale, dk, dv, kernels)
    elif part.shared and kernels.shared_backward is AttentionImpl.MOSAIC_GPU:
      dq_z, dk, dv = _part_backward_mosaic_gpu(q_pad, do_pad, lse_pad, delta_pad, k_cache,
                                               v_cache, part, scale, dk, dv, kernels)
    elif not part.shared and kernels.impl is AttentionImpl.MOSAIC_GPU:
      dq_z, dk, dv = _private_backward_mosaic_gpu(q_pad, do_pad, lse_pad, delta_pad, k_cache,
                                                  v_cache, part, scale, dk, dv, kernels)
    elif not part.shared and kernels.impl is AttentionImpl.MOSAIC_TPU:
      dq_z, dk, dv = _part_backward_mosaic_tpu(q_pad, do_pad, lse_pad, delta_pad, k_cache,
                                               v_cache, part, scale, dk, dv, kernels)
    else:
      dq_z, dk, dv = _part_backward(q_pad, do_pad, lse_pad, delta_pad, k_cache, v_cache, part,
                                    scale, dk, dv)
    z, r = part.rows.shape
    if not part.shared:  # row z's own: no scatter
      dq = dq_z.reshape(b, t, n, h) if dq is None else dq + dq_z.reshape(b, t, n, h)
      continue
    if index is not None:
      dq_items.append(dq_z.reshape(z * r, t, n, h))
      continue
    dq = jnp.zeros((b, t, n, h), jnp.float32) if dq is None else dq
    # The dump row (index B) is past the end: its updates are dropped.
    dq = dq.at[part.rows.reshape(-1)].add(dq_z.reshape(z * r, t, n, h), mode='drop')
  if dq_items:
    dense = jnp.zeros((b, t, n, h), jnp.float32) if dq is None else dq
    dq = sum_along_paths(dense, index, jnp.concatenate(dq_items))
  if dq is None:  # no keys at all
    dq = jnp.zeros((b, t, n, h), jnp.float32)
  return dq.astype(q.dtype), dk, dv


def _zero_cotangent(x):
  return np.zeros(x.shape, jax.dtypes.float0)


def _levels_forward(level_q, k_cache, v_cache, level_parts, level_index, scale, level_kernels):
  return tuple(_forward(q, k_cache, v_cache, parts, index, scale, kernels) for q, parts, index,
               kernels in zip(level_q, level_parts, level_index, level_kernels))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _levels_attention(level_q, k_cache, v_cache, level_parts, level_index, scale, level_kernels):
  """The custom VJP over one or more plans (parts, path index [B, D] or None, kernels) on one
  K/V buffer, e.g. the levels of a tree prefill: each plan's state (see the module doc); the
  backward adds every plan's dK, dV into one float32 buffer."""
  return _levels_forward(level_q, k_cache, v_cache, level_parts, level_index, scale,
                         level_kernels)


def _levels_attention_fwd(level_q, k_cache, v_cache, level_parts, level_index, scale,
                          level_kernels):
  states = _levels_forward(level_q, k_cache, v_cache, level_parts, level_index, scale,
                           level_kernels)
  return states, (level_q, k_cache, v_cache, level_parts, level_index, states)


def _levels_attention_bwd(scale, level_kernels, residuals, cotangents):
  level_q, k_cache, v_cache, level_parts, level_index, states = residuals
  dk = jnp.zeros(k_cache.shape, jnp.float32)
  dv = jnp.zeros(v_cache.shape, jnp.float32)
  dqs = []
  for q, parts, index, state, (d_out, d_lse), kernels in zip(
      level_q, level_parts, level_index, states, cotangents, level_kernels):
    dq, dk, dv = _backward(q, k_cache, v_cache, parts, index, state.out, state.lse, d_out,
                           d_lse, scale, kernels, dk, dv)
    dqs.append(dq)
  return (tuple(dqs), dk.astype(k_cache.dtype), dv.astype(v_cache.dtype),
          jax.tree.map(_zero_cotangent, level_parts), jax.tree.map(_zero_cotangent, level_index))


_levels_attention.defvjp(_levels_attention_fwd, _levels_attention_bwd)
