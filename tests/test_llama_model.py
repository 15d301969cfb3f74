"""The Llama model: configs, RoPE, tree forward vs the naive path, cached decode, sharding names."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hydrajax
from hydrajax import PromptNode, Segment, SharingPlan
from models import sharding_rules as sr
from models.config import PRESETS, Llama3RopeScaling, from_hf_dict, get_config
from models.hf_loading import abstract_model
from models.kv_cache import DenseKVCache, KVCache
from models.llama import Llama, ModelMode
from models.rope import apply_rope, inverse_frequencies


@pytest.mark.parametrize('name, billions', [
    ('llama2_7b', 6.74), ('codellama_7b', 6.74), ('codellama_13b', 13.02),
    ('codellama_34b', 33.74), ('llama3_8b', 8.03), ('llama3_2_1b', 1.24), ('llama3_1_70b', 70.55),
])
def test_preset_parameter_counts(name, billions):
  # Published sizes of these checkpoints, in billions of parameters.
  assert PRESETS[name].num_params() / 1e9 == pytest.approx(billions, rel=0.01)


def test_preset_details():
  assert PRESETS['codellama_34b'].group_size == 8
  assert PRESETS['llama3_1_8b'].rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 8192)
  assert PRESETS['llama3_2_1b'].tie_embeddings and not PRESETS['llama3_8b'].tie_embeddings
  assert get_config('tiny_gqa', num_layers=5).num_layers == 5
  with pytest.raises(ValueError, match='unknown preset'):
    get_config('llama9')


@pytest.mark.parametrize('field, value, match', [
    ('num_kv_heads', 4, 'multiple of num_kv_heads'),
    ('head_dim', 7, 'even'),
    ('dim', 0, 'dim must be >= 1'),
])
def test_config_validation(field, value, match):
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(PRESETS['tiny_gqa'], **{field: value})


def test_hf_config_v4_and_v5_rope_keys_agree():
  base = dict(vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)
  scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                 original_max_position_embeddings=64)
  v4 = from_hf_dict(dict(base, rope_theta=5e5, rope_scaling=dict(rope_type='llama3', **scaling)))
  v5 = from_hf_dict(dict(base, rope_parameters=dict(rope_type='llama3', rope_theta=5e5, **scaling)))
  assert v4 == v5
  assert v4.rope_theta == 5e5 and v4.head_dim == 4 and v4.rope_scaling.factor == 8.0
  assert from_hf_dict(v4.to_hf_dict()) == v4
  with pytest.raises(ValueError, match='rope type'):
    from_hf_dict(dict(base, rope_scaling=dict(rope_type='yarn', factor=2.0)))
  with pytest.raises(ValueError, match='attention_bias'):
    from_hf_dict(dict(base, attention_bias=True))


def test_rope_frequencies_and_rotation():
  # Worked by hand: H=4, theta=100 -> inv_freq = [1, 100^-0.5] = [1, 0.1].
  np.testing.assert_allclose(inverse_frequencies(4, 100.0), [1.0, 0.1], rtol=1e-6)
  # Llama 3.1 scaling, original context 64: wavelength 2*pi (< 16) stays, 2*pi/0.1 = 62.8 is
  # between 16 and 64, so smoothed: s = (64/62.83 - 1)/3 = 0.0062, f = (1-s)*0.1/8 + s*0.1.
  s = (64 / (2 * np.pi / 0.1) - 1) / 3
  np.testing.assert_allclose(inverse_frequencies(4, 100.0, Llama3RopeScaling(8.0, 1.0, 4.0, 64)),
                             [1.0, (1 - s) * 0.1 / 8 + s * 0.1], rtol=1e-5)
  inv = jnp.asarray(inverse_frequencies(4, 100.0))
  x = jnp.array([[[[1.0, 2.0, 3.0, 4.0]]]])  # [B=1, T=1, N=1, H=4]
  # Position 0 is the identity; position 1 rotates pair (x0, x2) by 1 rad and (x1, x3) by 0.1.
  np.testing.assert_allclose(apply_rope(x, jnp.zeros((1, 1), jnp.int32), inv), x)
  got = apply_rope(x, jnp.ones((1, 1), jnp.int32), inv)[0, 0, 0]
  c1, s1, c2, s2 = np.cos(1), np.sin(1), np.cos(0.1), np.sin(0.1)
  np.testing.assert_allclose(got, [1 * c1 - 3 * s1, 2 * c2 - 4 * s2, 3 * c1 + 1 * s1,
                                   4 * c2 + 2 * s2], rtol=1e-6)
  # Scores depend on relative positions only.
  q, k = jax.random.normal(jax.random.key(1), (2, 1, 1, 1, 4))
  dot = lambda pq, pk: float(jnp.sum(apply_rope(q, jnp.full((1, 1), pq), inv)
                                     * apply_rope(k, jnp.full((1, 1), pk), inv)))
  assert dot(7, 3) == pytest.approx(dot(12, 8), rel=1e-5)


@functools.lru_cache(maxsize=None)
def _model(name, dtype):
  """A random model per (config, dtype), shared by the tests (inputs get fresh seeds)."""
  return Llama(get_config(name), rngs=nnx.Rngs(3), dtype=dtype)


def _full_logits(model, tokens):
  """Reference: the naive path over whole sequences [B, S] at once."""
  b, s = tokens.shape
  cache = DenseKVCache.zeros(model.config, b, s, model.dtype)
  positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  return jax.jit(lambda t, p, c: model.forward_naive(t, p, c)[0])(tokens, positions, cache)


TOLERANCE = {jnp.float32: 2e-4, jnp.bfloat16: 6e-2}


@pytest.mark.parametrize('name, dtype', [('tiny_gqa', jnp.float32), ('tiny_mha', jnp.bfloat16)],
                         ids=['gqa_f32', 'mha_bf16'])
def test_tree_forward_appending_chunks_matches_full_forward(name, dtype):
  """3 rows share a 7-token segment; each holds 2 private tokens and appends T=3 at once."""
  model = _model(name, dtype)
  c = model.config
  prefix, own, t, page = 7, 2, 3, 4
  tokens = np.array(jax.random.randint(jax.random.key(4), (3, prefix + own + t), 0, c.vocab_size))
  tokens[:, :prefix] = tokens[0, :prefix]  # the shared prompt
  expected = _full_logits(model, jnp.asarray(tokens))[:, prefix + own:]
  # Buffer: prefix tokens [0, 7), then 2 pages of 4 per row from page 2 on (row b: 2+2b, 3+2b).
  length = (2 + 2 * 3) * page
  slots = np.zeros((3, prefix + own + t), np.int32)
  slots[:, :prefix] = np.arange(prefix)
  for b in range(3):
    slots[b, prefix:] = (2 + 2 * b) * page + np.arange(own + t)
  # Step 1, with the tree path itself: the prefix once (one row), then each row's 2 tokens.
  cache = KVCache.zeros(c, length, dtype)
  step = jax.jit(lambda *a: model(*a, impl='xla'))
  plan = SharingPlan(1, (), 1, (tuple(range(prefix)),), (prefix,), length)
  _, cache = step(jnp.asarray(tokens[:1, :prefix]), jnp.arange(prefix)[None], cache,
                  jnp.asarray(slots[:1, :prefix]), plan.to_device())
  seg = (Segment(0, prefix, 0, 3),)
  pages = tuple((2 + 2 * b, 3 + 2 * b) for b in range(3))
  plan = SharingPlan(3, seg, page, pages, (own,) * 3, length)
  pos = jnp.broadcast_to(jnp.arange(prefix, prefix + own), (3, own))
  _, cache = step(jnp.asarray(tokens[:, prefix:prefix + own]), pos, cache,
                  jnp.asarray(slots[:, prefix:prefix + own]), plan.to_device())
  # Step 2: append T=3 tokens per row; compare their logits.
  plan = SharingPlan(3, seg, page, pages, (own + t,) * 3, length)
  pos = jnp.broadcast_to(jnp.arange(prefix + own, prefix + own + t), (3, t))
  got, _ = step(jnp.asarray(tokens[:, prefix + own:]), pos, cache,
                jnp.asarray(slots[:, prefix + own:]), plan.to_device())
  err = jnp.linalg.norm(got - expected) / jnp.linalg.norm(expected)
  assert float(err) < TOLERANCE[dtype]
  if dtype == jnp.float32:
    np.testing.assert_array_equal(jnp.argmax(got, -1), jnp.argmax(expected, -1))


def test_cached_decode_one_token_at_a_time_equals_full_forward():
  model = _model('tiny_gqa', jnp.float32)
  c = model.config
  n, prompt = 13, 5
  tokens = jax.random.randint(jax.random.key(6), (1, n), 0, c.vocab_size)
  expected = _full_logits(model, tokens)[0]  # [n, V]
  length = 16
  cache = KVCache.zeros(c, length, jnp.float32)
  step = jax.jit(lambda *a: model(*a, impl='xla'))
  plan = SharingPlan(1, (), 1, (tuple(range(prompt)),), (prompt,), length)
  logits, cache = step(tokens[:, :prompt], jnp.arange(prompt)[None], cache,
                       jnp.arange(prompt)[None], plan.to_device())
  got = [logits[0]]
  pages = (tuple(range(n)),)
  for i in range(prompt, n):  # one token per call, its K/V appended at slot i
    layout = SharingPlan(1, (), 1, pages, (i + 1,), length).to_device()
    logits, cache = step(tokens[:, i:i + 1], jnp.full((1, 1), i), cache, jnp.full((1, 1), i),
                         layout)
    got.append(logits[0])
  got = jnp.concatenate(got)
  np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
  # The cache holds exactly the K/V a single full pass wrote.
  full_cache = KVCache.zeros(c, length, jnp.float32)
  plan = SharingPlan(1, (), 1, (tuple(range(n)),), (n,), length)
  _, full_cache = step(tokens, jnp.arange(n)[None], full_cache, jnp.arange(n)[None],
                       plan.to_device())
  np.testing.assert_allclose(cache.k, full_cache.k, rtol=1e-4, atol=1e-5)


def test_no_attention_mode_skips_attention_but_writes_the_cache():
  model = _model('tiny_mha', jnp.float32)
  c = model.config
  plan = hydrajax.plan_tree(PromptNode(6, num_samples=2), private_capacity=4, private_lengths=1)
  layout = plan.to_device()
  tokens = jnp.array([[3], [5]], jnp.int32)
  positions = jnp.full((2, 1), 6, jnp.int32)
  slots = jnp.asarray(np.array([[p[0] * plan.page_size] for p in plan.private_pages], np.int32))
  zeros = KVCache.zeros(c, plan.kv_tokens, jnp.float32)
  noise = jax.random.normal(jax.random.key(8), zeros.k.shape)
  noisy = KVCache(noise, -noise)
  run = jax.jit(lambda cache, impl: model(tokens, positions, cache, slots, layout, impl=impl),
                static_argnums=1)
  a, cache_a = run(zeros, ModelMode.NO_ATTENTION)
  b, cache_b = run(noisy, ModelMode.NO_ATTENTION)
  np.testing.assert_allclose(a, b)  # the cache contents do not matter without attention
  tree, cache_t = run(noisy, 'xla')
  assert float(jnp.max(jnp.abs(tree - b))) > 1e-3  # ... and they do with it
  # Layer 0's new K is the same in both modes (same inputs); it lands at the write slots.
  for s in np.asarray(slots)[:, 0]:
    np.testing.assert_allclose(cache_a.k[0, s], cache_t.k[0, s], rtol=1e-5)
    assert float(jnp.max(jnp.abs(cache_a.k[0, s]))) > 0


def test_padding_write_slots_are_dropped():
  model = _model('tiny_gqa', jnp.float32)
  c = model.config
  plan = SharingPlan(1, (), 1, ((0, 1, 0),), (3,), 8)  # the third query token is padding
  cache = KVCache.zeros(c, 8, jnp.float32)
  run = jax.jit(lambda *a: model(*a, impl='xla')[1])
  out = run(jnp.array([[1, 2, 3]]), jnp.array([[0, 1, 2]]), cache, jnp.array([[0, 1, 8]]),
            plan.to_device())
  written = np.flatnonzero(np.abs(np.asarray(out.k)).sum(axis=(0, 2, 3)))
  np.testing.assert_array_equal(written, [0, 1])


def test_bad_inputs_raise():
  model = _model('tiny_gqa', jnp.float32)
  c = model.config
  layout = SharingPlan(1, (), 4, ((0,),), (1,), 8).to_device()
  tok = jnp.zeros((1, 1), jnp.int32)
  cache = KVCache.zeros(c, 8, jnp.float32)
  with pytest.raises(ValueError, match=r'positions must be \[B, T\]'):
    model(tok, jnp.zeros((1, 2), jnp.int32), cache, tok, layout)
  with pytest.raises(ValueError, match='multiple of layout.page_size'):
    model(tok, tok, KVCache.zeros(c, 6, jnp.float32), tok, layout)
  with pytest.raises(ValueError, match='num_layers='):
    model(tok, tok, KVCache(cache.k[:1], cache.v[:1]), tok, layout)
  with pytest.raises(ValueError, match='layout has 1 rows'):
    model(jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32), cache,
          jnp.zeros((2, 1), jnp.int32), layout)


def test_every_parameter_has_logical_axes_and_a_rule():
  model = abstract_model(get_config('tiny_llama3'), jnp.float32)  # shapes and metadata only
  specs = sr.param_partition_specs(nnx.state(model, nnx.Param))
  flat = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  # embed, final_norm (tied: no lm_head), and per layer: attn_norm, wq, wkv, wo, mlp_norm, w_gate,
  # w_up, w_down
  assert len(flat) == 2 + 8 * model.config.num_layers
  assert all(isinstance(s, jax.sharding.PartitionSpec) for s in flat)
  assert sr.partition_spec(('embed', 'heads', 'head_dim')) == (
      jax.sharding.PartitionSpec(None, 'tp', None))
  assert sr.partition_spec(KVCache.logical_axes) == jax.sharding.PartitionSpec(None, 'dp', 'tp',
                                                                               None)
  with pytest.raises(ValueError, match='no rule'):
    sr.partition_spec(('experts',))


@pytest.mark.parametrize('name', ['tiny_gqa', 'tiny_mha', 'tiny_llama3'])
def test_fused_qkv_is_the_same_model(name, tmp_path):
  """`fuse_qkv`: one weight [D, 1, N + 2K, H] per layer on one device (q heads, k heads, v
  heads: the order of XLA's own concatenation) gives the separate weights' logits and cache
  (float32), greedy tokens and training forward; `save_params` writes wq and wkv again, so the
  checkpoint restores to the unfused model."""
  from models import generate as gen
  from models import prompt_plan as pp
  from models.saved_params import restore_params, save_params
  from models.llama import fused_qkv, split_qkv
  config = get_config(name)
  seed = int(np.random.default_rng().integers(2**31))
  unfused = Llama(config, rngs=nnx.Rngs(seed), dtype=jnp.float32)
  model = Llama(config, rngs=nnx.Rngs(seed), dtype=jnp.float32).fuse_qkv()
  assert model.qkv_fused and not unfused.qkv_fused
  layer = model.layers[0]
  assert not hasattr(layer, 'wq') and not hasattr(layer, 'wkv')
  n, kh = config.num_heads, config.num_kv_heads
  wqkv = layer.wqkv.get_value()
  assert wqkv.shape == (config.dim, 1, n + 2 * kh, config.head_dim)
  wq, wkv = unfused.layers[0].wq.get_value(), unfused.layers[0].wkv.get_value()
  np.testing.assert_array_equal(wqkv, fused_qkv(wq, wkv))
  flat = lambda w: w.reshape(config.dim, -1)
  np.testing.assert_array_equal(flat(wqkv), jnp.concatenate([flat(wq), flat(wkv)], axis=1))
  for got, want in zip(split_qkv(wqkv, n), (wq, wkv)):
    np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match=r'shards must be an int >= 1 dividing the kv heads'):
    fused_qkv(wq, wkv, shards=kh + 1)
  with pytest.raises(ValueError, match=r'fused_qkv needs wq \[D, N, H\] and wkv \[D, 2, K, H\]'):
    fused_qkv(wq, wkv[:, :1])
  assert model.fuse_qkv() is model  # idempotent

  prompts = [pp.prompt_node(list(range(1, 24)), children=[
      pp.prompt_node([5, 6, 7], num_samples=3), pp.prompt_node([9], num_samples=2)])]
  outs = [gen.generate(m, prompts, max_new_tokens=6, impl='xla', return_logprobs=True)
          for m in (unfused, model)]
  np.testing.assert_array_equal(np.asarray(outs[1].tokens), np.asarray(outs[0].tokens))
  np.testing.assert_allclose(np.asarray(outs[1].logprobs), np.asarray(outs[0].logprobs),
                             rtol=1e-5, atol=1e-5)

  from models.training.forward import causal_logits
  tokens = jnp.asarray(np.random.default_rng(seed).integers(0, config.vocab_size, (2, 11)))
  np.testing.assert_allclose(np.asarray(causal_logits(model, tokens)),
                             np.asarray(causal_logits(unfused, tokens)), rtol=1e-5, atol=1e-5)

  save_params(model, tmp_path / 'ckpt')
  restored = restore_params(tmp_path / 'ckpt', fuse_qkv=False)
  assert not restored.qkv_fused
  np.testing.assert_array_equal(restored.layers[1].wq.get_value(), unfused.layers[1].wq.get_value())
  np.testing.assert_array_equal(restored.layers[1].wkv.get_value(), unfused.layers[1].wkv.get_value())

# `make test` keeps these cases (conftest: `representative_cases`; `()`: the whole test is left
# to `make test-all`, another test of the default run covering its path).
representative_cases = {
    'test_fused_qkv_is_the_same_model': ('tiny_gqa',),
}
