"""Data parallel generation (issue 11): sharing groups split over `dp`, results equal one device.

8 fake CPU devices (tests/conftest.py). `generate` on dp:2, dp:2 x tp:2 and dp:2 x tp:4 meshes
for MHA, GQA and MQA tiny shapes gives the one-device greedy tokens (log-probs within float32
rounding); prefill logits and the cache's sharding; uneven groups, fewer groups than shards, the
Mosaic TPU kernels in interpret mode.
"""

import functools

import jax
import numpy as np
import pytest

from hydrajax.attention import parallel
from models import data_parallel as dpar
from models import generate as gen
from models import prompt_plan as pp
from models.config import get_config
from models.kv_cache import KVCache, cache_sharding
from models.llama import init_model
from models.sampling import SamplingParams

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason='needs 8 devices (tests/conftest.py sets XLA_FLAGS before jax)')

CONFIGS = {  # heads divide over tp = 4; MQA's single kv head is stored tp times
    'mha': get_config('tiny_mha', num_heads=8, num_kv_heads=8, vocab_size=96, num_layers=2),
    'gqa': get_config('tiny_gqa', num_heads=8, num_kv_heads=2, vocab_size=96),
    'mqa': get_config('tiny_llama3', num_heads=8, num_kv_heads=1),  # tied, vocab 101
}
CASES = [('mha', 'dp:2'), ('mha', 'dp:2,tp:2'), ('mha', 'dp:2,tp:4'), ('gqa', 'dp:2,tp:2'),
         ('gqa', 'dp:2,tp:4'), ('mqa', 'dp:2,tp:2'), ('mqa', 'dp:2,tp:4')]
# Each fold and each mesh once in `make test` (conftest); --all-cases runs the 7.
representative_cases = {
    'test_generate_greedy_tokens_equal_one_device': ('gqa_dp:2,tp:4',),
    'test_prefill_logits_equal_one_device_and_cache_sharded_as_the_rules_say': ('mqa-dp:2,tp:2',),
    'test_mosaic_tpu_kernels_in_interpret_mode': (),
}
NEW = 5


def _prompts(vocab, groups=3):
  """Independent sharing groups of different sizes (a tree, a single prompt, a deep chain)."""
  rng = np.random.default_rng(5)
  toks = lambda n: rng.integers(0, vocab, n).tolist()
  node = pp.prompt_node
  forest = [node(toks(21), [node(toks(5), num_samples=2), node(toks(9))]),
            node(toks(7), num_samples=2),
            node(toks(12), [node(toks(4), [node(toks(3), num_samples=3)]), node(toks(2))])]
  return forest[:groups]


@functools.cache
def _one_device(kind, groups=3, dtype='float32'):
  model = init_model(CONFIGS[kind], seed=2, dtype=dtype)
  return gen.generate(model, _prompts(model.config.vocab_size, groups), max_new_tokens=NEW,
                      impl='xla', return_logprobs=True)


def _check_equal(got, want, atol=1e-5, rtol=0.0):
  np.testing.assert_array_equal(got.prompt_ids, want.prompt_ids)
  np.testing.assert_array_equal(got.sample_ids, want.sample_ids)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.lengths, want.lengths)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=atol, rtol=rtol)


@pytest.mark.parametrize('kind,mesh', CASES, ids=[f'{k}_{m}' for k, m in CASES])
def test_generate_greedy_tokens_equal_one_device(kind, mesh):
  """3 groups over dp=2: the largest alone (4 rows), the two others together (5 rows); the
  first shard gets a padding row."""
  model = init_model(CONFIGS[kind], mesh=parallel.parse_mesh(mesh), seed=2)
  got = gen.generate(model, _prompts(model.config.vocab_size), max_new_tokens=NEW, impl='xla',
                     return_logprobs=True)
  _check_equal(got, _one_device(kind))


def test_fewer_groups_than_shards_runs_the_idle_shard_on_padding():
  model = init_model(CONFIGS['gqa'], mesh=parallel.parse_mesh('dp:2,tp:2'), seed=2)
  got = gen.generate(model, _prompts(96, groups=1), max_new_tokens=NEW, impl='xla',
                     return_logprobs=True)
  want = _one_device('gqa', groups=1)
  _check_equal(got, want)
  # A stop token every row draws at step 1: the padding rows (done from the start) do not keep
  # the loop running; outputs are -1 after the stop, as on one device.
  stop = [int(t) for t in set(want.tokens[:, 1].tolist())]
  got = gen.generate(model, _prompts(96, groups=1), max_new_tokens=NEW, impl='xla',
                     stop_tokens=stop)
  assert (got.lengths <= 2).all() and (got.tokens[:, 2:] == -1).all()
  np.testing.assert_array_equal(got.tokens[:, :2], want.tokens[:, :2])


def test_bfloat16_and_token_lists_with_samples():
  """Token lists (shared prefixes found) with 2 samples each, bf16, temperature sampling: the
  random keys depend on (seed, prompt, sample, index), not on the shard."""
  config = CONFIGS['gqa']
  rng = np.random.default_rng(1)
  prefix = rng.integers(0, 96, 17).tolist()
  prompts = ([prefix + rng.integers(0, 96, n).tolist() for n in (3, 6)]
             + [rng.integers(0, 96, n).tolist() for n in (11, 4, 8)])
  kwargs = dict(max_new_tokens=NEW, impl='xla', num_samples=2, seed=7,
                sampling=SamplingParams(temperature=0.8, top_k=20), return_logprobs=True)
  want = gen.generate(init_model(config, seed=2, dtype='bfloat16'), prompts, **kwargs)
  model = init_model(config, mesh=parallel.parse_mesh('dp:2,tp:4'), seed=2, dtype='bfloat16')
  _check_equal(gen.generate(model, prompts, **kwargs), want, atol=2e-2, rtol=1e-2)  # bf16 ulps


def test_mosaic_tpu_kernels_in_interpret_mode():
  """The TPU kernels (head dim 128 lanes) under the dp x tp shard_map, prefill and decode."""
  config = get_config('tiny_gqa', num_layers=1, num_heads=4, num_kv_heads=2, head_dim=128,
                      vocab_size=96)
  prompts = _prompts(96, groups=2)
  want = gen.generate(init_model(config, seed=2), prompts, max_new_tokens=3, impl='xla',
                      return_logprobs=True)
  model = init_model(config, mesh=parallel.parse_mesh('dp:2,tp:2'), seed=2)
  got = gen.generate(model, prompts, max_new_tokens=3, impl='mosaic_tpu',
                     prefill_impl='mosaic_tpu', interpret=True, return_logprobs=True)
  _check_equal(got, want)


@pytest.mark.parametrize('kind,mesh', [('mha', 'dp:2,tp:4'), ('mqa', 'dp:2,tp:2')])
def test_prefill_logits_equal_one_device_and_cache_sharded_as_the_rules_say(kind, mesh):
  config = CONFIGS[kind]
  forest = pp.prompt_forest(_prompts(config.vocab_size))
  reference = init_model(config, seed=2)
  tp = pp.plan_forest(forest, NEW)
  want, _ = gen.prefill(reference, tp, KVCache.zeros(config, tp.kv_tokens, 'float32'),
                        impl='xla', chunk=8)  # several rounds
  model = init_model(config, mesh=parallel.parse_mesh(mesh), seed=2)
  sp = dpar.plan_shards(forest, 2, NEW)
  cache = KVCache.zeros(config, sp.kv_tokens, 'float32', mesh=model.mesh)
  got, cache = gen.run_prefill(model, dpar.prefill_calls(sp, 8), sp.row_node, cache, impl='xla')
  want_sharding = cache_sharding(model.mesh, cache.k.shape)
  assert cache.k.sharding.spec[1] == 'dp'  # each shard its own tokens
  for x in (cache.k, cache.v):
    assert x.sharding.is_equivalent_to(want_sharding, 4), (x.sharding, want_sharding)
  real = sp.prompt_ids >= 0
  order = np.lexsort((sp.sample_ids[real], sp.prompt_ids[real]))
  want_order = np.lexsort((tp.sample_ids, tp.prompt_ids))
  np.testing.assert_allclose(np.asarray(got)[real][order], np.asarray(want)[want_order],
                             rtol=2e-5, atol=2e-5)


def test_plan_shards_balances_groups_and_pads_to_one_shape():
  forest = pp.prompt_forest(_prompts(96))
  sp = dpar.plan_shards(forest, 2, NEW)
  assert len({s.num_rows for s in sp.shards}) == 1 and len({s.kv_tokens for s in sp.shards}) == 1
  assert sp.kv_tokens % (2 * pp.private_capacity(NEW)) == 0
  assert sorted(sp.prompt_ids[sp.prompt_ids >= 0].tolist()) == [0, 0, 1, 2, 2, 3, 3, 3, 4]
  # the largest group alone, the other two together; whole groups per shard
  assert dpar.assign_groups([(100, 3), (10, 1), (60, 4)], 2) == [[0], [1, 2]]
  assert dpar.assign_groups([(5, 1)], 3) == [[0], [], []]
  idle = dpar.plan_shards(forest[:1], 4, NEW)  # fewer groups than shards: padding only
  assert [int((s.prompt_ids >= 0).sum()) for s in idle.shards] == [3, 0, 0, 0]
  with pytest.raises(ValueError, match='num_shards'):
    dpar.assign_groups([(5, 1)], 0)


def test_dense_ground_truth_needs_one_device():
  model = init_model(CONFIGS['mha'], mesh=parallel.parse_mesh('dp:2,tp:2'), seed=0)
  with pytest.raises(ValueError, match='runs on one device'):
    gen.generate(model, _prompts(96), max_new_tokens=2, impl='dense')
