"""The serving engine: greedy outputs equal independent generation; streaming; cancellation."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from hydrajax.chunk_cache import LayoutPolicy
from models.config import get_config
from models.engine import Engine, EngineConfig, SamplingParams
from models.generate import NAIVE, generate
from models.llama import Llama

NEW = 6
# One static shape for decode and one for prefill (every test reuses the compiles).
CONFIG = EngineConfig(
    num_chunks=28, chunk_size=4, max_batch=4, max_sequence_length=48, decode_buckets=(8,),
    min_prefill_len=32, max_prefill_rows=1, impl='xla', prefill_impl='xla',
    layout=LayoutPolicy(kv_piece=16, min_segments=8, fixed_shapes=True, min_private_pages=12),
    prefill_layout=LayoutPolicy(kv_piece=16, min_segments=8, fixed_shapes=True,
                                min_private_pages=12),
)


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
  out = generate(model, prompts, max_new_tokens=NEW, impl=NAIVE)
  return prompts, out.tokens.tolist()


@pytest.mark.parametrize('share', [True, False], ids=['sharing', 'no_sharing'])
def test_greedy_outputs_equal_independent_generation(model, reference, share):
  prompts, expected = reference
  engine = Engine(model, dataclasses.replace(CONFIG, share_prefixes=share))
  outputs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW))
  assert outputs == expected
  reqs = list(engine.requests.values())
  assert engine.cache.num_used_chunks == 0 and engine.cache.reserved_chunks == 0
  assert engine.stats.peak_chunks <= CONFIG.num_chunks
  assert engine.stats.peak_rows < len(prompts)  # the pool or max_batch made requests wait
  assert len(engine.stats.shapes) == 2  # one prefill shape, one decode shape
  if share:
    assert reqs[1].shared_tokens == 20 and reqs[2].shared_tokens == 12
    assert reqs[6].shared_tokens == 20  # the identical prompt waited one iteration and shared
    assert engine.stats.copied_tokens > 0
  else:
    assert all(r.shared_tokens == 0 for r in reqs) and engine.stats.copied_tokens == 0


def test_streaming_cancellation_and_stop_tokens(model, reference):
  prompts, expected = reference
  engine = Engine(model, CONFIG)
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
  assert engine.cache.num_used_chunks == 0 and engine.cache.num_rows == 0


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
