"""Sampling: parameter checks, per-row filters against a numpy reference, keys, log-probs,
and `generate` with stop sequences and log-probs."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import generate as gen
from models.config import get_config
from models.kv_cache import DenseKVCache
from models.llama import Llama, ModelMode
from models.sampling import (
  MAX_TEMPERATURE,
  SamplingMode,
  SamplingParams,
  SamplingRows,
  draw,
  filtered_logits,
  request_keys,
  row_keys,
  sample_batch,
)
from tests.conftest import fresh_rng


@pytest.mark.parametrize('field,value', [
    ('n', 2.0), ('n', True), ('n', 0), ('max_new_tokens', 2.5), ('max_new_tokens', 0),
    ('temperature', math.nan), ('temperature', math.inf), ('temperature', -1.0),
    ('temperature', '1'), ('temperature', True), ('temperature', 1e308), ('temperature', 1e7),
    ('top_k', -1), ('top_k', 1.5),
    ('top_p', 0.0), ('top_p', 1.5), ('top_p', math.nan), ('min_p', -0.1), ('min_p', 2.0),
    ('seed', -1), ('seed', 2**32), ('seed', 1.0), ('stop_tokens', 5), ('stop_tokens', (1.5,)),
    ('stop_tokens', (-1,)), ('stop_tokens', 'ab'), ('stop_sequences', ((),)),
    ('stop_sequences', (1, 2)), ('stop_sequences', ((1, 2.0),)), ('logprobs', 1),
    ('top_logprobs', 21), ('top_logprobs', -1),
], ids=lambda x: repr(x)[:12])
def test_params_refuse_bad_fields_naming_them(field, value):
  with pytest.raises(ValueError, match=field):
    SamplingParams(**{field: value})


def test_params_normalize_sequences_and_numpy_ints():
  p = SamplingParams(max_new_tokens=np.int64(3), stop_tokens=[np.int32(4), 5],
                     stop_sequences=[[1, 2], np.array([3])], temperature=1)
  assert p.max_new_tokens == 3 and type(p.max_new_tokens) is int
  assert p.stop_tokens == (4, 5) and p.stop_sequences == ((1, 2), (3,))
  assert p.temperature == 1.0 and hash(p) == hash(SamplingParams(
      max_new_tokens=3, stop_tokens=(4, 5), stop_sequences=((1, 2), (3,)), temperature=1.0))
  assert p.stops([9, 4]) and p.stops([7, 1, 2]) and p.stops([3]) and not p.stops([2, 1])


def filtered_reference(logits, temperature, top_k, top_p, min_p):
  """numpy: the kept tokens of one row (see the module doc of models.sampling)."""
  x = logits.astype(np.float64) / temperature
  keep = np.ones(x.shape, bool)
  if 0 < top_k < x.size:
    keep &= x >= np.sort(x)[::-1][top_k - 1]
  if top_p < 1:
    kept = np.sort(x[keep])[::-1]
    probs = np.exp(kept - kept.max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    keep &= x >= kept[before < top_p].min()
  if min_p > 0:
    p = np.exp(x - x.max())
    keep &= p >= min_p  # relative to the largest probability (1 here)
  return keep


def test_filters_per_row_equal_the_numpy_reference():
  rng = np.random.default_rng(0)
  b, v = 12, 50
  logits = rng.normal(0, 2, (b, v)).astype(np.float32)
  logits[3, :10] = logits[3, 10]  # ties
  params = [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.2),
            (0.5, 10, 0.9, 0.05), (2.0, 1, 1.0, 0.0), (1.0, 0, 0.3, 0.0), (1.0, 49, 0.99, 0.5),
            (1.0, 50, 1.0, 0.0), (0.9, 3, 0.5, 0.1), (1.0, 0, 1e-6, 0.0), (1.1, 0, 1.0, 1.0)]
  rows = SamplingRows(*(np.array(col, dt) for col, dt in zip(
      zip(*params), (np.float32, np.int32, np.float32, np.float32))))
  got = np.isfinite(np.asarray(filtered_logits(jnp.asarray(logits), rows)))
  for r, (t, k, p, m) in enumerate(params):
    np.testing.assert_array_equal(got[r], filtered_reference(logits[r], t, k, p, m), err_msg=r)


def test_greedy_rows_take_the_argmax_and_rows_do_not_depend_on_the_batch():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(0, 1, (6, 40)).astype(np.float32))
  keys = request_keys(jnp.arange(6, dtype=jnp.uint32), jnp.arange(6), jnp.full(6, 3))
  params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=5),
            SamplingParams(temperature=1.0, top_p=0.7), SamplingParams(),
            SamplingParams(temperature=1.5, min_p=0.1), SamplingParams(temperature=0.9)]
  together = np.asarray(draw(logits, keys, SamplingRows.of(params)))
  np.testing.assert_array_equal(together[[0, 3]], np.argmax(np.asarray(logits), -1)[[0, 3]])
  for r in range(6):  # alone, or with greedy neighbours only: the same draw
    alone = draw(logits[r : r + 1], keys[r : r + 1], SamplingRows.of([params[r]]))
    assert int(alone[0]) == together[r]
    plain = [params[r]] + [SamplingParams()] * 3
    with_greedy = draw(jnp.concatenate([logits[r : r + 1], logits[:3]]),
                       jnp.concatenate([keys[r : r + 1], keys[:3]]), SamplingRows.of(plain))
    assert int(with_greedy[0]) == together[r]


def test_request_keys_equal_row_keys_of_the_seed():
  seeds = jnp.array([0, 7, 7, 2**32 - 1], jnp.uint32)
  streams, index = jnp.array([3, 3, 4, 0]), jnp.array([0, 5, 5, 1])
  got = jax.random.key_data(request_keys(seeds, streams, index))
  for r in range(4):
    want = row_keys(jax.random.key(int(seeds[r])), streams[r : r + 1], int(index[r]))
    np.testing.assert_array_equal(got[r], jax.random.key_data(want)[0])


def test_sampled_logprobs_are_the_model_log_softmax():
  rng = np.random.default_rng(2)
  logits = rng.normal(0, 3, (4, 30)).astype(np.float32)
  keys = request_keys(jnp.zeros(4, jnp.uint32), jnp.arange(4), jnp.zeros(4, jnp.int32))
  rows = SamplingRows.of([SamplingParams(temperature=t, top_k=3) for t in (0.0, 0.5, 1.0, 2.0)])
  out = sample_batch(jnp.asarray(logits), keys, rows, top_logprobs=4)
  logp = np.asarray(jax.nn.log_softmax(logits.astype(np.float64), -1))
  tokens = np.asarray(out.tokens)
  np.testing.assert_allclose(out.logprobs, logp[np.arange(4), tokens], rtol=1e-5, atol=1e-5)
  order = np.argsort(-logp, -1)[:, :4]
  np.testing.assert_array_equal(out.top_tokens, order)
  np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(logp, order, -1), atol=1e-5)
  assert all(t in o for t, o in zip(tokens, order[:, :3]))  # top-k=3 kept the draws there


@pytest.mark.parametrize('temperature', [1e-30, 1e-40])
@pytest.mark.parametrize('filters', [{}, dict(top_k=5, top_p=0.9, min_p=0.1)], ids=repr)
def test_a_tiny_temperature_draws_the_argmax_with_its_logprobs(temperature, filters):
  # Jitted with t a constant (`generate`), logits / 1e-38 overflowed to +-inf (and a subnormal
  # t was flushed to 0): NaN draws gave token 0 and its log-prob.
  rng = np.random.default_rng(3)
  logits = jnp.asarray(rng.normal(0, 3, (4, 97)).astype(np.float32))
  keys = request_keys(jnp.zeros(4, jnp.uint32), jnp.arange(4), jnp.zeros(4, jnp.int32))
  greedy = sample_batch(logits, keys, SamplingRows.of([SamplingParams()] * 4))
  params = SamplingParams(temperature=temperature, **filters)
  host = SamplingRows.of([params] * 4)
  draws = (sample_batch(logits, keys, host),  # static mode
           sample_batch(logits, keys, dataclasses.replace(host, mode=None)),  # on the device
           jax.jit(lambda x, k: sample_batch(x, k, SamplingRows.full(params, 4)))(logits, keys))
  for got in draws:
    np.testing.assert_array_equal(got.tokens, np.argmax(np.asarray(logits), -1))
    assert np.all(np.isfinite(got.logprobs))
    np.testing.assert_allclose(got.logprobs, greedy.logprobs, rtol=1e-6)


def test_the_largest_temperature_draws_near_uniformly():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 4000))
  keys = row_keys(jax.random.key(16), jnp.arange(4000), 0)
  rows = SamplingRows.of([SamplingParams(temperature=MAX_TEMPERATURE)] * 4000)
  counts = np.bincount(draw(logits, keys, rows), minlength=4) / 4000
  np.testing.assert_allclose(counts, [0.25] * 4, atol=0.03)


def test_min_p_and_top_p_distributions():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 4000))
  keys = row_keys(jax.random.key(15), jnp.arange(4000), 0)

  def counts(params):
    return np.bincount(draw(logits, keys, SamplingRows.of([params] * 4000)), minlength=4) / 4000

  got = counts(SamplingParams(temperature=1.0, min_p=0.5))  # keeps p >= 0.25
  np.testing.assert_allclose(got, [0.625, 0.375, 0, 0], atol=0.03)
  got = counts(SamplingParams(temperature=1.0, top_p=0.85))  # 0.5 + 0.3 < 0.85: three kept
  np.testing.assert_allclose(got, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], atol=0.03)


@pytest.fixture(scope='module')
def model():
  return Llama(get_config('tiny_mha'), rngs=nnx.Rngs(14), dtype=jnp.float32)


def dense_logprobs(model, prompt, output):
  """log_softmax of the model's logits at the positions that predicted `output` (dense)."""
  tokens = np.array([list(prompt) + list(output)], np.int32)
  cache = DenseKVCache.zeros(model.config, 1, tokens.shape[1], jnp.float32)
  positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
  logits, _ = model.forward_naive(jnp.asarray(tokens), positions, cache)
  logp = np.asarray(jax.nn.log_softmax(logits[0], -1))
  steps = np.arange(len(prompt) - 1, tokens.shape[1] - 1)
  return logp[steps, output], logp[steps]


def test_generate_stop_sequences_and_logprobs(model):
  prompts = [[1, 2, 3, 4], [1, 2, 5], [7]]
  base = SamplingParams(temperature=0.9, top_k=20, min_p=0.02, seed=11, logprobs=True,
                        top_logprobs=3)
  out = gen.generate(model, prompts, max_new_tokens=6, sampling=base, impl='xla')
  assert out.top_tokens.shape == (3, 6, 3)
  for r, prompt in enumerate(prompts):
    chosen, logp = dense_logprobs(model, prompt, out.tokens[r])
    np.testing.assert_allclose(out.logprobs[r], chosen, atol=2e-5)
    np.testing.assert_allclose(out.top_logprobs[r], np.sort(logp, -1)[:, ::-1][:, :3], atol=2e-5)
  naive = gen.generate(model, prompts, max_new_tokens=6, sampling=base, impl=ModelMode.DENSE)
  np.testing.assert_array_equal(naive.tokens, out.tokens)  # same keys, same filters
  other_seed = gen.generate(model, prompts, max_new_tokens=6, impl='xla',
                            sampling=SamplingParams(temperature=0.9, top_k=20, min_p=0.02),
                            seed=11)
  np.testing.assert_array_equal(other_seed.tokens, out.tokens)  # sampling.seed == seed kwarg
  # Stop after tokens 1-2 of row 0: it ends there (the sequence kept), -1 after.
  seq = tuple(int(t) for t in out.tokens[0, 1:3])
  stopped = gen.generate(model, prompts, max_new_tokens=6, impl='xla',
                         sampling=SamplingParams(temperature=0.9, top_k=20, min_p=0.02, seed=11,
                                                 stop_sequences=(seq, (96, 95, 94))))
  assert stopped.lengths[0] == 3 and np.all(stopped.tokens[0, 3:] == -1)
  np.testing.assert_array_equal(stopped.tokens[0, :3], out.tokens[0, :3])
  for r in range(1, 3):
    row = out.tokens[r].tolist()
    ends = [i + 2 for i in range(5) if tuple(row[i : i + 2]) == seq]
    n = ends[0] if ends else 6
    assert stopped.lengths[r] == n
    np.testing.assert_array_equal(stopped.tokens[r, :n], out.tokens[r, :n])


def test_generate_with_a_tiny_temperature_is_greedy(model):
  prompts = [[1, 2, 3, 4], [1, 2, 5], [7]]  # 1e-40 gave token 0 at every step
  greedy = gen.generate(model, prompts, max_new_tokens=4, impl='xla', return_logprobs=True)
  tiny = gen.generate(model, prompts, max_new_tokens=4, impl='xla', sampling=SamplingParams(
      temperature=1e-40, top_p=0.9, min_p=0.1, logprobs=True))
  np.testing.assert_array_equal(tiny.tokens, greedy.tokens)
  assert np.all(np.isfinite(tiny.logprobs))
  np.testing.assert_allclose(tiny.logprobs, greedy.logprobs, rtol=1e-6)


def test_the_sampling_mode_is_known_from_the_host_rows():
  def mode(*params):
    return SamplingRows.of(list(params), 4).mode

  assert mode() is SamplingMode.GREEDY  # padding rows are greedy
  assert mode(SamplingParams(top_p=0.5, top_k=3)) is SamplingMode.GREEDY  # filters unused
  assert mode(SamplingParams(), SamplingParams(temperature=0.7, min_p=0.1)) is SamplingMode.DRAW
  assert mode(SamplingParams(temperature=0.7), SamplingParams(top_k=5),
              SamplingParams(temperature=1.0, top_p=0.9)) is SamplingMode.FILTER
  assert mode(SamplingParams(temperature=0.3, top_k=2)) is SamplingMode.FILTER
  assert SamplingRows.full(SamplingParams(temperature=0.5), 3).mode is SamplingMode.DRAW


def _has_conditional(fn, *args) -> bool:
  text = jax.jit(fn).lower(*args).as_text()
  return 'stablehlo.case' in text or 'stablehlo.if' in text


@pytest.mark.parametrize('case', ['greedy', 'draw', 'filter', 'mixed'])
def test_a_static_mode_draws_what_the_device_decides_without_a_conditional(case):
  """A GPU reads a `lax.cond` predicate back on the host (the dispatch waits for the device);
  rows with a static mode compile none, and draw the same tokens."""
  rng = fresh_rng()
  b, v = 9, 67
  logits = jnp.asarray(rng.normal(0, 2, (b, v)).astype(np.float32))
  keys = request_keys(jnp.asarray(rng.integers(0, 2**32, b, dtype=np.uint32)),
                      jnp.arange(b), jnp.asarray(rng.integers(0, 100, b)))
  greedy = SamplingParams()
  kinds = {'greedy': [greedy, SamplingParams(top_p=0.4)],
           'draw': [greedy, SamplingParams(temperature=0.8), SamplingParams(temperature=1.3,
                                                                             min_p=0.2)],
           'filter': [SamplingParams(temperature=0.9, top_k=4), SamplingParams(temperature=1.1,
                                                                               top_p=0.6)],
           'mixed': [greedy, SamplingParams(temperature=0.7),
                     SamplingParams(temperature=1.0, top_k=9, top_p=0.8, min_p=0.05)]}[case]
  rows = SamplingRows.of([kinds[i] for i in rng.integers(0, len(kinds), b)])
  decided = dataclasses.replace(rows, mode=None)
  np.testing.assert_array_equal(draw(logits, keys, rows), draw(logits, keys, decided))
  np.testing.assert_array_equal(sample_batch(logits, keys, rows, top_logprobs=2).tokens,
                                draw(logits, keys, decided))
  # FILTER (the engine's prefill mode) draws what each row's own mode draws.
  filtered = dataclasses.replace(rows, mode=SamplingMode.FILTER)
  np.testing.assert_array_equal(draw(logits, keys, filtered), draw(logits, keys, rows))
  assert not _has_conditional(lambda x: draw(x, keys, rows), logits)
  assert _has_conditional(lambda x: draw(x, keys, decided), logits)


def test_a_mode_that_would_drop_a_draw_is_refused():
  rows = SamplingRows.of([SamplingParams(), SamplingParams(temperature=0.5, top_p=0.9)])
  assert rows.mode is SamplingMode.FILTER
  for weaker in (SamplingMode.GREEDY, SamplingMode.DRAW):
    with pytest.raises(ValueError, match='cannot draw these rows, which need FILTER'):
      dataclasses.replace(rows, mode=weaker)
  greedy = SamplingRows.of([SamplingParams()] * 2)
  for mode in SamplingMode:  # any mode draws a greedy batch (the engine's warmup, prefill)
    assert dataclasses.replace(greedy, mode=mode).mode is mode
  with pytest.raises(ValueError, match='mode must be a SamplingMode'):
    dataclasses.replace(greedy, mode='greedy')

# `make test` keeps these cases (conftest: `representative_cases`; `()`: the whole test is left
# to `make test-all`, another test of the default run covering its path).
representative_cases = {
    'test_generate_stop_sequences_and_logprobs': (),
}
