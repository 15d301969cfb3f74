"""Tensor and data parallel Llama on 8 fake CPU devices equals the one-device model.

tests/conftest.py asks XLA for 8 host devices before jax starts. Cases: TP 1/2/4/8 and
DP x TP (2x2, 2x4) for MHA, GQA and MQA shapes (kv heads fewer than tp are replicated);
the forward pass (logits and cache), greedy `generate` and the engine; every parameter and
cache array's sharding against the rules; the collectives of one compiled decode step.
"""

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import hydrajax as hj
from hydrajax.attention import parallel
from models import hf_loading, saved_params
from models import sharding_rules as sr
from models.config import get_config
from models.engine import Engine, EngineConfig, SamplingParams
from models.generate import generate
from models.kv_cache import KVCache, cache_sharding
from models.llama import init_model, split_qkv
from models.prompt_plan import prompt_node

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason='needs 8 devices (tests/conftest.py sets XLA_FLAGS before jax)')

# Tiny shapes whose heads divide over 8 devices; vocab 96 divides over 8 too (vocab-parallel).
CONFIGS = {
    'mha': get_config('tiny_mha', num_heads=8, num_kv_heads=8, vocab_size=96, num_layers=2),
    'gqa': get_config('tiny_gqa', num_heads=8, num_kv_heads=2, vocab_size=96),
    'mqa': get_config('tiny_llama3', num_heads=8, num_kv_heads=1),  # tied, vocab 101: replicated
}
MESHES = {'tp1': (1, 1), 'tp2': (1, 2), 'tp4': (1, 4), 'tp8': (1, 8), 'dp2_tp2': (2, 2),
          'dp2_tp4': (2, 4)}
CASES = [('mha', m) for m in MESHES] + [('gqa', 'tp4'), ('gqa', 'dp2_tp4'), ('mqa', 'tp8'),
                                        ('mqa', 'dp2_tp2')]
# GQA on dp with tp and MQA on tp of 8 in `make test` (conftest); --all-cases runs the 10.
representative_cases = {
    'test_decode_step_equals_one_device': ('gqa_dp2_tp4',),
    'test_generate_in_blocks_gives_one_devices_tokens': ('mqa-tp8',),
    'test_generate_greedy_tokens_equal_one_device': ('gqa-tp4-bfloat16',),
    'test_fused_qkv_on_a_mesh_equals_one_device': ('gqa-dp2_tp2',),
    'test_one_decode_step_has_two_reductions_per_layer': ('tp8',),
}


def _mesh(name: str, explicit: bool = False):
  dp, tp = MESHES[name]
  shape, names = ((tp,), ('tp',)) if dp == 1 else ((dp, tp), ('dp', 'tp'))
  types = None if explicit else (jax.sharding.AxisType.Auto,) * len(names)
  return jax.make_mesh(shape, names, axis_types=types)


def _group_plan(seed: int) -> hj.SharingPlan:
  """One sharing group of 4 rows: a prefix, two children, private tails of different lengths."""
  rng = np.random.default_rng(seed)
  tree = hj.PromptNode(int(rng.integers(20, 40)), children=(
      hj.PromptNode(int(rng.integers(1, 9)), num_samples=3), hj.PromptNode(3, num_samples=1)))
  lengths = [int(x) for x in rng.integers(1, 16, 4)]
  plan = hj.plan_tree(tree, private_capacity=16, private_lengths=lengths)
  length = -(-plan.kv_tokens // 64) * 64  # every group the same buffer size
  return hj.SharingPlan(plan.num_rows, plan.segments, plan.page_size, plan.private_pages,
                        plan.private_lengths, max(length, 128))


def _decode_inputs(config, plans, seed=0):
  """Global tokens, positions, write slots (each row's last private token) and a random cache."""
  plan = parallel.join_plans(plans)
  rng = np.random.default_rng(seed)
  b = plan.num_rows
  tokens = rng.integers(0, config.vocab_size, (b, 1)).astype(np.int32)
  positions = np.array([[plan.private_position(r) + plan.private_lengths[r] - 1]
                        for r in range(b)], np.int32)
  slots = np.array([[plan.private_pages[r][0] * plan.page_size + plan.private_lengths[r] - 1]
                    for r in range(b)], np.int32)
  shape = (config.num_layers, plan.kv_tokens, config.num_kv_heads, config.head_dim)
  k, v = (rng.standard_normal(shape, np.float32) for _ in range(2))
  return plan, tokens, positions, slots, k, v


def _sharded_cache(model, k, v):
  r = sr.kv_replication(model.config.num_heads, model.config.num_kv_heads, model.mesh)
  k, v = np.repeat(k, r, axis=2), np.repeat(v, r, axis=2)
  if model.mesh is None:
    return KVCache(jnp.asarray(k), jnp.asarray(v))
  s = cache_sharding(model.mesh, k.shape)
  return KVCache(jax.device_put(k, s), jax.device_put(v, s))


def _forward(model, tokens, positions, cache, slots, layout):
  return jax.jit(lambda m, c: m(tokens, positions, c, slots, layout, impl='xla'))(model, cache)


def _check_shardings(model, cache):
  """Every parameter and cache array is placed as the rules table says."""
  state = nnx.state(model, nnx.Param)
  specs = sr.param_partition_specs(state, mesh=model.mesh)
  is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
  for (path, v), spec in zip(jax.tree_util.tree_leaves_with_path(state),
                             jax.tree.leaves(specs, is_leaf=is_spec)):
    sharding = v.sharding
    want = jax.sharding.NamedSharding(model.mesh, spec)
    assert sharding.is_equivalent_to(want, v.ndim), (jax.tree_util.keystr(path), sharding, spec)
  want = cache_sharding(model.mesh, cache.k.shape)
  for x in (cache.k, cache.v):
    assert x.sharding.is_equivalent_to(want, 4), (x.sharding, want)


@functools.cache
def _one_device(kind):
  """The one-device logits and cache of the decode-step cases (shared by every mesh)."""
  config = CONFIGS[kind]
  plan, tokens, positions, slots, k, v = _decode_inputs(config, [_group_plan(s) for s in (0, 1)])
  reference = init_model(config, seed=3)
  want, cache = _forward(reference, tokens, positions, _sharded_cache(reference, k, v), slots,
                         plan.to_device())
  return np.asarray(want), np.asarray(cache.k)


@pytest.mark.parametrize('kind,mesh_name', CASES, ids=[f'{k}_{m}' for k, m in CASES])
def test_decode_step_equals_one_device(kind, mesh_name):
  config = CONFIGS[kind]
  dp = MESHES[mesh_name][0]
  plans = [_group_plan(seed) for seed in range(2)]  # two independent sharing groups
  plan, tokens, positions, slots, k, v = _decode_inputs(config, plans)
  want, want_k = _one_device(kind)
  # jax.make_mesh's explicit axes (this JAX's default) on the largest meshes, Auto elsewhere.
  mesh = _mesh(mesh_name, explicit=mesh_name in ('tp8', 'dp2_tp4'))
  model = init_model(config, mesh=mesh, seed=3)
  layout = parallel.stack_layouts(parallel.split_plan(plan, dp)) if dp > 1 else plan.to_device()
  cache = _sharded_cache(model, k, v)
  _check_shardings(model, cache)
  got, got_cache = _forward(model, tokens, positions, cache, slots, layout)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(np.argmax(got, -1), np.argmax(want, -1))
  r = sr.kv_replication(config.num_heads, config.num_kv_heads, model.mesh)
  np.testing.assert_allclose(np.asarray(got_cache.k)[:, :, ::r], want_k, rtol=2e-5, atol=2e-5)
  _check_shardings(model, got_cache)


def _collectives(hlo: str) -> dict[str, int]:
  ops = ('all-reduce', 'reduce-scatter', 'all-gather', 'all-to-all', 'collective-permute')
  return {op: len(re.findall(rf'= \S+ {op}(?:-start)?\(', hlo)) for op in ops}


@pytest.mark.parametrize('mesh_name', ['tp8', 'dp2_tp4'])
def test_one_decode_step_has_two_reductions_per_layer(mesh_name):
  """Column-parallel q/k/v and gate/up, row-parallel wo and w_down: one all-reduce after each
  of wo and w_down per layer, plus one for the vocab-parallel embedding lookup (each device
  reads its slice of the table; the sum assembles the rows). Logits stay vocab-sharded."""
  config = CONFIGS['gqa']
  dp = MESHES[mesh_name][0]
  plans = [_group_plan(seed) for seed in range(2)]
  plan, tokens, positions, slots, k, v = _decode_inputs(config, plans)
  model = init_model(config, mesh=_mesh(mesh_name), seed=0)
  layout = parallel.stack_layouts(parallel.split_plan(plan, dp)) if dp > 1 else plan.to_device()
  cache = _sharded_cache(model, k, v)
  step = jax.jit(lambda m, c: m(tokens, positions, c, slots, layout, impl='xla'),
                 donate_argnums=1)
  counts = _collectives(step.lower(model, cache).compile().as_text())
  assert counts['all-reduce'] == 2 * config.num_layers + 1, counts
  assert sum(counts.values()) == counts['all-reduce'], counts


def test_micro_batches_give_the_same_step_with_ordered_reductions():
  """tp_micro_batches=2: the rows after attention go through in two blocks whose all-reduces
  follow each other (so one block's can run beside the other's matmuls): two all-reduces per
  layer per block (XLA's combiner cannot merge them), the same logits and cache as one block."""
  config = CONFIGS['gqa']
  plans = [_group_plan(seed) for seed in range(2)]
  plan, tokens, positions, slots, k, v = _decode_inputs(config, plans)
  layout, outs = plan.to_device(), []
  for blocks in (1, 2):
    model = init_model(config, mesh=_mesh('tp4'), seed=0, tp_micro_batches=blocks)
    step = jax.jit(lambda m, c: m(tokens, positions, c, slots, layout, impl='xla'))
    cache = _sharded_cache(model, k, v)
    counts = _collectives(step.lower(model, cache).compile().as_text())
    assert counts['all-reduce'] == 2 * blocks * config.num_layers + 1, counts
    outs.append(step(model, cache))
  (h1, c1), (h2, c2) = outs
  np.testing.assert_allclose(np.asarray(h2), np.asarray(h1), rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(c2.k), np.asarray(c1.k))
  with pytest.raises(ValueError, match='tp_micro_batches must be an int >= 1'):
    init_model(config, seed=0, tp_micro_batches=0)


@pytest.mark.parametrize('kind,mesh_name', [('mqa', 'tp8'), ('mha', 'tp2')])
def test_generate_in_blocks_gives_one_devices_tokens(kind, mesh_name):
  """tp_micro_batches=2 through greedy generation (kv heads replicated at MQA tp:8): the blocked
  path runs (wo and the MLP split over tp) and the tokens are one device's."""
  config = CONFIGS[kind]
  want = generate(init_model(config, seed=2), _prompts(config.vocab_size), max_new_tokens=6,
                  impl='xla')
  model = init_model(config, mesh=_mesh(mesh_name), seed=2, tp_micro_batches=2)
  assert model._row_parallel_specs(model.layers[0]) is not None
  got = generate(model, _prompts(config.vocab_size), max_new_tokens=6, impl='xla')
  np.testing.assert_array_equal(got.tokens, want.tokens)


def _prompts(vocab):
  rng = np.random.default_rng(5)
  toks = lambda n: rng.integers(0, vocab, n).tolist()
  shared = prompt_node(toks(21), [prompt_node(toks(5), num_samples=2),
                                  prompt_node(toks(9), num_samples=1)])
  return [shared, prompt_node(toks(7), num_samples=1)]


@pytest.mark.parametrize('kind,mesh_name,dtype', [('gqa', 'tp4', 'bfloat16'),
                                                  ('mqa', 'tp8', 'float32')])
def test_generate_greedy_tokens_equal_one_device(kind, mesh_name, dtype):
  """bf16 too: the row-parallel partial sums are all-reduced in float32, then rounded once."""
  config = CONFIGS[kind]
  want = generate(init_model(config, seed=2, dtype=dtype), _prompts(config.vocab_size),
                  max_new_tokens=6, impl='xla', return_logprobs=True)
  got = generate(init_model(config, mesh=_mesh(mesh_name), seed=2, dtype=dtype),
                 _prompts(config.vocab_size), max_new_tokens=6, impl='xla', return_logprobs=True)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  # bf16: per-device GEMMs sum in another order and the cache is rounded to bf16 each step, so
  # log-probs drift by a few bf16 ulps (0.4% each) over the steps.
  tol = dict(atol=2e-2, rtol=1e-2) if dtype == 'bfloat16' else dict(atol=1e-5)
  np.testing.assert_allclose(got.logprobs, want.logprobs, **tol)


def test_engine_runs_dp_and_refuses_overlap_decode_clearly():
  """The engine runs data parallel (tests/test_engine_data_parallel.py): one chunk cache per dp
  shard; overlap_decode is not supported there and says so."""
  model = init_model(CONFIGS['mha'], mesh=_mesh('dp2_tp2'), seed=0)
  engine = Engine(model, EngineConfig(num_chunks=8, chunk_size=16))
  assert len(engine.caches) == 2 and engine.kv.k.shape[1] == 2 * 8 * 16
  with pytest.raises(ValueError, match='overlap_decode is not supported with data parallel'):
    Engine(model, EngineConfig(num_chunks=8, chunk_size=16, overlap_decode=True))


def test_engine_greedy_outputs_equal_one_device():
  config = CONFIGS['gqa']
  rng = np.random.default_rng(0)
  prefix = rng.integers(0, config.vocab_size, 20).tolist()
  prompts = [prefix + rng.integers(0, config.vocab_size, n).tolist() for n in (3, 7, 1)]
  engine_config = EngineConfig(num_chunks=32, chunk_size=16, max_batch=4, impl='xla',
                               prefill_impl='xla', max_sequence_length=64)
  params = SamplingParams(max_new_tokens=5)
  outs = []
  for mesh in (None, _mesh('tp4')):
    engine = Engine(init_model(config, mesh=mesh, seed=4), engine_config)
    outs.append(engine.generate(prompts, params))
    if mesh is not None:
      want = cache_sharding(engine.model.mesh, engine.kv.k.shape)
      assert engine.kv.k.sharding.is_equivalent_to(want, 4)
  assert outs[0] == outs[1]


@pytest.mark.parametrize('mesh_name', ['tp2', 'dp2_tp2'])
def test_placed_parameters_are_in_the_form_a_jitted_step_returns(mesh_name):
  # A spec with trailing Nones places alike but is another sharding: a step fed parameters so
  # placed would compile again at its second call, fed its own outputs.
  model = init_model(CONFIGS['gqa'], mesh=_mesh(mesh_name), seed=1)
  state = nnx.state(model, nnx.Param)
  placed = sr.place_state(jax.tree.map(np.asarray, state), model.mesh)
  assert sr.sharding(('embed', 'heads', 'head_dim'), model.mesh).spec == P(None, 'tp')
  step = jax.jit(lambda s: jax.tree.map(lambda x: x * 2, s))
  for params in (state, placed):
    leaves = jax.tree.leaves(params)
    assert any(len(x.sharding.spec) for x in leaves)  # some split, none ending in None
    assert all(not x.sharding.spec or x.sharding.spec[-1] is not None for x in leaves)
    again = step(step(params))
    assert [x.sharding for x in jax.tree.leaves(again)] == [x.sharding for x in leaves]
    assert step._cache_size() == 1

def test_check_mesh_errors_before_any_work():
  with pytest.raises(ValueError, match='query heads N=6 do not divide over tp=4'):
    init_model(get_config('tiny_gqa'), mesh=_mesh('tp4'))
  with pytest.raises(ValueError, match='kv heads K=3'):
    sr.check_mesh(get_config('tiny_gqa', num_heads=12, num_kv_heads=3), _mesh('tp4'))
  with pytest.raises(ValueError, match="mesh axes \\['x'\\] are not known"):
    sr.check_mesh(CONFIGS['mha'], jax.make_mesh((2,), ('x',)))


def test_parse_mesh():
  mesh = parallel.parse_mesh('tp:4,dp:2')
  assert dict(mesh.shape) == {'dp': 2, 'tp': 4} and mesh.axis_names == ('dp', 'tp')
  assert parallel.parse_mesh('') is None and parallel.parse_mesh('none') is None
  assert dict(parallel.parse_mesh('tp:2').shape) == {'tp': 2}
  for spec, message in [('tp:16', 'needs 16 devices; there are 8'),
                        ('pp:2', "axis 'pp' is not known"), ('tp:0', 'must be >= 1'),
                        ('tp', 'must be axis:size'), ('tp:2,tp:2', 'twice'),
                        ('tp:x', 'must be an integer')]:
    with pytest.raises(ValueError, match=message):
      parallel.parse_mesh(spec)


def test_split_and_join_plans_round_trip_and_refuse_crossing_groups():
  plans = [_group_plan(seed) for seed in range(2)]
  joined = parallel.join_plans(plans)
  assert parallel.split_plan(joined, 2) == plans
  with pytest.raises(ValueError, match='straddles dp shards'):
    parallel.split_plan(joined, 4)


FIXTURES = os.path.join(os.path.dirname(__file__), 'fixtures')


@pytest.mark.parametrize('name,mesh_name', [('tiny_mha', 'tp4'), ('tiny_llama3', 'dp2_tp4')])
def test_hf_load_and_orbax_restore_place_each_parameter_in_its_shards(tmp_path, name, mesh_name):
  """Each tensor goes straight into its shards (a device holds 1/tp of a tp-sharded weight)."""
  folder = os.path.join(FIXTURES, f'hf_{name}')
  mesh = _mesh(mesh_name, explicit=True)
  whole = hf_loading.load_hf_checkpoint(folder, dtype=jnp.float32, fuse_qkv=False)
  sharded = hf_loading.load_hf_checkpoint(folder, dtype=jnp.float32, mesh=mesh, fuse_qkv=False)
  # By default one q/k/v weight wherever tp divides the kv heads (tiny_mha's 4 on tp=4, not
  # tiny_llama3's 1 on tp=4), its parts the unfused weights.
  default = hf_loading.load_hf_checkpoint(folder, dtype=jnp.float32, mesh=mesh)
  assert default.qkv_fused == (name == 'tiny_mha') == default.can_fuse_qkv
  if default.qkv_fused:
    for part, param in zip(split_qkv(default.layers[0].wqkv.get_value(), whole.config.num_heads),
                           (whole.layers[0].wq, whole.layers[0].wkv)):
      np.testing.assert_array_equal(np.asarray(part), np.asarray(param.get_value()))
  tp = MESHES[mesh_name][1]
  wq = sharded.layers[0].wq.get_value()
  assert {s.data.shape for s in wq.addressable_shards} == {
      (wq.shape[0], wq.shape[1] // tp, wq.shape[2])}
  saved_params.save_params(whole, tmp_path / 'saved')
  restored = saved_params.restore_params(tmp_path / 'saved', mesh=mesh, fuse_qkv=False)
  for model in (sharded, restored):
    cache = KVCache.zeros(model.config, 128, jnp.float32, mesh=model.mesh)
    _check_shardings(model, cache)
    for a, b in zip(jax.tree.leaves(nnx.state(whole, nnx.Param)),
                    jax.tree.leaves(nnx.state(model, nnx.Param))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize('kind,mesh_name', [('mha', 'tp4'), ('gqa', 'dp2_tp2')])
def test_fused_qkv_on_a_mesh_equals_one_device(kind, mesh_name):
  """`fuse_qkv` under tp (kv heads split, each device whole groups of q heads, k and v): the
  fused weight sits where the rules say, the decode step equals one device's unfused one and
  compiles to the same collectives."""
  config = CONFIGS[kind]
  dp = MESHES[mesh_name][0]
  plan, tokens, positions, slots, k, v = _decode_inputs(config, [_group_plan(s) for s in (0, 1)])
  want, want_k = _one_device(kind)
  model = init_model(config, mesh=_mesh(mesh_name), seed=3).fuse_qkv()
  wqkv = model.layers[0].wqkv.get_value()
  tp = MESHES[mesh_name][1]
  # Each device one shard: its N/tp q heads, then its K/tp k heads and v heads.
  width = (config.num_heads + 2 * config.num_kv_heads) // tp
  assert wqkv.shape[1] == tp
  assert {s.data.shape[1:3] for s in wqkv.addressable_shards} == {(1, width)}
  apart = init_model(config, mesh=model.mesh, seed=3).layers[0]
  for part, param in zip(split_qkv(wqkv, config.num_heads), (apart.wq, apart.wkv)):
    np.testing.assert_array_equal(np.asarray(part), np.asarray(param.get_value()))
  layout = parallel.stack_layouts(parallel.split_plan(plan, dp)) if dp > 1 else plan.to_device()
  cache = _sharded_cache(model, k, v)
  _check_shardings(model, cache)
  got, got_cache = _forward(model, tokens, positions, cache, slots, layout)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(np.asarray(got_cache.k), want_k, rtol=2e-5, atol=2e-5)
  # The fused projection is column parallel like the two it replaces: no collective more.
  step = lambda m: jax.jit(lambda m, c: m(tokens, positions, c, slots, layout, impl='xla')).lower(
      m, cache).compile().as_text()
  unfused = init_model(config, mesh=model.mesh, seed=3)
  assert _collectives(step(model)) == _collectives(step(unfused))


def test_fused_qkv_needs_tp_to_divide_the_kv_heads():
  model = init_model(CONFIGS['mqa'], mesh=_mesh('tp8'), seed=3)
  with pytest.raises(ValueError, match=r'kv heads K=1 split over tp=8 \(tp must divide K\)'):
    model.fuse_qkv()
  assert not model.qkv_fused
  assert model.fuse_qkv(required=False) is model and not model.qkv_fused  # apart, no error
