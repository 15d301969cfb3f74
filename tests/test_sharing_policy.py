"""SharingPolicy: demotion of shared segments to per-sequence pages; the break-even benchmark."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hydrajax as hj
from experiments.benchmarking import report
from hydrajax.sharing_policy import DEVICE_THRESHOLDS, MAX_ROWS
from tests.conftest import assert_states_close, naive_tree_attention, random_inputs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAD_DIM = 16


def _tree(rng, depth: int, rows: int, page: int, unaligned: float) -> hj.PromptNode:
  """A random tree over `rows` rows; lengths whole pages (0 included), or with probability
  `unaligned` not a multiple of `page`."""

  def length():
    if rng.random() < unaligned:
      return int(page * rng.integers(0, 3) + rng.integers(1, page))
    return int(page * rng.integers(0, 4))

  def node(level: int, n: int) -> hj.PromptNode:
    if level == depth - 1 or n == 1 or rng.random() < 0.2:
      return hj.PromptNode(length(), num_samples=n)
    fan = int(rng.integers(1, min(4, n) + 1))
    cuts = np.sort(rng.choice(np.arange(1, n), fan - 1, replace=False)) if fan > 1 else []
    sizes = np.diff(np.concatenate([[0], cuts, [n]])).astype(int)
    return hj.PromptNode(length(), children=tuple(node(level + 1, int(s)) for s in sizes))

  return node(0, rows)


def _plan(seed: int, t: int, unaligned: float, paged: bool = False) -> hj.SharingPlan:
  """A random forest from `plan_tree` (page size 8); `paged`: private regions re-laid as several
  pages per row at shuffled page ids (as a chunk cache holds them)."""
  rng = np.random.default_rng(seed)
  page = 8
  rows = [int(r) for r in rng.integers(1, 7, int(rng.integers(1, 4)))]
  roots = [_tree(rng, int(rng.integers(1, 5)), r, page, unaligned) for r in rows]
  lengths = [int(n) for n in rng.integers(t, page + 1, sum(rows))]
  plan = hj.plan_tree(roots, private_capacity=page, private_lengths=lengths)
  if not paged:
    return plan
  counts = rng.integers(1, 4, plan.num_rows)
  first = -(-plan.shared_tokens() // page)
  ids = first + rng.permutation(int(counts.sum()) + 2)  # two pages nobody uses
  offsets = np.concatenate([[0], np.cumsum(counts)])
  pages = tuple(tuple(int(p) for p in ids[a:z]) for a, z in zip(offsets[:-1], offsets[1:]))
  lengths = tuple(int(rng.integers(max(t, (c - 1) * page), c * page + 1)) for c in counts)
  return hj.SharingPlan(
      plan.num_rows, plan.segments, page, pages, lengths, (int(ids.max()) + 1) * page
  )


def _aligned(s: hj.Segment, page: int) -> bool:
  return s.kv_start % page == 0 and s.kv_length % page == 0


def _check_rules(plan: hj.SharingPlan, policy: hj.SharingPolicy) -> tuple[int, ...]:
  """The demoted set, checked against the rules stated independently of the implementation."""
  gone = policy.demoted(plan)
  assert list(gone) == sorted(set(gone))
  new = policy.apply(plan)
  c = plan.page_size
  for j in gone:
    s = plan.segments[j]
    assert s.num_rows < policy.rows_needed(s.kv_length)
    assert s.kv_length == 0 or _aligned(s, c)
  demoted_tokens = []
  for b in range(plan.num_rows):
    path = [j for j in plan.path(b) if plan.segments[j].kv_length > 0]
    flags = [j in gone for j in path]
    assert flags == sorted(flags), f'row {b}: demoted segments are not the deepest of its path'
    demoted_tokens.append(sum(plan.segments[j].kv_length for j in path if j in gone))
  for j, s in enumerate(plan.segments):  # maximal: every kept candidate has a reason
    if j in gone or s.num_rows >= policy.rows_needed(s.kv_length):
      continue
    assert s.kv_length > 0
    blocked = any(
        k > j and k not in gone and plan.segments[k].kv_length > 0
        for b in range(s.row_begin, s.row_end) for k in plan.path(b)
    )
    assert not _aligned(s, c) or blocked, f'segment {j} could have been demoted'
  # The kept segments are the rest, in order, with every field but the parent unchanged.
  kept = [s for j, s in enumerate(plan.segments) if j not in gone]
  assert [dataclasses.replace(s, parent=0) for s in new.segments] == [
      dataclasses.replace(s, parent=0) for s in kept]
  kept_ids = [j for j in range(len(plan.segments)) if j not in gone]
  for s, j in zip(new.segments, kept_ids):
    parent = plan.segments[j].parent
    while parent in gone:
      parent = plan.segments[parent].parent
    assert s.parent == (-1 if parent < 0 else kept_ids.index(parent))
  # Same tokens per row, in the same order; private positions move back by what was demoted.
  old_idx, old_len = plan.row_token_indices()
  new_idx, new_len = new.row_token_indices()
  np.testing.assert_array_equal(new_len, old_len)
  for b in range(plan.num_rows):
    np.testing.assert_array_equal(new_idx[b, : new_len[b]], old_idx[b, : old_len[b]])
    assert new.private_position(b) == plan.private_position(b) - demoted_tokens[b]
    assert new.private_lengths[b] == plan.private_lengths[b] + demoted_tokens[b]
    assert new.private_pages[b][len(new.private_pages[b]) - len(plan.private_pages[b]) :] == (
        plan.private_pages[b])
  return gone


POLICIES = {
    'min_rows=2': hj.SharingPolicy(min_rows=2),
    'demote_all': hj.SharingPolicy.demote_all(),
    'stepped': hj.SharingPolicy(min_rows=MAX_ROWS, steps=((8, 4), (16, 3), (24, 1))),
}


@pytest.mark.parametrize('seed', range(40))
def test_rules_on_random_plans(seed):
  for unaligned, paged in ((0.0, False), (0.15, False), (0.0, True)):
    plan = _plan(1000 + seed, t=1 + seed % 3, unaligned=unaligned, paged=paged)
    for policy in POLICIES.values():
      _check_rules(plan, policy)
    assert hj.SharingPolicy.never().demoted(plan) == ()
    assert hj.SharingPolicy.never().apply(plan) is plan


def test_random_plans_exercise_the_rules():
  """The random plans above do demote, keep unaligned segments, and block parents."""
  demoted = refused = blocked = 0
  for seed in range(40):
    plan = _plan(1000 + seed, t=1, unaligned=0.15)
    gone = hj.SharingPolicy.demote_all().demoted(plan)
    demoted += sum(plan.segments[j].kv_length > 0 for j in gone)
    refused += sum(s.kv_length > 0 and not _aligned(s, 8) for s in plan.segments)
    blocked += sum(j not in gone and _aligned(s, 8) and s.kv_length > 0
                   for j, s in enumerate(plan.segments))
  assert demoted >= 20 and refused >= 20 and blocked >= 5


def test_min_rows_2_demotes_exactly_the_one_row_segments_when_aligned():
  for seed in range(10):
    plan = _plan(2000 + seed, t=1, unaligned=0.0)
    gone = hj.SharingPolicy(min_rows=2).demoted(plan)
    assert set(gone) == {j for j, s in enumerate(plan.segments) if s.num_rows == 1}


def test_hand_worked_plan():
  # root 16 (5 rows) -> [a 8 (row 0), b 5 (rows 1-3), e 0 (row 4) -> f 8 (row 4)]; pages of 8.
  tree = hj.PromptNode(16, children=(
      hj.PromptNode(8, num_samples=1), hj.PromptNode(5, num_samples=3),
      hj.PromptNode(0, children=(hj.PromptNode(8, num_samples=1),))))
  plan = hj.plan_tree(tree, private_capacity=8, private_lengths=3)
  assert [(s.kv_start, s.kv_length) for s in plan.segments] == [(0, 16), (16, 8), (24, 5), (29, 0),
                                                                (29, 8)]
  two = hj.SharingPolicy(min_rows=2)
  # a (pages 2) is demoted; e is empty; f starts at 29: not whole pages, kept under the root.
  assert two.demoted(plan) == (1, 3)
  new = two.apply(plan)
  assert [(s.label, s.parent) for s in new.segments] == [('node0', -1), ('node2', 0), ('node4', 0)]
  assert new.private_pages[0] == (2, 5) and new.private_lengths[0] == 11
  assert new.private_pages[1:] == plan.private_pages[1:]
  assert new.private_position(0) == 16
  # Everything wanted: the root is blocked by b and f (kept, unaligned).
  assert hj.SharingPolicy.demote_all().demoted(plan) == (1, 3)
  # A whole-page tree goes fully per-sequence, root pages first.
  flat = hj.plan_tree(hj.PromptNode(16, num_samples=2), private_capacity=8, private_lengths=2)
  new = hj.SharingPolicy.demote_all().apply(flat)
  assert new.segments == () and new.private_pages == ((0, 1, 2), (0, 1, 3))
  assert new.private_lengths == (18, 18) and new.private_position(1) == 0


def test_rows_needed_steps():
  p = hj.SharingPolicy(min_rows=9, steps=((64, 4), (256, 2), (1024, 1)))
  lengths = (0, 63, 64, 255, 256, 1023, 1024, 10**6)
  assert [p.rows_needed(n) for n in lengths] == [9, 9, 4, 4, 2, 2, 1, 1]
  assert hj.SharingPolicy(min_rows=3).rows_needed(5) == 3
  assert hj.SharingPolicy.never().rows_needed(0) == 1
  assert hj.SharingPolicy(min_rows=2, steps=[[8, 3]]).steps == ((8, 3),)


@pytest.mark.parametrize('kwargs, match', [
    (dict(min_rows=0), 'min_rows'),
    (dict(min_rows=True), 'min_rows'),
    (dict(min_rows=2.5), 'min_rows'),
    (dict(steps=((8, 2), (8, 3))), 'increasing'),
    (dict(steps=((-1, 2),)), 'steps: length'),
    (dict(steps=((8, 0),)), 'steps: min_rows'),
    (dict(steps=((8, 2, 1),)), 'steps'),
    (dict(steps=5), 'steps'),
])
def test_policy_rejects_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    hj.SharingPolicy(**kwargs)


def test_rows_needed_and_from_dict_reject_bad_input():
  with pytest.raises(ValueError, match='kv_length'):
    hj.SharingPolicy().rows_needed(-1)
  with pytest.raises(ValueError, match='data'):
    hj.SharingPolicy.from_dict({'steps': []})
  with pytest.raises(ValueError, match='steps'):
    hj.SharingPolicy.from_dict({'min_rows': 2, 'steps': 3})


def test_demote_rejects_illegal_sets():
  tree = hj.PromptNode(16, children=(hj.PromptNode(8, num_samples=2), hj.PromptNode(5)))
  plan = hj.plan_tree(tree, private_capacity=8, private_lengths=1)
  with pytest.raises(ValueError, match='segments.*not whole pages'):
    hj.demote(plan, [2])
  with pytest.raises(ValueError, match='segments.*followed'):
    hj.demote(plan, [0])  # its child 1 is kept
  with pytest.raises(ValueError, match='segments'):
    hj.demote(plan, [3])
  with pytest.raises(ValueError, match='segments'):
    hj.demote(plan, [1, 1])
  with pytest.raises(ValueError, match='segments'):
    hj.demote(plan, ['1'])
  assert hj.demote(plan, []) is plan
  assert hj.demote(plan, [1]).segments == (plan.segments[0], plan.segments[2])


def test_default_thresholds_load_and_round_trip(tmp_path):
  for name, resource in DEVICE_THRESHOLDS.items():
    with open(os.path.join(REPO, 'hydrajax', *resource)) as f:
      data = json.load(f)
    assert data['status'].startswith('measured') and name in data['device'].lower()
    policy = hj.SharingPolicy.default(device_kind=data['device'])
    assert resource[-1] in policy.source and policy == hj.SharingPolicy.from_dict(data)
  default = hj.SharingPolicy.default()  # this machine's device: a CPU gets the H200's table
  assert default == hj.SharingPolicy.default(jax.devices()[0].device_kind)
  path = tmp_path / 'p.json'
  path.write_text(json.dumps(POLICIES['stepped'].to_dict()))
  assert hj.SharingPolicy.load(str(path)) == POLICIES['stepped']


def test_default_thresholds_follow_the_device():
  h100 = hj.SharingPolicy.default('NVIDIA H100 80GB HBM3')
  h200 = hj.SharingPolicy.default('NVIDIA H200')
  assert 'break_even_h100.json' in h100.source and 'break_even_h200.json' in h200.source
  for other in ('cpu', 'TPU v5 lite', 'NVIDIA A100-SXM4-80GB'):
    assert hj.SharingPolicy.default(other) == h200
  # Where the two measured differently (break_even/grid_s50*): 2 rows of 1K tokens, 32/32 heads,
  # B = 8, were 1.11x slower batched on the H100 and 0.94x on the H200.
  assert h100.rows_needed(1024, num_rows=8, group_size=1) == 4
  assert h200.rows_needed(1024, num_rows=8, group_size=1) == 2
  with pytest.raises(ValueError, match='device_kind must be a str'):
    hj.SharingPolicy.default(100)


def _numeric_case(base: int, heads, dtype, t, unaligned, paged, policy):
  """The first seed from `base` whose plan demotes something and, with `unaligned`, also keeps
  an unaligned segment: both paths then run side by side."""
  for seed in range(base, base + 100):
    plan = _plan(seed, t, unaligned, paged)
    gone = POLICIES[policy].demoted(plan)
    odd = [j for j, s in enumerate(plan.segments) if s.kv_length and not _aligned(s, 8)]
    if any(plan.segments[j].kv_length for j in gone) and (bool(odd) == (unaligned > 0)):
      return seed, heads, dtype, t, unaligned, paged, policy
  raise AssertionError(f'no seed from {base} fits')


# Numerics: (seed, heads, dtype, T, unaligned fraction, private pages re-laid, policy).
NUMERIC_CASES = [
    _numeric_case(3000 + 100 * i, *case)
    for i, case in enumerate([
        ((8, 2), jnp.float32, 1, 0.0, False, 'demote_all'),
        ((8, 2), jnp.float32, 3, 0.0, True, 'demote_all'),
        ((4, 4), jnp.float32, 3, 0.3, False, 'stepped'),
        ((4, 4), jnp.float32, 1, 0.3, True, 'min_rows=2'),
        ((8, 2), jnp.bfloat16, 3, 0.3, False, 'demote_all'),
        ((8, 2), jnp.bfloat16, 1, 0.3, True, 'stepped'),
        ((4, 4), jnp.bfloat16, 1, 0.0, False, 'demote_all'),
        ((4, 4), jnp.bfloat16, 3, 0.0, True, 'min_rows=2'),
    ])
]


@pytest.mark.parametrize(
    'seed, heads, dtype, t, unaligned, paged, policy', NUMERIC_CASES,
    ids=[f'{c[1][0]}-{c[1][1]}_{jnp.dtype(c[2]).name}_T={c[3]}_unaligned={c[4]}_paged={c[5]}_{c[6]}'
         for c in NUMERIC_CASES],
)
def test_demoted_plan_attention_matches(seed, heads, dtype, t, unaligned, paged, policy):
  plan = _plan(seed, t, unaligned, paged)
  new = POLICIES[policy].apply(plan)
  assert len(new.segments) < len(plan.segments)  # something was demoted
  n, k = heads
  q, k_cache, v_cache = random_inputs(seed, plan, t, n, k, HEAD_DIM, dtype)
  expected = naive_tree_attention(q, k_cache, v_cache, plan)
  shared = hj.tree_attention(q, k_cache, v_cache, plan.to_device(), impl='xla')
  demoted = hj.tree_attention(q, k_cache, v_cache, new.to_device(), impl='xla')
  assert demoted.out.dtype == dtype
  assert_states_close(demoted, expected)
  assert_states_close(demoted, shared)


def _point(n, b, r, ratio, status='ok', g=4):
  return dict(kind='point', status=status, length=n, batch=b, rows=r, ratio=ratio, group_size=g,
              num_q_heads=32, num_kv_heads=32 // g)


def test_derive_thresholds():
  from experiments import break_even  # here: its absl flags stay out of other tests' processes

  rec = _point
  records = [
      rec(64, 32, 1, 1.5), rec(64, 32, 2, 1.02), rec(64, 32, 4, 0.8),  # 1.02 is within 3%
      rec(64, 256, 1, 1.3), rec(64, 256, 2, 1.1), rec(64, 256, 4, 0.9),  # per batch
      rec(256, 32, 1, 0.9), rec(256, 32, 2, 1.2), rec(256, 32, 4, 0.5),  # from r on, not just at r
      rec(1024, 32, 1, 1.2), rec(1024, 32, 2, 1.1),  # lost everywhere: demote all (B + 1)
      rec(4096, 32, 4, 0.1, status='wrong'),  # a wrong point counts as lost
      rec(4096, 32, 8, 0.5),
      rec(64, 8, 2, 0.5, g=1), rec(64, 32, 2, 0.5, g=1),  # equal thresholds: one batch range
      rec(64, 32, 1, 0.5, status='skipped'),  # not measured: ignored
  ]
  out = break_even.derive_thresholds(records, slack=0.03)
  assert out['format'] == 'hydrajax.sharing_policy/2'
  assert out['tables'] == [
      dict(group_size=1, batches=[8, 32], min_rows=2, steps=[]),
      dict(group_size=4, batches=[32, 32], min_rows=2, steps=[[256, 4], [1024, 33], [4096, 8]]),
      dict(group_size=4, batches=[256, 256], min_rows=4, steps=[]),
  ]
  assert out['beyond_measured'] == [[4, 32, 1024]]
  policy = hj.SharingPolicy.from_dict(out)
  assert policy.rows_needed(5000, num_rows=32, group_size=4) == 8
  assert policy.rows_needed(100, num_rows=300, group_size=4) == 4
  assert not break_even.violations(policy, records, 0.03)
  looser = hj.SharingPolicy.from_dict(dict(out, tables=[dict(out['tables'][1], steps=[])]))
  bad = {(r['batch'], r['length'], r['rows']) for r in break_even.violations(looser, records, 0.03)}
  assert bad == {(32, 256, 2), (32, 1024, 2), (32, 4096, 4), (256, 64, 2)}
  assert break_even.derive_thresholds([rec(64, 32, 1, 1.0, status='failed')], 0.03) is None


def test_staircase_walks_from_long_segments_up_in_rows():
  from experiments import break_even

  ratio = {(4096, 2): 0.5, (1024, 2): 1.2, (1024, 4): 0.9, (1024, 8): 0.7, (256, 8): 1.1,
           (256, 16): 1.5}
  feasible = lambda n, r: not (n == 4096 and r < 2)
  walk = break_even.staircase(16, [256, 1024, 4096], [1, 2, 4, 8, 16, 32, 3], feasible, 0.03)
  seen, rec = [], None
  while True:
    try:
      n, r = walk.send(rec) if rec else next(walk)
    except StopIteration:
      break
    seen.append((n, r))
    rec = dict(status='ok', ratio=ratio.get((n, r), 2.0))
  # 4096 starts at the first feasible r (r=1, over the cap, is not a loss); 1024 at 1, galloping 1 -> 2 -> 8 (a win) then bisecting
  # to 4; 256 above 2 (lost at 1024) and, losing at every r up to B, ends the walk. r=32 > B
  # and r=3 (does not divide B) never run.
  assert seen == [(4096, 2), (1024, 1), (1024, 2), (1024, 8), (1024, 4), (256, 4), (256, 8),
                  (256, 16)]


def test_break_even_pipeline_from_given_timings(tmp_path):
  """Records, table, plot and thresholds from given times: nothing depends on the machine."""
  from experiments import break_even
  from experiments.benchmarking import timing

  # Full grid, cell order (heads, batch), then n, then r; each point times batched, then
  # per-sequence (µs).
  given = iter([3.0, 2.0,    # n=64 r=1: ratio 1.5, batched loses
                1.0, 2.0,    # n=64 r=2: 0.5, wins -> r_min(64) = 2
                2.0, 2.0,    # n=128 r=1: 1.0, within the slack -> r_min(128) = 1
                0.0, 4.0])   # n=128 r=2: a time <= 0 -> untimeable: lost
  calls = []

  def fake_time(fn, q, k, v, plan, **kw):
    calls.append(kw)
    us = next(given)
    return timing.Timing(us * 1e-6, (us * 1e-6,), 7, 'given', 0)

  config = dict(head_dim=16, dtype='float32', query_len=1, suffix=1, page_size=64,
                impl='auto', rows_checked=4, seed=0, timing=dict(repeats=2, target_s=1e-3),
                lengths=[64, 128], rows=[1, 2])
  workdir = tmp_path / 'be'
  records, thresholds = break_even.run([((4, 2), 8)], config, str(workdir), slack=0.03,
                                       time_fn=fake_time, check='all')
  assert calls == [config['timing']] * 8
  assert records == break_even.report.read_jsonl(str(workdir / 'results.jsonl'))
  by = {(r['length'], r['rows']): r for r in records}
  assert [by[64, 1]['ratio'], by[64, 2]['ratio'], by[128, 1]['ratio']] == [1.5, 0.5, 1.0]
  assert by[128, 2]['status'] == 'untimeable' and 'ratio' not in by[128, 2]
  for r in records:
    assert r['impl'] == 'xla' and r['impl_requested'] == 'auto' and r['groups'] == 8 // r['rows']
    assert r['rel_error_batched'] < 1e-5 and r['rel_error_per_sequence'] < 1e-5  # checked first
    assert r['iterations_batched'] == 7 and r['meta']['device'] and r['group_size'] == 2
  assert thresholds['tables'] == [
      dict(group_size=2, batches=[8, 8], min_rows=2, steps=[[128, 9]])]
  assert thresholds['ratios'] == {
      '2': {'8': {'64': {'1': 1.5, '2': 0.5}, '128': {'1': 1.0, '2': None}}}}
  table = (workdir / 'table.md').read_text()
  assert '| 4/2 | 64 | 2 | 8 | xla | ok | 1.0 | 2.0 | 0.500 |' in table
  assert '| 4/2 | 128 | 2 | 8 | xla | untimeable |' in table and 'r_min' in table
  assert (workdir / 'ratio.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'

  path = tmp_path / 'th' / 'thresholds.json'
  break_even.write_thresholds(thresholds, records, config, str(path))
  data = json.loads(path.read_text())
  assert data['status'] == 'measured' and data['impl'] == ['xla']
  assert data['device'] == records[0]['meta']['device'] and data['heads'] == {'2': [4, 2]}
  policy = hj.SharingPolicy.load(str(path))
  assert [policy.rows_needed(n, num_rows=8, group_size=2) for n in (64, 100, 5000)] == [2, 2, 9]
  with pytest.raises(AssertionError, match='lost'):  # a policy that keeps a lost shape shared
    bad = dict(thresholds, tables=[dict(thresholds['tables'][0], steps=[])])
    break_even.write_thresholds(bad, records, config, str(path))


def test_break_even_budget_and_memory_cap(tmp_path):
  """No point starts after the budget; points over the K/V cap are skipped and listed."""
  from experiments import break_even
  from experiments.benchmarking import timing

  fake = lambda *a, **kw: timing.Timing(1e-6, (1e-6,), 1, 'given', 0)
  config = dict(head_dim=16, dtype='float32', query_len=1, suffix=1, page_size=64,
                impl='xla', rows_checked=2, seed=0, timing={}, lengths=[64, 128], rows=[1, 2])
  cap = break_even.kv_bytes(4, 128, 2, (2, 1), config)  # (n=128, r=1) is over it
  records, _ = break_even.run([((2, 1), 4), ((1, 1), 4)], config, str(tmp_path), slack=0.03,
                              search='staircase', max_kv_bytes=cap, time_fn=fake)
  # Staircase per heads, in turn: n=128 from r=2 (r=1 over the cap), a win; n=64 from r=1, a win.
  assert [(r['num_q_heads'], r['length'], r['rows']) for r in records] == [
      (2, 128, 2), (1, 128, 2), (2, 64, 1), (1, 64, 1)]
  assert [r['checked'] for r in records] == [True, True, False, False]
  table = (tmp_path / 'table.md').read_text()
  assert '(2/1, 4, 128, 1)' in table and '(1/1, 4, 128, 1)' in table
  records, _ = break_even.run([((2, 1), 4)], config, str(tmp_path), slack=0.03,
                              budget_s=1e-9, time_fn=fake)
  assert len(records) <= 1 and 'cut by --budget_s' in (tmp_path / 'table.md').read_text()


def test_break_even_cli_writes_to_a_scratch_folder_by_default(tmp_path):
  """The command line end to end, from a folder outside the repository and without --workdir.

  Times on a loaded machine may be noise: a point is 'ok' or 'untimeable', either is fine.
  """
  cmd = [sys.executable, '-m', 'experiments.break_even', '--lengths=64', '--rows=1,2',
         '--batches=4', '--heads=2:1', '--head_dim=16', '--dtype=float32', '--repeats=1',
         '--target_ms=1', '--search=full', '--check=all']
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS='cpu')
  done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  workdir = tmp_path / 'workdir' / 'break_even'
  records = report.read_jsonl(str(workdir / 'results.jsonl'))
  assert [(r['length'], r['rows'], r['batch']) for r in records] == [(64, 1, 4), (64, 2, 4)]
  for r in records:
    assert r['status'] in ('ok', 'untimeable'), r
    assert r['rel_error_batched'] < 1e-5 and r['rel_error_per_sequence'] < 1e-5
    assert 'experiments.break_even' in r['meta']['command']
    if r['status'] == 'ok':
      assert r['ratio'] == pytest.approx(r['time_batched_us'] / r['time_per_sequence_us'])
  assert '| 2/1 | 64 | 2 | 4 | xla |' in (workdir / 'table.md').read_text()
  assert 'experiments.break_even' in (workdir / 'README.md').read_text()


def test_break_even_rejects_unaligned_lengths(tmp_path):
  cmd = [sys.executable, '-m', 'experiments.break_even', '--lengths=60', '--rows=1',
         '--batches=2', f'--workdir={tmp_path}']
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS='cpu')
  done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert done.returncode != 0 and 'page_size' in done.stderr


def _v2(*tables):
  return hj.SharingPolicy.from_dict({'format': 'hydrajax.sharing_policy/2', 'tables': [
      dict(group_size=g, batches=list(b), min_rows=m, steps=st) for g, b, m, st in tables]})


def test_format_2_tables_by_group_size_and_batch(tmp_path):
  policy = _v2((4, (8, 32), 9, [[4096, 4]]), (4, (128, 1024), 3, [[256, 2]]),
               (1, (8, 1024), 5, []))
  need = lambda n, b=None, g=None: policy.rows_needed(n, num_rows=b, group_size=g)
  assert [need(1000, 32, 4), need(5000, 32, 4), need(100, 512, 4), need(300, 512, 4)] == [9, 4, 3, 2]
  assert need(100, 64, 4) == 9  # between the ranges: equally near (log2), the larger r_min
  assert need(100, 2000, 4) == 3 and need(100, 4, 4) == 9  # beyond a range: the nearest
  assert need(100, 32, 8) == 9 and need(100, 32, 2) == 9  # nearest group size; 2 ties 1 and 4
  assert need(100, 32, 1) == 5 and need(100) == 9  # nothing known: every table, the largest
  assert policy == hj.SharingPolicy.from_dict(policy.to_dict())
  # apply() picks the plan's batch and the given group size.
  plan = hj.plan_tree([hj.PromptNode(64, num_samples=4) for _ in range(8)], private_capacity=64)
  assert len(policy.apply(plan, group_size=4).segments) == 0  # B=32, r=4 < 9
  assert len(policy.apply(plan, group_size=1).segments) == 0  # r=4 < 5
  assert len(_v2((4, (32, 32), 4, [])).apply(plan, group_size=4).segments) == 8
  # Format 1 (the first shipped file) still loads; a bad format or table names the problem.
  v1 = {'format': 'hydrajax.sharing_policy/1', 'min_rows': 9, 'steps': [[4096, 4]]}
  assert hj.SharingPolicy.from_dict(v1).rows_needed(5000, num_rows=8, group_size=1) == 4
  with pytest.raises(ValueError, match='format'):
    hj.SharingPolicy.from_dict(dict(v1, format='hydrajax.sharing_policy/9'))
  with pytest.raises(ValueError, match='tables'):
    hj.SharingPolicy.from_dict({'format': 'hydrajax.sharing_policy/2', 'tables': []})
  with pytest.raises(ValueError, match='batches'):
    _v2((4, (32, 8), 2, []))
  with pytest.raises(ValueError, match='group_size'):
    policy.rows_needed(64, group_size=0)


@pytest.fixture(scope='module')
def tiny_model():
  from flax import nnx
  from models.config import get_config
  from models.llama import Llama
  return Llama(get_config('tiny_gqa'), rngs=nnx.Rngs(0))


def test_generate_applies_the_policy_without_changing_tokens(tiny_model, monkeypatch):
  """Whole-page prompts (page = 64 with max_new_tokens <= 64) let the policy demote: the greedy
  tokens are those of every segment shared, and only what the rules allow moves."""
  from models import generate as gen
  from models import prompt_plan as pp

  rng = np.random.default_rng(0)
  toks = lambda n: [int(t) for t in rng.integers(1, 97, n)]
  tree = pp.prompt_node(toks(64), [
      pp.prompt_node(toks(128), [pp.prompt_node(toks(64)), pp.prompt_node(toks(64))]),
      pp.prompt_node(toks(64), [pp.prompt_node(toks(64)), pp.prompt_node(toks(5))]),
  ])
  applied = []
  real_apply = hj.SharingPolicy.apply

  def spy(self, plan, **kw):
    out = real_apply(self, plan, **kw)
    applied.append((self.source, kw, plan, out))
    return out

  monkeypatch.setattr(hj.SharingPolicy, 'apply', spy)
  run = lambda policy: gen.generate(tiny_model, tree, max_new_tokens=6, impl='xla',
                                    sharing_policy=policy, return_logprobs=True)
  shared = run(hj.SharingPolicy.never())
  for policy in (hj.SharingPolicy.demote_all(), hj.SharingPolicy(min_rows=2), None):
    out = run(policy)
    np.testing.assert_array_equal(out.tokens, shared.tokens)
    np.testing.assert_allclose(out.logprobs, shared.logprobs, rtol=1e-5, atol=1e-5)
  sources = [a[0] for a in applied]
  assert sources[0] == 'never' and sources[-1] == hj.SharingPolicy.default().source
  assert all(kw == {'group_size': 3} for _, kw, _, _ in applied)  # tiny_gqa: 6 / 2 heads
  plan = applied[0][2]
  assert applied[0][3] is plan  # never(): nothing moves
  assert [(s.kv_length, s.num_rows) for s in plan.segments] == [
      (64, 4), (128, 2), (64, 1), (64, 1), (64, 2), (64, 1), (5, 1)]
  # demote_all: the 5-token leaf is not whole pages, so it and everything above it stay; the
  # other leaves and the 128-token node move.
  kept = [(s.kv_length, s.num_rows) for s in applied[1][3].segments]
  assert kept == [(64, 4), (64, 2), (5, 1)]
  assert applied[1][3].private_lengths == (192, 192, 64, 0)
  # min_rows=2: the one-row leaves that can move do; the shared ones stay.
  assert [(s.kv_length, s.num_rows) for s in applied[2][3].segments] == [
      (64, 4), (128, 2), (64, 2), (5, 1)]


def test_break_even_resume_replays_earlier_points_and_runs_only_the_rest(tmp_path):
  """--resume: a sweep cut short goes on where it stopped, with the same walk and thresholds."""
  from experiments import break_even
  from experiments.benchmarking import timing

  ratios = {(128, 1): 1.5, (128, 2): 0.5, (64, 2): 1.5, (64, 4): 0.4}
  timed = []

  def ratio_time(points):
    """Batched takes ratio µs, per-sequence 1 µs, for the given points in turn."""
    calls = iter([t for p in points for t in (ratios[p], 1.0)])

    def time_fn(fn, q, k, v, plan, **kw):
      timed.append(plan)
      us = next(calls)
      return timing.Timing(us * 1e-6, (us * 1e-6,), 1, 'given', 0)
    return time_fn

  config = dict(head_dim=16, dtype='float32', query_len=1, suffix=1, page_size=64,
                impl='xla', rows_checked=2, seed=0, timing={}, lengths=[64, 128], rows=[1, 2, 4])
  walk = [(128, 1), (128, 2), (64, 2), (64, 4)]  # staircase at B=4: 128 from r=1, 64 from r=2
  full, th_full = break_even.run([((2, 1), 4)], config, str(tmp_path / 'a'), slack=0.03,
                                 search='staircase', time_fn=ratio_time(list(walk)))
  assert [(r['length'], r['rows']) for r in full] == walk
  # A run cut after two points, then resumed: only the last two points are timed again.
  lines = (tmp_path / 'a' / 'results.jsonl').read_text().splitlines(keepends=True)
  (tmp_path / 'b').mkdir()
  (tmp_path / 'b' / 'results.jsonl').write_text(''.join(lines[:2]))
  timed.clear()
  resumed, th_resumed = break_even.run([((2, 1), 4)], config, str(tmp_path / 'b'), slack=0.03,
                                       search='staircase', time_fn=ratio_time(list(walk[2:])),
                                       resume=True)
  assert len(timed) == 4  # two points, two variants each
  assert [(r['length'], r['rows'], r['ratio']) for r in resumed] == [
      (r['length'], r['rows'], r['ratio']) for r in full]
  assert th_resumed['tables'] == th_full['tables']
  assert len(break_even.report.read_jsonl(str(tmp_path / 'b' / 'results.jsonl'))) == 4
  # Another workload (page size) replays nothing.
  other = dict(config, page_size=128)
  assert break_even.earlier_points(str(tmp_path / 'b' / 'results.jsonl'), other) == {}

# `make test` keeps these cases (conftest: `representative_cases`; `()`: the whole test is left
# to `make test-all`, another test of the default run covering its path).
representative_cases = {
    'test_demoted_plan_attention_matches': ('8-2_float32_T=3_unaligned=0.0_paged=True_demote_all', '8-2_bfloat16_T=1_unaligned=0.3_paged=True_stepped'),
}
