"""Tree attention (the XLA path, directly and through dispatch) against the naive oracle."""

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hydrajax as hj
from hydrajax.attention.training import tree_attention_differentiable
from tests.conftest import (
    assert_states_close,
    fanouts,
    naive_tree_attention,
    random_inputs,
    random_tree,
    segment_lengths,
    tree_depth,
)
from tests.tree_attention_conformance import Case as ConformanceCase
from tests.tree_attention_conformance import TreeAttentionConformance
from tests.tree_attention_conformance import pytest_generate_tests  # noqa: F401 (parametrizes)

HEAD_DIM = 16
HEADS = ((8, 8), (8, 2), (8, 1))  # (N, K): MHA, GQA (G=4), MQA (G=8)
DTYPES = (jnp.float32, jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class Case:
  seed: int
  depth: int
  heads: tuple[int, int]
  dtype: object
  t: int
  batch_one: bool = False

  @property
  def id(self) -> str:
    n, k = self.heads
    rows = 'batch=1_' if self.batch_one else ''
    dtype = jnp.dtype(self.dtype).name
    return f'{rows}depth={self.depth}_N={n}_K={k}_T={self.t}_{dtype}_seed={self.seed}'


def _cases() -> list[Case]:
  """Every depth with every GQA fold in both dtypes, each with T = 1 or T = 3 (half of the grid)."""
  cases = []
  grid = itertools.product(range(2), range(1, 5), enumerate(HEADS))
  for i, (flip, depth, (h, heads)) in enumerate(grid):
    dtype = DTYPES[(depth + h + flip) % 2]
    t = (1, 3)[((depth - 1) // 2 + h + flip) % 2]
    cases.append(Case(100 + i, depth, heads, dtype, t))
  for depth in range(1, 5):  # batch 1: one row under a chain of `depth` segments
    heads, dtype = HEADS[depth % 3], DTYPES[depth % 2]
    cases.append(Case(200 + depth, depth, heads, dtype, t=depth, batch_one=True))
  return cases


CASES = _cases()


@dataclasses.dataclass(frozen=True)
class Built:
  roots: tuple[hj.PromptNode, ...]
  plan: hj.SharingPlan
  kv_block: int


def _build(case: Case) -> Built:
  """The case's random forest and plan, from a numpy Generator seeded by the case."""
  rng = np.random.default_rng(case.seed)
  if case.batch_one:
    rows = [1]
  else:
    rows = [int(r) for r in rng.integers(1, 6, int(rng.integers(1, 4)))]
  roots = tuple(random_tree(rng, case.depth, r) for r in rows)
  capacity = case.t + int(rng.integers(0, 40))
  lengths = [int(n) for n in rng.integers(case.t, capacity + 1, sum(rows))]
  plan = hj.plan_tree(roots, private_capacity=capacity, private_lengths=lengths)
  return Built(roots, plan, kv_block=int(rng.choice([7, 16])))


def test_random_cases_cover_the_issue():
  """The parameterized cases below span what the issue asks for (checked, not assumed)."""
  built = [(c, _build(c)) for c in CASES]
  assert {tree_depth(r) for _, b in built for r in b.roots} == {1, 2, 3, 4}
  assert set(range(1, 6)) <= {f for _, b in built for r in b.roots for f in fanouts(r)}
  lengths = {n for _, b in built for r in b.roots for n in segment_lengths(r)}
  assert {0, 1} <= lengths and max(lengths) >= 250
  assert any(b.plan.num_rows == 1 for _, b in built)
  assert any(len(b.roots) >= 3 for _, b in built)  # forests
  assert {c.t for c in CASES} >= {1, 3} and {c.heads for c in CASES} == set(HEADS)
  assert {jnp.dtype(c.dtype) for c in CASES} == {jnp.dtype(d) for d in DTYPES}
  for c in CASES:  # every T and GQA fold is seen with both dtypes
    assert c.batch_one or any(
        d.t == c.t and d.heads == c.heads and d.dtype != c.dtype for d in CASES
    ), c.id
  # The blocked (multi-block) KV path runs in most cases.
  blocked = [any(s.kv_length > b.kv_block for s in b.plan.segments) for _, b in built]
  assert sum(blocked) >= len(CASES) // 2


@pytest.mark.parametrize('case', CASES, ids=lambda c: c.id)
def test_random_tree_matches_oracle(case: Case):
  built = _build(case)
  plan = built.plan
  n, k = case.heads
  q, k_cache, v_cache = random_inputs(case.seed, plan, case.t, n, k, HEAD_DIM, case.dtype)
  expected = naive_tree_attention(q, k_cache, v_cache, plan)

  via_dispatch = hj.tree_attention(q, k_cache, v_cache, plan.to_device(), impl=hj.AttentionImpl.XLA)
  assert via_dispatch.out.dtype == case.dtype
  assert via_dispatch.out.shape == q.shape and via_dispatch.lse.shape == q.shape[:3]
  assert_states_close(via_dispatch, expected)

  blocked = hj.tree_attention_xla(
      q, k_cache, v_cache, plan.to_device(bucket=False), kv_block=built.kv_block
  )
  assert_states_close(blocked, expected)


# Golden cases, worked by hand. H = 1 and scale = 1 so that a score is q * k.


def _golden_layout(tree, capacity, lengths):
  plan = hj.plan_tree(tree, private_capacity=capacity, private_lengths=lengths)
  return plan, plan.to_device()


def _golden_check(plan, layout, q, k_cache, v_cache, out, lse):
  q, k_cache, v_cache = (jnp.asarray(x, jnp.float32) for x in (q, k_cache, v_cache))
  expected = hj.PartialState(jnp.asarray(out, jnp.float32), jnp.asarray(lse, jnp.float32))
  for impl in ('xla', hj.AttentionImpl.AUTO):
    got = hj.tree_attention(q, k_cache, v_cache, layout, impl=impl, scale=1.0)
    assert_states_close(got, expected, rtol=1e-6, atol=1e-6)
  assert_states_close(hj.naive_tree_attention(q, k_cache, v_cache, plan, scale=1.0), expected)


def test_golden_two_keys_shared_and_private():
  # One row; a shared segment of one key (k = 0, v = 1) and one private key (k = log 3, v = 5).
  # q = 1: scores 0 and log 3, weights 1/4 and 3/4: out = 1/4 * 1 + 3/4 * 5 = 4, lse = log(1 + 3).
  plan, layout = _golden_layout(hj.PromptNode(1), capacity=1, lengths=1)
  assert plan.kv_tokens == 2  # token 0: the segment, token 1: the row's private page
  q = [[[[1.0]]]]  # [B=1, T=1, N=1, H=1]
  k_cache = [[[0.0]], [[math.log(3)]]]
  v_cache = [[[1.0]], [[5.0]]]
  _golden_check(plan, layout, q, k_cache, v_cache, out=[[[[4.0]]]], lse=[[[math.log(4)]]])


def test_golden_two_row_tree():
  # Two rows share a root segment of two tokens (k = 0, log 2; v = 0, 6); each row has one
  # private token: row 0 (k = log 3, v = 12), row 1 (k = 5, v = 3).
  # Row 0, q = 1: scores 0, log 2, log 3 -> weights 1, 2, 3 over 6:
  #   out = (0 + 2 * 6 + 3 * 12) / 6 = 8, lse = log 6.
  # Row 1, q = 0: all scores 0 -> the plain mean of 0, 6, 3: out = 3, lse = log 3.
  plan, layout = _golden_layout(hj.PromptNode(2, num_samples=2), capacity=1, lengths=1)
  assert [s.kv_length for s in plan.segments] == [2]
  assert plan.private_pages == ((2,), (3,))
  q = [[[[1.0]]], [[[0.0]]]]
  k_cache = [[[0.0]], [[math.log(2)]], [[math.log(3)]], [[5.0]]]
  v_cache = [[[0.0]], [[6.0]], [[12.0]], [[3.0]]]
  _golden_check(
      plan,
      layout,
      q,
      k_cache,
      v_cache,
      out=[[[[8.0]]], [[[3.0]]]],
      lse=[[[math.log(6)]], [[math.log(3)]]],
  )


def test_golden_causal_suffix_with_gqa():
  # One row, T = 2 query tokens, an empty shared segment, two private keys (k = 0, log 3;
  # v = 1, 5) under one kv head and two query heads (G = 2): head 0 has q = 1, head 1 has q = 0.
  # Token 0 sees key 0 only: out = 1, lse = 0 (both heads).
  # Token 1 sees both keys: head 0 (scores 0, log 3): out = 4, lse = log 4;
  #                         head 1 (scores 0, 0):     out = 3, lse = log 2.
  plan, layout = _golden_layout(hj.PromptNode(0), capacity=2, lengths=2)
  assert layout.groups == ()  # the empty segment is dropped
  assert plan.private_pages == ((0,),) and plan.page_size == 2  # the private page is tokens 0, 1
  q = [[[[1.0], [0.0]], [[1.0], [0.0]]]]  # [B=1, T=2, N=2, H=1]
  k_cache = [[[0.0]], [[math.log(3)]]]  # [L=2, K=1, H=1]
  v_cache = [[[1.0]], [[5.0]]]
  _golden_check(
      plan,
      layout,
      q,
      k_cache,
      v_cache,
      out=[[[[1.0], [1.0]], [[4.0], [3.0]]]],
      lse=[[[0.0, 0.0], [math.log(4), math.log(2)]]],
  )


@pytest.mark.parametrize('scale', [0.9, 300.0], ids=['scale=0.9', 'large_logits_scale=300'])
def test_custom_scale_matches_oracle(scale):
  # scale=300 gives scores in the thousands (lse about 4e3): exp would overflow without the max.
  plan = hj.plan_tree(
      hj.PromptNode(9, children=(hj.PromptNode(4), hj.PromptNode(30, num_samples=2))),
      private_capacity=3,
      private_lengths=[1, 2, 3],
  )
  q, k_cache, v_cache = random_inputs(7, plan, 1, 4, 2, 8, jnp.float32)
  expected = hj.naive_tree_attention(q, k_cache, v_cache, plan, scale=scale)
  got = hj.tree_attention(q, k_cache, v_cache, plan.to_device(), impl='xla', scale=scale)
  assert_states_close(got, expected)
  blocked = hj.tree_attention_xla(  # the 30-token segment in blocks of 8, merged
      q, k_cache, v_cache, plan.to_device(bucket=False), scale=scale, kv_block=8
  )
  assert_states_close(blocked, expected)
  assert np.abs(np.asarray(got.lse)).max() > (1e3 if scale > 1 else 0)
  default = naive_tree_attention(q, k_cache, v_cache, plan)
  assert not np.allclose(np.asarray(got.lse), np.asarray(default.lse))  # the scale is used


# Splitting one segment into a chain of two over the same rows and buffer is exact.


@pytest.mark.parametrize('split', [0, 1, 18, 37], ids=lambda a: f'split={a}_of_37')
def test_splitting_a_segment_is_exact(split: int):
  n = 37
  leaves = (hj.PromptNode(5, num_samples=2), hj.PromptNode(0), hj.PromptNode(11))
  private = dict(private_capacity=4, private_lengths=[2, 2, 3, 4, 2])  # each >= T = 2
  whole = hj.plan_tree([hj.PromptNode(n, children=leaves), hj.PromptNode(3)], **private)
  chain = hj.PromptNode(split, children=(hj.PromptNode(n - split, children=leaves),))
  parts = hj.plan_tree([chain, hj.PromptNode(3)], **private)
  # The same rows see the same tokens of the same buffer.
  assert parts.num_rows == whole.num_rows and parts.kv_tokens == whole.kv_tokens
  for a, b in zip(parts.row_token_indices(), whole.row_token_indices()):
    np.testing.assert_array_equal(a, b)
  assert len(parts.segments) == len(whole.segments) + 1

  q, k_cache, v_cache = random_inputs(300 + split, whole, 2, 4, 1, 8, jnp.float32)
  expected = hj.tree_attention_xla(q, k_cache, v_cache, whole.to_device(bucket=False))
  for layout in (parts.to_device(bucket=False), parts.to_device()):
    assert_states_close(
        hj.tree_attention_xla(q, k_cache, v_cache, layout), expected, rtol=2e-6, atol=2e-6
    )
  assert_states_close(expected, naive_tree_attention(q, k_cache, v_cache, whole))


def test_splitting_a_segment_by_hand_built_plans():
  # A parent segment of n tokens vs two segments [0, a) and [a, n) over the same rows.
  n, a, rows = 23, 9, 3
  private = dict(
      page_size=4, private_pages=((6,), (7,), (8,)), private_lengths=(4, 1, 3), kv_tokens=36
  )
  one = hj.SharingPlan(rows, (hj.Segment(0, n, 0, rows),), **private)
  head, tail = hj.Segment(0, a, 0, rows), hj.Segment(a, n - a, 0, rows, parent=0, position=a)
  two = hj.SharingPlan(rows, (head, tail), **private)
  q, k_cache, v_cache = random_inputs(31, one, 1, 2, 2, 8, jnp.float32)
  expected = naive_tree_attention(q, k_cache, v_cache, one)
  for plan in (one, two):
    assert_states_close(hj.tree_attention_xla(q, k_cache, v_cache, plan.to_device()), expected)
    assert_states_close(naive_tree_attention(q, k_cache, v_cache, plan), expected)


# Padded layouts under jit.


def _padding_plan():
  return hj.plan_tree(
      [
          hj.PromptNode(
              45, children=(hj.PromptNode(3, num_samples=7), hj.PromptNode(0), hj.PromptNode(70))
          ),
          hj.PromptNode(1, num_samples=2),
      ],
      private_capacity=6,
      private_lengths=[2, 6, 3, 4, 5, 2, 3, 6, 2, 5, 4],
  )


def test_padded_layouts_match_unpadded():
  dtype = jnp.float32
  plan = _padding_plan()
  q, k_cache, v_cache = random_inputs(41, plan, 2, 4, 2, 8, dtype, extra_kv=13)
  unpadded = plan.to_device(bucket=False)
  assert sorted(g.kv_capacity for g in unpadded.groups) == sorted(
      s.kv_length for s in plan.segments if s.kv_length
  )
  expected = hj.tree_attention_xla(q, k_cache, v_cache, unpadded)
  padded = {
      'bucket': plan.to_device(),
      'bucket_wide_pages': plan.to_device(max_private_pages=4),
      'exact_wide_pages': plan.to_device(bucket=False, max_private_pages=3),
  }
  bucketed = padded['bucket']
  assert any(g.kv_capacity > min(g.kv_length) for g in bucketed.groups)  # real padding
  assert any(g.row_capacity > min(g.row_count) for g in bucketed.groups)
  assert padded['bucket_wide_pages'].private_pages.shape == (plan.num_rows, 4)
  for layout in padded.values():
    got = hj.tree_attention_xla(q, k_cache, v_cache, layout)
    assert_states_close(got, expected, rtol=1e-6, atol=1e-6)
  assert_states_close(expected, naive_tree_attention(q, k_cache, v_cache, plan))


def test_segment_kv_capacity_sizes_its_group_not_its_attention():
  """A segment in a slot of `kv_capacity` tokens (a training batch's padded prompt) gets a group
  of that capacity whatever its real length, so layouts of one slot shape share their static
  shapes; attention still sees only the real tokens. Split pieces size the last by the slot."""
  def plan(lengths, capacity=8, kv_piece=None):
    segments = tuple(hj.Segment(i * capacity, n, 2 * i, 2 * i + 2, kv_capacity=capacity)
                     for i, n in enumerate(lengths))
    rows = 2 * len(lengths)
    return hj.SharingPlan(rows, segments, 4, tuple((2 * len(lengths) + r,) for r in range(rows)),
                          (3,) * rows, (2 * len(lengths) + rows) * 4)

  layouts = [plan(lengths).to_device(bucket=False) for lengths in ((8, 3), (1, 5))]
  assert jax.tree.structure(layouts[0]) == jax.tree.structure(layouts[1])
  assert [(g.row_capacity, g.kv_capacity) for g in layouts[0].groups] == [(2, 8)]
  for lengths, layout in zip(((8, 3), (1, 5)), layouts):
    p = plan(lengths)
    q, k_cache, v_cache = random_inputs(60 + lengths[1], p, 3, 4, 2, 8, jnp.float32)
    assert_states_close(hj.tree_attention_xla(q, k_cache, v_cache, layout),
                        naive_tree_attention(q, k_cache, v_cache, p))
  policy = hj.LayoutPolicy(kv_piece=4, rounding='exact')
  split = plan((7, 3)).to_device(policy=policy)  # pieces 4 + 3 (slot 4 + 4) and 3 (slot 4)
  assert [(g.kv_capacity, list(np.asarray(g.kv_length))) for g in split.groups] == [
      (4, [4, 3, 3])]
  with pytest.raises(ValueError, match='kv_capacity'):
    hj.Segment(0, 5, 0, 1, kv_capacity=4)


def test_same_bucket_signature_does_not_retrace():
  traces = []

  @jax.jit
  def attend(q, k_cache, v_cache, layout):
    traces.append(1)  # runs once per trace
    return hj.tree_attention(q, k_cache, v_cache, layout, impl='xla')

  def plan(root, child, leaf, lengths):
    tree = hj.PromptNode(root, children=(hj.PromptNode(child, num_samples=2), hj.PromptNode(leaf)))
    return hj.plan_tree(tree, private_capacity=5, private_lengths=lengths)

  first = plan(17, 35, 3, [1, 5, 2])
  second = plan(19, 38, 14, [3, 1, 5])  # other lengths, same buckets: 20, 40 and 16 tokens
  third = plan(17, 41, 3, [1, 5, 2])  # 41 tokens bucket to 48
  length = 128  # one buffer size for all three
  for i, p in enumerate((first, second, third)):
    q, k_cache, v_cache = random_inputs(50 + i, p, 1, 4, 2, 8, jnp.float32)
    pad = ((0, length - p.kv_tokens), (0, 0), (0, 0))
    k_cache, v_cache = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad)
    got = attend(q, k_cache, v_cache, p.to_device())
    assert_states_close(got, naive_tree_attention(q, k_cache, v_cache, p))
    assert len(traces) == (1, 1, 2)[i], f'plan {i}: {len(traces)} traces'


def test_many_trees_in_one_bucket_signature_share_one_compile():
  # One topology; every draw picks lengths inside fixed buckets (rows 9 -> 10, tokens
  # 33..40 -> 40, 17..20 -> 20, 1..16 -> 16), so all draws run one compiled program with
  # different amounts of padding. Checked: one trace for all draws.
  traces = []

  @jax.jit
  def attend(q, k_cache, v_cache, layout):
    traces.append(1)
    return hj.tree_attention_xla(q, k_cache, v_cache, layout, kv_block=16)

  rng = np.random.default_rng(77)
  length = 512
  for draw in range(8):
    root, mid, leaf = (int(rng.integers(lo, hi + 1)) for lo, hi in ((33, 40), (18, 20), (1, 15)))
    tree = hj.PromptNode(
        root,
        children=(
            hj.PromptNode(
                mid, children=(hj.PromptNode(leaf, num_samples=3), hj.PromptNode(leaf + 1))
            ),
            hj.PromptNode(mid - 1, num_samples=5),
        ),
    )
    lengths = [int(n) for n in rng.integers(2, 9, 9)]
    plan = hj.plan_tree(tree, private_capacity=8, private_lengths=lengths)
    q, k_cache, v_cache = random_inputs(
        700 + draw, plan, 2, 4, 1, 8, jnp.float32, extra_kv=length - plan.kv_tokens
    )
    expected = naive_tree_attention(q, k_cache, v_cache, plan)
    assert_states_close(attend(q, k_cache, v_cache, plan.to_device()), expected)
  assert len(traces) == 1


def test_deeper_tree_with_the_same_groups_does_not_retrace():
  # Both trees have the segments 17 (3 rows), 35 (2 rows) and 3 (1 row), so the same
  # groups; the second is one level deeper (empty segments are dropped). Path depth is
  # padded to a multiple of 4, so both share a trace.
  traces = []

  @jax.jit
  def attend(q, k_cache, v_cache, layout):
    traces.append(1)
    return hj.tree_attention(q, k_cache, v_cache, layout, impl='xla')

  P = hj.PromptNode
  shallow = hj.plan_tree(P(17, children=(P(35, num_samples=2), P(3))), private_capacity=4,
                         private_lengths=[1, 2, 3])
  deep = hj.plan_tree(P(17, children=(P(35, children=(P(3), P(0))), P(0))), private_capacity=4,
                      private_lengths=[2, 1, 4])
  layouts = [p.to_device() for p in (shallow, deep)]
  assert layouts[0].row_segments.shape == layouts[1].row_segments.shape == (3, 4)
  for i, (p, layout) in enumerate(zip((shallow, deep), layouts)):
    q, k_cache, v_cache = random_inputs(90 + i, p, 1, 4, 2, 8, jnp.float32)
    pad = ((0, 96 - p.kv_tokens), (0, 0), (0, 0))
    k_cache, v_cache = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad)
    assert_states_close(attend(q, k_cache, v_cache, layout), naive_tree_attention(q, k_cache, v_cache, p))
  assert len(traces) == 1


# The conformance suite every backend passes (tests/tree_attention_conformance.py).


class TestXla(TreeAttentionConformance):
  impl = hj.AttentionImpl.XLA
  cases = tuple(
      ConformanceCase(seed, depth, heads, t, dtype_index=seed % 2, max_len=60)
      for seed, (depth, heads, t) in enumerate(
          [(1, (8, 8), 1), (2, (8, 2), 3), (3, (8, 1), 1), (4, (8, 2), 2), (2, (4, 4), 2),
           (3, (4, 1), 3)], start=900)
  ) + (ConformanceCase(906, 2, (8, 8), 2, dtype_index=1, shared=False),
       ConformanceCase(907, 2, (8, 1), 1, dtype_index=0, shared=False))
  config = hj.XlaConfig(kv_block=16)  # long segments run in several blocks
  representative_cases = {
      'test_random_tree_matches_oracle': (
          'depth=1_mha_N=8_K=8_T=1_dtype0_seed=900', 'depth=2_gqa_N=8_K=2_T=3_dtype1_seed=901',
          'depth=3_mqa_N=8_K=1_T=1_dtype0_seed=902', 'unshared_mha_N=8_K=8_T=2_dtype1_seed=906'),
  }


@pytest.mark.parametrize('seed_offset', range(3))
def test_states_gathered_along_paths_equal_the_scatter(seed_offset):
  """`merge_along_paths` / `sum_along_paths` at `path_item_index` give what scattering the
  groups' states into their rows gives (`merge_into_rows`; a scatter-add), on random forests
  of several groups and depths: empty states (with NaN out) and padded slots included."""
  seed = int(np.random.default_rng().integers(1 << 30)) + seed_offset
  print(f'seed={seed}')  # shown on failure
  rng = np.random.default_rng(seed)
  roots = tuple(random_tree(rng, 3, int(rng.integers(2, 9)), max_fanout=3, max_len=90)
                for _ in range(int(rng.integers(1, 4))))
  layout = hj.plan_tree(roots, private_capacity=8, private_lengths=3).to_device()
  b = layout.num_rows
  rows = []  # the flattened order of the groups' states (what `merge_rows` holds)
  for g in layout.groups:
    r = np.arange(g.row_capacity)
    slot_rows = np.asarray(g.row_begin)[:, None] + r
    rows.append(np.where(r < np.asarray(g.row_count)[:, None], slot_rows, b).reshape(-1))
  rows = jnp.asarray(np.concatenate(rows), jnp.int32)
  m, shape = rows.shape[0], (2, 3, 4)  # [T, N, H]
  draw = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32))
  empty = jnp.asarray(rng.random((m,) + shape[:-1]) < 0.2)
  outs = jnp.where(empty[..., None], jnp.nan, draw(m, *shape))
  lses = jnp.where(empty, -jnp.inf, 5 * draw(m, *shape[:-1]))
  dense = hj.PartialState(draw(b, *shape), 5 * draw(b, *shape[:-1]))
  index = hj.path_item_index(layout)
  assert index.shape == layout.row_segments.shape
  got = hj.merge_along_paths(dense, index, outs, lses)
  want = hj.merge_many([dense, hj.merge_into_rows(b, rows, outs, lses)])
  assert_states_close(got, want, jnp.float32)
  items = draw(m, *shape)
  scattered = jnp.zeros((b + 1,) + shape).at[rows].add(items)[:b]
  np.testing.assert_allclose(np.asarray(hj.sum_along_paths(dense.out, index, items)),
                             np.asarray(dense.out + scattered), rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match='index must be an integer'):
    hj.sum_along_paths(dense.out, index[:-1], items)
  with pytest.raises(ValueError, match='items must be'):
    hj.sum_along_paths(dense.out, index, items[..., :-1])
  with pytest.raises(ValueError, match='outs must be'):
    hj.merge_along_paths(dense, index, outs, lses[:-1])


@pytest.mark.parametrize('gather', ['merge', 'sum'])
def test_path_gathers_are_one_op_whatever_the_path_width(gather):
  """Fixed-shape layouts make the path width D the group's J (hundreds of slots): the program
  has as many gathers at D=512 as at D=4 (one gather a column made a tiny model's decode step
  take 47 s to compile at J=512 on a CPU)."""
  b, m, shape = 8, 64, (1, 2, 4)
  dense = hj.PartialState(jnp.zeros((b,) + shape), jnp.zeros((b,) + shape[:-1]))

  def gathers(width):
    index = jnp.zeros((b, width), jnp.int32)
    if gather == 'merge':
      f = lambda i: hj.merge_along_paths(dense, i, jnp.zeros((m,) + shape),
                                         jnp.zeros((m,) + shape[:-1]))
    else:
      f = lambda i: hj.sum_along_paths(dense.out, i, jnp.zeros((m,) + shape))
    return jax.jit(f).lower(index).as_text().count('stablehlo.gather')

  assert 1 <= gathers(4) == gathers(512) <= 4


def test_layouts_without_paths_scatter_to_the_same_result():
  """A layout built without `row_segments` (a hand-made `TreeLayout`) takes the scatter merge;
  it gives what the gather along paths gives, forward (XLA path) and backward (the
  differentiable attention's dq, dk, dv)."""
  seed = int(np.random.default_rng().integers(1 << 30))
  print(f'seed={seed}')  # shown on failure
  rng = np.random.default_rng(seed)
  roots = tuple(random_tree(rng, 3, int(rng.integers(2, 7)), max_fanout=3, max_len=40)
                for _ in range(2))
  plan = hj.plan_tree(roots, private_capacity=8, private_lengths=3)
  layout = plan.to_device()
  no_paths = dataclasses.replace(layout, row_segments=None)
  draw = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32))
  q, k, v = draw(plan.num_rows, 1, 4, 16), draw(plan.kv_tokens, 2, 16), draw(plan.kv_tokens, 2, 16)
  xla = hj.AttentionImpl.XLA
  assert_states_close(hj.tree_attention(q, k, v, no_paths, impl=xla),
                      hj.tree_attention(q, k, v, layout, impl=xla), jnp.float32)

  def loss(q, k, v, lay):
    state = tree_attention_differentiable(q, k, v, lay)
    return jnp.sum(state.out * jnp.cos(state.out)) + jnp.sum(jnp.sin(state.lse))

  grads = [jax.grad(loss, argnums=(0, 1, 2))(q, k, v, lay) for lay in (layout, no_paths)]
  for got, want in zip(*grads):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)

# `make test` keeps these cases (conftest: `representative_cases`; `()`: the whole test is left
# to `make test-all`, another test of the default run covering its path).
representative_cases = {
    'test_splitting_a_segment_is_exact': ('split=1_of_37', 'split=37_of_37'),
    'test_random_tree_matches_oracle': ('depth=1_N=8_K=8_T=1_bfloat16_seed=100', 'depth=1_N=8_K=2_T=3_float32_seed=101', 'depth=2_N=8_K=1_T=1_float32_seed=105', 'depth=3_N=8_K=8_T=3_bfloat16_seed=106', 'depth=4_N=8_K=2_T=1_bfloat16_seed=110', 'batch=1_depth=4_N=8_K=2_T=4_float32_seed=204'),
    'test_layouts_without_paths_scatter_to_the_same_result': (),
}
