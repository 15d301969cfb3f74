"""Tests of the Mosaic GPU training kernels (`pallas_kernels/mosaic_gpu/training_attention.py`):
the shared segment's and the batched causal mode's, and their use in tree / prefill attention
and a GRPO step.

`TestTrainingKernels` runs compiled on a Hopper GPU (skipped elsewhere);
`TestTrainingKernelsInterpret` runs the same cases on CPU in Mosaic GPU interpret
mode, small shapes. The kernels take bf16 / f16 only (Hopper wgmma), so everything
is bf16 against float32 oracles: tolerances are those of bf16 in
`tests/test_tree_attention_grad.py` (P and dS are rounded to bf16 before their
matmuls, dQ / dK / dV are returned in bf16).
"""

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hydrajax as hj
from experiments.mosaic_gpu import check_training
from hydrajax.attention import dispatch
from hydrajax.attention.training import prefill_layout as pl
from hydrajax.attention.training import tree_attention_differentiable
from hydrajax.devices import hopper_reason
from models.config import get_config
from models.llama import Llama
from models.training import grpo
from models.training.parallel import data_parallel
from pallas_kernels.mosaic_gpu import training_attention as ta
from pallas_kernels.mosaic_gpu.schedule import row_parts
from tests.conftest import assert_states_close, random_inputs, random_tree

TOL = dict(rtol=3e-2, atol=3e-2)  # bf16 (see the module docstring)
LSE_TOL = dict(rtol=0, atol=5e-3)
BF16 = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Case:
  heads: tuple[int, int]  # (N, K)
  m: int  # query rows
  s: int  # segment capacity
  kv_length: int
  h: int = 64

  @property
  def id(self):
    return f'N={self.heads[0]}_K={self.heads[1]}_M={self.m}_S={self.s}_len={self.kv_length}'


CASES = [
    Case((8, 2), 96, 100, 77),  # GQA 4:1, M and kv_length no block multiples
    Case((4, 1), 64, 128, 128, h=128),  # MQA, a full segment
    Case((2, 2), 40, 130, 129),  # MHA, one token into the last block
    Case((4, 2), 64, 64, 0),  # empty segment
]


@dataclasses.dataclass(frozen=True)
class CausalCase:
  heads: tuple[int, int]  # (N, K)
  t: int  # queries per row
  s: int  # kv capacity per row
  lengths: tuple[int, ...]  # keys per row (Z = len(lengths)); the queries are the last T
  h: int = 64

  @property
  def id(self):
    return f'N={self.heads[0]}_K={self.heads[1]}_T={self.t}_S={self.s}_len={self.lengths}'


CAUSAL_CASES = [
    # GQA 4:1, T no block multiple; row 1 has 30 keys before its queries, row 2 is T exactly.
    CausalCase((8, 2), 70, 130, (100, 70)),
    CausalCase((4, 1), 128, 128, (128, 128), h=128),  # MQA, full blocks (two diagonal blocks)
    # MHA; row 1: length < T (its first 14 queries see no key); row 2: 129 = one key into a block.
    CausalCase((2, 2), 40, 150, (40, 26, 129)),
]


def _inputs(case: Case, seed: int):
  """q, k, v, and output weights (w_out, w_lse); K/V past kv_length hold NaN."""
  n, kh = case.heads
  keys = jax.random.split(jax.random.key(seed), 5)
  draw = lambda key, shape: jax.random.normal(key, shape, jnp.float32)
  q = draw(keys[0], (case.m, n, case.h)).astype(BF16)
  k, v = (draw(key, (case.s, kh, case.h)).astype(BF16) for key in keys[1:3])
  k, v = (x.at[case.kv_length:].set(jnp.nan) for x in (k, v))
  return q, k, v, (draw(keys[3], q.shape), draw(keys[4], q.shape[:2]))


def _oracle(q, k, v, length):
  """Naive attention: every query row attends the segment's first `length` tokens."""
  m = q.shape[0]
  rows = lambda x: jnp.broadcast_to(x[:length], (m, length) + x.shape[1:])
  state = hj.naive_attention(q[:, None], rows(k), rows(v), jnp.full((m,), length, jnp.int32))
  return state.out[:, 0], state.lse[:, 0]


def _causal_inputs(case: CausalCase, seed: int):
  """q [Z, T, N, H], k, v [Z, S, K, H] with NaN past each row's length, weights (w_out, w_lse)."""
  n, kh = case.heads
  z = len(case.lengths)
  keys = jax.random.split(jax.random.key(seed), 5)
  draw = lambda key, shape: jax.random.normal(key, shape, jnp.float32)
  q = draw(keys[0], (z, case.t, n, case.h)).astype(BF16)
  unseen = (jnp.arange(case.s)[None, :] >= jnp.asarray(case.lengths)[:, None])[..., None, None]
  k, v = (jnp.where(unseen, jnp.nan, draw(key, (z, case.s, kh, case.h))).astype(BF16)
          for key in keys[1:3])
  return q, k, v, (draw(keys[3], q.shape), draw(keys[4], q.shape[:3]))


def _causal_oracle(q, k, v, lengths):
  """Naive causal attention (bottom-right aligned); K/V past the lengths zeroed (no NaN path)."""
  lengths = jnp.asarray(lengths, jnp.int32)
  seen = (jnp.arange(k.shape[1])[None, :] < lengths[:, None])[..., None, None]
  k, v = (jnp.where(seen, x, jnp.zeros((), x.dtype)) for x in (k, v))
  return hj.naive_attention(q, k, v, lengths)


def _close(name, actual, expected, **tol):
  a, e = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  assert not np.isnan(a).any(), f'NaN in {name}'
  np.testing.assert_array_equal(np.isneginf(a), np.isneginf(e), err_msg=name)
  fin = np.isfinite(e)
  np.testing.assert_allclose(a[fin], e[fin], err_msg=name, **(tol or TOL))


class TestTrainingKernels:
  """Compiled on a Hopper GPU."""

  interpret = False

  @pytest.fixture(autouse=True)
  def _need_hopper(self):
    if not self.interpret and hopper_reason() is not None:
      pytest.skip(f'compiled Mosaic GPU kernels need a Hopper GPU: {hopper_reason()}')

  @pytest.mark.parametrize('case', CASES, ids=lambda c: c.id)
  def test_forward(self, case, request):
    seed = zlib.crc32(request.node.name.encode())  # a fresh seed per case, reproducible
    q, k, v, _ = _inputs(case, seed)
    scale = case.h**-0.5
    out, lse = ta.segment_forward(q, k, v, case.kv_length, scale=scale, interpret=self.interpret)
    ref_out, ref_lse = ta.segment_forward_reference(q, k, v, case.kv_length, scale=scale)
    _close('out', out, ref_out)
    _close('lse', lse, ref_lse, **LSE_TOL)
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    if case.kv_length == 0:
      np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)
      assert np.isneginf(np.asarray(lse)).all()
      return
    oracle_out, oracle_lse = _oracle(q, k, v, case.kv_length)
    _close('out vs oracle', out, oracle_out)
    _close('lse vs oracle', lse, oracle_lse, **LSE_TOL)

  @pytest.mark.parametrize('case', CASES, ids=lambda c: c.id)
  @pytest.mark.parametrize('fused_dq', [True, False], ids=['fused_dq', 'dq_kernel'])
  def test_backward(self, case, fused_dq, request):
    seed = zlib.crc32(request.node.name.encode())
    q, k, v, (w_out, w_lse) = _inputs(case, seed)
    n = case.kv_length
    scale = case.h**-0.5
    out, lse = ta.segment_forward_reference(q, k, v, n, scale=scale)
    # The cotangents of out and lse of loss = sum(out * w_out) + sum(lse * w_lse).
    delta = jnp.sum(w_out * out.astype(jnp.float32), -1) - w_lse
    args = (q, k, v, w_out.astype(BF16), lse, delta, n)
    default = ta.INTERPRET_CONFIG if self.interpret else ta.TrainingKernelConfig()
    config = dataclasses.replace(default, fused_dq=fused_dq)
    dq, dk, dv = ta.segment_backward(*args, scale=scale, interpret=self.interpret, config=config)
    refs = ta.segment_backward_reference(*args, scale=scale)
    for name, a, r in zip(('dq', 'dk', 'dv'), (dq, dk, dv), refs):
      _close(name, a, r)
    # dq_dtype=float32: the sums before rounding (what the VJP adds other parts' dQ to).
    dq32 = ta.segment_backward(*args, scale=scale, interpret=self.interpret, config=config,
                               dq_dtype=jnp.float32)[0]
    assert dq32.dtype == jnp.float32 and dq.dtype == q.dtype
    _close('dq float32', dq32, ta.segment_backward_reference(*args, scale=scale,
                                                            dq_dtype=jnp.float32)[0])
    # Tokens past kv_length (NaN in K / V) get exactly zero gradient.
    np.testing.assert_array_equal(np.asarray(dk[n:], np.float32), 0.0)
    np.testing.assert_array_equal(np.asarray(dv[n:], np.float32), 0.0)
    if n == 0:
      np.testing.assert_array_equal(np.asarray(dq, np.float32), 0.0)
      return

    def loss(q, k, v):
      out, lse = _oracle(q, k, v, n)
      return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(lse * w_lse)

    expected = jax.grad(loss, argnums=(0, 1, 2))(q, k[:n], v[:n])
    for name, a, e in zip(('dq', 'dk', 'dv'), (dq, dk[:n], dv[:n]), expected):
      assert np.abs(np.asarray(e, np.float32)).max() > 0.1, f'{name}: no gradient exercised'
      _close(f'{name} vs oracle grad', a, e)

  @pytest.mark.parametrize('paired', [True, False], ids=['paired', 'one_tile'])
  def test_dq_in_float32_and_onto_dq_init(self, paired, request):
    """causal_backward(dq_dtype=float32): the dQ kernel stages float32 in the finished tile's
    Q and dO buffers (a RefUnion); rounded, it is bitwise the bf16 dQ. segments_backward's
    dq_init: dQ is it plus the segment's (fused kernel and dQ kernel)."""
    rng = np.random.default_rng(zlib.crc32(request.node.name.encode()))
    # GQA 4:1, a row with 32 keys before its queries. Compiled: H = 128 (the fused kernel's at
    # two warpgroups), 2 query tiles of 128 a row. Interpret (one warpgroup, fused at H = 64,
    # time about linear in H): 3 tiles of 64 a row, so a paired program and a lone tile.
    case = (CausalCase((8, 2), 192, 224, (224, 192)) if self.interpret else
            CausalCase((8, 2), 256, 288, (288, 256), h=128))
    q, k, v, (w_out, _) = _causal_inputs(case, int(rng.integers(1 << 30)))
    lengths, scale = jnp.asarray(case.lengths), case.h**-0.5
    out, lse = ta.causal_forward_reference(q, k, v, lengths, scale=scale)
    delta = jnp.sum(w_out * out.astype(jnp.float32), -1)
    args = (q, k, v, w_out.astype(BF16), lse, delta, lengths)
    default = ta.INTERPRET_CONFIG if self.interpret else ta.TrainingKernelConfig()
    config = dataclasses.replace(default, pair_causal_tiles=paired)
    assert ta._paired_dq(config, case.t, case.h, BF16) == paired
    kw = dict(scale=scale, interpret=self.interpret, config=config)
    dq16 = ta.causal_backward(*args, **kw)[0]
    dq32 = ta.causal_backward(*args, **kw, dq_dtype=jnp.float32)[0]
    assert dq32.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(dq32.astype(BF16), np.float32),
                                  np.asarray(dq16, np.float32))
    _close('dq float32', dq32, ta.causal_backward_reference(*args, scale=scale,
                                                           dq_dtype=jnp.float32)[0])
    # The rows over a shared segment (row 0's first 30 tokens' K/V), onto dq32; lse merged
    # over both parts (so P <= 1 on the segment).
    rows = lambda x: x.reshape((1, -1) + x.shape[2:])
    seg_kv = (k[:1, :128], v[:1, :128])
    seg_lse = ta.segments_forward_reference(rows(q), *seg_kv, 30, scale=scale)[1]
    merged = jnp.logaddexp(rows(lse), seg_lse)
    seg = (rows(q), *seg_kv, rows(w_out.astype(BF16)), merged, rows(delta), 30)
    expected = ta.segments_backward_reference(*seg, scale=scale, dq_init=rows(dq32),
                                              dq_dtype=jnp.float32)[0]
    for fused in (True, False):
      cfg = dataclasses.replace(config, fused_dq=fused)
      assert ta._fused_dq(cfg, None, case.h) == fused
      dq = ta.segments_backward(*seg, scale=scale, interpret=self.interpret, config=cfg,
                                dq_init=rows(dq32), dq_dtype=jnp.float32)[0]
      _close(f'dq onto dq_init, fused={fused}', dq, expected)

  @pytest.mark.parametrize('parts', [2, 4])
  def test_backward_in_row_parts(self, parts, request):
    """The fused dK/dV kernel split over query rows (`row_parts`): every part's float32 dK / dV
    summed after, dQ reduce-added as before; the reference's gradients."""
    seed = zlib.crc32(request.node.name.encode())
    # 512 padded rows: 8 query blocks of 64. H = 128: the fused kernel's at two warpgroups;
    # interpret mode (one warpgroup) fuses at H = 64, in about half the time.
    case = Case((8, 2), 500, 200, 130, h=64 if self.interpret else 128)
    q, k, v, (w_out, w_lse) = _inputs(case, seed)
    scale = case.h**-0.5
    out, lse = ta.segment_forward_reference(q, k, v, case.kv_length, scale=scale)
    delta = jnp.sum(w_out * out.astype(jnp.float32), -1) - w_lse
    args = (q, k, v, w_out.astype(BF16), lse, delta, case.kv_length)
    default = ta.INTERPRET_CONFIG if self.interpret else ta.TrainingKernelConfig()
    config = dataclasses.replace(default, row_parts=parts)
    assert ta._row_parts(config, case.s, case.heads[1], 512, self.interpret) == parts
    assert ta._fused_dq(config, None, case.h)
    grads = ta.segment_backward(*args, scale=scale, interpret=self.interpret, config=config)
    for name, a, r in zip(('dq', 'dk', 'dv'), grads, ta.segment_backward_reference(*args,
                                                                                 scale=scale)):
      assert a.dtype == r.dtype, name
      _close(name, a, r)
    for name, x in zip(('dk', 'dv'), grads[1:]):  # tokens past kv_length (NaN in K / V)
      np.testing.assert_array_equal(np.asarray(x[case.kv_length:], np.float32), 0.0, name)

  def test_unmasked_steps_change_nothing(self):
    """Steps whose block holds no invisible pair skip the mask (`mask_all_steps=False`, the
    forward's and dQ's default; `mask_all_steps_dkv=False`): the kernels that mask every
    step, causal and not, to within a bf16 ulp (the two branches' multiply-adds may be
    contracted differently). dQ unfused: the fused one's reduce-adds may land in any order."""
    default = ta.INTERPRET_CONFIG if self.interpret else ta.TrainingKernelConfig()
    configs = [dataclasses.replace(default, fused_dq=False, mask_all_steps=m,
                                   mask_all_steps_dkv=m) for m in (False, True)]
    # Interpret mode: half the query heads (GQA 2:1), half the time; the masks are per block.
    heads = lambda case: dataclasses.replace(case, heads=(4, 2)) if self.interpret else case
    case = heads(CAUSAL_CASES[0])
    q, k, v, (w_out, _) = _causal_inputs(case, 11)
    lengths, scale = jnp.asarray(case.lengths), case.h**-0.5
    causal = [ta.causal_forward(q, k, v, lengths, scale=scale, interpret=self.interpret,
                                config=c) for c in configs]
    out, lse = causal[0]
    delta = jnp.sum(w_out * out.astype(jnp.float32), -1)
    causal += [ta.causal_backward(q, k, v, w_out.astype(BF16), lse, delta, lengths, scale=scale,
                                  interpret=self.interpret, config=c) for c in configs]
    case = heads(CASES[0])
    q, k, v, (w_out, _) = _inputs(case, 12)
    segment = [ta.segment_forward(q, k, v, case.kv_length, scale=scale,
                                  interpret=self.interpret, config=c) for c in configs]
    out, lse = segment[0]
    delta = jnp.sum(w_out * out.astype(jnp.float32), -1)
    segment += [ta.segment_backward(q, k, v, w_out.astype(BF16), lse, delta, case.kv_length,
                                    scale=scale, interpret=self.interpret, config=c)
                for c in configs]
    for name, pair in (('causal forward', causal[:2]), ('causal backward', causal[2:]),
                       ('segment forward', segment[:2]), ('segment backward', segment[2:])):
      for a, b in zip(*pair):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b), err_msg=name)
        fin = np.isfinite(b)
        np.testing.assert_allclose(a[fin], b[fin], rtol=2**-7, atol=1e-6, err_msg=name)  # 1 ulp

  # 150 and 300 queries: 3 and 5 tiles of 64 rows (interpret), 2 and 3 of 128 (GPU); an odd
  # count leaves a middle program one tile. Lengths below T: queries that see no key.
  @pytest.mark.parametrize('case', [CausalCase((4, 2), 150, 200, (180, 150, 100)),
                                    CausalCase((8, 2), 300, 330, (330, 250))], ids=lambda c: c.id)
  def test_paired_tiles_change_nothing(self, case, request):
    """Causal forward and dQ programs that run two query tiles (`pair_causal_tiles`, the
    default) give the unpaired kernels' results bitwise: each tile streams the same blocks in
    the same order."""
    default = ta.INTERPRET_CONFIG if self.interpret else ta.TrainingKernelConfig()
    configs = [dataclasses.replace(default, pair_causal_tiles=p) for p in (True, False)]
    for paired in (ta._paired_forward, ta._paired_dq):
      assert paired(configs[0], case.t, case.h, BF16) and not paired(configs[1], case.t, case.h,
                                                                       BF16)
    q, k, v, (w_out, w_lse) = _causal_inputs(case, zlib.crc32(request.node.name.encode()))
    lengths, scale = jnp.asarray(case.lengths), case.h**-0.5
    forward = [ta.causal_forward(q, k, v, lengths, scale=scale, interpret=self.interpret,
                                 config=c) for c in configs]
    out, lse = forward[1]
    delta = jnp.sum(w_out * out.astype(jnp.float32), -1) - jnp.where(jnp.isfinite(lse), w_lse, 0)
    backward = [ta.causal_backward(q, k, v, w_out.astype(BF16), lse, delta, lengths,
                                   scale=scale, interpret=self.interpret, config=c)
                for c in configs]
    for name, a, b in zip(('out', 'lse', 'dq', 'dk', 'dv'), forward[0] + backward[0],
                          forward[1] + backward[1]):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), name)
    _close('out', forward[0][0], ta.causal_forward_reference(q, k, v, lengths, scale=scale)[0])

  def test_row_parts_fill_the_chip(self):
    """`schedule.row_parts`: a 1K prompt at 8 kv heads (64 programs) runs in 2 parts; 8K (512
    programs) in 1; parts divide the query blocks."""
    cfg = ta.TrainingKernelConfig()
    assert ta._row_parts(cfg, 1024, 8, 65536, False) == 2
    assert row_parts(64, 1024, num_sms=132) == 2
    assert row_parts(512, 1024, num_sms=132) == 1
    assert row_parts(192, 1024, num_sms=132) == 2  # 2 waves of 1024 -> 3 waves of 512
    assert row_parts(64, 7, num_sms=132) == 1  # 7 blocks: no part count divides them
    assert ta._row_parts(dataclasses.replace(cfg, block_kv_dkv=128), 1024, 8, 65536,
                         False) == 1  # staging through the dQ buffer needs bk == bq

  def test_dkv_reduced_in_kernel_over_rows_and_group(self):
    """Many query blocks and all G heads of a kv head land in one dK / dV (no per-row output)."""
    case = Case((8, 1), 256, 64, 64)
    q, k, v, (w_out, _) = _inputs(case, 5)
    out, lse = ta.segment_forward_reference(q, k, v, 64, scale=0.125)
    delta = jnp.sum(w_out * out.astype(jnp.float32), -1)
    args = (q, k, v, w_out.astype(BF16), lse, delta, 64)
    _, dk, dv = ta.segment_backward(*args, scale=0.125, interpret=self.interpret)
    assert dk.shape == k.shape and dv.shape == v.shape
    _, dk_ref, dv_ref = ta.segment_backward_reference(*args, scale=0.125)
    _close('dk', dk, dk_ref)
    _close('dv', dv, dv_ref)

  @pytest.mark.parametrize('case', CAUSAL_CASES, ids=lambda c: c.id)
  def test_causal_forward(self, case, request):
    seed = zlib.crc32(request.node.name.encode())
    q, k, v, _ = _causal_inputs(case, seed)
    scale = case.h**-0.5
    out, lse = ta.causal_forward(q, k, v, jnp.asarray(case.lengths), scale=scale,
                                 interpret=self.interpret)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3]
    ref_out, ref_lse = ta.causal_forward_reference(q, k, v, jnp.asarray(case.lengths),
                                                   scale=scale)
    _close('out', out, ref_out)
    _close('lse', lse, ref_lse, **LSE_TOL)
    oracle = _causal_oracle(q, k, v, case.lengths)
    _close('out vs oracle', out, oracle.out)
    _close('lse vs oracle', lse, oracle.lse, **LSE_TOL)

  @pytest.mark.parametrize('case', CAUSAL_CASES, ids=lambda c: c.id)
  def test_causal_backward(self, case, request):
    seed = zlib.crc32(request.node.name.encode())
    q, k, v, (w_out, w_lse) = _causal_inputs(case, seed)
    lengths = jnp.asarray(case.lengths)
    scale = case.h**-0.5
    out, lse = ta.causal_forward_reference(q, k, v, lengths, scale=scale)
    w_lse = jnp.where(jnp.isfinite(lse), w_lse, 0.0)  # queries that see no key: no lse
    # The cotangents of out and lse of loss = sum(out * w_out) + sum(lse * w_lse).
    delta = jnp.sum(w_out * out.astype(jnp.float32), -1) - w_lse
    args = (q, k, v, w_out.astype(BF16), lse, delta, lengths)
    grads = ta.causal_backward(*args, scale=scale, interpret=self.interpret)
    refs = ta.causal_backward_reference(*args, scale=scale)
    for name, a, r, x in zip(('dq', 'dk', 'dv'), grads, refs, (q, k, v)):
      assert a.shape == x.shape and a.dtype == x.dtype, name
      _close(name, a, r)
    # Tokens past a row's length (NaN in K / V) get exactly zero gradient.
    for z, n in enumerate(case.lengths):
      for name, g in (('dk', grads[1]), ('dv', grads[2])):
        np.testing.assert_array_equal(np.asarray(g[z, n:], np.float32), 0.0, err_msg=name)

    def loss(q, k, v):
      state = _causal_oracle(q, k, v, lengths)
      lse = jnp.where(jnp.isfinite(state.lse), state.lse, 0.0)
      return jnp.sum(state.out.astype(jnp.float32) * w_out) + jnp.sum(lse * w_lse)

    expected = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for name, a, e in zip(('dq', 'dk', 'dv'), grads, expected):
      assert np.abs(np.asarray(e, np.float32)).max() > 0.1, f'{name}: no gradient exercised'
      _close(f'{name} vs oracle grad', a, e)

  def test_tree_attention_differentiable_matches_xla(self):
    """impl='mosaic_gpu' (shared segments by the kernels) against the XLA impl and the oracle."""
    rng = np.random.default_rng(23)
    t, n, kh, h = 2, 4, 2, 64
    tree = random_tree(rng, 2, 4, max_len=70)
    plan = hj.plan_tree(tree, private_capacity=t + 2, private_lengths=[t, t + 1, t + 2, t])
    q, k, v = random_inputs(3, plan, t, n, kh, h, BF16)
    # NaN in every buffer token no row attends.
    indices, lengths = plan.row_token_indices()
    attended = np.zeros(k.shape[0], bool)
    for row, count in zip(indices, lengths):
      attended[row[:count]] = True
    k, v = (jnp.where(jnp.asarray(~attended)[:, None, None], jnp.nan, x) for x in (k, v))
    layout = plan.to_device()
    assert layout.groups, 'the case needs shared segments'
    w = jax.random.normal(jax.random.key(4), q.shape)
    w_lse = jax.random.normal(jax.random.key(5), q.shape[:-1])

    def loss(impl):
      def f(q, k, v):
        state = impl(q, k, v)
        lse = jnp.where(jnp.isfinite(state.lse), state.lse, 0.0)
        return jnp.sum(state.out.astype(jnp.float32) * w) + jnp.sum(lse * w_lse)
      return f

    ours = lambda q, k, v: tree_attention_differentiable(
        q, k, v, layout, impl='mosaic_gpu', interpret=self.interpret)
    xla = lambda q, k, v: tree_attention_differentiable(q, k, v, layout)
    oracle = lambda q, k, v: hj.naive_tree_attention(q, k, v, plan)
    # Jitted (here and below): op by op, each op compiles on its own.
    state = jax.jit(ours)(q, k, v)
    assert_states_close(state, jax.jit(xla)(q, k, v))
    assert_states_close(state, jax.jit(oracle)(q, k, v))
    grad = lambda impl: jax.jit(jax.grad(loss(impl), argnums=(0, 1, 2)))
    actual = grad(ours)(q, k, v)
    for other in (xla, oracle):
      expected = grad(other)(q, k, v)
      for name, a, e in zip(('dq', 'dk', 'dv'), actual, expected):
        _close(name, a, e)

  def test_scattered_private_pages(self):
    """impl='mosaic_gpu' with several private pages per row, out of order and not contiguous
    (the kernels get them gathered), NaN in every unattended token, against XLA and the oracle."""
    t, n, kh, h = 5, 4, 2, 64
    plan = hj.SharingPlan(
        num_rows=2, segments=(hj.Segment(kv_start=0, kv_length=20, row_begin=0, row_end=2),),
        page_size=16, private_pages=((4, 2), (5, 3)), private_lengths=(30, 20), kv_tokens=96)
    layout = plan.to_device()
    rng = np.random.default_rng(41)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32)).astype(BF16)
    q, k, v = draw(2, t, n, h), draw(96, kh, h), draw(96, kh, h)
    indices, lengths = plan.row_token_indices()
    attended = np.zeros(96, bool)
    for row, count in zip(indices, lengths):
      attended[row[:count]] = True
    k, v = (jnp.where(jnp.asarray(~attended)[:, None, None], jnp.nan, x) for x in (k, v))
    w = jax.random.normal(jax.random.key(8), q.shape)

    def loss(impl):
      return lambda q, k, v: jnp.sum(impl(q, k, v).out.astype(jnp.float32) * w)

    ours = lambda q, k, v: tree_attention_differentiable(
        q, k, v, layout, impl='mosaic_gpu', interpret=self.interpret)
    xla = lambda q, k, v: tree_attention_differentiable(q, k, v, layout)
    oracle = lambda q, k, v: hj.naive_tree_attention(q, k, v, plan)
    state = ours(q, k, v)
    assert_states_close(state, xla(q, k, v))
    assert_states_close(state, oracle(q, k, v))
    actual = jax.grad(loss(ours), argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(loss(xla), argnums=(0, 1, 2))(q, k, v)
    for name, a, e in zip(('dq', 'dk', 'dv'), actual, expected):
      _close(name, a, e)
    for name, a in zip(('dk', 'dv'), actual[1:]):  # unattended tokens: exact zeros
      np.testing.assert_array_equal(np.asarray(a, np.float32)[~attended], 0.0, err_msg=name)

  @pytest.mark.parametrize('dq_in_place,heads', [(False, (4, 2)), (True, (4, 2)), (True, (4, 1))],
                           ids=['dq_summed', 'dq_in_place', 'dq_in_place_mqa'])
  def test_prefill_attention_impl(self, dq_in_place, heads):
    """Every part on the kernels (shared prompts, completions' and prompts' causal self-attention;
    on slices of the buffer, `prefill_vjp`) against the XLA path: values of both states and
    gradients of q_p, q_c, k, v. Two prompts of different lengths, no block multiples. The
    completions' dQ summed after, or in place (`prefill_dq_in_place`)."""
    default = ta.INTERPRET_CONFIG if self.interpret else ta.TrainingKernelConfig()
    config = dataclasses.replace(default, prefill_dq_in_place=dq_in_place)
    (n, kh), lengths, g, t, p, h = heads, (5, 11), 3, 6, 12, 64
    layout = pl.plan_prefill(lengths, g, t, prompt_capacity=p).to_device()
    rng = np.random.default_rng(9)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32)).astype(BF16)
    bp, b = len(lengths), len(lengths) * g
    q_p, q_c = draw(bp, p, n, h), draw(b, t, n, h)
    kb = pl.write_kv(layout, draw(bp, p, kh, h), draw(b, t, kh, h))
    vb = pl.write_kv(layout, draw(bp, p, kh, h), draw(b, t, kh, h))
    keys = jax.random.split(jax.random.key(6), 4)
    w_c, w_p = (jax.random.normal(key, x.shape) for key, x in zip(keys, (q_c, q_p)))
    w_lc, w_lp = (jax.random.normal(key, x.shape[:-1]) for key, x in zip(keys[2:], (q_c, q_p)))

    def states(impl):  # jitted: op by op, each op compiles on its own
      kernel = dict(kernel_config=config) if impl == 'mosaic_gpu' else {}
      return jax.jit(lambda *a: pl.prefill_attention(*a, layout, impl=impl,
                                                     interpret=self.interpret, **kernel))

    def loss(impl):
      def f(*a):
        total = 0.0
        for state, w, w_lse in zip(states(impl)(*a), (w_p, w_c), (w_lp, w_lc)):
          total += jnp.sum(state.out.astype(jnp.float32) * w) + jnp.sum(state.lse * w_lse)
        return total
      return f

    args = (q_p, q_c, kb, vb)
    prepare = lambda impl: pl.prepare_prefill_attention(layout, q_p, q_c, kb, impl=impl,
                                                        interpret=self.interpret)
    assert prepare('mosaic_gpu').on_slices and not prepare('xla').on_slices  # `prefill_vjp`
    for actual, expected in zip(states('mosaic_gpu')(*args), states('xla')(*args)):
      assert_states_close(actual, expected)
    actual = jax.jit(jax.grad(loss('mosaic_gpu'), argnums=(0, 1, 2, 3)))(*args)
    expected = jax.jit(jax.grad(loss('xla'), argnums=(0, 1, 2, 3)))(*args)
    for name, a, e in zip(('dq_prompt', 'dq_completion', 'dk', 'dv'), actual, expected):
      _close(name, a, e)

  @pytest.mark.parametrize('uniform', [True, False], ids=['on_slices', 'walked'])
  def test_tree_prefill_impl(self, uniform):
    """A three-level rollout tree (`tree_prefill`): every level's ancestors and causal
    self-attention on the kernels, against the XLA path: states at the real queries and the
    gradients of every level's q and of k, v. A uniform tree runs on slices of the buffer
    (`prefill_vjp`); one whose root has a childless third branch walks each level's tree (a
    group of two branch segments among them)."""
    from hydrajax.attention.training import tree_prefill as tp

    parents = [-1, 0, 0, 1, 1, 2, 2] + ([] if uniform else [0])
    plan = tp.plan_tree_prefill(parents, [37, 21, 21, 9, 13, 5, 11, 17][:len(parents)])
    layout = plan.to_device()
    prepared = tp.prepare_tree_prefill(
        layout, [jax.ShapeDtypeStruct((b, c, 4, 64), BF16) for b, c in layout.level_shapes],
        jax.ShapeDtypeStruct((layout.kv_tokens, 2, 64), BF16), impl='mosaic_gpu',
        interpret=self.interpret)
    assert prepared.on_slices == uniform
    if not uniform:
      assert max(g.num_segments for g in layout.layouts[2].groups) == 2, layout.layouts[2].groups
    n, kh, h = 4, 2, 64
    keys = iter(jax.random.split(jax.random.key(17), 9))
    draw = lambda shape: jax.random.normal(next(keys), shape, jnp.float32).astype(BF16)
    qs = [draw((b, c, n, h)) for b, c in layout.level_shapes]
    k, v = (tp.write_tree_kv(layout, [draw((b, c, kh, h)) for b, c in layout.level_shapes])
            for _ in range(2))
    real = [np.arange(c)[None, :] < np.asarray(m)[:, None]
            for m, c in zip(layout.lengths, layout.capacities)]
    states = lambda impl: jax.jit(lambda *a: tp.tree_prefill_attention(
        *a, layout, impl=impl, interpret=self.interpret if impl == 'mosaic_gpu' else False))

    def loss(impl):
      def f(qs, k, v):
        return sum(jnp.sum(jnp.where(r[..., None, None], s.out.astype(jnp.float32) * q, 0.0))
                   for s, q, r in zip(states(impl)(qs, k, v), qs, real))
      return jax.jit(jax.grad(f, argnums=(0, 1, 2)))
    for d, (a, e, r) in enumerate(zip(states('mosaic_gpu')(qs, k, v), states('xla')(qs, k, v),
                                      real)):
      _close(f'out, level {d}', a.out[r], e.out[r])
      _close(f'lse, level {d}', a.lse[r], e.lse[r], **LSE_TOL)
    actual, expected = loss('mosaic_gpu')(qs, k, v), loss('xla')(qs, k, v)
    for d, (a, e) in enumerate(zip(actual[0], expected[0])):
      _close(f'dq, level {d}', a, e)
    for name, a, e in zip(('dk', 'dv'), actual[1:], expected[1:]):
      _close(name, a, e)

  def test_grpo_step_impl(self):
    """A GRPO loss and gradient (bf16 Llama, head dim 64) with impl='mosaic_gpu' equal to XLA's."""
    config = get_config('tiny_gqa', head_dim=64, num_layers=1)
    lengths, g, t = (5, 9), 2, 7
    layout = pl.plan_prefill(lengths, g, t).to_device()
    rng = np.random.default_rng(31)
    bp, b = len(lengths), len(lengths) * g
    base = -float(np.log(config.vocab_size))
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    batch = grpo.GrpoBatch(
        prompts=jnp.asarray(rng.integers(1, config.vocab_size, (bp, max(lengths))), jnp.int32),
        completions=jnp.asarray(rng.integers(1, config.vocab_size, (b, t)), jnp.int32),
        mask=jnp.ones((b, t)), advantages=f32(rng.standard_normal(b)),
        old_logp=f32(base + 0.3 * rng.standard_normal((b, t))),
        ref_logp=f32(base + 0.3 * rng.standard_normal((b, t))))
    graphdef, params = nnx.split(Llama(config, rngs=nnx.Rngs(4), dtype=BF16))
    cfg = grpo.GrpoConfig()
    # Jitted: run op by op, each of the model's hundreds of ops compiles on its own (about
    # half the interpret test's time).
    run = lambda impl: jax.jit(lambda params: grpo.loss_and_grads(
        graphdef, params, batch, layout, cfg, impl=impl, interpret=self.interpret))(params)
    (loss_k, _), grads_k = run('mosaic_gpu')
    (loss_x, _), grads_x = run('xla')
    _close_grads((loss_k, grads_k), (loss_x, grads_x))

    # Data parallel (`data_parallel`), each device its prompt and its own plan: the kernels run
    # inside the shard_map, and the averaged loss and gradients are the one device's.
    # Interpret mode keeps one simulated shared memory a process: two CPU devices running
    # kernels at once trip its barrier bookkeeping, so there the mesh is one device.
    dp = 1 if self.interpret else min(2, len(jax.devices()))
    mesh = jax.make_mesh((dp,), ('dp',), devices=jax.devices()[:dp])
    sharded = data_parallel(
        lambda params, batch, layout: grpo.loss_and_grads(
            graphdef, params, batch, layout, cfg, impl='mosaic_gpu', interpret=self.interpret),
        mesh)
    (loss_dp, _), grads_dp = jax.jit(sharded)(params, batch,
                                             pl.plan_prefill(lengths, g, t).to_device_sharded(dp))
    _close_grads((loss_dp, grads_dp), (loss_k, grads_k))


def _close_grads(actual, expected):
  """(loss, grads) of bf16 runs: the loss to 1e-2, every gradient to 3e-2 of its largest."""
  (loss_a, grads_a), (loss_e, grads_e) = actual, expected
  np.testing.assert_allclose(float(loss_a), float(loss_e), rtol=1e-2, atol=1e-3)
  for (path, a), e in zip(jax.tree.leaves_with_path(grads_a), jax.tree.leaves(grads_e)):
    a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
    scale = float(np.abs(e).max())
    assert scale > 0, f'{jax.tree_util.keystr(path)}: no gradient'
    np.testing.assert_allclose(a, e, rtol=0, atol=3e-2 * scale,
                               err_msg=jax.tree_util.keystr(path))


class TestTrainingKernelsInterpret(TestTrainingKernels):
  """The same cases in Mosaic GPU interpret mode on CPU; of the many-case tests, the
  `representative_cases` (conftest): MHA, GQA and MQA, an empty item, both dQ paths, the
  default tiles."""

  interpret = True
  representative_cases = {
      'test_backward': ('fused_dq-N=8_K=2_M=96_S=100_len=77', 'dq_kernel-N=4_K=1_M=64_S=128_len=128'),
      'test_causal_forward': ('N=2_K=2_T=40_S=150_len=(40, 26, 129)',),
      'test_causal_backward': ('N=2_K=2_T=40_S=150_len=(40, 26, 129)',),
      'test_dq_in_float32_and_onto_dq_init': (),
      'test_paired_tiles_change_nothing': (),
      'test_backward_in_row_parts': (),
      'test_prefill_attention_impl': (),
      'test_tree_prefill_impl': (),
      'test_grpo_step_impl': (),
      'test_tree_attention_differentiable_matches_xla': (),
      'test_unmasked_steps_change_nothing': (),
      'test_scattered_private_pages': (),
  }


def test_arguments_are_checked():
  q = jnp.zeros((64, 4, 64), jnp.float32)
  k = jnp.zeros((64, 2, 64), jnp.float32)
  with pytest.raises(ValueError, match='bfloat16 or float16'):
    ta.segment_forward(q, k, k, 64, scale=1.0, interpret=True)
  with pytest.raises(ValueError, match='head dim'):
    ta.segment_forward(q[..., :32].astype(BF16), k[..., :32].astype(BF16),
                       k[..., :32].astype(BF16), 64, scale=1.0, interpret=True)
  qb, kb = jnp.zeros((2, 64, 4, 64), BF16), jnp.zeros((2, 64, 2, 64), BF16)
  with pytest.raises(ValueError, match='expected q'):
    ta.causal_forward(qb, kb[:1], kb[:1], 64, scale=1.0, interpret=True)
  with pytest.raises(ValueError, match='lengths'):
    ta.causal_forward(qb, kb, kb, jnp.array([64, 64, 64]), scale=1.0, interpret=True)
  with pytest.raises(ValueError, match='block_q'):
    ta.TrainingKernelConfig(block_q=32)
  stats = jnp.zeros((2, 64, 4), jnp.float32)
  with pytest.raises(ValueError, match='dq_dtype must be None'):
    ta.causal_backward(qb, kb, kb, qb, stats, stats, 64, scale=1.0, interpret=True,
                       dq_dtype=jnp.float16)
  with pytest.raises(ValueError, match='dq_init must be'):
    ta.segments_backward(qb, kb, kb, qb, stats, stats, jnp.array([64, 64]), scale=1.0,
                         interpret=True, dq_init=stats)
  plan = hj.plan_tree(hj.PromptNode(3, num_samples=2), private_capacity=2, private_lengths=1)
  qt, kt, vt = random_inputs(0, plan, 1, 4, 2, 64, BF16)
  with pytest.raises(ValueError, match='impl'):
    tree_attention_differentiable(qt, kt, vt, plan.to_device(), impl='cuda')
  with pytest.raises(ValueError, match='kernel_config tunes the Mosaic GPU kernels'):
    tree_attention_differentiable(qt, kt, vt, plan.to_device(),
                                  kernel_config=ta.TrainingKernelConfig())
  with pytest.raises(TypeError, match='kernel_config must be a TrainingKernelConfig'):
    tree_attention_differentiable(qt, kt, vt, plan.to_device(), impl='mosaic_gpu',
                                  kernel_config=dict(block_kv_dq=64))


def _reference_stand_ins(monkeypatch, names):
  """Stands each kernel in `names` in for by its `*_reference` (same signature); returns the
  dict in which each records the `config` of every call (one entry a launch)."""
  seen = {}
  for name in names:
    reference = getattr(ta, f'{name}_reference')

    def stand_in(*args, name=name, reference=reference, **kwargs):
      seen.setdefault(name, []).append(kwargs['config'])
      return reference(*args, **kwargs)
    monkeypatch.setattr(ta, name, stand_in)
  return seen


def test_kernel_config_reaches_every_kernel(monkeypatch):
  """`kernel_config` is what the four kernels get (each stood in for by its `*_reference`,
  same signature), in the forward and the backward, and each segment group is one launch of
  each pass, whatever its segment count; the result is still exact."""
  cfg = ta.TrainingKernelConfig(block_kv_dq=128, compute_wgs=1)
  # The stand-ins run anywhere and in float32: the resolver may pick the kernels.
  monkeypatch.setattr(dispatch, 'training_unsupported_reason', lambda *a, **kw: None)
  seen = _reference_stand_ins(monkeypatch, ('segments_forward', 'causal_forward',
                                            'segments_backward', 'causal_backward'))
  rng = np.random.default_rng(zlib.crc32(b'kernel_config'))
  t = 3
  # A root over three children of two rows and one length each: one group of 3 segments.
  root, child = (int(x) for x in rng.integers(10, 40, size=2))
  tree = hj.PromptNode(root, children=tuple(hj.PromptNode(child, num_samples=2) for _ in range(3)))
  plan = hj.plan_tree(tree, private_capacity=t + 2, private_lengths=[t, t + 1, t + 2, t, t, t])
  q, k, v = random_inputs(int(rng.integers(1 << 30)), plan, t, 4, 2, 64, jnp.float32)
  layout = plan.to_device()
  assert layout.groups and layout.private_pages.size, 'the case needs both kinds of parts'
  assert max(group.kv_start.shape[0] for group in layout.groups) > 1, 'a group of segments'

  def loss(**kw):
    return lambda q, k, v: jnp.sum(
        tree_attention_differentiable(q, k, v, layout, **kw).out * jnp.cos(q))
  actual = jax.grad(loss(impl='mosaic_gpu', kernel_config=cfg), argnums=(0, 1, 2))(q, k, v)
  assert len(seen) == 4 and {c for calls in seen.values() for c in calls} == {cfg}, seen
  for name in ('segments_forward', 'segments_backward'):
    assert len(seen[name]) == len(layout.groups), (name, len(seen[name]))
  expected = jax.grad(loss(), argnums=(0, 1, 2))(q, k, v)
  for name, a, e in zip(('dq', 'dk', 'dv'), actual, expected):
    np.testing.assert_allclose(a, e, rtol=2e-4, atol=2e-5, err_msg=name)


@pytest.mark.parametrize('dq_in_place', [False, True], ids=['dq_summed', 'dq_in_place'])
def test_kernel_config_reaches_every_prefill_kernel(monkeypatch, dq_in_place):
  """The prefill on slices (`prefill_vjp`): `kernel_config` reaches the batched segment and
  causal kernels (stood in for by their `*_reference`s), forward and backward, and the states
  and gradients equal the XLA path's (two prompts of different lengths, float32), with the
  completions' dQ summed after or in place (`prefill_dq_in_place`)."""
  cfg = ta.TrainingKernelConfig(block_kv_dq=128, compute_wgs=1, prefill_dq_in_place=dq_in_place)
  monkeypatch.setattr(dispatch, 'training_unsupported_reason', lambda *a, **kw: None)
  seen = _reference_stand_ins(monkeypatch, ('segments_forward', 'causal_forward',
                                            'segments_backward', 'causal_backward'))
  lengths, g, t, p, n, kh, h = (3, 7), 2, 5, 8, 4, 2, 16
  layout = pl.plan_prefill(lengths, g, t, prompt_capacity=p).to_device()
  rng = np.random.default_rng(zlib.crc32(b'prefill kernel_config'))
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
  bp, b = len(lengths), len(lengths) * g
  args = (draw(bp, p, n, h), draw(b, t, n, h), pl.write_kv(layout, draw(bp, p, kh, h),
          draw(b, t, kh, h)), pl.write_kv(layout, draw(bp, p, kh, h), draw(b, t, kh, h)))

  def loss(**kw):
    def f(*a):
      prompt, completion = pl.prefill_attention(*a, layout, **kw)
      return (jnp.sum(prompt.out * jnp.cos(a[0])) + jnp.sum(completion.out * jnp.sin(a[1]))
              + jnp.sum(completion.lse * 0.1))
    return f

  actual = jax.value_and_grad(loss(impl='mosaic_gpu', kernel_config=cfg), argnums=(0, 1, 2, 3))(
      *args)
  assert len(seen) == 4 and {c for calls in seen.values() for c in calls} == {cfg}, seen
  expected = jax.value_and_grad(loss(), argnums=(0, 1, 2, 3))(*args)
  np.testing.assert_allclose(actual[0], expected[0], rtol=2e-5)
  for name, a, e in zip(('dq_prompt', 'dq_completion', 'dk', 'dv'), actual[1], expected[1]):
    np.testing.assert_allclose(a, e, rtol=2e-4, atol=2e-5, err_msg=name)


@pytest.mark.parametrize('dq_in_place', [False, True], ids=['dq_summed', 'dq_in_place'])
def test_uniform_tree_prefill_on_slices(monkeypatch, dq_in_place):
  """A uniform forest on slices of the buffer (`prefill_vjp`, all levels one custom VJP): two
  roots, two branches each, two leaves a branch, every length its own and no block multiple.
  One causal launch a level and one segment launch a level and ancestor level, forward and
  backward (the kernels stood in for by their `*_reference`s, float32), with `kernel_config`;
  states and the gradients of every level's q and of k, v equal the walked XLA path's."""
  from hydrajax.attention.training import tree_prefill as tp

  cfg = ta.TrainingKernelConfig(block_kv_dq=128, compute_wgs=1, prefill_dq_in_place=dq_in_place)
  monkeypatch.setattr(dispatch, 'training_unsupported_reason', lambda *a, **kw: None)
  seen = _reference_stand_ins(monkeypatch, ('segments_forward', 'causal_forward',
                                            'segments_backward', 'causal_backward'))
  rng = np.random.default_rng(zlib.crc32(b'uniform tree on slices'))
  parents = [-1, -1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
  plan = tp.plan_tree_prefill(parents, [int(n) for n in rng.integers(1, 30, len(parents))],
                              capacities=(31, 33, 30))
  assert plan.uniform
  layout = plan.to_device()
  n, kh, h = 4, 2, 16
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
  qs = [draw(b, c, n, h) for b, c in layout.level_shapes]
  k, v = (tp.write_tree_kv(layout, [draw(b, c, kh, h) for b, c in layout.level_shapes])
          for _ in range(2))
  weights = [(draw(*q.shape), draw(*q.shape[:3])) for q in qs]

  def loss(**kw):
    def f(qs, k, v):
      states = tp.tree_prefill_attention(qs, k, v, layout, **kw)
      return sum(jnp.sum(s.out * w) + jnp.sum(s.lse * w_lse)
                 for s, (w, w_lse) in zip(states, weights))
    return f

  kernels = dict(impl='mosaic_gpu', kernel_config=cfg)
  prepared = tp.prepare_tree_prefill(layout, qs, k, **kernels)
  # On slices the plan holds no walked plans and no index arrays: its leaves are the segment
  # lengths of every level but the last.
  assert prepared.on_slices and prepared.levels == () and prepared.num_levels == 3
  assert len(jax.tree.leaves(prepared)) == 2, jax.tree.leaves(prepared)
  walked = tp.prepare_tree_prefill(layout, qs, k, **kernels, slices=False)
  assert not walked.on_slices and len(walked.levels) == 3
  actual = jax.value_and_grad(loss(**kernels), argnums=(0, 1, 2))(qs, k, v)
  # Three levels: three causal launches and 0 + 1 + 2 segment launches, each pass.
  assert {name: len(calls) for name, calls in seen.items()} == dict(
      causal_forward=3, segments_forward=3, causal_backward=3, segments_backward=3), seen
  assert {c for calls in seen.values() for c in calls} == {cfg}, seen
  expected = jax.value_and_grad(loss(), argnums=(0, 1, 2))(qs, k, v)
  np.testing.assert_allclose(actual[0], expected[0], rtol=2e-5)
  for d, (a, e) in enumerate(zip(actual[1][0], expected[1][0])):
    np.testing.assert_allclose(a, e, rtol=2e-4, atol=2e-5, err_msg=f'dq, level {d}')
  for name, a, e in zip(('dk', 'dv'), actual[1][1:], expected[1][1:]):
    np.testing.assert_allclose(a, e, rtol=2e-4, atol=2e-5, err_msg=name)


def test_full_lengths_skip_the_kv_pass():
  """K/V tokens past the lengths are zeroed (a select over K/V) unless the length is a Python
  int covering every token (the prefill's prompts and completions): then no pass at all."""
  k = jnp.zeros((2, 100, 2, 64), BF16)
  jaxpr = lambda lengths: str(jax.make_jaxpr(lambda k: ta._prepare_kv(k, k, lengths, 64))(k))
  assert 'select_n' not in jaxpr(100) and 'select_n' in jaxpr(99)
  assert 'select_n' in jaxpr(jnp.array([100, 100]))
  length, kp, _ = jax.jit(lambda k: ta._prepare_kv(k, k, 100, 64))(k + 1)
  assert kp.shape == (2, 128, 2, 64) and length.tolist() == [100, 100]
  assert bool(jnp.all(kp[:, :100] == 1)) and bool(jnp.all(kp[:, 100:] == 0))


def test_check_training_records_jsonl(monkeypatch):
  """check_training.py --out: each record is a JSON line with its kind and the config's fields."""
  import io
  import json


  sink = io.StringIO()
  monkeypatch.setattr(check_training, '_SINK', [sink])
  config = ta.TrainingKernelConfig(block_kv_dq=128)
  check_training.record('time', config, part='segment forward', ms=1.5)
  check_training.record('check', None, passed=False)
  first, second = (json.loads(line) for line in sink.getvalue().splitlines())
  assert first == dict(kind='time', config=dataclasses.asdict(config), part='segment forward',
                       ms=1.5)
  assert second['config'] == dataclasses.asdict(ta.TrainingKernelConfig())
  assert second['passed'] is False

# `make test` keeps these cases (conftest: `representative_cases`; `()`: the whole test is left
# to `make test-all`, another test of the default run covering its path).
representative_cases = {
    'test_uniform_tree_prefill_on_slices': ('dq_in_place',),
    'test_kernel_config_reaches_every_prefill_kernel': ('dq_summed',),
}
