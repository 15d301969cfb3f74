"""GRPO over the shared prefill layout: same log-probs, loss, gradients and step as unshared."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from experiments.benchmarking import training_costs as costs
from hydrajax.attention.training import plan_prefill
from hydrajax.attention.training import tree_prefill as tp
from models.config import get_config
from models.llama import Llama
from models.training import forward as fw
from models.training import grpo, rollout
from models.training.parallel import shard_over_dp


def _batch(config, lengths, g, t, seed, capacity=None):
  """Random prompts / completions with padding, rewards, old and reference log-probs."""
  rng = np.random.default_rng(seed)
  bp, b, p = len(lengths), len(lengths) * g, capacity or max(lengths)
  prompts = rng.integers(1, config.vocab_size, (bp, p))
  completions = rng.integers(1, config.vocab_size, (b, t))
  done = rng.integers(1, t + 1, b)  # valid completion tokens per row
  mask = (np.arange(t)[None, :] < done[:, None]).astype(np.float32)
  rewards = rng.standard_normal((bp, g)).astype(np.float32)
  # old / reference log-probs near the policy's (about -log V), some ratios past the clip.
  base = -np.log(config.vocab_size)
  old = base + 0.3 * rng.standard_normal((b, t))
  ref = base + 0.3 * rng.standard_normal((b, t))
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return grpo.GrpoBatch(
      prompts=jnp.asarray(prompts, jnp.int32), completions=jnp.asarray(completions, jnp.int32),
      mask=f32(mask), advantages=grpo.group_advantages(f32(rewards)), old_logp=f32(old),
      ref_logp=f32(ref),
  )


def test_group_advantages_by_hand():
  # Group [1, 3]: mean 2, std 1 -> [-1, 1]; group [5, 5, ...]: std 0 -> 0.
  rewards = jnp.array([[1.0, 3.0], [5.0, 5.0]])
  adv = grpo.group_advantages(rewards, grpo.GrpoConfig(adv_eps=1e-6))
  np.testing.assert_allclose(adv, [-1.0, 1.0, 0.0, 0.0], atol=1e-5)
  with pytest.raises(ValueError, match='rewards'):
    grpo.group_advantages(jnp.zeros(4))


def test_grpo_loss_by_hand():
  # One token, A = 1, ratio e^0.5 = 1.65 clipped to 1.2 -> pg = -1.2; kl(ref = logp) = 0.
  batch = grpo.GrpoBatch(
      prompts=jnp.zeros((1, 1), jnp.int32), completions=jnp.zeros((1, 1), jnp.int32),
      mask=jnp.ones((1, 1)), advantages=jnp.ones(1), old_logp=jnp.full((1, 1), -1.5),
      ref_logp=jnp.full((1, 1), -1.0))
  loss, metrics = grpo.grpo_loss(jnp.full((1, 1), -1.0), batch, grpo.GrpoConfig())
  np.testing.assert_allclose(loss, -1.2, rtol=1e-6)
  np.testing.assert_allclose(metrics['clip_fraction'], 1.0)


def test_shared_forward_loss_and_grads_match_unshared():
  config = get_config('tiny_gqa')
  model = Llama(config, rngs=nnx.Rngs(0))
  lengths, g, t = (4, 7), 3, 5
  layout = plan_prefill(lengths, g, t).to_device()
  batch = _batch(config, lengths, g, t, seed=1)
  shared = jax.jit(lambda m: grpo.policy_logprobs(m, batch, layout, kv_block=4))(model)
  unshared = grpo.policy_logprobs(model, batch, layout, shared=False)
  np.testing.assert_allclose(shared, unshared, rtol=1e-5, atol=1e-5)

  graphdef, params = nnx.split(model)
  cfg = grpo.GrpoConfig()
  (loss_s, metrics_s), grads_s = jax.jit(
      lambda p: grpo.loss_and_grads(graphdef, p, batch, layout, cfg, kv_block=4))(params)
  (loss_u, metrics_u), grads_u = grpo.loss_and_grads(graphdef, params, batch, layout, cfg,
                                                     shared=False)
  assert 0 < float(metrics_u['clip_fraction']) < 1  # both branches of the clip are exercised
  np.testing.assert_allclose(loss_s, loss_u, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(metrics_s['kl'], metrics_u['kl'], rtol=1e-5, atol=1e-6)
  flat_s, flat_u = jax.tree.leaves_with_path(grads_s), jax.tree.leaves(grads_u)
  for (path, a), e in zip(flat_s, flat_u):
    scale = float(np.abs(e).max())
    assert scale > 0, f'{jax.tree_util.keystr(path)}: no gradient'
    np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5 * scale,
                               err_msg=jax.tree_util.keystr(path))


def test_train_step_matches_unshared():
  """One Adam step from the same start lands on the same parameters (MQA, tied embeddings)."""
  config = get_config('tiny_llama3')
  lengths, g, t = (5,), 4, 3
  layout = plan_prefill(lengths, g, t).to_device()
  batch = _batch(config, lengths, g, t, seed=2)
  optimizer = optax.adam(1e-2)
  results = []
  for shared in (True, False):
    graphdef, params = nnx.split(Llama(config, rngs=nnx.Rngs(3)))
    step = grpo.make_train_step(graphdef, optimizer, grpo.GrpoConfig(), shared=shared)
    params, _, metrics = step(params, optimizer.init(params), batch, layout)
    results.append((jax.tree.leaves(params), metrics))
  (p_s, m_s), (p_u, m_u) = results
  np.testing.assert_allclose(m_s['loss'], m_u['loss'], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(m_s['grad_norm'], m_u['grad_norm'], rtol=1e-4)
  for a, e in zip(p_s, p_u):
    np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5)


def _tree_batch(config, layout, leaves, rng):
  """A TreeGrpoBatch of random tokens and advantages, every token counted, log-probs near
  the policy's (about -log V), the reference's apart from the sampler's."""
  shapes = layout.level_shapes
  base = -float(np.log(config.vocab_size))
  return grpo.TreeGrpoBatch(
      level_tokens=[jnp.asarray(rng.integers(1, config.vocab_size, s), jnp.int32)
                    for s in shapes],
      mask=[jnp.ones(s) for s in shapes[1:]],
      advantages=jnp.asarray(rng.standard_normal(leaves), jnp.float32),
      old_logp=[jnp.full(s, base) for s in shapes[1:]],
      ref_logp=[jnp.full(s, base - 0.5) for s in shapes[1:]])


def test_train_steps_compile_once_for_batches_of_one_shape():
  """The prompts' real lengths are data: a training loop over batches of one shape (Bp, P, G,
  T; a tree's level sizes and capacities) compiles its step once, one-level and tree alike."""
  config = get_config('tiny_gqa')
  graphdef, params = nnx.split(Llama(config, rngs=nnx.Rngs(4)))
  optimizer, cfg = optax.sgd(0.1), grpo.GrpoConfig()
  step = grpo.make_train_step(graphdef, optimizer, cfg, kv_block=4)
  state = (params, optimizer.init(params))
  for seed, lengths in enumerate([(6, 2), (3, 5), (1, 6)]):
    layout = plan_prefill(lengths, 2, 3, prompt_capacity=6).to_device()
    *state, metrics = step(*state, _batch(config, lengths, 2, 3, seed, capacity=6), layout)
    assert np.isfinite(float(metrics['loss']))
  assert step.jitted._cache_size() == 1

  tree_step = grpo.make_tree_train_step(graphdef, optimizer, cfg, kv_block=4)
  rng = np.random.default_rng(5)
  for prompt, branches in ((7, (3, 2)), (2, (1, 3)), (5, (3, 3))):
    layout = tp.plan_tree_prefill([-1, 0, 0, 1, 1, 2, 2], [prompt, *branches, 2, 1, 2, 2],
                                  capacities=[7, 3, 2]).to_device()
    *state, metrics = tree_step(*state, _tree_batch(config, layout, 4, rng), layout)
    assert np.isfinite(float(metrics['loss']))
  assert tree_step.jitted._cache_size() == 1


def _assert_same_step(got, expected, label):
  """A step's (params, opt_state, metrics) against (params, metrics) of another."""
  (p_got, _, m_got), (p_expected, m_expected) = got, expected
  for name in ('loss', 'kl', 'clip_fraction', 'grad_norm'):
    np.testing.assert_allclose(m_got[name], m_expected[name], rtol=1e-5, atol=1e-6,
                               err_msg=f'{name}, {label}')
  for a, e in zip(jax.tree.leaves(p_got), jax.tree.leaves(p_expected)):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6, err_msg=label)


@pytest.mark.skipif(jax.device_count() < 4, reason='needs 4 devices (tests/conftest.py sets '
                    'XLA_FLAGS before jax)')
def test_data_parallel_train_step_is_the_one_device_step():
  """Over a dp mesh each shard trains on its block of prompts (its own layout) and the
  gradients are averaged: the same metrics and parameters as one device on the whole batch,
  shared and unshared forwards, dp = 2 and 4; bad meshes and layouts are refused by name."""
  config = get_config('tiny_gqa')
  lengths, g, t = (3, 6, 2, 5), 2, 3
  plan = plan_prefill(lengths, g, t)
  batch = _batch(config, lengths, g, t, seed=9)
  optimizer, cfg = optax.sgd(0.1), grpo.GrpoConfig()
  graphdef, params = nnx.split(Llama(config, rngs=nnx.Rngs(6)))
  run = lambda step, layout: step(jax.tree.map(jnp.copy, params), optimizer.init(params), batch,
                                  layout)
  for shared in (True, False):
    one = grpo.make_train_step(graphdef, optimizer, cfg, shared=shared, kv_block=4)
    p_one, _, m_one = run(one, plan.to_device())
    for dp in (2, 4):
      mesh = jax.make_mesh((dp,), ('dp',), devices=jax.devices()[:dp])
      step = grpo.make_train_step(graphdef, optimizer, cfg, shared=shared, kv_block=4, mesh=mesh)
      _assert_same_step(run(step, plan.to_device_sharded(dp)), (p_one, m_one),
                        f'dp={dp}, shared={shared}')

  mesh = jax.make_mesh((2,), ('dp',), devices=jax.devices()[:2])
  step = grpo.make_train_step(graphdef, optimizer, cfg, kv_block=4, mesh=mesh)
  # Parameters and optimizer state in dp slices (`shard_over_dp`): gathered for the step, each
  # slice updated where it lives, the same step; the state stays in slices.
  adam = optax.adam(1e-2)
  one = grpo.make_train_step(graphdef, adam, cfg, kv_block=4)
  expected = one(jax.tree.map(jnp.copy, params), adam.init(params), batch, plan.to_device())
  sliced = shard_over_dp(params, mesh)
  got = grpo.make_train_step(graphdef, adam, cfg, kv_block=4, mesh=mesh)(
      sliced, shard_over_dp(adam.init(params), mesh), batch, plan.to_device_sharded(2))
  np.testing.assert_allclose(got[2]['loss'], expected[2]['loss'], rtol=1e-5)
  for a, e in zip(jax.tree.leaves(got[0]), jax.tree.leaves(expected[0])):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-3)  # Adam's first step: +-lr a weight
  for state in got[:2]:
    leaves = jax.tree.leaves(state)
    assert sum('dp' in x.sharding.spec for x in leaves) >= len(leaves) // 2
  # The state as the step leaves it is the state it was compiled for: one compile, step after
  # step (a state on one device, or in dp slices; `on_one_mesh`).
  for placed in (lambda x: x, lambda x: shard_over_dp(x, mesh)):
    step = grpo.make_train_step(graphdef, adam, cfg, kv_block=4, mesh=mesh)
    state = (placed(jax.tree.map(jnp.copy, params)), placed(adam.init(params)))
    for _ in range(3):
      *state, _ = step(*state, batch, plan.to_device_sharded(2))
    assert step.jitted._cache_size() == 1
  with pytest.raises(ValueError, match='layout must be .* 2 dp shards'):
    run(step, plan.to_device())
  with pytest.raises(ValueError, match=r'num_shards \(dp\) must be >= 1 and divide the 4'):
    plan.to_device_sharded(3)
  tp_mesh = jax.make_mesh((2, 2), ('dp', 'tp'), devices=jax.devices()[:4])
  step = grpo.make_train_step(graphdef, optimizer, cfg, kv_block=4, mesh=tp_mesh)
  with pytest.raises(ValueError, match="mesh has tp=2 and the model's tp=1"):
    run(step, plan.to_device_sharded(2))


def _forest(trees, rng):
  """parents and lengths of `trees` copies of one shape (root, 2 branches, 1 + 3 leaves) with
  random lengths, numbered root by root (the plan orders each level by its parents)."""
  parents, lengths = [], []
  for _ in range(trees):
    base = len(parents)
    parents += [-1, base, base, base + 1, base + 2, base + 2, base + 2]
    lengths += [int(rng.integers(1, 7)), *rng.integers(1, 4, 2).tolist(),
                *rng.integers(1, 3, 4).tolist()]
  return parents, lengths


@pytest.mark.skipif(jax.device_count() < 4, reason='needs 4 devices (tests/conftest.py sets '
                    'XLA_FLAGS before jax)')
def test_data_parallel_tree_train_step_is_the_one_device_step():
  """`make_tree_train_step(mesh=)`: a forest of four trees (not uniform), each shard its block
  of roots: the one-device step's metrics and parameters at dp = 2 and 4; forests that do not
  split are refused."""
  config = get_config('tiny_mha')
  rng = np.random.default_rng(21)
  plan = tp.plan_tree_prefill(*_forest(4, rng), capacities=[6, 3, 2])
  layout = plan.to_device()
  shapes = layout.level_shapes
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  base = -float(np.log(config.vocab_size))
  draw = lambda: [f32(base + 0.3 * rng.standard_normal(s)) for s in shapes[1:]]
  batch = grpo.TreeGrpoBatch(
      level_tokens=[jnp.asarray(rng.integers(1, config.vocab_size, s), jnp.int32)
                    for s in shapes],
      mask=[f32(np.arange(c)[None, :] < np.asarray(n)[:, None])
            for n, c in zip(layout.lengths[1:], layout.capacities[1:])],
      advantages=f32(rng.standard_normal(len(plan.leaves))), old_logp=draw(), ref_logp=draw())
  optimizer, cfg = optax.sgd(0.1), grpo.GrpoConfig()
  graphdef, params = nnx.split(Llama(config, rngs=nnx.Rngs(2)))
  run = lambda step, layout: step(jax.tree.map(jnp.copy, params), optimizer.init(params), batch,
                                  layout)
  p_one, _, m_one = run(grpo.make_tree_train_step(graphdef, optimizer, cfg, kv_block=4), layout)
  for dp in (2, 4):
    mesh = jax.make_mesh((dp,), ('dp',), devices=jax.devices()[:dp])
    step = grpo.make_tree_train_step(graphdef, optimizer, cfg, kv_block=4, mesh=mesh)
    _assert_same_step(run(step, plan.to_device_sharded(dp)), (p_one, m_one), f'dp={dp}')

  with pytest.raises(ValueError, match=r'divide the 4 roots'):
    plan.shards(3)
  with pytest.raises(ValueError, match='every leaf at the last level'):
    tp.plan_tree_prefill([-1, 0, 0, 1, -1, 4, 4, 5], [3, 2, 2, 1, 3, 2, 2, 1]).shards(2)
  with pytest.raises(ValueError, match='equal level sizes'):
    tp.plan_tree_prefill([-1, 0, 0, -1, 3], [3, 2, 2, 3, 2]).shards(2)
  with pytest.raises(ValueError, match="dp shard 1's trees share their tokens differently"):
    tp.plan_tree_prefill([-1, 0, 0, 1, 1, 1, 2, -1, 7, 7, 8, 8, 9, 9],  # 3 + 1 leaves, 2 + 2
                         [3, 2, 2, 1, 1, 1, 1, 3, 2, 2, 1, 1, 1, 1]).to_device_sharded(2)


@pytest.mark.skipif(jax.device_count() < 4, reason='needs 4 devices (tests/conftest.py sets '
                    'XLA_FLAGS before jax)')
def test_tensor_parallel_train_steps_are_the_one_device_steps():
  """A model on a tp mesh (`Llama(..., mesh=)`, parameters split by the rules table) trains with
  each device's heads in one shard_map a layer: the one-device steps' metrics and parameters,
  one-level and tree, and with dp too (a 2 x 2 mesh); kv heads tp does not divide are refused."""
  from models import sharding_rules as sr

  config = get_config('tiny_mha', num_layers=2)  # two layers, not three: a third of the compiles
  mesh = jax.make_mesh((2,), ('tp',), devices=jax.devices()[:2])
  graphdef, params = nnx.split(Llama(config, rngs=nnx.Rngs(6)))
  graphdef_tp, _ = nnx.split(Llama(config, rngs=nnx.Rngs(6), mesh=mesh))
  params_tp = jax.device_put(params, sr.param_shardings(params, sr.auto_mesh(mesh)))
  assert any('tp' in leaf.sharding.spec for leaf in jax.tree.leaves(params_tp))
  optimizer, cfg = optax.sgd(0.1), grpo.GrpoConfig()
  init = lambda p: (jax.tree.map(jnp.copy, p), optimizer.init(p))

  lengths, g, t = (3, 6), 2, 3
  batch, layout = _batch(config, lengths, g, t, seed=4), plan_prefill(lengths, g, t).to_device()
  expected = grpo.make_train_step(graphdef, optimizer, cfg, kv_block=4)(*init(params), batch,
                                                                       layout)
  got = grpo.make_train_step(graphdef_tp, optimizer, cfg, kv_block=4)(*init(params_tp), batch,
                                                                      layout)
  _assert_same_step(got, expected[::2], 'tp=2')
  step = grpo.make_train_step(graphdef_tp, optimizer, cfg, kv_block=4)
  state = init(params_tp)
  for _ in range(3):  # the outputs' shardings are the inputs' (`on_one_mesh`): one compile
    *state, _ = step(*state, batch, layout)
  assert step.jitted._cache_size() == 1
  jaxpr = str(jax.make_jaxpr(lambda p: grpo.loss_and_grads(graphdef_tp, p, batch, layout, cfg,
                                                           kv_block=4))(params_tp))
  assert jaxpr.count('shard_map[') == 2 * config.num_layers  # each layer's, forward + backward

  rng = np.random.default_rng(8)
  plan = tp.plan_tree_prefill(*_forest(2, rng), capacities=[6, 3, 2])
  layout = plan.to_device()
  tree = _tree_batch(config, layout, len(plan.leaves), rng)
  expected = grpo.make_tree_train_step(graphdef, optimizer, cfg, kv_block=4)(*init(params),
                                                                            tree, layout)
  got = grpo.make_tree_train_step(graphdef_tp, optimizer, cfg, kv_block=4)(*init(params_tp),
                                                                           tree, layout)
  _assert_same_step(got, expected[::2], 'tree, tp=2')

  # dp and tp together: make_train_step's dp shard_map (dp manual) around the model's tp one.
  both = jax.make_mesh((2, 2), ('dp', 'tp'), devices=jax.devices()[:4])
  graphdef_both, _ = nnx.split(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0),
                                                              mesh=both)))
  params_both = shard_over_dp(
      jax.device_put(params, sr.param_shardings(params, sr.auto_mesh(both))), both)
  assert any({'dp', 'tp'} <= set(x.sharding.spec) for x in jax.tree.leaves(params_both))
  got = grpo.make_tree_train_step(graphdef_both, optimizer, cfg, kv_block=4, mesh=both)(
      *init(params_both), tree, plan.to_device_sharded(2))
  _assert_same_step(got, expected[::2], 'tree, dp=2, tp=2')
  with pytest.raises(ValueError, match='tp=2 to divide the kv heads K=1'):
    fw.shared_forward(Llama(get_config('tiny_llama3'), rngs=nnx.Rngs(0), mesh=mesh),
                      batch.prompts, batch.completions, plan_prefill(lengths, g, t).to_device())


def test_per_sequence_forward_matches_unshared():
  """The benchmark's per-sequence model (jax.nn attention) is the ground truth's numbers."""
  config = get_config('tiny_mha')
  model = Llama(config, rngs=nnx.Rngs(4))
  lengths, g, t = (3, 6), 2, 4
  layout = plan_prefill(lengths, g, t).to_device()
  batch = _batch(config, lengths, g, t, seed=5)
  attention = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
  actual = fw.per_sequence_forward(model, batch.prompts, batch.completions,
                                   layout.prompt_lengths, g, attention)
  expected = fw.unshared_forward(model, batch.prompts, batch.completions, layout.prompt_lengths, g)
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


def _path_logprobs(model, plan, layout, level_tokens):
  """Ground truth of `tree_forward`: each root-to-leaf path's own sequence through the model
  (`causal_logits`), every non-root node's real tokens scored on its first path."""
  tokens = tp.path_sequences(layout, tp.write_tree_kv(layout, level_tokens))  # [paths, S]
  logp = jax.nn.log_softmax(fw.causal_logits(model, tokens), axis=-1)
  out = [jnp.zeros(x.shape) for x in level_tokens[1:]]
  for i, leaf in enumerate(plan.leaves):
    for x in plan.path(leaf)[1:]:
      d, first, n = plan.depth(x), plan.offsets[x], plan.lengths[x]
      scored = logp[i, first - 1:first + n - 1]  # token j from the position before it
      picked = jnp.take_along_axis(scored, tokens[i, first:first + n, None], axis=-1)[:, 0]
      out[d - 1] = out[d - 1].at[plan.rows[x], :n].set(picked)
  return out


def test_tree_forward_matches_each_path_unshared():
  """A three-level rollout tree: every non-root node's log-probs, and the gradient of a loss
  over them, equal each root-to-leaf path run as its own sequence (GQA, 2 layers)."""
  config = get_config('tiny_gqa')
  model = Llama(config, rngs=nnx.Rngs(6))
  plan = tp.plan_tree_prefill([-1, 0, 0, 1, 1, 2, -1, 6], [5, 3, 4, 2, 4, 3, 4, 2])
  layout = plan.to_device()
  rng = np.random.default_rng(7)
  level_tokens = [jnp.asarray(rng.integers(1, config.vocab_size, shape), jnp.int32)
                  for shape in layout.level_shapes]
  real = [jnp.arange(c)[None, :] < n[:, None]
          for n, c in zip(layout.lengths[1:], layout.capacities[1:])]
  weights = [jnp.asarray(rng.standard_normal(r.shape), jnp.float32) * r for r in real]
  graphdef, params = nnx.split(model)

  def loss(params, forward):
    logps = forward(nnx.merge(graphdef, params))
    return sum(jnp.sum(jnp.where(r, lp, 0.0) * w) for lp, r, w in zip(logps, real, weights))
  tree = lambda m: fw.tree_forward(m, level_tokens, layout, kv_block=4)
  paths = lambda m: _path_logprobs(m, plan, layout, level_tokens)
  for d, (a, e, r) in enumerate(zip(jax.jit(tree)(model), paths(model), real)):
    np.testing.assert_allclose(np.asarray(a)[r], np.asarray(e)[r], rtol=1e-5, atol=1e-5,
                               err_msg=f'level {d + 1}')
  grads_t = jax.jit(jax.grad(lambda p: loss(p, tree)))(params)
  grads_p = jax.grad(lambda p: loss(p, paths))(params)
  for (path, a), e in zip(jax.tree.leaves_with_path(grads_t), jax.tree.leaves(grads_p)):
    scale = float(np.abs(e).max())
    assert scale > 0, f'{jax.tree_util.keystr(path)}: no gradient'
    np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5 * scale,
                               err_msg=jax.tree_util.keystr(path))


def test_arithmetic_rewards_and_mask_by_hand():
  task = rollout.ArithmeticTask(max_operand=9, completion_length=3)
  d = lambda x: rollout.DIGIT0 + x
  ops = np.array([[7, 5]])  # 12: target [1, 2, eos]
  completions = np.array([
      [d(1), d(2), rollout.EOS],  # exact: 1 + 1
      [d(1), d(3), rollout.EOS],  # 2 of 3
      [d(2), d(1), d(0)],  # nothing
  ])
  np.testing.assert_allclose(task.rewards(completions, ops, 3), [[2.0, 2 / 3, 0.0]], rtol=1e-6)
  mask = rollout.completion_mask(np.array([[d(1), rollout.EOS, d(3)], [d(1), d(2), d(3)]]))
  np.testing.assert_array_equal(mask, [[1, 1, 0], [1, 1, 1]])
  prompts, ops = task.prompts(np.random.default_rng(0), 2)
  assert (prompts[:, 1] - rollout.DIGIT0 == ops[:, 0]).all()
  assert (prompts[:, 4] == rollout.EQUALS).all()


def test_training_attention_cost_by_hand():
  # 1 prompt of 3 tokens, G = 2 completions of 2, N = K = H = 1. Pairs: shared 6 + 2 * (2 * 3 + 3)
  # = 24; per-sequence 2 * (5 * 6 / 2) = 30. FLOPs = 6 matmuls * 2 * pairs.
  shared = costs.training_attention_cost(1, 2, 3, 2, 1, 1, 1, shared=True, dtype_bytes=1)
  unshared = costs.training_attention_cost(1, 2, 3, 2, 1, 1, 1, shared=False, dtype_bytes=1)
  assert (shared.flops, unshared.flops) == (288.0, 360.0)
  # q tokens: 3 + 4 = 7 (shared), 10 (per-sequence); bytes = 6 q + 3 * 2 kv per token.
  assert (shared.bytes, unshared.bytes) == (7 * 12.0, 10 * 12.0)
  with pytest.raises(ValueError, match='num_q_heads'):
    costs.training_attention_cost(1, 2, 3, 2, 3, 2, 1, shared=True)


def test_tree_grpo_loss_is_the_loss_of_every_path():
  """`tree_grpo_loss` (each shared token once, weighted by its leaves) equals `grpo_loss` over
  every leaf's path as its own sample: loss, metrics and the gradient in every level's logp,
  with masked tokens, both advantage signs and ratios past the clip."""
  plan = tp.plan_tree_prefill([-1, 0, 0, 1, 1, 1, 2, 2], [4, 3, 5, 2, 4, 3, 5, 1])
  layout = plan.to_device()
  rng = np.random.default_rng(13)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  shapes = layout.level_shapes[1:]
  draw = lambda: [f32(-2 + 0.4 * rng.standard_normal(s)) for s in shapes]
  real = [np.arange(c)[None, :] < np.asarray(n)[:, None]
          for n, c in zip(layout.lengths[1:], layout.capacities[1:])]
  mask = [f32(r & (rng.random(r.shape) < 0.8)) for r in real]
  batch = grpo.TreeGrpoBatch(
      level_tokens=[jnp.zeros(s, jnp.int32) for s in layout.level_shapes], mask=mask,
      advantages=f32(rng.standard_normal(len(plan.leaves))), old_logp=draw(), ref_logp=draw())
  assert (batch.advantages > 0).any() and (batch.advantages < 0).any()
  cfg = grpo.GrpoConfig()

  def per_path(level_logp):
    seq = lambda levels: tp.path_sequences(layout, tp.write_tree_kv(
        layout, [jnp.zeros(layout.level_shapes[0])] + list(levels)))  # [paths, S]
    paths = grpo.GrpoBatch(prompts=None, completions=None, mask=seq(batch.mask),
                           advantages=batch.advantages, old_logp=seq(batch.old_logp),
                           ref_logp=seq(batch.ref_logp))
    return grpo.grpo_loss(seq(level_logp), paths, cfg)

  logp = draw()
  (loss_t, m_t), grads_t = jax.value_and_grad(
      lambda lp: grpo.tree_grpo_loss(lp, batch, layout, cfg), has_aux=True)(logp)
  (loss_p, m_p), grads_p = jax.value_and_grad(per_path, has_aux=True)(logp)
  assert 0 < float(m_p['clip_fraction']) < 1
  np.testing.assert_allclose(loss_t, loss_p, rtol=1e-5, atol=1e-6)
  for name in ('kl', 'clip_fraction'):
    np.testing.assert_allclose(m_t[name], m_p[name], rtol=1e-5, atol=1e-6, err_msg=name)
  for d, (a, e) in enumerate(zip(grads_t, grads_p)):
    assert np.abs(np.asarray(e)).max() > 0, f'level {d + 1}: no gradient'
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-7, err_msg=f'level {d + 1}')


def test_tree_loss_and_grads_match_every_path_through_the_model():
  """`tree_loss_and_grads` (tree_forward + tree_grpo_loss) against the same loss of log-probs
  from every path run as its own sequence through the model (`grpo_loss`'s equal, above): the
  loss and every parameter's gradient, and one step of `make_tree_train_step`."""
  config = get_config('tiny_mha')
  plan = tp.plan_tree_prefill([-1, 0, 0, 1, 1, 2], [4, 3, 2, 3, 2, 4])
  layout = plan.to_device()
  rng = np.random.default_rng(17)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  tokens = [jnp.asarray(rng.integers(1, config.vocab_size, s), jnp.int32)
            for s in layout.level_shapes]
  base = -float(np.log(config.vocab_size))
  draw = lambda: [f32(base + 0.3 * rng.standard_normal(s)) for s in layout.level_shapes[1:]]
  mask = [f32(np.arange(c)[None, :] < np.asarray(n)[:, None])
          for n, c in zip(layout.lengths[1:], layout.capacities[1:])]
  batch = grpo.TreeGrpoBatch(level_tokens=tokens, mask=mask,
                             advantages=f32(rng.standard_normal(len(plan.leaves))),
                             old_logp=draw(), ref_logp=draw())
  cfg = grpo.GrpoConfig()
  graphdef, params = nnx.split(Llama(config, rngs=nnx.Rngs(8)))
  (loss_t, _), grads_t = jax.jit(
      lambda p: grpo.tree_loss_and_grads(graphdef, p, batch, layout, cfg, kv_block=4))(params)

  def per_path(params):
    model = nnx.merge(graphdef, params)
    logp = _path_logprobs(model, plan, layout, tokens)
    return grpo.tree_grpo_loss(logp, batch, layout, cfg)[0]
  loss_p, grads_p = jax.jit(jax.value_and_grad(per_path))(params)
  np.testing.assert_allclose(loss_t, loss_p, rtol=1e-5, atol=1e-6)
  for (path, a), e in zip(jax.tree.leaves_with_path(grads_t), jax.tree.leaves(grads_p)):
    scale = float(np.abs(e).max())
    assert scale > 0, f'{jax.tree_util.keystr(path)}: no gradient'
    np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5 * scale,
                               err_msg=jax.tree_util.keystr(path))

  # One step of `make_tree_train_step` lands where the per-path gradients take it (SGD: Adam's
  # first step divides each gradient by its own size, amplifying rounding where it is ~0).
  optimizer = optax.sgd(0.1)
  step = grpo.make_tree_train_step(graphdef, optimizer, cfg, kv_block=4)
  stepped, _, metrics = step(jax.tree.map(jnp.copy, params), optimizer.init(params), batch,
                             layout)
  np.testing.assert_allclose(metrics['loss'], loss_p, rtol=1e-5, atol=1e-6)
  updates, _ = optimizer.update(grads_p, optimizer.init(params), params)
  expected = optax.apply_updates(params, updates)
  for a, e in zip(jax.tree.leaves(stepped), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5)


def test_toy_tree_rollouts_are_the_group_step_of_the_same_samples():
  """`train_grpo_toy --branches`: rollout trees sampled and assembled into a `TreeGrpoBatch`
  score every sample (its branch, then its own tokens) as the one-level batch of the same
  completions does: the sampling log-probs, and the GRPO loss and gradients."""
  from absl import app as absl_app

  from experiments import grpo_toy as toy

  task = rollout.ArithmeticTask(completion_length=4)
  config = get_config('tiny_gqa', vocab_size=rollout.VOCAB_SIZE)
  graphdef, params = nnx.split(Llama(config, rngs=nnx.Rngs(5)))
  cfg = grpo.GrpoConfig()
  bp, g, b, l, t = 3, 6, 2, 2, task.completion_length
  rollout_fn, _, make_batch = toy.tree_rollouts(task, graphdef, optax.sgd(0.1), cfg, bp, g, b, l)
  for bad in (dict(b=4), dict(b=0), dict(l=0), dict(l=t)):  # sizes named in a usage error
    sizes = dict(dict(b=b, l=l), **bad)
    with pytest.raises(absl_app.UsageError, match='--branch'):
      toy.tree_rollouts(task, graphdef, optax.sgd(0.1), cfg, bp, g, sizes['b'], sizes['l'])
  prompts, ops = task.prompts(np.random.default_rng(23), bp)
  tree, completions, layout = make_batch(
      prompts, rollout_fn(params, params, jnp.asarray(prompts), jax.random.key(4)))
  assert completions.shape == (bp * g, t)
  advantages = grpo.group_advantages(jnp.asarray(task.rewards(completions, ops, g)), cfg)
  tree = dataclasses.replace(tree, advantages=advantages)

  prefill = plan_prefill([5] * bp, g, t).to_device()
  model = nnx.merge(graphdef, params)
  logp = fw.shared_forward(model, jnp.asarray(prompts), jnp.asarray(completions), prefill)
  per = g // b  # leaves a branch: leaf r continues branch r // per
  np.testing.assert_allclose(tree.old_logp[0], logp[::per, :l], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(tree.old_logp[1], logp[:, l:], rtol=1e-5, atol=1e-5)
  mask = rollout.completion_mask(completions)
  np.testing.assert_array_equal(np.repeat(np.asarray(tree.mask[0]), per, axis=0), mask[:, :l])
  old = jnp.concatenate([jnp.repeat(tree.old_logp[0], per, axis=0), tree.old_logp[1]], axis=1)
  ref = old + 0.1  # some ratio to the reference
  tree = dataclasses.replace(tree, ref_logp=[x + 0.1 for x in tree.old_logp])
  flat = grpo.GrpoBatch(prompts=jnp.asarray(prompts), completions=jnp.asarray(completions),
                        mask=jnp.asarray(mask), advantages=advantages, old_logp=old, ref_logp=ref)
  (loss_t, _), grads_t = grpo.tree_loss_and_grads(graphdef, params, tree, layout, cfg)
  (loss_f, _), grads_f = grpo.loss_and_grads(graphdef, params, flat, prefill, cfg)
  assert float(loss_f) != 0
  np.testing.assert_allclose(loss_t, loss_f, rtol=1e-5, atol=1e-6)
  for (path, a), e in zip(jax.tree.leaves_with_path(grads_t), jax.tree.leaves(grads_f)):
    np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5 * float(np.abs(e).max()),
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.skipif(jax.device_count() < 2, reason='needs 2 devices (tests/conftest.py sets '
                    'XLA_FLAGS before jax)')
@pytest.mark.parametrize('branches', [0, 2])
def test_toy_trains_data_parallel_as_on_one_device(branches):
  """`train_grpo_toy --dp=2`: the toy's step over a dp mesh (its batch's sharded layout) takes
  the one-device step's parameters, one-level and over rollout trees; a bad --dp is named."""
  from absl import app as absl_app

  from experiments import grpo_toy as toy

  task = rollout.ArithmeticTask(completion_length=4)
  config = get_config('tiny_gqa', vocab_size=rollout.VOCAB_SIZE)
  graphdef, params = nnx.split(Llama(config, rngs=nnx.Rngs(5)))
  optimizer, cfg, bp, g = optax.sgd(0.1), grpo.GrpoConfig(), 4, 4
  prompts, ops = task.prompts(np.random.default_rng(3), bp)
  results = []
  for mesh in (None, toy.dp_mesh(2, bp)):
    make = (functools.partial(toy.tree_rollouts, b=branches, l=1) if branches else
            toy.group_rollouts)
    rollout_fn, step_fn, make_batch = make(task, graphdef, optimizer, cfg, bp, g, mesh=mesh)
    batch, completions, layout = make_batch(
        prompts, rollout_fn(params, params, jnp.asarray(prompts), jax.random.key(2)))
    advantages = grpo.group_advantages(jnp.asarray(task.rewards(completions, ops, g)), cfg)
    results.append(step_fn(jax.tree.map(jnp.copy, params), optimizer.init(params),
                           dataclasses.replace(batch, advantages=advantages), layout))
  _assert_same_step(results[1], results[0][::2], f'toy, branches={branches}')
  for dp in (0, 3, 64):
    with pytest.raises(absl_app.UsageError, match='--dp'):
      toy.dp_mesh(dp, bp)


def test_train_parallel_step_smoke(tmp_path):
  """The parallel step benchmark's CPU smoke on two fake devices: the dp and tp steps give the
  one-device loss on the same batch; every variant runs; table, plot and README are written."""
  import json
  import os
  import subprocess
  import sys

  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=2')
  cmd = [sys.executable, '-m', 'experiments.train_parallel_step', '--steps=1', '--repeats=1',
         '--layers=1', f'--workdir={tmp_path}']
  subprocess.run(cmd, check=True, capture_output=True, timeout=600, env=env)
  records = [json.loads(line) for line in (tmp_path / 'results.jsonl').read_text().splitlines()]
  variants = {r['variant']: r for r in records}
  assert set(variants) == {'one_device', 'dp2', 'tp2'}
  assert all(r['status'] == 'ok' and r['time_s'] > 0 for r in variants.values()), variants
  for name in ('dp2', 'tp2'):
    assert variants[name]['loss_rel_diff'] < 1e-5 and variants[name]['speedup'] > 0
  for name in ('table.md', 'samples.png', 'README.md'):
    assert (tmp_path / name).stat().st_size > 0, name

# `make test` keeps these cases (conftest: `representative_cases`; `()`: the whole test is left
# to `make test-all`, another test of the default run covering its path).
representative_cases = {
    'test_data_parallel_train_step_is_the_one_device_step': (),
    'test_data_parallel_tree_train_step_is_the_one_device_step': (),
    'test_tensor_parallel_train_steps_are_the_one_device_steps': (),
    'test_toy_tree_rollouts_are_the_group_step_of_the_same_samples': (),
    'test_toy_trains_data_parallel_as_on_one_device': (),
    'test_train_parallel_step_smoke': (),
    'test_shared_forward_loss_and_grads_match_unshared': (),
}
