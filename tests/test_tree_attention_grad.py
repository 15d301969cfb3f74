"""Gradients of the differentiable tree attention (custom VJP) against jax.grad of the oracle."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hydrajax as hj
from hydrajax.attention.training import prefill_layout as pl
from hydrajax.attention.training import tree_attention_differentiable
from tests.conftest import assert_states_close, random_inputs, random_tree

GRAD_TOLERANCES = {
    jnp.dtype(jnp.float32): dict(rtol=1e-5, atol=1e-5),
    # bf16: P and dS are rounded to bf16 before their matmuls; the oracle runs in float32.
    jnp.dtype(jnp.bfloat16): dict(rtol=3e-2, atol=3e-2),
}


@dataclasses.dataclass(frozen=True)
class Case:
  seed: int
  heads: tuple[int, int]  # (N, K)
  t: int
  dtype: object
  kv_block: int = 1024
  empty: bool = False  # an empty root and rows without any key
  nan_padding: bool = False  # NaN in every buffer token no row attends

  @property
  def id(self) -> str:
    n, k = self.heads
    empty = 'empty_' if self.empty else ''
    empty += 'nan_padding_' if self.nan_padding else ''
    return (f'{empty}N={n}_K={k}_T={self.t}_{jnp.dtype(self.dtype).name}'
            f'_kv_block={self.kv_block}_seed={self.seed}')


CASES = [
    Case(0, (4, 4), 1, jnp.float32),  # MHA, decode
    Case(1, (4, 2), 3, jnp.float32, kv_block=8, nan_padding=True),  # GQA, several kv blocks
    Case(2, (4, 1), 2, jnp.bfloat16),  # MQA
    Case(3, (4, 2), 2, jnp.float32, empty=True),
]


def _case_inputs(case: Case):
  n, k = case.heads
  rng = np.random.default_rng(case.seed)
  rows = 5
  if case.empty:  # root of length 0; rows 0 and 1 have no key at all
    tree = hj.PromptNode(0, children=(hj.PromptNode(0, num_samples=2),
                                      hj.PromptNode(13, num_samples=3)))
    lengths = [0, 0, 1, 2, 5]
  else:
    tree = random_tree(rng, 3, rows, max_len=40)
    lengths = [int(x) for x in rng.integers(case.t, case.t + 4, rows)]
  plan = hj.plan_tree(tree, private_capacity=case.t + 3, private_lengths=lengths)
  q, k, v = random_inputs(case.seed, plan, case.t, n, k, 8, case.dtype)
  if case.nan_padding:
    indices, lengths = plan.row_token_indices()
    attended = np.zeros(k.shape[0], bool)
    for row, n_tokens in zip(indices, lengths):
      attended[row[:n_tokens]] = True
    assert not attended.all()
    poison = jnp.asarray(~attended)[:, None, None]
    k, v = (jnp.where(poison, jnp.nan, x) for x in (k, v))
  return plan, (q, k, v)


def _loss(attention, weights):
  """A scalar that depends on every output and on the lse (finite entries)."""
  w_out, w_lse = weights

  def loss(q, k, v):
    state = attention(q, k, v)
    lse = jnp.where(jnp.isfinite(state.lse), state.lse, 0.0)
    return jnp.sum(state.out.astype(jnp.float32) * w_out) + jnp.sum(lse * w_lse)

  return loss


def _weights(q):
  return (jax.random.normal(jax.random.key(1), q.shape, jnp.float32),
          jax.random.normal(jax.random.key(2), q.shape[:-1], jnp.float32))


def _assert_grads_close(actual, expected, dtype):
  for name, a, e in zip(('dq', 'dk', 'dv'), actual, expected):
    a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
    assert not np.isnan(a).any(), f'NaN in {name}'
    assert np.abs(e).max() > 0.1, f'{name}: the case exercises no gradient'
    np.testing.assert_allclose(a, e, err_msg=name, **GRAD_TOLERANCES[jnp.dtype(dtype)])


@pytest.mark.parametrize('case', CASES, ids=lambda c: c.id)
def test_grad_matches_oracle(case):
  plan, (q, k, v) = _case_inputs(case)
  layout = plan.to_device()
  weights = _weights(q)
  ours = lambda q, k, v: tree_attention_differentiable(q, k, v, layout, kv_block=case.kv_block)
  oracle = lambda q, k, v: hj.naive_tree_attention(q, k, v, plan)
  state = jax.jit(ours)(q, k, v)
  assert_states_close(state, oracle(q, k, v))
  actual = jax.jit(jax.grad(_loss(ours, weights), argnums=(0, 1, 2)))(q, k, v)
  expected = jax.grad(_loss(oracle, weights), argnums=(0, 1, 2))(q, k, v)
  _assert_grads_close(actual, expected, case.dtype)


def test_forward_matches_xla_path():
  """Same numbers as the inference XLA path (another oracle, same layout)."""
  case = dataclasses.replace(CASES[1], nan_padding=False)
  plan, (q, k, v) = _case_inputs(case)
  layout = plan.to_device()
  state = tree_attention_differentiable(q, k, v, layout, kv_block=case.kv_block)
  assert_states_close(state, hj.tree_attention(q, k, v, layout, impl=hj.AttentionImpl.XLA))


def test_bad_kv_block_is_named():
  plan, (q, k, v) = _case_inputs(CASES[0])
  with pytest.raises(ValueError, match='kv_block'):
    tree_attention_differentiable(q, k, v, plan.to_device(), kv_block=0)


# The causal prefill (training) form: prompts shared by G completions of T tokens each.

def _prefill_oracle(q_p, q_c, k_p, k_c, v_p, v_c, lengths, group_size):
  """Every sample's own sequence (prompt + completion), naive causal attention."""
  p, t = k_p.shape[1], k_c.shape[1]
  prompt = hj.naive_attention(q_p, k_p, v_p, jnp.full((k_p.shape[0],), p, jnp.int32))
  k_seq = pl.unshared_sequences(k_p, k_c, lengths, group_size)
  v_seq = pl.unshared_sequences(v_p, v_c, lengths, group_size)
  completion = hj.naive_attention(q_c, k_seq, v_seq, jnp.repeat(lengths, group_size) + t)
  return prompt, completion


@pytest.mark.parametrize('impl', ('xla', 'mosaic_tpu'))
@pytest.mark.parametrize('dtype', (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
def test_prefill_attention_matches_causal_oracle(dtype, impl):
  """impl 'mosaic_tpu': every part on the TPU kernels (interpret mode)."""
  from jax.experimental.pallas import tpu as pltpu

  interpret = pltpu.InterpretParams() if impl == 'mosaic_tpu' else False
  lengths, g, t, p, n, k, h = (5, 11), 3, 6, 12, 4, 2, 8
  plan = pl.plan_prefill(lengths, g, t, prompt_capacity=p)
  layout = plan.to_device()
  rng = np.random.default_rng(7)
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
  bp, b = len(lengths), len(lengths) * g
  args = (draw(bp, p, n, h), draw(b, t, n, h), draw(bp, p, k, h), draw(b, t, k, h),
          draw(bp, p, k, h), draw(b, t, k, h))
  w_p = jax.random.normal(jax.random.key(3), (bp, p, n, h))
  w_c = jax.random.normal(jax.random.key(4), (b, t, n, h))

  def ours(q_p, q_c, k_p, k_c, v_p, v_c):
    kb, vb = pl.write_kv(layout, k_p, k_c), pl.write_kv(layout, v_p, v_c)
    return pl.prefill_attention(q_p, q_c, kb, vb, layout, kv_block=8, impl=impl,
                                interpret=interpret)

  oracle = lambda *a: _prefill_oracle(*a, layout.prompt_lengths, g)

  def loss(fn):
    def f(*a):
      prompt, completion = fn(*a)
      return (jnp.sum(prompt.out.astype(jnp.float32) * w_p)
              + jnp.sum(completion.out.astype(jnp.float32) * w_c))
    return f

  for actual, expected in zip(jax.jit(ours)(*args), oracle(*args)):
    assert_states_close(actual, expected)
  argnums = tuple(range(6))
  actual = jax.jit(jax.grad(loss(ours), argnums))(*args)
  expected = jax.grad(loss(oracle), argnums)(*args)
  tol = GRAD_TOLERANCES[jnp.dtype(dtype)]
  for name, a, e in zip(('dq_p', 'dq_c', 'dk_p', 'dk_c', 'dv_p', 'dv_c'), actual, expected):
    a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
    np.testing.assert_allclose(a, e, err_msg=name, **tol)
  # The prompts' padding tokens (after the real ones) reach no completion.
  assert np.abs(np.asarray(actual[2], np.float32)[0, lengths[0]:]).max() > 0  # prompt causal
  assert plan.completion_plan.segments[0].kv_length == lengths[0]


def test_plan_prefill_checks_arguments():
  with pytest.raises(ValueError, match='prompt_lengths'):
    pl.plan_prefill([], 2, 3)
  with pytest.raises(ValueError, match='prompt_capacity'):
    pl.plan_prefill([4], 2, 3, prompt_capacity=2)
  with pytest.raises(ValueError, match='group_size'):
    pl.plan_prefill([4], 0, 3)


@pytest.mark.parametrize('impl, case', [
    ('xla', dataclasses.replace(CASES[1], kv_block=1024)),  # the shared backward alone
    ('mosaic_tpu', dataclasses.replace(CASES[1], kv_block=1024)),  # everything
    ('mosaic_tpu', CASES[2]),  # MQA, bf16
    ('mosaic_tpu', CASES[3]),  # an empty root, rows without any key
], ids=lambda x: x if isinstance(x, str) else x.id)
def test_grad_with_mosaic_tpu_kernels_matches_oracle(impl, case):
  """The custom VJP with the shared segments' backward in the TPU kernels, and with
  impl=MOSAIC_TPU every part's forward and backward (interpret mode; the kernels alone:
  tests/test_tpu_training_attention.py)."""
  from jax.experimental.pallas import tpu as pltpu

  plan, (q, k, v) = _case_inputs(case)
  layout = plan.to_device()
  assert layout.groups, 'the case needs shared segments'
  weights = _weights(q)
  ours = lambda q, k, v: tree_attention_differentiable(
      q, k, v, layout, impl=impl, shared_backward='mosaic_tpu',
      interpret=pltpu.InterpretParams())
  oracle = lambda q, k, v: hj.naive_tree_attention(q, k, v, plan)
  assert_states_close(ours(q, k, v), oracle(q, k, v))
  actual = jax.grad(_loss(ours, weights), argnums=(0, 1, 2))(q, k, v)
  expected = jax.grad(_loss(oracle, weights), argnums=(0, 1, 2))(q, k, v)
  _assert_grads_close(actual, expected, case.dtype)
  with pytest.raises(ValueError, match='shared_backward'):
    tree_attention_differentiable(q, k, v, layout, shared_backward='cuda')

# `make test` keeps these cases (conftest: `representative_cases`; `()`: the whole test is left
# to `make test-all`, another test of the default run covering its path).
representative_cases = {
    'test_prefill_attention_matches_causal_oracle': ('bfloat16-mosaic_tpu',),
    'test_grad_matches_oracle': ('nan_padding_N=4_K=2_T=3_float32_kv_block=8_seed=1',),
    'test_grad_with_mosaic_tpu_kernels_matches_oracle': ('mosaic_tpu-nan_padding_N=4_K=2_T=3_float32_kv_block=1024_seed=1',),
}
