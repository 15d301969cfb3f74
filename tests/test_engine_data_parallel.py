"""The engine on a dp x tp mesh (issue 11): one chunk cache per dp shard, one program per step.

8 fake CPU devices (tests/conftest.py). Greedy outputs of `Engine.generate` on dp:2, dp:2 x tp:2
and dp:2 x tp:4 for MHA, GQA and MQA tiny shapes equal a one-device engine's and `generate`'s;
routing (a cached prefix draws its request to its shard; a full shard sends it to another);
parallel samples, cancellation and sampling with a temperature; no chunk leaks; the cache's
sharding; the compiled shapes within the budget (and `warmup` compiling all of them).
"""

import dataclasses
import functools
import warnings

import jax
import numpy as np
import pytest

from hydrajax.attention import parallel
from hydrajax.layout import LayoutPolicy
from models import sharding_rules as sr
from models.config import get_config
from models.engine import Engine, EngineConfig, SamplingParams
from models.generate import generate
from models.kv_cache import cache_sharding
from models.llama import init_model

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason='needs 8 devices (tests/conftest.py sets XLA_FLAGS before jax)')

CONFIGS = {  # heads divide over tp = 4; MQA's single kv head is stored tp times
    'mha': get_config('tiny_mha', num_heads=8, num_kv_heads=8, vocab_size=96, num_layers=2),
    'gqa': get_config('tiny_gqa', num_heads=8, num_kv_heads=2, vocab_size=96),
    'mqa': get_config('tiny_llama3', num_heads=8, num_kv_heads=1),  # tied, vocab 101
}
MESHES = ('dp:2', 'dp:2,tp:2', 'dp:2,tp:4')
CASES = [(k, m) for k in CONFIGS for m in MESHES]
# MHA on dp alone and MQA on dp with tp in `make test` (conftest); --all-cases runs the 9.
representative_cases = {
    'test_greedy_outputs_equal_one_device': ('mqa_dp:2,tp:4',),
    'test_warmup_compiles_every_step_shape': (),
    'test_greedy_outputs_without_sharing_or_retention': ('no_sharing',),
}
NEW = 6
# tests/test_engine.py's engine: one decode and one prefill shape in most runs; the pool and
# max_batch (per shard) small enough that requests wait and shards fill up.
CONFIG = EngineConfig(
    num_chunks=28, chunk_size=4, max_batch=4, max_sequence_length=48, decode_buckets=(8,),
    min_prefill_len=32, max_prefill_rows=1, impl='xla', prefill_impl='xla',
    layout=LayoutPolicy(kv_piece=16, min_segments=8, fixed_shapes=True, min_private_pages=12),
    prefill_layout=LayoutPolicy(kv_piece=16, min_segments=8, fixed_shapes=True,
                                min_private_pages=12),
)


def _prompts(vocab, seed=0):
  """Prompts sharing a system prompt (copy on write, identical ones) and unrelated ones."""
  rng = np.random.default_rng(seed)
  toks = lambda n: rng.integers(0, vocab, n).tolist()
  system = toks(21)
  return [system + toks(3), system + toks(6), system[:16], toks(9), system[:13], toks(7),
          system + [1, 2, 3], system + [1, 2, 3], system[:2], toks(11) + system[:5]]


def _model(kind, mesh=None):
  return init_model(CONFIGS[kind], mesh=parallel.parse_mesh(mesh), seed=2)


@functools.cache
def _one_device(kind):
  """(one-device engine's outputs, generate's outputs) of the prompts."""
  model = _model(kind)
  prompts = _prompts(model.config.vocab_size)
  engine = Engine(model, CONFIG).generate(prompts, SamplingParams(max_new_tokens=NEW))
  ref = generate(model, prompts, max_new_tokens=NEW, impl='xla').tokens.tolist()
  return engine, ref


def assert_no_leak(engine):
  """Idle: in every shard's cache no row, no reservation, only cached chunks in use; evicting
  them empties the pool."""
  for cache in engine.caches:
    cache.check()
    assert cache.num_rows == 0 and cache.reserved_chunks == 0
    assert cache.num_used_chunks == cache.num_cached_chunks
    cache.evict()
    assert cache.num_used_chunks == 0 and cache.num_free_chunks == engine.config.num_chunks




@pytest.mark.parametrize('kind,mesh', CASES, ids=[f'{k}_{m}' for k, m in CASES])
def test_greedy_outputs_equal_one_device(kind, mesh):
  want, ref = _one_device(kind)
  assert want == ref
  engine = Engine(_model(kind, mesh), CONFIG)
  with warnings.catch_warnings():
    warnings.filterwarnings('error', message='engine step shape')  # outside the budget
    got = engine.generate(_prompts(engine.model.config.vocab_size),
                          SamplingParams(max_new_tokens=NEW))
  assert got == want
  reqs = list(engine.requests.values())
  assert {r.shard for r in reqs} == {0, 1}  # both shards served requests
  assert max(r.shared_tokens for r in reqs) > 0  # prefixes were shared within a shard
  assert engine.stats.peak_rows <= 2 * CONFIG.max_batch
  assert_no_leak(engine)
  want_sharding = cache_sharding(engine.model.mesh, engine.kv.k.shape)
  for array in (engine.kv.k, engine.kv.v):
    assert array.sharding.is_equivalent_to(want_sharding, 4)
  assert engine.kv.k.shape[1] == 2 * CONFIG.num_chunks * CONFIG.chunk_size  # dp x L_s
  assert len(engine.stats.shapes) <= engine.compiled_shape_budget().num_programs


@pytest.mark.parametrize('share,retain', [(True, False), (False, False)],
                         ids=['sharing_no_retention', 'no_sharing'])
def test_greedy_outputs_without_sharing_or_retention(share, retain):
  engine = Engine(_model('gqa', 'dp:2,tp:2'),
                  dataclasses.replace(CONFIG, share_prefixes=share, retain_prefixes=retain))
  got = engine.generate(_prompts(96), SamplingParams(max_new_tokens=NEW))
  assert got == _one_device('gqa')[0]
  reqs = list(engine.requests.values())
  assert share or all(r.shared_tokens == 0 for r in reqs)
  assert_no_leak(engine)


def test_routing_follows_the_cached_prefix_and_room():
  """A prefix cached on shard 1 draws a later request there (shard 0 would win the tie
  otherwise); a prompt whose prefix shard is full goes to the other shard instead of waiting."""
  engine = Engine(_model('gqa', 'dp:2'), CONFIG)
  rng = np.random.default_rng(3)
  system = rng.integers(0, 96, 20).tolist()
  params = SamplingParams(max_new_tokens=NEW)
  first = engine.submit(rng.integers(0, 96, 9).tolist(), params)  # shard 0
  second = engine.submit(system + [5], params)  # shard 1: fewer rows
  engine.run()
  assert (engine.requests[first].shard, engine.requests[second].shard) == (0, 1)
  later = engine.submit(system + [7, 8], params)
  engine.run()
  req = engine.requests[later]
  assert req.shard == 1 and req.cached_tokens == 20  # its 5 chunks came from shard 1's cache
  assert engine.caches[0].num_cached_chunks > 0  # shard 0's cache did not have them
  # Shard 1 full (max_batch rows of the system prompt): the next one goes to shard 0.
  many = [engine.submit(system + [i], params) for i in range(CONFIG.max_batch + 1)]
  engine.step()
  engine.step()
  shards = [engine.requests[i].shard for i in many]
  states = [engine.requests[i].state for i in many]
  assert states == ['running'] * len(many), states
  assert shards.count(1) == CONFIG.max_batch and shards.count(0) == 1
  engine.run()
  assert_no_leak(engine)


def test_samples_cancellation_and_temperature_equal_one_device():
  """Parallel samples (fork in the shard's cache), a cancelled request and sampled tokens:
  the same as one device (a request's key does not depend on its shard)."""
  outs = []
  for mesh in (None, 'dp:2,tp:2'):
    engine = Engine(_model('gqa', mesh), CONFIG)
    prompts = _prompts(96, seed=1)[:6]
    ids = [engine.submit(p, SamplingParams(max_new_tokens=NEW, n=2)) for p in prompts[:2]]
    ids += [engine.submit(p, SamplingParams(max_new_tokens=NEW, temperature=0.9, seed=7))
            for p in prompts[2:]]
    cancelled = ids[-1]
    for event in engine.stream():
      if event.request_id == cancelled and event.index == 1:
        engine.cancel(cancelled)
    assert engine.requests[cancelled].state == 'cancelled'
    outs.append({rid: list(r.output) for rid, r in engine.requests.items()})
    if mesh is not None:
      assert engine.stats.forked_samples == 2
      assert_no_leak(engine)
  assert outs[0] == outs[1]


def test_warmup_compiles_every_step_shape():
  engine = Engine(_model('mqa', 'dp:2,tp:2'), CONFIG)
  budget = engine.compiled_shape_budget()
  assert budget == CONFIG.shape_budget(2)
  assert budget.num_steps == CONFIG.shape_budget().num_steps  # per shard: the same step shapes
  engine.warmup()
  assert len(engine.runner.seen_shapes) == budget.num_programs
  outputs = engine.generate(_prompts(101), SamplingParams(max_new_tokens=NEW))
  assert outputs == _one_device('mqa')[0]
  assert engine.stats.new_shape_steps == 0  # nothing left to compile
  assert engine.runner.seen_shapes >= engine.stats.shapes
  assert_no_leak(engine)


def test_dp_refuses_overlap_decode_and_one_cache():
  model = _model('mha', 'dp:2')
  with pytest.raises(ValueError, match='overlap_decode'):
    Engine(model, dataclasses.replace(CONFIG, overlap_decode=True))
  engine = Engine(model, CONFIG)
  assert len(engine.caches) == 2
  with pytest.raises(AttributeError, match='engine.caches'):
    engine.cache  # noqa: B018



def test_decode_plan_is_reused_until_a_shard_tree_changes():
  """The stacked plan is prepared (and put in its shards) once per change of any shard's tree;
  the steps between pass the same plan arrays with the private lengths swapped in from the
  host: each shard's rows' lengths after the append, plus the demoted lead."""
  engine = Engine(_model('gqa', 'dp:2'), CONFIG)
  step, seen = engine.runner.model_step, []

  def recording(params, cache, tokens, positions, slots, layout, *args, **kwargs):
    if tokens.shape[1] == 1:  # a decode step
      key = tuple((c.structure_version, c.pages_version) for c in engine.caches)
      lengths = np.concatenate([c.private_lengths(layout.num_rows // 2) for c in engine.caches])
      lead = engine.decoder.plan[2]
      seen.append((key, engine.stats.plan_builds, layout,
                   lengths if lead is None else lengths + lead))
    return step(params, cache, tokens, positions, slots, layout, *args, **kwargs)

  engine.runner.model_step = recording
  assert engine.generate(_prompts(96), SamplingParams(max_new_tokens=NEW)) == _one_device('gqa')[0]
  reused = rebuilt = 0
  for (key0, builds0, plan0, _), (key, builds, plan, lengths) in zip(seen, seen[1:]):
    swapped = plan.layouts.layout.private_lengths
    assert isinstance(swapped, np.ndarray)  # uploaded by the step's dispatch
    np.testing.assert_array_equal(swapped.reshape(-1), lengths)
    on_device = [x for x in jax.tree.leaves(plan) if not isinstance(x, np.ndarray)]
    if key == key0:
      reused += 1
      assert builds == builds0
      before = {id(x) for x in jax.tree.leaves(plan0)}
      assert all(id(x) in before for x in on_device)  # the same arrays, not uploaded again
    else:
      rebuilt += 1
      assert builds == builds0 + 1
      assert all(x.sharding.is_equivalent_to(engine.model._shard_leading(2), x.ndim)
                 for x in on_device)  # in their shards
  assert reused and rebuilt
