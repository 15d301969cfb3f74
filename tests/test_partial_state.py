"""Partial attention states (out, lse) and their merges: identities, empties, extreme logits."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hydrajax as hj
from tests.conftest import assert_states_close

SHAPE = (3, 2, 4, 8)  # [B, T, N, H]


def _state(seed: int, shape=SHAPE, empty_fraction=0.0, lse_scale=3.0, dtype=jnp.float32):
  """A random state; about `empty_fraction` of its rows are empty (0, -inf)."""
  rng = np.random.default_rng(seed)
  out = rng.standard_normal(shape, np.float32)
  lse = lse_scale * rng.standard_normal(shape[:-1], np.float32)
  empty = rng.random(shape[:-1]) < empty_fraction
  out[empty] = 0.0
  lse[empty] = -np.inf
  return hj.PartialState(jnp.asarray(out.astype(jnp.dtype(dtype))), jnp.asarray(lse))


def _close(a, b, tol=1e-6):
  assert_states_close(a, b, rtol=tol, atol=tol)


def _assert_identical(a, b):
  np.testing.assert_array_equal(np.asarray(a.out), np.asarray(b.out))
  np.testing.assert_array_equal(np.asarray(a.lse), np.asarray(b.lse))


def test_golden_merge():
  # One key (score 0, value 1) gives (1, 0); another (score log 3, value 5) gives (5, log 3).
  # Merged: lse = log(1 + 3) = log 4, out = 1/4 * 1 + 3/4 * 5 = 4.
  a = hj.PartialState(jnp.array([1.0]), jnp.array(0.0))
  b = hj.PartialState(jnp.array([5.0]), jnp.array(math.log(3)))
  _close(hj.merge(a, b), hj.PartialState(jnp.array([4.0]), jnp.array(math.log(4))))


def test_golden_merge_of_three_keys():
  # Scores log 1, log 2, log 5 and values 10, -4, 2: weights 1/8, 2/8, 5/8.
  # out = (10 - 8 + 10) / 8 = 1.5, lse = log 8.
  states = [
      hj.PartialState(jnp.array([10.0]), jnp.array(0.0)),
      hj.PartialState(jnp.array([-4.0]), jnp.array(math.log(2))),
      hj.PartialState(jnp.array([2.0]), jnp.array(math.log(5))),
  ]
  _close(hj.merge_many(states), hj.PartialState(jnp.array([1.5]), jnp.array(math.log(8))))


@pytest.mark.parametrize('empty_fraction', [0.0, 0.3], ids=['full', 'some_empty'])
def test_merge_is_associative_and_commutative(empty_fraction):
  a, b, c = (_state(s, empty_fraction=empty_fraction) for s in (1, 2, 3))
  left = hj.merge(hj.merge(a, b), c)
  right = hj.merge(a, hj.merge(b, c))
  _close(left, right)
  _close(hj.merge(a, b), hj.merge(b, a))
  _close(hj.merge(hj.merge(c, a), b), left)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['float32', 'bfloat16'])
def test_merging_an_empty_state_is_a_no_op(dtype):
  a = _state(4, empty_fraction=0.3, dtype=dtype)
  empty = hj.empty_state(SHAPE, dtype)
  assert empty.out.dtype == dtype and empty.lse.dtype == jnp.float32
  assert np.all(np.asarray(empty.lse) == -np.inf) and not np.asarray(empty.out, np.float32).any()
  _assert_identical(hj.merge(a, empty), a)
  _assert_identical(hj.merge(empty, a), a)
  _assert_identical(hj.merge_many([empty, a, empty]), a)


def test_two_empty_states_give_an_empty_state_without_nan():
  empty = hj.empty_state(SHAPE)
  for merged in (hj.merge(empty, empty), hj.merge_many([empty] * 5)):
    assert not np.isnan(np.asarray(merged.out)).any() and not np.isnan(np.asarray(merged.lse)).any()
    _assert_identical(merged, empty)


def test_merging_an_empty_state_under_jit_is_a_no_op():
  a = _state(5, empty_fraction=0.5)
  merged = jax.jit(lambda x, y: hj.merge(x, y))(a, hj.empty_state(SHAPE))
  _assert_identical(merged, a)


@pytest.mark.parametrize(
    'lse_a, lse_b',
    [(1e4, 1e4), (-1e4, -1e4), (1e4, -1e4), (-1e4, 1e4), (1e4, 1e4 - 3.0), (-1e4, -np.inf)],
    ids=['both_large', 'both_very_negative', 'large_small', 'small_large', 'near', 'small_empty'],
)
def test_merge_with_extreme_logits(lse_a, lse_b):
  # Naive exp(lse) overflows (or underflows to 0/0) here; the merge stays exact:
  # weights are exp(lse_i - max), so lse = max + log(sum of weights).
  out_a, out_b = jnp.full((2, 4), 1.0), jnp.full((2, 4), -3.0)
  a = hj.PartialState(out_a, jnp.full((2,), lse_a, jnp.float32))
  b = hj.PartialState(out_b, jnp.full((2,), lse_b, jnp.float32))
  m = max(lse_a, lse_b)
  wa, wb = math.exp(lse_a - m), math.exp(lse_b - m)
  expected = hj.PartialState(
      jnp.full((2, 4), (wa * 1.0 + wb * -3.0) / (wa + wb)),
      jnp.full((2,), m + math.log(wa + wb), jnp.float32),
  )
  merged = hj.merge(a, b)
  assert np.isfinite(np.asarray(merged.out)).all() and np.isfinite(np.asarray(merged.lse)).all()
  # Absolute: float32 spacing at 1e4 is about 1e-3, well below the log 2 a wrong merge would miss.
  assert_states_close(merged, expected, rtol=0, atol=2e-3)


def test_merge_many_equals_sequential_merges():
  states = [_state(10 + i, empty_fraction=0.25, lse_scale=20.0) for i in range(6)]
  sequential = states[0]
  for s in states[1:]:
    sequential = hj.merge(sequential, s)
  _close(hj.merge_many(states), sequential, tol=2e-6)
  _close(hj.merge_many(states[::-1]), sequential, tol=2e-6)
  with pytest.raises(ValueError, match='at least one state'):
    hj.merge_many([])


def test_merge_output_dtype():
  a, b = _state(20, dtype=jnp.bfloat16), _state(21, dtype=jnp.bfloat16)
  assert hj.merge(a, b).out.dtype == jnp.bfloat16
  merged = hj.merge(a, b, out_dtype=jnp.float32)
  assert merged.out.dtype == jnp.float32 and merged.lse.dtype == jnp.float32
  reference = hj.merge(*(hj.PartialState(s.out.astype(jnp.float32), s.lse) for s in (a, b)))
  _close(merged, reference)


@pytest.mark.parametrize('chunks', [(5,), (2, 3), (1, 1, 3), (0, 5), (4, 0, 1)], ids=str)
def test_merging_kv_chunks_equals_full_attention(chunks):
  """Attention over a split of the keys, merged, is attention over all of them."""
  b, t, n, k, h = 2, 1, 4, 2, 8
  s = sum(chunks)
  rng = np.random.default_rng(30 + len(chunks))
  q, keys, values = (
      jnp.asarray(rng.standard_normal(shape, np.float32))
      for shape in ((b, t, n, h), (b, s, k, h), (b, s, k, h))
  )
  full_lengths = jnp.full((b,), s, jnp.int32)
  expected = hj.naive_attention(q, keys, values, full_lengths)
  parts, start = [], 0
  for c in chunks:  # T = 1: the query sees every key of its chunk; an empty chunk is masked
    sl = slice(start, start + max(c, 1))
    lengths = jnp.full((b,), c, jnp.int32)
    parts.append(hj.naive_attention(q, keys[:, sl], values[:, sl], lengths))
    start += c
  assert all(np.all(np.asarray(p.lse) == -np.inf) for p, c in zip(parts, chunks) if c == 0)
  _close(hj.merge_many(parts), expected, tol=1e-5)


def test_merge_into_rows():
  # Seven partial states for four rows: row 0 gets three, row 1 one, row 2 none, row 3 two
  # (one of them empty), and one goes to the dump row (== num_rows) and is dropped.
  num_rows = 4
  rows = jnp.array([3, 0, 4, 0, 1, 3, 0], jnp.int32)
  shape = (len(rows), 2, 2, 4)  # [M, T, N, H]
  states = _state(40, shape=shape, lse_scale=10.0)
  # Row 3's second state is empty: it must not change row 3.
  outs = states.out.at[5].set(0.0)
  lses = states.lse.at[5].set(-jnp.inf)
  merged = jax.jit(hj.merge_into_rows, static_argnums=0)(num_rows, rows, outs, lses)
  assert merged.out.shape == (num_rows, 2, 2, 4) and merged.lse.shape == (num_rows, 2, 2)

  def part(i):
    return hj.PartialState(outs[i], lses[i])

  _close(hj.PartialState(merged.out[0], merged.lse[0]), hj.merge_many([part(1), part(3), part(6)]))
  _close(hj.PartialState(merged.out[1], merged.lse[1]), part(4))
  _assert_identical(hj.PartialState(merged.out[2], merged.lse[2]), hj.empty_state((2, 2, 4)))
  _close(hj.PartialState(merged.out[3], merged.lse[3]), part(0))
  assert not np.isnan(np.asarray(merged.out)).any() and not np.isnan(np.asarray(merged.lse)).any()


@pytest.mark.parametrize('scattered', [0, 7])
def test_a_state_of_every_row_merges_without_a_scatter(scattered):
  """A state every row has once, in row order (its private part), merged elementwise with the
  scattered merge (what the XLA and differentiable paths do) is the same merge as listing it
  among the scattered states at rows 0..B-1; empty rows (-inf, garbage out), a dump row and
  no scattered state at all included."""
  num_rows, shape = 4, (2, 2, 4)  # [T, N, H]
  seed = int(np.random.default_rng().integers(1 << 30))
  base = _state(seed, shape=(num_rows,) + shape, empty_fraction=0.3, lse_scale=10.0)
  others = _state(seed + 1, shape=(scattered,) + shape, empty_fraction=0.2, lse_scale=10.0)
  rows = jnp.asarray(np.random.default_rng(seed).integers(0, num_rows + 1, scattered), jnp.int32)
  got = hj.merge(base, hj.merge_into_rows(num_rows, rows, others.out, others.lse))
  every_row = jnp.arange(num_rows, dtype=jnp.int32)
  want = hj.merge_into_rows(num_rows, jnp.concatenate([every_row, rows]),
                            jnp.concatenate([base.out, others.out]),
                            jnp.concatenate([base.lse, others.lse]))
  _close(got, want, tol=1e-5)
  if not scattered:
    _close(got, base, tol=1e-6)
  # An empty state adds nothing whatever its out holds: NaN in the base's empty rows.
  garbage = hj.PartialState(jnp.where(jnp.isinf(base.lse)[..., None], jnp.nan, base.out), base.lse)
  _close(hj.merge(garbage, hj.merge_into_rows(num_rows, rows, others.out, others.lse)), want,
         tol=1e-5)


def test_merge_into_rows_with_extreme_logits():
  rows = jnp.array([0, 0, 1, 1, 2], jnp.int32)
  lses = jnp.array([1e4, -1e4, -1e4, -1e4, 1e4], jnp.float32)[:, None]  # [M, T=1]
  outs = jnp.array([1.0, 7.0, 2.0, 4.0, 5.0])[:, None, None]  # [M, T=1, H=1]
  merged = hj.merge_into_rows(3, rows, outs, lses)
  expected = hj.PartialState(
      jnp.array([1.0, 3.0, 5.0])[:, None, None],
      jnp.array([1e4, -1e4 + math.log(2), 1e4], jnp.float32)[:, None],
  )
  assert_states_close(merged, expected, rtol=0, atol=2e-3)


def test_naive_attention_over_zero_keys_is_the_empty_state():
  q = jnp.ones((2, 3, 4, 8), jnp.bfloat16)
  kv = jnp.ones((2, 0, 2, 8), jnp.bfloat16)
  out, lse = hj.naive_attention(q, kv, kv, jnp.zeros(2, jnp.int32))
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)
  assert np.all(np.isneginf(np.asarray(lse)))
