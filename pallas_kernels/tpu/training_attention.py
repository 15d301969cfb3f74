"""Mosaic TPU kernels for training attention: a group of items' forward and backward passes.

`hydrajax.attention.training.tree_attention_differentiable` with `impl=MOSAIC_TPU` runs its
parts here:

* a group of shared segments (`segments_forward`, `segments_backward`): for each segment z,
  the queries of every row it covers, times their T tokens and the GQA group G, are one matrix
  of M rows per kv head, attended against the segment's first `kv_lengths[z]` tokens;
* the private part (the same calls with `causal=(T, G)`): item z is row z's own tokens, its
  T * G query rows token-major (row r is token r // G), and token t sees the first
  `kv_lengths[z] - T + t + 1` of them (the T queries are the row's last T tokens).

The items are the outermost grid axis (one launch a group). The forward keeps the running
state (`online_softmax`) in VMEM while K/V blocks stream through (the innermost, reduction
axis) and returns each item's partial state (out, lse), which XLA merges into the rows. The
backward recomputes from the rows' merged lse and delta = rowsum(dO * O) - dlse, as flash
attention does:

    P = exp(Q K^T * scale - lse)      dS = P * (dO V^T - delta)
    dV = P^T dO      dK = scale * dS^T Q      dQ = scale * dS K

`_dkv_kernel` walks the row blocks innermost and accumulates an item's dK and dV in VMEM, so a
prompt's gradient is reduced over all of its rows inside the kernel and written once per kv
block, never per row; `_dq_kernel` is the transposed walk. A TPU has no atomic add to global
memory, so dQ keeps its own pass (as in `jax.experimental.pallas.ops.tpu.flash_attention`).

Tokens no query of a block sees are masked and their values zeroed (they may hold anything);
blocks that no query sees are skipped, and blocks every query sees wholly skip the mask. Tested
in TPU interpret mode only (no TPU here). The default blocks are chosen on paper
(`ROOFLINE.md`, "Training"): a row tile re-reads its item's K/V (bm FLOP/byte), and the dK/dV
kernel re-reads every row's q, dO, lse and delta per kv block; 512-row tiles and 512-token kv
blocks leave all three kernels compute bound on v5e and v5p, where 128 would not.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu import online_softmax as osm

CONTRACT_ROWS = (((0,), (0,)), ((), ()))  # a [M, S]^T . b [M, H] -> [S, H]


@dataclasses.dataclass(frozen=True)
class TrainingBlockSizes:
  """The kernels' tiles, tuned through `kernel_config=` of `prepare_training_attention` (and the
  prefill and tree-prefill entries) with impl or shared_backward MOSAIC_TPU. Each shrinks to
  the problem when that is smaller. The defaults are chosen on paper (module doc)."""

  block_rows: int = 512  # query-matrix rows a tile
  block_kv: int = 512  # kv tokens a block

  def __post_init__(self):
    for name in ('block_rows', 'block_kv'):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 8 or value % 8:
        raise ValueError(f'{name} must be a positive multiple of 8, got {value!r}')


def _blocks(row_block, kv_block, bm, bs, length, causal):
  """(any query of the block sees a token of it, every query sees all of it), traced bools."""
  start, end = kv_block * bs, (kv_block + 1) * bs
  if causal is None:
    return start < length, end <= length
  t, g = causal
  first = length - t + 1  # tokens the block's queries see: first + token, token = row // g
  low = first + row_block * bm // g
  high = first + jnp.minimum((row_block * bm + bm - 1) // g, t - 1)
  return (start < length) & (start < high), (end <= length) & (end <= low)


def _visible(row_block, kv_block, shape, length, causal):
  """[bm, bs] bool: which of the block's (query row, token) pairs attend."""
  col = kv_block * shape[1] + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  visible = col < length
  if causal is not None:
    t, g = causal
    row = row_block * shape[0] + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    visible &= col < length - t + 1 + row // g
  return visible


def _zero_past(ref, kv_block, length):
  """ref's [bs, H] block with the tokens at or past `length` zeroed (0 * NaN would be NaN)."""
  token = kv_block * ref.shape[0] + jax.lax.broadcasted_iota(jnp.int32, ref.shape, 0)
  return jnp.where(token < length, ref[...], jnp.zeros((), ref.dtype))


def _on_blocks(row_block, kv_block, bm, bs, length, causal, step):
  """Runs step(masked) on the block where any of its pairs attend (masked unless all do)."""
  attended, whole = _blocks(row_block, kv_block, bm, bs, length, causal)
  pl.when(attended & whole)(lambda: step(False))
  pl.when(attended & ~whole)(lambda: step(True))


def _forward_kernel(len_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, m_ref, l_ref, acc_ref, *,
                    scale, causal):
  # q_ref [bm, H]; k_ref, v_ref [bs, H]; out_ref [bm, H] float32; lse_ref [bm, 128] float32.
  row_block, kv_block = pl.program_id(2), pl.program_id(3)
  length = len_ref[pl.program_id(0)]
  shape = (q_ref.shape[0], k_ref.shape[0])

  @pl.when(kv_block == 0)
  def _init():
    osm.reset(m_ref, l_ref, acc_ref)

  def step(masked):  # unmasked: the online-softmax fast path, every value in the block real
    v = _zero_past(v_ref, kv_block, length) if masked else v_ref[...]
    visible = _visible(row_block, kv_block, shape, length, causal) if masked else None
    osm.update(q_ref[...], k_ref[...], v, visible, m_ref, l_ref, acc_ref, scale=scale)

  _on_blocks(row_block, kv_block, *shape, length, causal, step)

  @pl.when(kv_block == pl.num_programs(3) - 1)
  def _finish():
    out_ref[...], lse_ref[...] = osm.finish(m_ref, l_ref, acc_ref)


def _probs(refs, row_block, kv_block, length, scale, causal, masked):
  """(P, dS [bm, bs] float32, k): the backward's recomputation over one block."""
  q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref = refs
  k, v = k_ref[...], v_ref[...]
  if masked:
    k, v = _zero_past(k_ref, kv_block, length), _zero_past(v_ref, kv_block, length)
  s = jax.lax.dot_general(q_ref[...], k, osm.TRANS_B, preferred_element_type=jnp.float32)
  p = jnp.exp(s * scale - lse_ref[:, :1])
  if masked:
    p = jnp.where(_visible(row_block, kv_block, s.shape, length, causal), p, 0.0)
  dp = jax.lax.dot_general(do_ref[...], v, osm.TRANS_B, preferred_element_type=jnp.float32)
  return p, p * (dp - delta_ref[:, :1]), k


def _dkv_kernel(len_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, dk_ref, dv_ref,
                dk_acc, dv_acc, *, scale, causal):
  # q_ref, do_ref [bm, H]; lse_ref, delta_ref [bm, 128]; k_ref, v_ref [bs, H];
  # dk_ref, dv_ref [bs, H] float32; dk_acc, dv_acc [bs, H] float32 scratch.
  kv_block, row_block = pl.program_id(2), pl.program_id(3)
  length = len_ref[pl.program_id(0)]
  refs = (q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref)

  @pl.when(row_block == 0)
  def _init():
    dk_acc[...] = jnp.zeros_like(dk_acc)
    dv_acc[...] = jnp.zeros_like(dv_acc)

  def step(masked):
    p, ds, _ = _probs(refs, row_block, kv_block, length, scale, causal, masked)
    dv_acc[...] += jax.lax.dot_general(p.astype(do_ref.dtype), do_ref[...], CONTRACT_ROWS,
                                       preferred_element_type=jnp.float32)
    dk_acc[...] += jax.lax.dot_general(ds.astype(q_ref.dtype), q_ref[...], CONTRACT_ROWS,
                                       preferred_element_type=jnp.float32) * scale

  _on_blocks(row_block, kv_block, q_ref.shape[0], k_ref.shape[0], length, causal, step)

  @pl.when(row_block == pl.num_programs(3) - 1)
  def _finish():
    dk_ref[...] = dk_acc[...]
    dv_ref[...] = dv_acc[...]


def _dq_kernel(len_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, dq_ref, dq_acc, *,
               scale, causal):
  # dq_ref [bm, H] float32; dq_acc [bm, H] float32 scratch.
  row_block, kv_block = pl.program_id(2), pl.program_id(3)
  length = len_ref[pl.program_id(0)]
  refs = (q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref)

  @pl.when(kv_block == 0)
  def _init():
    dq_acc[...] = jnp.zeros_like(dq_acc)

  def step(masked):
    _, ds, k = _probs(refs, row_block, kv_block, length, scale, causal, masked)
    dq_acc[...] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale

  _on_blocks(row_block, kv_block, q_ref.shape[0], k_ref.shape[0], length, causal, step)

  @pl.when(kv_block == pl.num_programs(3) - 1)
  def _finish():
    dq_ref[...] = dq_acc[...]


def _check(q, k_cache, v_cache, kv_lengths, causal, **per_row):
  """ValueError naming the argument unless q [Z, M, K, H], K/V [Z, S, K, H], kv_lengths [Z],
  `per_row` arrays (d_out [Z, M, K, H]; lse, delta [Z, M, K]) and causal (T, G) with M = T G."""
  if q.ndim != 4:
    raise ValueError(f'q must be [Z, M, K, H] (items, query rows, kv heads, head dim), got '
                     f'{q.shape}')
  z, m, kh, h = q.shape
  if k_cache.ndim != 4 or k_cache.shape[0] != z or k_cache.shape[2:] != (kh, h):
    raise ValueError(f'k_cache must be [Z={z}, S, K={kh}, H={h}], got {k_cache.shape}')
  if v_cache.shape != k_cache.shape:
    raise ValueError(f'v_cache must be k_cache\'s shape {k_cache.shape}, got {v_cache.shape}')
  if kv_lengths.shape != (z,):
    raise ValueError(f'kv_lengths must be [Z] = ({z},), got {kv_lengths.shape}')
  for name, x in per_row.items():
    want = q.shape if name == 'd_out' else (z, m, kh)
    if x.shape != want:
      raise ValueError(f'{name} must be {want}, got {x.shape}')
  if causal is not None and (len(causal) != 2 or causal[0] * causal[1] != m):
    raise ValueError(f'causal must be (T, G) with T * G = M = {m} query rows an item, got '
                     f'{causal}')


def _layout(z, m, kh, s, block_rows, block_kv):
  """(blocks shrunk to the problem, rounded up to 8 rows; padded M, S; heads-first pad)."""
  block_rows, block_kv = min(block_rows, -(-m // 8) * 8), min(block_kv, -(-s // 8) * 8)
  mp, sp = -(-m // block_rows) * block_rows, -(-s // block_kv) * block_kv
  heads_first = lambda x, n: jnp.pad(jnp.swapaxes(x, 1, 2),
                                     ((0, 0), (0, 0), (0, n - x.shape[1]), (0, 0)))
  return block_rows, block_kv, mp, sp, heads_first


def _specs(block_rows, block_kv, h, rows_axis, kv_axis):
  """BlockSpecs of a row block (width wide) and a kv block over a grid (z, k, i, j), rows and
  kv blocks taken from grid axes `rows_axis` and `kv_axis`."""
  rows = lambda width: pl.BlockSpec((None, None, block_rows, width),
                                    lambda *g: (g[0], g[1], g[rows_axis], 0))
  kv = pl.BlockSpec((None, None, block_kv, h), lambda *g: (g[0], g[1], g[kv_axis], 0))
  return rows, kv


_PARAMS = pltpu.CompilerParams(dimension_semantics=('parallel', 'parallel', 'parallel',
                                                    'arbitrary'))


@functools.partial(jax.jit, static_argnames=('scale', 'causal', 'block_rows', 'block_kv',
                                             'interpret'))
def segments_forward(
    q: jax.Array,  # [Z, M, K, H]: each item's query matrix rows per kv head
    k_cache: jax.Array,  # [Z, S, K, H]: each item's keys
    v_cache: jax.Array,  # [Z, S, K, H]
    kv_lengths: jax.Array,  # [Z] int32: tokens of each item (<= S)
    *,
    scale: float,
    causal: tuple[int, int] | None = None,
    block_rows: int = 512,
    block_kv: int = 512,
    interpret=False,
) -> tuple[jax.Array, jax.Array]:
  """Each item's partial state (out [Z, M, K, H], lse [Z, M, K]), float32; a query that sees
  no token gives (0, -inf). causal: (T, G) for items of one row each (see the module doc).
  Blocks larger than the problem shrink to it."""
  _check(q, k_cache, v_cache, kv_lengths, causal)
  z, m, kh, h = q.shape
  block_rows, block_kv, mp, sp, heads_first = _layout(z, m, kh, k_cache.shape[1], block_rows,
                                                      block_kv)
  rows, kv = _specs(block_rows, block_kv, h, rows_axis=2, kv_axis=3)
  out, lse = pl.pallas_call(
      functools.partial(_forward_kernel, scale=scale, causal=causal),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(z, kh, mp // block_rows, sp // block_kv),
          in_specs=[rows(h), kv, kv],
          out_specs=[rows(h), rows(osm.LANES)],
          scratch_shapes=[pltpu.VMEM((block_rows, osm.LANES), jnp.float32)] * 2
          + [pltpu.VMEM((block_rows, h), jnp.float32)],
      ),
      out_shape=[jax.ShapeDtypeStruct((z, kh, mp, h), jnp.float32),
                 jax.ShapeDtypeStruct((z, kh, mp, osm.LANES), jnp.float32)],
      compiler_params=_PARAMS,
      interpret=interpret,
      name='hydrajax_training_forward',
  )(kv_lengths.astype(jnp.int32), heads_first(q, mp), heads_first(k_cache, sp),
    heads_first(v_cache, sp))
  return jnp.swapaxes(out[:, :, :m], 1, 2), jnp.swapaxes(lse[:, :, :m, 0], 1, 2)


@functools.partial(jax.jit, static_argnames=('scale', 'causal', 'block_rows', 'block_kv',
                                             'interpret'))
def segments_backward(
    q: jax.Array,  # [Z, M, K, H]
    k_cache: jax.Array,  # [Z, S, K, H]
    v_cache: jax.Array,  # [Z, S, K, H]
    d_out: jax.Array,  # [Z, M, K, H]
    lse: jax.Array,  # [Z, M, K] float32: each query row's merged lse (+inf on padding rows)
    delta: jax.Array,  # [Z, M, K] float32: rowsum(dO * O) - dlse
    kv_lengths: jax.Array,  # [Z] int32
    *,
    scale: float,
    causal: tuple[int, int] | None = None,
    block_rows: int = 512,
    block_kv: int = 512,
    interpret=False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(dq [Z, M, K, H], dk [Z, S, K, H], dv [Z, S, K, H]), all float32; tokens no query sees
  get zero dK, dV. Arguments as in `segments_forward`."""
  _check(q, k_cache, v_cache, kv_lengths, causal, d_out=d_out, lse=lse, delta=delta)
  z, m, kh, h = q.shape
  s = k_cache.shape[1]
  block_rows, block_kv, mp, sp, heads_first = _layout(z, m, kh, s, block_rows, block_kv)
  lanes = lambda x, value: jnp.pad(
      jnp.broadcast_to(jnp.swapaxes(x, 1, 2)[..., None], (z, kh, m, osm.LANES)),
      ((0, 0), (0, 0), (0, mp - m), (0, 0)), constant_values=value)
  args = (kv_lengths.astype(jnp.int32),
          heads_first(q, mp), heads_first(d_out.astype(q.dtype), mp),
          lanes(lse, jnp.inf), lanes(delta, 0.0),
          heads_first(k_cache, sp), heads_first(v_cache, sp))
  kernel = lambda body: functools.partial(body, scale=scale, causal=causal)
  # dK, dV: a kv block's sums over every row block (the innermost axis).
  rows, kv = _specs(block_rows, block_kv, h, rows_axis=3, kv_axis=2)
  dk, dv = pl.pallas_call(
      kernel(_dkv_kernel),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(z, kh, sp // block_kv, mp // block_rows),
          in_specs=[rows(h), rows(h), rows(osm.LANES), rows(osm.LANES), kv, kv],
          out_specs=[kv, kv],
          scratch_shapes=[pltpu.VMEM((block_kv, h), jnp.float32)] * 2,
      ),
      out_shape=[jax.ShapeDtypeStruct((z, kh, sp, h), jnp.float32)] * 2,
      compiler_params=_PARAMS,
      interpret=interpret,
      name='hydrajax_training_dkv',
  )(*args)
  # dQ: the same products with the kv blocks innermost.
  rows, kv = _specs(block_rows, block_kv, h, rows_axis=2, kv_axis=3)
  dq = pl.pallas_call(
      kernel(_dq_kernel),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(z, kh, mp // block_rows, sp // block_kv),
          in_specs=[rows(h), rows(h), rows(osm.LANES), rows(osm.LANES), kv, kv],
          out_specs=rows(h),
          scratch_shapes=[pltpu.VMEM((block_rows, h), jnp.float32)],
      ),
      out_shape=jax.ShapeDtypeStruct((z, kh, mp, h), jnp.float32),
      compiler_params=_PARAMS,
      interpret=interpret,
      name='hydrajax_training_dq',
  )(*args)
  back = lambda x, n: jnp.swapaxes(x[:, :, :n], 1, 2)
  return back(dq, m), back(dk, s), back(dv, s)


def _reference_visible(q, k_cache, kv_lengths, causal):
  """[Z, 1, M, S] bool: which (query row, token) pairs attend."""
  m, s = q.shape[1], k_cache.shape[1]
  col = jnp.arange(s)[None, None, :]
  length = kv_lengths[:, None, None]
  visible = col < length
  if causal is not None:
    t, g = causal
    visible = visible & (col < length - t + 1 + (jnp.arange(m) // g)[None, :, None])
  return jnp.broadcast_to(visible, (q.shape[0], m, s))[:, None]


def segments_forward_reference(q, k_cache, v_cache, kv_lengths, *, scale, causal=None,
                               block_rows: int = 512, block_kv: int = 512, interpret=False):
  """`segments_forward` in jnp (block sizes and interpret ignored)."""
  del block_rows, block_kv, interpret
  _check(q, k_cache, v_cache, kv_lengths, causal)
  visible = _reference_visible(q, k_cache, kv_lengths, causal)  # [Z, 1, M, S]
  seen = jnp.any(visible, axis=2)[:, 0, :, None, None]  # [Z, S, 1, 1]
  v = jnp.where(seen, v_cache, jnp.zeros((), v_cache.dtype))
  hi = jax.lax.Precision.HIGHEST
  s = jnp.einsum('zmkh,zskh->zkms', q, k_cache, preferred_element_type=jnp.float32,
                 precision=hi) * scale
  s = jnp.where(visible, s, -jnp.inf)
  lse = jax.nn.logsumexp(s, axis=-1)  # [Z, K, M]; -inf where a query sees nothing
  p = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
  out = jnp.einsum('zkms,zskh->zmkh', p, v.astype(jnp.float32), precision=hi)
  return out, jnp.swapaxes(lse, 1, 2)


def segments_backward_reference(q, k_cache, v_cache, d_out, lse, delta, kv_lengths, *, scale,
                                causal=None, block_rows: int = 512, block_kv: int = 512,
                                interpret=False):
  """`segments_backward` in jnp (block sizes and interpret ignored)."""
  del block_rows, block_kv, interpret
  _check(q, k_cache, v_cache, kv_lengths, causal, d_out=d_out, lse=lse, delta=delta)
  visible = _reference_visible(q, k_cache, kv_lengths, causal)
  seen = jnp.any(visible, axis=2)[:, 0, :, None, None]
  k, v = (jnp.where(seen, x, jnp.zeros((), x.dtype)) for x in (k_cache, v_cache))
  hi = jax.lax.Precision.HIGHEST
  s = jnp.einsum('zmkh,zskh->zkms', q, k, preferred_element_type=jnp.float32,
                 precision=hi) * scale
  p = jnp.where(visible, jnp.exp(s - jnp.swapaxes(lse, 1, 2)[..., None]), 0.0)
  dp = jnp.einsum('zmkh,zskh->zkms', d_out, v, preferred_element_type=jnp.float32, precision=hi)
  ds = p * (dp - jnp.swapaxes(delta, 1, 2)[..., None])
  f32 = lambda x: x.astype(jnp.float32)
  dv = jnp.einsum('zkms,zmkh->zskh', p, f32(d_out), precision=hi)
  dk = jnp.einsum('zkms,zmkh->zskh', ds, f32(q), precision=hi) * scale
  dq = jnp.einsum('zkms,zskh->zmkh', ds, f32(k), precision=hi) * scale
  return dq, dk, dv
