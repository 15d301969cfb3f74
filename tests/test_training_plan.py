"""The prepared plan of the differentiable (training) path: equal to the one-call form, the
kernels resolved through `hydrajax.attention.dispatch`, inputs checked, a jit pytree, prepared once per
model forward."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hydrajax as hj
from hydrajax import devices
from hydrajax.attention import dispatch
from hydrajax.attention.training import prefill_layout as pl
from hydrajax.attention.training import training_plan as tp
from hydrajax.attention.training import tree_attention_differentiable
from models.config import get_config
from models.llama import Llama
from models.training import forward as fw
from tests.conftest import assert_states_close, fresh_rng, random_inputs, random_tree

AUTO, XLA = hj.AttentionImpl.AUTO, hj.AttentionImpl.XLA
MOSAIC_GPU, MOSAIC_TPU = hj.AttentionImpl.MOSAIC_GPU, hj.AttentionImpl.MOSAIC_TPU
on_cpu = pytest.mark.skipif(jax.default_backend() != 'cpu', reason='checks the CPU choice')


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
  """Each test sees the once-per-reason fallback warnings afresh."""
  monkeypatch.setattr(dispatch, '_warned', set())


def _problem(seed, dtype, h=8, t=2, heads=(4, 2), rows=5, depth=3, max_len=40):
  """A random tree (GQA), its device layout, and q, k, v."""
  rng = np.random.default_rng(seed)
  plan = hj.plan_tree(random_tree(rng, depth, rows, max_len=max_len), private_capacity=t + 3,
                      private_lengths=[int(x) for x in rng.integers(t, t + 4, rows)])
  layout = plan.to_device()
  assert layout.groups and layout.private_pages.size, 'the case needs both kinds of parts'
  return layout, random_inputs(seed, plan, t, *heads, h, dtype)


def _loss(attention, q):
  """(a scalar of every output and of the (finite) lse, the state): for jax.value_and_grad."""
  w_out = jax.random.normal(jax.random.key(1), q.shape, jnp.float32)
  w_lse = jax.random.normal(jax.random.key(2), q.shape[:-1], jnp.float32)

  def loss(q, k, v):
    state = attention(q, k, v)
    lse = jnp.where(jnp.isfinite(state.lse), state.lse, 0.0)
    return jnp.sum(state.out.astype(jnp.float32) * w_out) + jnp.sum(lse * w_lse), state

  return loss


def _state_and_grads(attention, q, jit=True):
  """(q, k, v) -> (state, (dq, dk, dv)) of `_loss`, in one forward and backward."""
  fn = jax.value_and_grad(_loss(attention, q), argnums=(0, 1, 2), has_aux=True)
  fn = jax.jit(fn) if jit else fn

  def run(q, k, v):
    (_, state), grads = fn(q, k, v)
    return state, grads

  return run


def _assert_grads_close(actual, expected, **tol):
  for name, a, e in zip(('dq', 'dk', 'dv'), actual, expected):
    a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
    assert not np.isnan(a).any(), f'NaN in {name}'
    assert np.abs(e).max() > 0.1, f'{name}: the case exercises no gradient'
    np.testing.assert_allclose(a, e, err_msg=name, **tol)


def test_a_plan_attends_every_layer_as_the_one_call_form(monkeypatch):
  """One plan, two layers' K/V: the same states and gradients as `tree_attention_differentiable`
  per layer, and nothing is derived from the layout after `prepare_training_attention`."""
  layout, (q, k, v) = _problem(3, jnp.float32)
  layers = [(k, v), (v * 0.5, k[::-1])]
  reference = lambda q, k, v: tree_attention_differentiable(q, k, v, layout, kv_block=8)
  run = _state_and_grads(reference, q)  # one compile for both layers
  expected = [run(q, *kv) for kv in layers]
  plan = tp.prepare_training_attention(layout, hj.AttentionShapes.of(q, k), impl=XLA,
                                       kv_block=8)
  assert (plan.impl, plan.shared_backward, plan.kv_block) == (XLA, XLA, 8)
  for name in ('_parts', 'path_item_index'):  # derived once, in the plan
    monkeypatch.setattr(tp, name, lambda *a, name=name: pytest.fail(f'{name} called again'))
  run = _state_and_grads(lambda q, k, v: tp.attend_differentiable(q, k, v, plan), q)
  for kv, (state, grads) in zip(layers, expected):
    actual_state, actual = run(q, *kv)
    assert_states_close(actual_state, state, rtol=1e-6, atol=1e-6)
    _assert_grads_close(actual, grads, rtol=1e-6, atol=1e-6)


def test_mosaic_gpu_plan_matches_xla_in_interpret_mode():
  """impl=MOSAIC_GPU (every part on the Hopper kernels, interpret mode) against impl=XLA, bf16;
  tolerances of tests/test_mosaic_gpu_training.py."""
  # Small (interpret mode is slow): a group of two segments and one of one.
  layout, (q, k, v) = _problem(25, jnp.bfloat16, h=64, rows=3, depth=2, max_len=70)
  shapes = hj.AttentionShapes.of(q, k)
  gpu = tp.prepare_training_attention(layout, shapes, impl='mosaic_gpu', interpret=True)
  assert (gpu.impl, gpu.shared_backward, gpu.interpret) == (MOSAIC_GPU, MOSAIC_GPU, True)
  xla = tp.prepare_training_attention(layout, shapes, impl=XLA)
  state, grads = _state_and_grads(lambda *a: tp.attend_differentiable(*a, gpu), q,
                                  jit=False)(q, k, v)
  expected_state, expected = _state_and_grads(lambda *a: tp.attend_differentiable(*a, xla),
                                              q)(q, k, v)
  assert_states_close(state, expected_state)  # bf16 tolerances
  _assert_grads_close(grads, expected, rtol=3e-2, atol=3e-2)


@on_cpu
def test_auto_on_cpu_is_xla_without_a_warning():
  layout, (q, k, v) = _problem(0, jnp.bfloat16, h=64)
  with warnings.catch_warnings():
    warnings.simplefilter('error')  # no kernel was a candidate: nothing to warn about
    plan = tp.prepare_training_attention(layout, hj.AttentionShapes.of(q, k))
  assert (plan.impl, plan.shared_backward, plan.interpret) == (XLA, XLA, False)


@pytest.fixture
def on(monkeypatch):
  """Makes this machine, as far as the resolver can tell, a Hopper GPU or a TPU."""

  def install(kernel):
    monkeypatch.setattr(dispatch, 'default_kernel', lambda: kernel)
    device = 'hopper_reason' if kernel is MOSAIC_GPU else 'tpu_reason'
    monkeypatch.setattr(devices, device, lambda: None)

  return install


def test_auto_on_hopper_falls_back_visibly_and_picks_the_kernel_where_it_can(on):
  on(MOSAIC_GPU)
  layout, (q, k, _) = _problem(1, jnp.float32, h=64)
  with pytest.warns(hj.AttentionFallbackWarning, match='from MOSAIC_GPU: .*float32'):
    plan = tp.prepare_training_attention(layout, hj.AttentionShapes.of(q, k), impl='auto')
  assert (plan.impl, plan.shared_backward, plan.interpret) == (XLA, XLA, False)
  with pytest.warns(hj.AttentionFallbackWarning, match='head dim must be a multiple of 64, got 32'):
    tp.prepare_training_attention(layout, hj.AttentionShapes(5, 2, 4, 2, 32, k.shape[0],
                                                             jnp.bfloat16))
  shapes = hj.AttentionShapes.of(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16))
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    plan = tp.prepare_training_attention(layout, shapes)
  assert (plan.impl, plan.shared_backward) == (MOSAIC_GPU, MOSAIC_GPU)


def test_auto_on_a_tpu_keeps_xla(on):
  on(MOSAIC_TPU)  # the Mosaic TPU training kernels are interpret-tested only
  layout, (q, k, _) = _problem(2, jnp.float32)
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    plan = tp.prepare_training_attention(layout, hj.AttentionShapes.of(q, k))
  assert (plan.impl, plan.shared_backward) == (XLA, XLA)
  plan = tp.prepare_training_attention(layout, hj.AttentionShapes.of(q, k), impl=MOSAIC_TPU)
  assert (plan.impl, plan.shared_backward) == (MOSAIC_TPU, MOSAIC_TPU)
  plan = tp.prepare_training_attention(layout, hj.AttentionShapes.of(q, k), impl=XLA,
                                       shared_backward=MOSAIC_TPU)
  assert (plan.impl, plan.shared_backward) == (XLA, MOSAIC_TPU)


@on_cpu
def test_explicit_kernels_that_cannot_run_raise():
  layout, (q, k, _) = _problem(4, jnp.bfloat16, h=64)
  shapes = hj.AttentionShapes.of(q, k)
  match = 'impl=MOSAIC_GPU does not support these inputs: needs a Hopper GPU.+interpret=True'
  with pytest.raises(ValueError, match=match):
    tp.prepare_training_attention(layout, shapes, impl=MOSAIC_GPU)
  with pytest.raises(ValueError, match='impl=MOSAIC_TPU .+need a TPU.+interpret=True'):
    tp.prepare_training_attention(layout, shapes, impl='mosaic_tpu')
  with pytest.raises(ValueError, match='shared_backward=MOSAIC_TPU .+interpret=True'):
    tp.prepare_training_attention(layout, shapes, impl=XLA, shared_backward=MOSAIC_TPU)
  f32 = hj.AttentionShapes.of(q.astype(jnp.float32), k.astype(jnp.float32))
  with pytest.raises(ValueError, match="impl=MOSAIC_GPU .+bfloat16 or float16 .+'float32'"):
    tp.prepare_training_attention(layout, f32, impl=MOSAIC_GPU, interpret=True)
  with pytest.raises(ValueError, match='shared_backward must be one of XLA, MOSAIC_GPU, MOSAIC'):
    tp.prepare_training_attention(layout, shapes, shared_backward=AUTO)


def test_bad_inputs_are_named():
  layout, (q, k, v) = _problem(5, jnp.float32)
  shapes = hj.AttentionShapes.of(q, k)
  with pytest.raises(ValueError, match='shapes must be an AttentionShapes, got tuple'):
    tp.prepare_training_attention(layout, (q.shape, k.shape))
  for kv_block in (0, -3, 2.5, True):
    with pytest.raises(ValueError, match='kv_block must be an integer >= 1'):
      tp.prepare_training_attention(layout, shapes, kv_block=kv_block)
  with pytest.raises(ValueError, match='impl must be one of AUTO, XLA'):
    tp.prepare_training_attention(layout, shapes, impl='cuda')
  with pytest.raises(ValueError, match='layout must be a TreeLayout'):
    tp.prepare_training_attention(layout.groups, shapes)
  plan = tp.prepare_training_attention(layout, shapes, impl=XLA)
  with pytest.raises(ValueError, match=r'q must be \[B, T, N, H\] = \(5, 2, 4, 8\) as planned'):
    tp.attend_differentiable(q[:, :1], k, v, plan)
  with pytest.raises(ValueError, match='k bfloat16'):
    tp.attend_differentiable(q, k.astype(jnp.bfloat16), v, plan)
  with pytest.raises(ValueError, match=r"v_cache must be one layer's \[L, K, H\]"):
    tp.attend_differentiable(q, k, jnp.concatenate([v, v]), plan)
  with pytest.raises(ValueError, match='plan must be a TrainingAttentionPlan'):
    tp.attend_differentiable(q, k, v, layout)
  with pytest.raises(ValueError, match='scale must be finite and > 0'):
    tp.attend_differentiable(q, k, v, plan, scale=-1.0)


def test_the_plan_is_a_jit_pytree():
  layout, (q, k, v) = _problem(6, jnp.float32)
  plan = tp.prepare_training_attention(layout, hj.AttentionShapes.of(q, k), impl=XLA,
                                       kv_block=8)
  leaves, treedef = jax.tree.flatten(plan)
  assert all(isinstance(x, jax.Array) for x in leaves)
  assert jax.tree.unflatten(treedef, leaves).kernels == plan.kernels
  closed = lambda q, k, v: tp.attend_differentiable(q, k, v, plan)  # the plan a constant
  expected_state, expected = _state_and_grads(closed, q)(q, k, v)
  attend = jax.jit(lambda plan, q, k, v: tp.attend_differentiable(q, k, v, plan))
  assert_states_close(attend(plan, q, k, v), expected_state, rtol=1e-6, atol=1e-6)
  grad = jax.jit(jax.grad(lambda plan, *a: _loss(lambda *b: tp.attend_differentiable(*b, plan),
                                                 q)(*a)[0], argnums=(1, 2, 3)))
  _assert_grads_close(grad(plan, q, k, v), expected, rtol=1e-5, atol=1e-5)


def test_prefill_plan_is_the_one_call_form():
  lengths, g, t, p, n, kh, h = (5, 11), 3, 6, 12, 4, 2, 8
  layout = pl.plan_prefill(lengths, g, t, prompt_capacity=p).to_device()
  rng = np.random.default_rng(7)
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
  bp, b = len(lengths), len(lengths) * g
  q_p, q_c = draw(bp, p, n, h), draw(b, t, n, h)
  kb = pl.write_kv(layout, draw(bp, p, kh, h), draw(b, t, kh, h))
  vb = pl.write_kv(layout, draw(bp, p, kh, h), draw(b, t, kh, h))
  plan = pl.prepare_prefill_attention(layout, q_p, jax.ShapeDtypeStruct(q_c.shape, q_c.dtype),
                                      kb, kv_block=8)
  assert plan.prompt.shapes.num_rows == bp and plan.completion.shapes.num_rows == b
  attend = jax.jit(lambda plan, *a: pl.attend_prefill(*a, plan))
  expected = pl.prefill_attention(q_p, q_c, kb, vb, layout, kv_block=8)
  for actual, e in zip(attend(plan, q_p, q_c, kb, vb), expected):
    assert_states_close(actual, e, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match='layout must be a PrefillLayout'):
    pl.prepare_prefill_attention(layout.completion_layout, q_p, q_c, kb)
  with pytest.raises(ValueError, match='plan must be a PrefillAttentionPlan'):
    pl.attend_prefill(q_p, q_c, kb, vb, plan.prompt)


def test_shared_forward_prepares_once_with_the_same_numbers(monkeypatch):
  """`shared_hidden` plans the attention once for all layers; its log-probs are those of every
  layer attending in one call (what it did before the plan)."""
  config = get_config('tiny_gqa')
  assert config.num_layers > 1
  model = Llama(config, rngs=nnx.Rngs(0))
  lengths, g, t = (4, 7), 3, 5
  layout = pl.plan_prefill(lengths, g, t).to_device()
  rng = np.random.default_rng(1)
  prompts = jnp.asarray(rng.integers(1, config.vocab_size, (len(lengths), max(lengths))))
  completions = jnp.asarray(rng.integers(1, config.vocab_size, (len(lengths) * g, t)))
  prepare, prepared = pl.prepare_prefill_attention, []
  monkeypatch.setattr(pl, 'prepare_prefill_attention',
                      lambda *a, **kw: prepared.append(1) or prepare(*a, **kw))
  planned = fw.shared_forward(model, prompts, completions, layout, kv_block=4)
  assert len(prepared) == 1

  def every_layer_in_one_call(q_p, q_c, k, v, plan):
    del plan
    return (tree_attention_differentiable(q_p, k, v, layout.prompt_layout, kv_block=4),
            tree_attention_differentiable(q_c, k, v, layout.completion_layout, kv_block=4))

  monkeypatch.setattr(pl, 'attend_prefill', every_layer_in_one_call)
  before = fw.shared_forward(model, prompts, completions, layout, kv_block=4)
  np.testing.assert_allclose(planned, before, rtol=1e-6, atol=1e-6)


def test_write_kv_puts_every_token_at_its_slot():
  """The concatenation is the slots' scatter (padding zero), and its gradient each token's."""
  layout = pl.plan_prefill((5, 11), 3, 6, prompt_capacity=12).to_device()
  rng = fresh_rng()
  prompt_kv = jnp.asarray(rng.standard_normal((2, 12, 2, 8), np.float32))
  completion_kv = jnp.asarray(rng.standard_normal((6, 6, 2, 8), np.float32))
  buffer = pl.write_kv(layout, prompt_kv, completion_kv)
  want = np.zeros((layout.kv_tokens, 2, 8), np.float32)
  want[np.asarray(layout.prompt_slots).reshape(-1)] = np.asarray(prompt_kv).reshape(-1, 2, 8)
  want[np.asarray(layout.completion_slots).reshape(-1)] = np.asarray(completion_kv).reshape(-1, 2, 8)
  np.testing.assert_array_equal(np.asarray(buffer), want)
  weights = jnp.asarray(rng.standard_normal(buffer.shape, np.float32))
  d_prompt, d_completion = jax.grad(
      lambda p, c: jnp.sum(pl.write_kv(layout, p, c) * weights), argnums=(0, 1))(
          prompt_kv, completion_kv)
  np.testing.assert_array_equal(np.asarray(d_prompt),
                                np.asarray(weights)[np.asarray(layout.prompt_slots)])
  np.testing.assert_array_equal(np.asarray(d_completion),
                                np.asarray(weights)[np.asarray(layout.completion_slots)])
  with pytest.raises(ValueError, match=r'completion_kv must be \[6, 6, K, H\]'):
    pl.write_kv(layout, prompt_kv, completion_kv[:5])


def test_mosaic_tpu_block_sizes_reach_the_kernels(monkeypatch):
  """A `TrainingBlockSizes` as kernel_config tunes every TPU launch of the plan (forward, dK/dV
  and dQ of the segment groups and the private part); the states and gradients stay the
  oracle's (interpret mode)."""
  from jax.experimental.pallas import tpu as pltpu
  from pallas_kernels.tpu import training_attention as tpu_kernels

  blocks = tpu_kernels.TrainingBlockSizes(block_rows=8, block_kv=16)
  seen = []
  for name in ('segments_forward', 'segments_backward'):
    kernel = getattr(tpu_kernels, name)

    def record(*args, kernel=kernel, **kwargs):
      seen.append((kernel.__name__, kwargs.get('block_rows'), kwargs.get('block_kv')))
      return kernel(*args, **kwargs)

    monkeypatch.setattr(tpu_kernels, name, record)
  layout, (q, k, v) = _problem(5, jnp.float32)
  plan = tp.prepare_training_attention(layout, hj.AttentionShapes.of(q, k), impl=MOSAIC_TPU,
                                       kernel_config=blocks, interpret=pltpu.InterpretParams())
  assert plan.kernel_config == blocks
  xla = tp.prepare_training_attention(layout, hj.AttentionShapes.of(q, k), impl=XLA)
  state, grads = _state_and_grads(lambda *a: tp.attend_differentiable(*a, plan), q)(q, k, v)
  expected_state, expected = _state_and_grads(lambda *a: tp.attend_differentiable(*a, xla),
                                              q)(q, k, v)
  assert_states_close(state, expected_state)
  for a, e in zip(grads, expected):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)
  parts = 1 + len(layout.groups)  # the private part and each segment group
  assert sorted(seen) == sorted([('segments_forward', 8, 16)] * parts
                                + [('segments_backward', 8, 16)] * parts), seen


@on_cpu
def test_kernel_config_is_checked_against_the_kernels_that_run():
  from pallas_kernels.tpu.training_attention import TrainingBlockSizes

  layout, (q, k, _) = _problem(4, jnp.bfloat16, h=64)
  shapes = hj.AttentionShapes.of(q, k)
  with pytest.raises(ValueError, match='block_rows must be a positive multiple of 8, got 12'):
    TrainingBlockSizes(block_rows=12)
  with pytest.raises(ValueError, match='kernel_config tunes the Mosaic TPU kernels: pass it with '
                     'impl or shared_backward MOSAIC_TPU, got XLA and XLA'):
    tp.prepare_training_attention(layout, shapes, impl=XLA, kernel_config=TrainingBlockSizes())
  with pytest.raises(ValueError, match='tunes the Mosaic TPU kernels only; this plan runs '
                     'MOSAIC_GPU and MOSAIC_TPU'):
    tp.prepare_training_attention(layout, shapes, impl=MOSAIC_GPU, shared_backward=MOSAIC_TPU,
                                  kernel_config=TrainingBlockSizes(), interpret=True)
  with pytest.raises(TypeError, match='a TrainingKernelConfig \\(Mosaic GPU\\) or a '
                     'TrainingBlockSizes \\(Mosaic TPU\\), got dict'):
    tp.prepare_training_attention(layout, shapes, impl=MOSAIC_TPU, interpret=True,
                                  kernel_config=dict(block_rows=8))
  plan = tp.prepare_training_attention(layout, shapes, impl=XLA, shared_backward=MOSAIC_TPU,
                                       kernel_config=TrainingBlockSizes(), interpret=True)
  assert (plan.impl, plan.shared_backward) == (XLA, MOSAIC_TPU)

# `make test` keeps these cases (conftest: `representative_cases`; `()`: the whole test is left
# to `make test-all`, another test of the default run covering its path).
representative_cases = {
    'test_mosaic_gpu_plan_matches_xla_in_interpret_mode': (),
}
