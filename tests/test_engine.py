"""The serving engine: greedy outputs equal independent generation; streaming; cancellation;
parallel samples (fork); prefix retention."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from hydrajax.layout import LayoutPolicy
from models.config import get_config
from models.engine import Engine, EngineConfig, SamplingParams
from models.generate import generate
from models.llama import Llama, ModelMode
from models.sampling import SamplingMode

NEW = 6
# One static shape for decode and one for prefill (every test reuses the compiles).
CONFIG = EngineConfig(
    num_chunks=28, chunk_size=4, max_batch=4, max_sequence_length=48, decode_buckets=(8,),
    min_prefill_len=32, max_prefill_rows=1, impl='xla', prefill_impl='xla',
    layout=LayoutPolicy(kv_piece=16, min_segments=8, fixed_shapes=True, min_private_pages=12),
    prefill_layout=LayoutPolicy(kv_piece=16, min_segments=8, fixed_shapes=True,
                                min_private_pages=12),
)


def assert_no_leak(engine):
  """Idle: no row, no reservation, only cached chunks in use; evicting them empties the pool."""
  cache = engine.cache
  cache.check()
  assert cache.num_rows == 0 and cache.reserved_chunks == 0
  assert cache.num_used_chunks == cache.num_cached_chunks
  assert cache.config.retain_prefixes or cache.num_cached_chunks == 0
  cache.evict()
  assert cache.num_used_chunks == 0 and cache.num_free_chunks == engine.config.num_chunks


@pytest.fixture(scope='module')
def model():
  return Llama(get_config('tiny_gqa'), rngs=nnx.Rngs(0))


def _prompts(seed):
  rng = np.random.default_rng(seed)
  system = rng.integers(0, 97, 21).tolist()
  return [
      system + rng.integers(0, 97, 3).tolist(),
      system + rng.integers(0, 97, 6).tolist(),
      system[:16],  # ends on a chunk boundary inside the system prompt (copy on write)
      system[:13],
      rng.integers(0, 97, 7).tolist(),  # unrelated
      system + [1, 2, 3],
      system + [1, 2, 3],  # identical prompts
      system[:2],
  ]


@pytest.fixture(scope='module')
def reference(model):
  """Independent single-request generation: each prompt in its own dense cache (naive attention)."""
  prompts = _prompts(0)
  out = generate(model, prompts, max_new_tokens=NEW, impl=ModelMode.DENSE)
  return prompts, out.tokens.tolist()


@pytest.mark.parametrize('overlap', [False, True], ids=['waited', 'overlapped'])
@pytest.mark.parametrize('share,retain', [(True, True), (True, False), (False, True)],
                         ids=['sharing', 'sharing_no_retention', 'no_sharing'])
def test_greedy_outputs_equal_independent_generation(model, reference, share, retain, overlap):
  prompts, expected = reference
  engine = Engine(model, dataclasses.replace(CONFIG, share_prefixes=share, retain_prefixes=retain,
                                             overlap_decode=overlap))
  outputs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW))
  assert outputs == expected
  reqs = list(engine.requests.values())
  assert_no_leak(engine)
  assert engine.stats.peak_chunks <= CONFIG.num_chunks
  assert engine.stats.peak_rows < len(prompts)  # the pool or max_batch made requests wait
  assert len(engine.stats.shapes) == 2  # one prefill shape, one decode shape
  if share:
    assert reqs[1].shared_tokens == 20 and reqs[2].shared_tokens == 12
    assert reqs[6].shared_tokens == 20  # the identical prompt waited one iteration and shared
    assert engine.stats.copied_tokens > 0
  else:
    assert all(r.shared_tokens == 0 for r in reqs) and engine.stats.copied_tokens == 0


@pytest.mark.parametrize('overlap', [False, True], ids=['waited', 'overlapped'])
def test_streaming_cancellation_and_stop_tokens(model, reference, overlap):
  prompts, expected = reference
  engine = Engine(model, dataclasses.replace(CONFIG, overlap_decode=overlap))
  seen: dict[int, list[int]] = {}
  ids = [
      engine.submit(p, SamplingParams(max_new_tokens=NEW), on_token=lambda e: seen.setdefault(
          e.request_id, []).append(e.token))
      for p in prompts[:4]
  ]
  stop = expected[4][2]
  stopper = engine.submit(prompts[4], SamplingParams(max_new_tokens=NEW, stop_tokens=(stop,)))
  events = []
  for event in engine.stream():
    events.append(event)
    if event.request_id == ids[1] and event.index == 1:
      assert engine.cancel(ids[1])
  assert engine.requests[ids[1]].state == 'cancelled'
  assert engine.requests[ids[1]].output == expected[1][: len(engine.requests[ids[1]].output)]
  assert [e.token for e in events if e.request_id == ids[1]][-1] == -1
  for i in (0, 2, 3):
    assert engine.requests[ids[i]].output == expected[i]
    assert seen[ids[i]] == expected[i]  # the callback streamed every token, in order
    finals = [e for e in events if e.request_id == ids[i] and e.finished]
    assert len(finals) == 1 and finals[0].reason == 'length' and finals[0].index == NEW - 1
  assert engine.requests[stopper].output == expected[4][: expected[4].index(stop) + 1]
  assert engine.requests[stopper].reason == 'stop'
  assert not engine.cancel(ids[0])  # already finished
  assert_no_leak(engine)


def test_temperature_sampling_does_not_depend_on_the_batch(model):
  prompts = _prompts(1)[:5]
  params = SamplingParams(max_new_tokens=NEW, temperature=0.8)
  together = Engine(model, CONFIG).generate(prompts, params)
  alone = []
  for i, p in enumerate(prompts):  # same request ids (i), one request at a time
    engine = Engine(model, CONFIG)
    for _ in range(i):
      engine.cancel(engine.submit([0]))
    alone.append(engine.generate([p], params)[0])
  assert together == alone
  greedy = Engine(model, CONFIG).generate(prompts, SamplingParams(max_new_tokens=NEW))
  assert together != greedy  # it did sample


def test_requests_that_can_never_fit_are_refused(model):
  engine = Engine(model, CONFIG)
  with pytest.raises(ValueError, match='max_sequence_length'):
    engine.submit(list(range(40)), SamplingParams(max_new_tokens=10))
  small = Engine(model, dataclasses.replace(CONFIG, num_chunks=4))
  with pytest.raises(ValueError, match='never fit'):
    small.submit(list(range(14)), SamplingParams(max_new_tokens=4))
  with pytest.raises(ValueError, match='token ids'):
    engine.submit([5, 200])


@pytest.mark.parametrize('share', [True, False], ids=['sharing', 'no_sharing'])
def test_greedy_samples_equal_the_single_request_output(model, reference, share):
  prompts, expected = reference
  engine = Engine(model, dataclasses.replace(CONFIG, share_prefixes=share))
  params = SamplingParams(max_new_tokens=NEW, n=3)
  # 24 tokens: the prompt's last chunk is full (shared by the samples); 27: a partial tail (copied).
  assert len(prompts[0]) % 4 == 0 and len(prompts[1]) % 4 == 3
  rids = [engine.submit(prompts[i], params) for i in (0, 1)]
  assert [engine.samples(r) for r in rids] == [(0, 1, 2), (3, 4, 5)]
  engine.run()
  for rid, i in zip(rids, (0, 1)):
    for sid in engine.samples(rid):
      req = engine.requests[sid]
      assert req.output == expected[i] and req.first_sample == rid and req.reason == 'length'
  assert engine.stats.forked_samples == 4
  assert engine.stats.prefill_tokens == sum(engine.requests[r].prefilled_tokens for r in rids)
  assert engine.stats.prefill_tokens <= len(prompts[0]) + len(prompts[1])  # each prompt once
  assert engine.generate([prompts[4]], params) == [expected[4]] * 3  # n outputs per prompt
  assert_no_leak(engine)


@pytest.mark.parametrize('share', [True, False])
def test_overlapped_decode_samples_like_waited_decode(model, share):
  # Sampling keys use each token's index, also for the tokens still on the device.
  prompts = _prompts(3)
  params = SamplingParams(max_new_tokens=NEW, temperature=0.8, n=2, stop_tokens=(5, 17))
  outputs, engines = [], []
  for overlap in (False, True):
    engine = Engine(model, dataclasses.replace(CONFIG, share_prefixes=share,
                                               overlap_decode=overlap))
    outputs.append(engine.generate(prompts, params))
    engines.append(engine)
    assert_no_leak(engine)
  assert outputs[0] == outputs[1]
  assert any(len(o) < NEW for o in outputs[0])  # some stopped early
  waited, overlapped = (e.stats for e in engines)
  assert overlapped.generated_tokens == waited.generated_tokens
  assert overlapped.decode_steps + overlapped.new_shape_steps >= waited.decode_steps


def test_samples_sample_like_independent_requests_and_are_deterministic(model):
  prompt = _prompts(2)[1]  # 27 tokens: the samples copy the partial tail
  params = SamplingParams(max_new_tokens=NEW, temperature=0.8, n=3)
  runs = []
  for _ in range(2):
    engine = Engine(model, CONFIG)
    engine.cancel(engine.submit([0]))  # sample ids 1, 2, 3
    runs.append(engine.generate([prompt], params))
    assert_no_leak(engine)
  assert runs[0] == runs[1]
  assert len({tuple(o) for o in runs[0]}) > 1  # the samples differ
  for i, out in enumerate(runs[0]):  # sample i draws like a lone request with id 1 + i
    engine = Engine(model, CONFIG)
    for _ in range(1 + i):
      engine.cancel(engine.submit([0]))
    assert engine.generate([prompt], dataclasses.replace(params, n=1)) == [out]


def test_cancelling_one_sample_leaves_the_others(model, reference):
  prompts, expected = reference
  engine = Engine(model, CONFIG)
  queued = engine.submit(prompts[1], SamplingParams(max_new_tokens=NEW, n=3))
  assert engine.cancel(queued)  # sample 0, before admission: the others still run
  running = engine.submit(prompts[0], SamplingParams(max_new_tokens=NEW, n=2))
  for event in engine.stream():
    if event.request_id == running + 1 and event.index == 1:
      assert engine.cancel(running + 1)
  reqs = engine.requests
  assert reqs[queued].state == 'cancelled' and reqs[queued].output == []
  assert reqs[queued + 1].output == reqs[queued + 2].output == expected[1]
  assert reqs[running].output == expected[0]
  assert reqs[running + 1].state == 'cancelled'
  assert reqs[running + 1].output == expected[0][: len(reqs[running + 1].output)]
  assert engine.stats.forked_samples == 2  # one more sequence per prompt
  assert_no_leak(engine)


def test_admission_holds_room_for_every_sample(model, reference):
  prompts, expected = reference
  # No sharing, 20 chunks: prompt 0 takes 8; prompt 1 takes 8 and its second sample 8 more.
  engine = Engine(model, dataclasses.replace(CONFIG, share_prefixes=False, num_chunks=20))
  first = engine.submit(prompts[0], SamplingParams(max_new_tokens=NEW))
  rid = engine.submit(prompts[1], SamplingParams(max_new_tokens=NEW, n=2))
  engine.run()  # a fork without room would raise here
  assert engine.requests[rid].admitted >= engine.requests[first].finished  # it waited
  outputs = [engine.requests[i].output for i in (first, rid, rid + 1)]
  assert outputs == [expected[0], expected[1], expected[1]]
  assert engine.stats.peak_chunks <= 20
  with pytest.raises(ValueError, match='never fit'):
    engine.submit(prompts[1], SamplingParams(max_new_tokens=NEW, n=3))  # 24 chunks
  with pytest.raises(ValueError, match='max_batch'):
    engine.submit([1], SamplingParams(n=5))
  assert_no_leak(engine)


@pytest.mark.parametrize('share,retain', [(True, True), (True, False), (False, True)],
                         ids=['retention', 'no_retention', 'no_sharing'])
def test_a_finished_prompt_prefix_is_reused(model, reference, share, retain):
  prompts, expected = reference
  engine = Engine(model, dataclasses.replace(CONFIG, share_prefixes=share, retain_prefixes=retain))
  first = engine.generate([prompts[0]], SamplingParams(max_new_tokens=NEW))  # system + 3 tokens
  assert first == [expected[0]] and engine.num_running == 0
  before = engine.stats.prefill_tokens
  rid = engine.submit(prompts[1], SamplingParams(max_new_tokens=NEW))  # the same system prompt
  engine.run()
  req = engine.requests[rid]
  assert req.output == expected[1]
  if share and retain:  # 5 cached chunks reused, 1 token copied: only the 6 new tokens prefill
    assert (req.cached_tokens, req.shared_tokens, req.prefilled_tokens) == (20, 20, 6)
  else:
    assert (req.cached_tokens, req.prefilled_tokens) == (0, len(prompts[1]))
  assert engine.stats.prefill_tokens - before == req.prefilled_tokens
  assert_no_leak(engine)


# ---- validation, failures, sampling, compiled shapes ------------------------------------------


@pytest.mark.parametrize('prompt', [
    [1.0, 2.0], [True, 2], [[1, 2]], np.array([[1, 2]]), np.array([1.5]), [2**63], [-1], [97],
    [], 'ab', 5, [1, None], np.array([True]),
], ids=lambda p: repr(p)[:16])
def test_bad_prompts_are_refused_and_change_nothing(model, prompt):
  engine = Engine(model, CONFIG)
  with pytest.raises(ValueError, match='prompt'):
    engine.submit(prompt, SamplingParams(max_new_tokens=2))
  assert engine.requests == {} and engine.num_queued == 0 and not engine.has_work
  assert engine.submit(np.array([3, 4], np.int32), SamplingParams(max_new_tokens=2)) == 0


def test_bad_params_are_refused_and_change_nothing(model):
  engine = Engine(model, CONFIG)
  for bad in (dict(n=2.0), dict(stop_tokens=5), dict(max_new_tokens=2.5),
              dict(temperature=float('nan'))):
    with pytest.raises(ValueError, match=next(iter(bad))):
      engine.submit([1, 2], SamplingParams(**bad))
  with pytest.raises(ValueError, match='params'):
    engine.submit([1, 2], dict(n=2))
  with pytest.raises(ValueError, match='top_logprobs'):
    engine.submit([1, 2], SamplingParams(top_logprobs=CONFIG.max_top_logprobs + 1))
  assert engine.requests == {} and engine._next_id == 0
  rid = engine.submit([1, 2], SamplingParams(max_new_tokens=2, n=2))
  assert engine.samples(rid) == (0, 1) and isinstance(engine._next_id, int)


def test_a_failing_request_finishes_with_error_and_the_others_go_on(model, reference, monkeypatch):
  prompts, expected = reference
  engine = Engine(model, CONFIG)
  insert = engine.cache.insert

  def flaky_insert(prompt, **kwargs):  # the cache fails on prompt 3 (a bug, not a capacity)
    if len(prompt) == len(prompts[3]) and list(prompt) == prompts[3]:
      raise RuntimeError('boom')
    return insert(prompt, **kwargs)

  monkeypatch.setattr(engine.cache, 'insert', flaky_insert)

  def bad_callback(event):
    raise KeyError('callback')

  ids = [engine.submit(p, SamplingParams(max_new_tokens=NEW)) for p in prompts[:4]]
  noisy = engine.submit(prompts[4], SamplingParams(max_new_tokens=NEW), on_token=bad_callback)
  events = list(engine.stream())
  reqs = engine.requests
  assert reqs[ids[3]].reason == 'error' and 'boom' in reqs[ids[3]].error
  assert reqs[noisy].reason == 'error' and 'callback' in reqs[noisy].error
  assert reqs[noisy].output == expected[4][: len(reqs[noisy].output)]
  for i in range(3):
    assert reqs[ids[i]].output == expected[i] and reqs[ids[i]].reason == 'length'
  finals = [e for e in events if e.finished]
  assert sorted(e.request_id for e in finals) == sorted(ids + [noisy])  # one end each
  assert engine.stats.errors == 2
  assert_no_leak(engine)


def test_mixed_sampling_in_one_batch(model, reference):
  prompts, expected = reference
  engine = Engine(model, CONFIG)
  greedy = SamplingParams(max_new_tokens=NEW)
  seeded = SamplingParams(max_new_tokens=NEW, temperature=0.9, top_k=10, top_p=0.9, min_p=0.05,
                          seed=1234)
  stop = tuple(expected[2][2:4])
  kinds = [greedy, seeded, dataclasses.replace(greedy, stop_sequences=((96, 96), stop)),
           dataclasses.replace(greedy, logprobs=True, top_logprobs=3)]
  ids = [engine.submit(prompts[i], kinds[i]) for i in range(4)]
  events = list(engine.stream())
  reqs = [engine.requests[i] for i in ids]
  assert reqs[0].output == expected[0] and reqs[3].output == expected[3]  # greedy rows
  assert reqs[2].output == expected[2][:4] and reqs[2].reason == 'stop'  # the stop sequence
  # The seeded request draws the same alone, with another id, in another engine.
  alone = Engine(model, CONFIG)
  alone.cancel(alone.submit([0]))
  assert alone.generate([prompts[1]], seeded) == [reqs[1].output]
  # Log-probs are the dense model's log-softmax at each position.
  from tests.test_sampling import dense_logprobs
  chosen, logp = dense_logprobs(model, prompts[3], reqs[3].output)
  np.testing.assert_allclose(reqs[3].logprobs, chosen, atol=1e-4)
  top = [[(int(t), lp) for t, lp in step] for step in reqs[3].top_logprobs]
  for k, step in enumerate(top):
    assert [t for t, _ in step] == np.argsort(-logp[k])[:3].tolist()
    np.testing.assert_allclose([lp for _, lp in step], np.sort(logp[k])[::-1][:3], atol=1e-4)
  mine = [e for e in events if e.request_id == ids[3]]
  assert [e.logprob for e in mine] == reqs[3].logprobs
  assert all(e.logprob is None for e in events if e.request_id != ids[3])
  assert_no_leak(engine)


def test_the_cache_part_of_the_config_makes_its_chunk_cache_config():
  from hydrajax.chunk_cache import ChunkCacheConfig
  assert CONFIG.cache == ChunkCacheConfig(
      num_chunks=28, chunk_size=4, max_sequence_length=48, max_sequences=4, share_prefixes=True,
      retain_prefixes=True, layout=CONFIG.layout)
  small = dataclasses.replace(CONFIG, num_chunks=4, share_prefixes=False)
  assert (small.cache.num_chunks, small.cache.share_prefixes, small.cache.retain_prefixes) == (
      4, False, False)  # no prefix cache without sharing
  assert small.max_prefill_rows == 1
  with pytest.raises(TypeError, match='num_chunk'):
    EngineConfig(num_chunk=3)
  with pytest.raises(ValueError, match='ChunkCacheConfig.num_chunks'):
    EngineConfig(num_chunks=0)


@pytest.mark.parametrize('kwargs,name', [
    (dict(num_chunks=8.0), 'num_chunks'), (dict(num_chunks='8'), 'num_chunks'),
    (dict(num_chunks=True), 'num_chunks'), (dict(num_chunks=8, chunk_size=8.5), 'chunk_size'),
    (dict(num_chunks=8, max_batch=4.0), 'max_batch'),
    (dict(num_chunks=8, max_prefill_tokens=8.0), 'max_prefill_tokens'),
    (dict(num_chunks=8, max_top_logprobs=True), 'max_top_logprobs'),
    (dict(num_chunks=8, decode_buckets=(64.0,)), 'decode_buckets'),
    (dict(num_chunks=8, decode_buckets=64), 'decode_buckets'),
    (dict(num_chunks=8, seed=1.0), 'seed'),
], ids=lambda x: repr(x)[:32])
def test_config_integer_fields_must_be_ints(kwargs, name):
  with pytest.raises(ValueError, match=name):
    EngineConfig(**kwargs)


@pytest.mark.parametrize('field,value', [
    ('num_chunks', 8.0), ('num_chunks', '8'), ('chunk_size', 8.5), ('max_sequences', False),
    ('max_sequence_length', 48.0),
])
def test_chunk_cache_config_integer_fields_must_be_ints(field, value):
  from hydrajax.chunk_cache import ChunkCacheConfig
  with pytest.raises(ValueError, match=f'ChunkCacheConfig.{field}'):
    ChunkCacheConfig(**{'num_chunks': 8, field: value})
  config = ChunkCacheConfig(num_chunks=np.int64(8), chunk_size=np.int32(4))  # numpy ints are ints
  assert (type(config.num_chunks), type(config.chunk_size)) == (int, int)


def _stub(engine):
  """The model call replaced by zeros: shapes are the host's business."""
  import jax.numpy as jnp

  def step(params, cache, tokens, positions, slots, layout, seeds, streams, *args, **kwargs):
    return jnp.zeros(streams.shape, jnp.int32), cache

  engine.runner.model_step = step


def test_decode_prepares_its_attention_plan_once_per_tree_change(model):
  config = EngineConfig(num_chunks=8, chunk_size=16, max_batch=2, max_sequence_length=32,
                        impl='xla', prefill_impl='xla')
  engine = Engine(model, config)
  _stub(engine)
  engine.submit([5, 6, 7], SamplingParams(max_new_tokens=12))  # 3 + 11 tokens: one chunk
  engine.run()
  stats = engine.stats
  assert (stats.decode_steps + stats.new_shape_steps, stats.plan_builds) == (11, 1)
  # Admitted one iteration apart: trees of 1 row, 2 rows, then 1 (the first one done).
  engine.generate([[1, 2, 3, 4], [1, 2, 3, 9]], SamplingParams(max_new_tokens=12))
  assert (stats.decode_steps + stats.new_shape_steps, stats.plan_builds) == (23, 4)
  assert_no_leak(engine)


def test_greedy_outputs_equal_with_the_default_sharing_policy(model, reference):
  from hydrajax import SharingPolicy

  prompts, expected = reference
  engine = Engine(model, dataclasses.replace(CONFIG, sharing_policy=SharingPolicy.default()))
  decoder = engine.decoder
  apply, demoted = decoder.apply_sharing_policy, []
  decoder.apply_sharing_policy = lambda *a: demoted.append(apply(*a)[1] is not None) or apply(*a)
  assert engine.generate(prompts, SamplingParams(max_new_tokens=NEW)) == expected
  assert any(demoted)  # the policy moved segments into private pages on some trees
  assert_no_leak(engine)
  with pytest.raises(ValueError, match='sharing_policy'):
    dataclasses.replace(CONFIG, sharing_policy='default')


def test_command_buffers_off_is_an_xla_gpu_option_only():
  from models.engine.step import compiler_options
  from models.kv_cache import CACHE_PROGRAM_OPTIONS
  remat_off = {'xla_disable_hlo_passes': 'rematerialization'}  # every program over the cache
  assert CACHE_PROGRAM_OPTIONS == remat_off
  assert compiler_options('gpu', command_buffers=False) == {
      **remat_off, 'xla_gpu_enable_command_buffer': ''}
  assert compiler_options('gpu', command_buffers=True) == remat_off
  assert compiler_options('cpu', command_buffers=False) == remat_off
  assert dataclasses.replace(CONFIG, command_buffers=False).command_buffers is False
  with pytest.raises(ValueError, match='command_buffers'):
    dataclasses.replace(CONFIG, command_buffers=None)


@pytest.mark.parametrize('share', [True, False], ids=['sharing', 'no_sharing'])
def test_random_traffic_stays_within_the_compiled_shape_budget(model, share):
  import warnings

  from hydrajax.layout import LayoutPolicy

  config = EngineConfig(
      num_chunks=96, chunk_size=4, max_batch=8, max_sequence_length=64, share_prefixes=share,
      max_prefill_rows=4, max_prefill_tokens=64, min_prefill_len=4,
      layout=LayoutPolicy(kv_piece=8, min_segments=2))
  engine = Engine(model, config)
  _stub(engine)
  budget = engine.compiled_shape_budget()
  rng = np.random.default_rng(0)
  systems = [rng.integers(0, 97, n).tolist() for n in (5, 13, 30)]
  with warnings.catch_warnings():
    warnings.simplefilter('error')  # a step outside the budget warns
    for i in range(160):
      head = systems[rng.integers(3)][: rng.integers(0, 31)]
      prompt = head + rng.integers(0, 97, rng.integers(1, 20)).tolist()
      n = int(rng.choice([1, 2, 4]))
      new = int(rng.integers(1, min(20, 64 - len(prompt)) + 1))
      engine.submit(prompt, SamplingParams(max_new_tokens=new, n=n))
      for _ in range(int(rng.integers(0, 3))):
        engine.step()
      if rng.random() < 0.1 and engine.requests:
        engine.cancel(int(rng.integers(len(engine.requests))))
    engine.run()
  assert engine.stats.decode_steps + engine.stats.new_shape_steps > 100
  assert 2 <= len(engine.stats.shapes) <= budget.num_programs
  assert all(r.state in ('done', 'cancelled') for r in engine.requests.values())
  assert_no_leak(engine)


def test_warmup_compiles_every_shape_the_traffic_runs(model, reference):
  prompts, expected = reference
  engine = Engine(model, dataclasses.replace(CONFIG, overlap_decode=True))
  assert engine.compiled_shape_budget().num_steps == 6  # 2 decode (J = 8, 16), 4 prefill
  engine.warmup()
  assert engine.generate(prompts, SamplingParams(max_new_tokens=NEW)) == expected
  assert engine.stats.new_shape_steps == 0
  assert_no_leak(engine)


def test_model_steps_hold_no_conditional_in_any_sampling_mode(model, reference):
  """A GPU reads a `lax.cond` predicate back on the host, so an overlapped step's dispatch would
  wait for the step before it: the engine's steps carry their sampling mode statically."""
  prompts, expected = reference
  engine = Engine(model, dataclasses.replace(CONFIG, overlap_decode=True))
  step, calls = engine.runner.model_step, {}

  def spy(*args, **kwargs):
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x,
        (args, kwargs))
    calls.setdefault((args[2].shape, args[9].mode), abstract)
    return step(*args, **kwargs)

  engine.runner.model_step = spy
  assert engine.generate(prompts[:3], SamplingParams(max_new_tokens=NEW)) == expected[:3]
  engine.generate(prompts[:2], SamplingParams(max_new_tokens=3, temperature=0.8))
  engine.generate(prompts[:2], SamplingParams(max_new_tokens=3, temperature=0.8, top_p=0.9))
  assert {mode for _, mode in calls} == set(SamplingMode)
  for (args, kwargs) in calls.values():
    text = step.lower(*args, **kwargs).as_text()
    assert 'stablehlo.case' not in text and 'stablehlo.if' not in text
  assert_no_leak(engine)


def test_interpret_runs_the_mosaic_tpu_kernels_on_a_cpu():
  """EngineConfig(interpret=True): the TPU kernels in interpret mode give the XLA path's tokens."""
  # The TPU kernels want a head dim of 128 lanes: one small layer of that shape.
  model = Llama(get_config('tiny_gqa', num_layers=1, num_heads=2, num_kv_heads=1, head_dim=128),
                rngs=nnx.Rngs(1))
  prompts = _prompts(1)[:2]
  expected = Engine(model, CONFIG).generate(prompts, SamplingParams(max_new_tokens=3))
  config = dataclasses.replace(CONFIG, impl='mosaic_tpu', prefill_impl='mosaic_tpu',
                               interpret=True)
  engine = Engine(model, config)
  runner = engine.runner
  plan = runner.prepare_plan(runner.empty_layout(8, 8, engine.cache.config.layout), config.impl)
  assert plan.impl.name == 'MOSAIC_TPU' and plan.interpret
  assert engine.generate(prompts, SamplingParams(max_new_tokens=3)) == expected
  with pytest.raises(ValueError, match='interpret'):
    dataclasses.replace(CONFIG, interpret='yes')

# `make test` keeps these cases (conftest: `representative_cases`; `()`: the whole test is left
# to `make test-all`, another test of the default run covering its path).
representative_cases = {
    'test_interpret_runs_the_mosaic_tpu_kernels_on_a_cpu': (),
}
