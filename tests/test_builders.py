"""Builders of sharing plans, the device layout, bucketing and the text rendering."""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

import hydrajax as hj
from tests.conftest import assert_states_close, naive_tree_attention, random_inputs

# plan_tree


def _fewshot_tree():
  return hj.PromptNode(
      1000,
      label='few-shot',
      children=(
          hj.PromptNode(100, num_samples=4, label='problem 0'),
          hj.PromptNode(
              0, children=(hj.PromptNode(7, num_samples=2), hj.PromptNode(1)), label='problem 1'
          ),
          hj.PromptNode(100, num_samples=1, label='problem 2'),
      ),
  )


def test_plan_tree_layout_by_hand():
  plan = hj.plan_tree(_fewshot_tree(), private_capacity=10, private_lengths=3)
  # Depth-first: the few-shot prompt, problem 0 (rows 0-3), problem 1 (empty) with two
  # children (rows 4-5 and row 6), problem 2 (row 7). Tokens laid out in the same order.
  expected = [
      hj.Segment(0, 1000, 0, 8, -1, 0, 'few-shot'),
      hj.Segment(1000, 100, 0, 4, 0, 1000, 'problem 0'),
      hj.Segment(1100, 0, 4, 7, 0, 1000, 'problem 1'),
      hj.Segment(1100, 7, 4, 6, 2, 1000, 'node3'),
      hj.Segment(1107, 1, 6, 7, 2, 1000, 'node4'),
      hj.Segment(1108, 100, 7, 8, 0, 1000, 'problem 2'),
  ]
  assert list(plan.segments) == expected
  assert plan.num_rows == 8 and plan.page_size == 10
  # Private pages start at the first page boundary after the shared tokens (1208 -> page 121).
  assert plan.private_pages == tuple((121 + b,) for b in range(8))
  assert plan.private_lengths == (3,) * 8 and plan.kv_tokens == 129 * 10
  assert plan.path(5) == [0, 2, 3] and plan.path(7) == [0, 5]
  assert plan.private_position(5) == 1007 and plan.private_position(0) == 1100
  assert plan.shared_tokens() == 1208
  assert plan.unshared_tokens() == 4 * 1103 + 2 * 1010 + 1004 + 1103


def test_plan_tree_segment_align():
  """segment_align=8: each segment starts on a multiple of 8 (gaps unused), the same rows and
  positions; the attention is unchanged."""
  plan = hj.plan_tree(_fewshot_tree(), private_capacity=10, private_lengths=3, segment_align=8)
  starts = [s.kv_start for s in plan.segments]
  assert starts == [0, 1000, 1104, 1104, 1112, 1120]
  base = hj.plan_tree(_fewshot_tree(), private_capacity=10, private_lengths=3)
  same = lambda s: (s.kv_length, s.row_begin, s.row_end, s.parent, s.position, s.label)
  assert list(map(same, plan.segments)) == list(map(same, base.segments))
  assert plan.private_pages[0] == (122,)  # 1220 shared tokens and gaps -> page 122
  q, k, v = random_inputs(int(np.random.SeedSequence().entropy % 2**31), plan, 1, 2, 1, 8,
                          jnp.float32)
  assert_states_close(hj.tree_attention(q, k, v, plan.to_device()),
                      naive_tree_attention(q, k, v, plan))
  for bad in (0, 2.5):
    with pytest.raises(ValueError, match='segment_align'):
      hj.plan_tree(_fewshot_tree(), private_capacity=10, segment_align=bad)


def test_plan_tree_forest_and_ragged_private_lengths():
  roots = [hj.PromptNode(5, num_samples=2), hj.PromptNode(0), hj.PromptNode(3, num_samples=3)]
  plan = hj.plan_tree(roots, private_capacity=4, private_lengths=[0, 1, 2, 3, 4, 4])
  rows = [(s.row_begin, s.row_end, s.parent) for s in plan.segments]
  assert rows == [(0, 2, -1), (2, 3, -1), (3, 6, -1)]
  assert plan.path(2) == [1]
  indices, lengths = plan.row_token_indices()
  # Shared tokens 0-4 and 5-7; private pages of 4 tokens start at page 2 (token 8).
  assert lengths.tolist() == [5, 6, 2, 6, 7, 7]
  assert indices[1, :6].tolist() == [0, 1, 2, 3, 4, 12]
  assert indices[2, :2].tolist() == [16, 17]
  assert indices[5, :7].tolist() == [5, 6, 7, 28, 29, 30, 31]


def test_plan_tree_variable_fanout():
  tree = hj.PromptNode(
      2, children=tuple(hj.PromptNode(1, children=(hj.PromptNode(1),) * f) for f in (1, 5, 3))
  )
  plan = hj.plan_tree(tree, private_capacity=1)
  children = [s for s in plan.segments if s.parent == 0]
  assert [c.num_rows for c in children] == [1, 5, 3]
  assert plan.num_rows == 9 and plan.private_lengths == (0,) * 9


# plan_from_tokens: brute-force checks of the radix tree


def _materialise(tp: hj.TokenPlan, row: int) -> list[int]:
  tokens = [t for j in tp.plan.path(row) for t in tp.segment_tokens[j]]
  return tokens + list(tp.private_tokens[row])


def _lcp(a, b) -> int:
  n = 0
  while n < min(len(a), len(b)) and a[n] == b[n]:
    n += 1
  return n


def check_radix_plan(seqs, tp: hj.TokenPlan, max_new_tokens: int = 0):
  plan = tp.plan
  seqs = [list(s) for s in seqs]
  assert sorted(tp.order) == list(range(len(seqs)))  # a permutation
  assert plan.num_rows == len(seqs) and len(tp.private_tokens) == len(seqs)
  for row in range(plan.num_rows):  # each row spells its own sequence
    assert _materialise(tp, row) == seqs[tp.order[row]], f'row {row}'
    assert plan.private_lengths[row] == len(tp.private_tokens[row])
  capacity = max(1, max(len(t) for t in tp.private_tokens) + max_new_tokens)
  assert plan.page_size == -(-capacity // 8) * 8  # rounded up to 8 tokens (Mosaic GPU tiles)
  for j, s in enumerate(plan.segments):
    assert s.kv_length == len(tp.segment_tokens[j]) >= 1
    assert s.num_rows >= 2, f'segment {j} is not shared'
    # The rows under a segment are exactly (and contiguously) the sequences with its prefix.
    prefix = [t for i in plan.path(s.row_begin) if i <= j for t in tp.segment_tokens[i]]
    assert s.position == len(prefix) - s.kv_length
    having = [r for r in range(plan.num_rows) if seqs[tp.order[r]][: len(prefix)] == prefix]
    assert having == list(range(s.row_begin, s.row_end)), f'segment {j}'
  # Maximal sharing: two rows share exactly their longest common prefix.
  for a in range(plan.num_rows):
    for b in range(a + 1, plan.num_rows):
      common = set(plan.path(a)) & set(plan.path(b))
      shared = sum(plan.segments[j].kv_length for j in common)
      assert shared == _lcp(seqs[tp.order[a]], seqs[tp.order[b]]), (a, b)
  # Each distinct shared prefix is stored once.
  assert plan.shared_tokens() == sum(len(t) for t in tp.segment_tokens)


def _random_sequences(rng: np.random.Generator, n: int):
  """Sequences that branch off a few random stems, with a small vocabulary (lots of sharing)."""

  def draw(vocab, low, high):  # a random length in [low, high), tokens in [0, vocab)
    return [int(t) for t in rng.integers(0, vocab, int(rng.integers(low, high)))]

  stems = [draw(4, 0, 12) for _ in range(int(rng.integers(1, 4)))]
  seqs = []
  for _ in range(n):
    stem = stems[int(rng.integers(len(stems)))]
    cut = int(rng.integers(0, len(stem) + 1))
    seqs.append(stem[:cut] + draw(3, 0, 6))
  return seqs


@pytest.mark.parametrize('seed', range(12), ids=lambda s: f'seed={s}')
def test_plan_from_random_tokens_is_a_radix_tree(seed):
  rng = np.random.default_rng(seed)
  seqs = _random_sequences(rng, int(rng.integers(1, 12)))
  max_new = int(rng.integers(0, 4))
  check_radix_plan(seqs, hj.plan_from_tokens(seqs, max_new_tokens=max_new), max_new)


@pytest.mark.parametrize(
    'seqs',
    [
        [[1, 2, 3]] * 4,  # identical: one shared segment, nothing private
        [[1, 2], [3, 4], [5], [6, 7, 8]],  # no sharing at all
        [[4, 4, 4, 4]],  # one sequence
        [[1, 2, 3], [1, 2], [1, 2, 3, 4], [1]],  # prefixes of one another
        [[], [1], [1, 1], []],  # empty sequences
        [[9, 1, 2], [9, 1, 3], [8, 1, 2], [9, 1, 2], [8, 1]],  # two trees, reordered rows
    ],
    ids=['identical', 'no_sharing', 'one_sequence', 'nested_prefixes', 'empty', 'forest'],
)
def test_plan_from_tokens_edge_cases(seqs):
  tp = hj.plan_from_tokens(seqs, max_new_tokens=2)
  check_radix_plan(seqs, tp, max_new_tokens=2)


def test_plan_from_tokens_shapes_by_hand():
  tp = hj.plan_from_tokens([[1, 2, 3]] * 4)
  assert len(tp.plan.segments) == 1 and tp.segment_tokens == ((1, 2, 3),)
  assert tp.private_tokens == ((),) * 4 and tp.plan.segments[0].num_rows == 4
  tp = hj.plan_from_tokens([[1, 2], [3, 4], [5]])
  assert tp.plan.segments == () and tp.order == (0, 1, 2)
  assert tp.plan.page_size == 8  # 2 tokens rounded up to a multiple of 8 (Mosaic GPU tiles)
  tp = hj.plan_from_tokens([[9, 1, 2], [8, 5], [9, 1, 3], [9, 7]])
  # Rows sorted by next token: [8, 5], then under [9]: [9, 1, *] (sharing [1]), then [9, 7].
  assert tp.order == (1, 0, 2, 3)
  assert tp.segment_tokens == ((9,), (1,))
  assert [(s.row_begin, s.row_end, s.parent) for s in tp.plan.segments] == [(1, 4, -1), (1, 3, 0)]


@pytest.mark.parametrize('seed', [0, 1, 2], ids=lambda s: f'seed={s}')
def test_attention_over_a_token_plan_matches_oracle(seed):
  rng = np.random.default_rng(100 + seed)
  seqs = _random_sequences(rng, 6) + [[1, 2, 3, 0, 0, 1]] * 2
  t = 2
  tp = hj.plan_from_tokens(seqs, max_new_tokens=t)
  # Decoding: each row has appended T tokens to its private prompt tail.
  plan = dataclasses.replace(tp.plan, private_lengths=tuple(n + t for n in tp.plan.private_lengths))
  q, k_cache, v_cache = random_inputs(400 + seed, plan, t, 4, 1, 8, jnp.float32)
  expected = naive_tree_attention(q, k_cache, v_cache, plan)
  got = hj.tree_attention(q, k_cache, v_cache, plan.to_device(), impl='xla')
  assert_states_close(got, expected)


# to_device and bucket_size


def test_to_device_groups_segments_by_capacity():
  tree = hj.PromptNode(
      40,
      children=(
          hj.PromptNode(17, num_samples=2), hj.PromptNode(0), hj.PromptNode(19, num_samples=2)
      ),
  )
  plan = hj.plan_tree(tree, private_capacity=3, private_lengths=[1, 2, 3, 1, 2])
  exact = plan.to_device(bucket=False)
  bucketed = plan.to_device()
  # bucket=False: one group per distinct (rows, tokens); the empty segment is dropped.
  assert sorted((g.row_capacity, g.kv_capacity, g.num_segments) for g in exact.groups) == [
      (2, 17, 1), (2, 19, 1), (5, 40, 1)
  ]
  # Bucketed: 17 and 19 tokens both round up to 20, so the two leaves batch in one group.
  assert sorted((g.row_capacity, g.kv_capacity, g.num_segments) for g in bucketed.groups) == [
      (2, 20, 2), (5, 40, 1)
  ]
  pair = next(g for g in bucketed.groups if g.num_segments == 2)
  assert pair.kv_start.tolist() == [40, 57] and pair.kv_length.tolist() == [17, 19]
  assert pair.row_begin.tolist() == [0, 3] and pair.row_count.tolist() == [2, 2]
  assert bucketed.private_pages.tolist() == [[26], [27], [28], [29], [30]]
  assert bucketed.private_lengths.tolist() == [1, 2, 3, 1, 2] and bucketed.page_size == 3
  assert bucketed.num_rows == 5 and bucketed.max_private_tokens == 3
  wide = plan.to_device(max_private_pages=3)
  assert wide.private_pages.tolist() == [[26, 0, 0], [27, 0, 0], [28, 0, 0], [29, 0, 0], [30, 0, 0]]
  assert wide.max_private_tokens == 9


def test_bucket_size_properties():
  ns = np.arange(1, 5000)
  sizes = np.array([hj.bucket_size(int(n)) for n in ns])
  assert np.all(sizes >= ns)
  assert np.all(np.diff(sizes) >= 0)  # monotone
  assert np.all(sizes <= 1.25 * ns + 1)  # wastes at most a quarter
  assert np.all(sizes[:4] == ns[:4])
  for i in range(13):  # powers of two are their own bucket
    assert hj.bucket_size(2**i) == 2**i
  assert all(hj.bucket_size(int(s)) == s for s in sizes)  # idempotent
  assert len(set(sizes.tolist())) <= 4 * math.ceil(math.log2(5000))  # few distinct compiles
  assert [hj.bucket_size(n, 16) for n in (0, 1, 15, 16, 17, 21, 33)] == [16, 16, 16, 16, 20, 24, 40]


# render_plan


def test_render_plan():
  plan = hj.plan_tree(_fewshot_tree(), private_capacity=10, private_lengths=3)
  text = hj.render_plan(plan)
  lines = text.splitlines()
  shared, private = 1208, 8 * 3
  unshared = plan.unshared_tokens()
  assert lines[0] == (
      f'8 rows, 6 shared segments; KV tokens stored: {shared + private:,} with sharing vs '
      f'{unshared:,} without ({unshared / (shared + private):.1f}x)'
  )
  assert '(6.9x)' in lines[0]  # 8539 / 1232, worked by hand (see test_plan_tree_layout_by_hand)
  assert lines[1] == '└─ few-shot: 1,000 tokens, rows 0-7 (8)'
  assert '├─ problem 0: 100 tokens, rows 0-3 (4)' in lines[2]
  assert 'problem 1: 0 tokens, rows 4-6 (3)' in text and 'node4: 1 tokens, row 6' in text
  assert lines[-1] == 'private: 24 tokens in pages of 10 (per row 3..3)'
  assert len(lines) == 1 + 6 + 1


def test_render_plan_elides_long_sibling_lists():
  many = hj.PromptNode(3, children=tuple(hj.PromptNode(2, label=f'leaf {i}') for i in range(10)))
  text = hj.render_plan(hj.plan_tree([many] * 8, private_capacity=1), max_children=4)
  assert '... 7 more like these' in text and '... 4 more trees' in text
  assert 'leaf 2' in text and 'leaf 3' not in text
