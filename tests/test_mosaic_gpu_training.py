"""Tests of the Mosaic GPU training kernels (`pallas_kernels/mosaic_gpu/training_attention.py`).

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

import hydrajax as hj
from hydrajax.dispatch import hopper_reason
from hydrajax.training import prefill_layout as pl
from hydrajax.training import tree_attention_differentiable
from pallas_kernels.mosaic_gpu import training_attention as ta
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
  def test_backward(self, case, request):
    seed = zlib.crc32(request.node.name.encode())
    q, k, v, (w_out, w_lse) = _inputs(case, seed)
    n = case.kv_length
    scale = case.h**-0.5
    out, lse = ta.segment_forward_reference(q, k, v, n, scale=scale)
    # The cotangents of out and lse of loss = sum(out * w_out) + sum(lse * w_lse).
    delta = jnp.sum(w_out * out.astype(jnp.float32), -1) - w_lse
    args = (q, k, v, w_out.astype(BF16), lse, delta, n)
    dq, dk, dv = ta.segment_backward(*args, scale=scale, interpret=self.interpret)
    refs = ta.segment_backward_reference(*args, scale=scale)
    for name, a, r in zip(('dq', 'dk', 'dv'), (dq, dk, dv), refs):
      _close(name, a, r)
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
    state = ours(q, k, v)
    assert_states_close(state, xla(q, k, v))
    assert_states_close(state, oracle(q, k, v))
    actual = jax.grad(loss(ours), argnums=(0, 1, 2))(q, k, v)
    for other in (xla, oracle):
      expected = jax.grad(loss(other), argnums=(0, 1, 2))(q, k, v)
      for name, a, e in zip(('dq', 'dk', 'dv'), actual, expected):
        _close(name, a, e)

  def test_prefill_attention_impl(self):
    lengths, g, t, p, n, kh, h = (5, 11), 3, 6, 12, 4, 2, 64
    layout = pl.plan_prefill(lengths, g, t, prompt_capacity=p).to_device()
    rng = np.random.default_rng(9)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32)).astype(BF16)
    bp, b = len(lengths), len(lengths) * g
    q_p, q_c = draw(bp, p, n, h), draw(b, t, n, h)
    kb = pl.write_kv(layout, draw(bp, p, kh, h), draw(b, t, kh, h))
    vb = pl.write_kv(layout, draw(bp, p, kh, h), draw(b, t, kh, h))
    w = jax.random.normal(jax.random.key(6), q_c.shape)

    def loss(impl):
      def f(q_c, kb, vb):
        _, completion = pl.prefill_attention(q_p, q_c, kb, vb, layout, impl=impl,
                                             interpret=self.interpret)
        return jnp.sum(completion.out.astype(jnp.float32) * w)
      return f

    actual = jax.grad(loss('mosaic_gpu'), argnums=(0, 1, 2))(q_c, kb, vb)
    expected = jax.grad(loss('xla'), argnums=(0, 1, 2))(q_c, kb, vb)
    for name, a, e in zip(('dq', 'dk', 'dv'), actual, expected):
      _close(name, a, e)


class TestTrainingKernelsInterpret(TestTrainingKernels):
  """The same cases in Mosaic GPU interpret mode on CPU."""

  interpret = True


def test_arguments_are_checked():
  q = jnp.zeros((64, 4, 64), jnp.float32)
  k = jnp.zeros((64, 2, 64), jnp.float32)
  with pytest.raises(ValueError, match='bfloat16 or float16'):
    ta.segment_forward(q, k, k, 64, scale=1.0, interpret=True)
  with pytest.raises(ValueError, match='head dim'):
    ta.segment_forward(q[..., :32].astype(BF16), k[..., :32].astype(BF16),
                       k[..., :32].astype(BF16), 64, scale=1.0, interpret=True)
  with pytest.raises(ValueError, match='block_q'):
    ta.TrainingKernelConfig(block_q=32)
  plan = hj.plan_tree(hj.PromptNode(3, num_samples=2), private_capacity=2, private_lengths=1)
  qt, kt, vt = random_inputs(0, plan, 1, 4, 2, 64, BF16)
  with pytest.raises(ValueError, match='impl'):
    tree_attention_differentiable(qt, kt, vt, plan.to_device(), impl='cuda')
