"""The causal prefill of a token tree (`hydrajax.attention.training.tree_prefill`) against a dense oracle:
every token of the buffer attends its node's ancestors and itself, causally, under one mask."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hydrajax.attention.training import prefill_layout as pl
from hydrajax.attention.training import tree_prefill as tp
from tests.test_tree_attention_grad import GRAD_TOLERANCES
from tests.conftest import TOLERANCES


def random_forest(rng, nodes: int, max_len: int = 40):
  """parents (each an earlier node, or -1 for a new root, 1 in 6) and lengths in 1..max_len."""
  parents = [-1] + [-1 if rng.random() < 1 / 6 else int(rng.integers(0, x))
                    for x in range(1, nodes)]
  return parents, [int(n) for n in rng.integers(1, max_len + 1, nodes)]


def _token_map(plan: tp.TreePrefillPlan):
  """node [L] (-1 on padding between levels) and offset [L] of every buffer token."""
  node, offset = np.full(plan.kv_tokens, -1), np.zeros(plan.kv_tokens, int)
  for x in range(len(plan.parents)):
    s, c = plan.slot(x), plan.capacities[plan.depth(x)]
    node[s:s + c], offset[s:s + c] = x, np.arange(c)
  return node, offset


def oracle(level_q, k, v, plan: tp.TreePrefillPlan, layout):
  """Dense float32 attention over the buffer under the tree's causal mask: query (x, j) sees
  (y, i) when y is a strict ancestor of x and i < len(y), or y = x and i <= j."""
  node, offset = _token_map(plan)
  ancestors = np.zeros((len(plan.parents),) * 2, bool)
  for x in range(len(plan.parents)):
    ancestors[x, list(plan.path(x)[:-1])] = True
  real_key = (node >= 0) & (offset < np.asarray(plan.lengths)[node])
  mask = ((node[:, None] >= 0) & real_key[None, :] & ancestors[node[:, None], node[None, :]])
  mask |= (node[:, None] == node[None, :]) & (node >= 0)[:, None] & (
      offset[None, :] <= offset[:, None])
  q = tp.write_tree_kv(layout, level_q).astype(jnp.float32)
  length, n, h = q.shape
  kh = k.shape[1]
  s = jnp.einsum('ikgh,jkh->kgij', q.reshape(length, kh, n // kh, h), k.astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST) * h**-0.5
  s = jnp.where(jnp.asarray(mask), s, -jnp.inf)
  lse = jax.nn.logsumexp(s, axis=-1)
  p = jnp.where(jnp.asarray(mask), jnp.exp(s - lse[..., None]), 0.0)
  out = jnp.einsum('kgij,jkh->ikgh', p, v.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST).reshape(length, n, h)
  lse = jnp.moveaxis(lse, -1, 0).reshape(length, n)
  levels = []
  for (b, c), start in zip(layout.level_shapes, layout.starts):
    levels.append((out[start:start + b * c].reshape(b, c, n, h),
                   lse[start:start + b * c].reshape(b, c, n)))
  return levels


def _inputs(seed, layout, heads, h, dtype):
  n, kh = heads
  keys = iter(jax.random.split(jax.random.key(seed), 3 * len(layout.level_shapes)))
  draw = lambda shape: jax.random.normal(next(keys), shape, jnp.float32).astype(dtype)
  qs = [draw((b, c, n, h)) for b, c in layout.level_shapes]
  k = tp.write_tree_kv(layout, [draw((b, c, kh, h)) for b, c in layout.level_shapes])
  v = tp.write_tree_kv(layout, [draw((b, c, kh, h)) for b, c in layout.level_shapes])
  return qs, k, v


def _real(layout):
  """[B_d, C_d] bool a level: the real (not padding) queries."""
  return [np.arange(c)[None, :] < np.asarray(n)[:, None]
          for n, c in zip(layout.lengths, layout.capacities)]


def masked_loss(attend, layout, seed):
  """A loss over every level's real queries' out and lse (padding queries masked out)."""
  rng = np.random.default_rng(seed)
  weights = [(np.where(r[..., None, None], rng.standard_normal(r.shape + (1, 1)), 0.0),
              np.where(r[..., None], rng.standard_normal(r.shape + (1,)), 0.0))
             for r in _real(layout)]

  def loss(qs, k, v):
    return sum(jnp.sum(out.astype(jnp.float32) * jnp.cos(q.astype(jnp.float32)) * w)
               + jnp.sum(jnp.where(w_lse != 0, lse * w_lse, 0.0))
               for (out, lse), q, (w, w_lse) in zip(attend(qs, k, v), qs, weights))
  return loss


@pytest.mark.parametrize('heads,dtype,impl', [
    ((4, 4), jnp.float32, 'xla'), ((4, 2), jnp.float32, 'xla'), ((4, 1), jnp.bfloat16, 'xla'),
    ((6, 2), jnp.bfloat16, 'xla'),
    # The Mosaic TPU kernels in interpret mode (the Mosaic GPU ones: test_mosaic_gpu_training).
    ((4, 4), jnp.bfloat16, 'mosaic_tpu')],
    ids=['MHA_f32', 'GQA_f32', 'MQA_bf16', 'GQA_bf16', 'tpu_MHA_bf16'])
def test_states_and_gradients_match_the_dense_oracle(heads, dtype, impl):
  seed = zlib.crc32(f'tree_prefill {heads} {jnp.dtype(dtype).name}'.encode())
  rng = np.random.default_rng(seed)
  plan = tp.plan_tree_prefill(*random_forest(rng, int(rng.integers(6, 11))))
  assert len(plan.levels) >= 3, plan.levels
  layout = plan.to_device()
  qs, k, v = _inputs(seed, layout, heads, 16, dtype)
  ours = jax.jit(lambda qs, k, v: tp.tree_prefill_attention(
      qs, k, v, layout, kv_block=16, impl=impl, interpret=impl != 'xla'))
  dense = jax.jit(lambda qs, k, v: oracle(qs, k, v, plan, layout))
  # All levels in one custom VJP (one float32 dK / dV buffer), not one a level.
  assert str(jax.make_jaxpr(ours)(qs, k, v)).count('custom_vjp_call') == 1
  for d, (state, (out, lse), real) in enumerate(zip(ours(qs, k, v), dense(qs, k, v),
                                                    _real(layout))):
    np.testing.assert_allclose(np.asarray(state.out, np.float32)[real], np.asarray(out)[real],
                               err_msg=f'out, level {d}', **TOLERANCES[jnp.dtype(dtype)])
    np.testing.assert_allclose(np.asarray(state.lse)[real], np.asarray(lse)[real], rtol=1e-4,
                               atol=1e-4, err_msg=f'lse, level {d}')
  grad = lambda attend: jax.jit(jax.grad(masked_loss(attend, layout, seed), argnums=(0, 1, 2)))
  actual, expected = grad(ours)(qs, k, v), grad(dense)(qs, k, v)
  tol = GRAD_TOLERANCES[jnp.dtype(dtype)]
  for d, (a, e) in enumerate(zip(actual[0], expected[0])):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32),
                               err_msg=f'dq, level {d}', **tol)
  node, offset = _token_map(plan)
  padding = (node < 0) | (offset >= np.asarray(plan.lengths)[node])
  for name, a, e in zip(('dk', 'dv'), actual[1:], expected[1:]):
    a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
    assert np.abs(e).max() > 0.1, f'{name}: no gradient exercised'
    np.testing.assert_allclose(a, e, err_msg=name, **tol)
    np.testing.assert_array_equal(a[padding], 0.0, err_msg=f'{name} of padding tokens')


def test_two_levels_are_the_prefill_layout():
  """Prompts and their completions: the same states and gradients as `prefill_attention`."""
  lengths, g, t, n, kh, h = (9, 5), 3, 7, 4, 2, 16
  plan = tp.plan_tree_prefill([-1, -1] + [i // g for i in range(2 * g)],
                              list(lengths) + [t] * (2 * g))
  layout = plan.to_device()
  prefill = pl.plan_prefill(lengths, g, t).to_device()
  qs, k, v = _inputs(11, layout, (n, kh), h, jnp.float32)
  split = lambda buf: [buf[s:s + b * c].reshape((b, c) + buf.shape[1:])
                       for (b, c), s in zip(layout.level_shapes, layout.starts)]
  to_prefill = lambda buf: pl.write_kv(prefill, *split(buf))

  def ours(qs, k, v):
    return sum(jnp.sum(s.out * jnp.cos(q)) for s, q in
               zip(tp.tree_prefill_attention(qs, k, v, layout), qs))

  def theirs(qs, k, v):
    states = pl.prefill_attention(*qs, to_prefill(k), to_prefill(v), prefill)
    return sum(jnp.sum(s.out * jnp.cos(q)) for s, q in zip(states, qs))
  a, e = (jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(qs, k, v) for f in (ours, theirs))
  np.testing.assert_allclose(a[0], e[0], rtol=1e-5)
  for name, x, y in (('dq_prompt', a[1][0][0], e[1][0][0]), ('dq_completion', a[1][0][1],
                     e[1][0][1])):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5, err_msg=name)
  for name, x, y in (('dk', a[1][1], e[1][1]), ('dv', a[1][2], e[1][2])):
    np.testing.assert_allclose(to_prefill(x), y, rtol=1e-5, atol=1e-5, err_msg=name)


def test_path_sequences_are_what_an_unshared_model_attends():
  """Causal attention over each root-to-leaf path's own sequence (`path_sequences`) gives the
  leaf's tree outputs at its real tokens; positions run on from the ancestors'."""
  rng = np.random.default_rng(zlib.crc32(b'path_sequences'))
  plan = tp.plan_tree_prefill(*random_forest(rng, 8))
  layout = plan.to_device()
  qs, k, v = _inputs(3, layout, (4, 2), 16, jnp.float32)
  states = jax.jit(lambda qs, k, v: tp.tree_prefill_attention(qs, k, v, layout))(qs, k, v)
  seq = lambda x: tp.path_sequences(layout, x)
  full = jax.nn.dot_product_attention(seq(tp.write_tree_kv(layout, qs)), seq(k), seq(v),
                                      is_causal=True)
  pos = seq(tp.write_tree_kv(layout, [p[..., None] for p in layout.positions]))[..., 0]
  for i, leaf in enumerate(plan.leaves):
    d = plan.depth(leaf)
    r, n = plan.rows[leaf], plan.lengths[leaf]
    first = int(layout.path_lengths[i]) - n
    np.testing.assert_allclose(states[d].out[r, :n], full[i, first:first + n], rtol=1e-5,
                               atol=1e-5, err_msg=f'leaf {leaf}')
    np.testing.assert_array_equal(pos[i, :first + n], np.arange(first + n))


def test_uniform_trees_are_recognized():
  """`uniform` (then the kernels run on slices of the buffer): every node of a level has the
  same number of children."""
  plan = lambda parents: tp.plan_tree_prefill(parents, [3] * len(parents))
  assert all(plan(p).uniform for p in ([-1], [-1, -1, 0, 1], [-1, 0, 0, 1, 1, 2, 2]))
  assert not plan([-1, 0, 0, 1]).uniform  # a leaf above the last level
  assert not plan([-1, 0, 0, 1, 1, 1, 2]).uniform  # three children and one
  assert plan([-1, 0, 0, 1, 1, 2, 2]).to_device().uniform
  assert not plan([-1, 0, 0, 1]).to_device().uniform


def test_plan_rollout_tree():
  """A prompt, B branches under it, G / B leaves under each: uniform; bad sizes named."""
  plan = tp.plan_rollout_tree(10, 2, 4, 6, 3)
  assert plan.parents == (-1, 0, 0, 1, 1, 1, 2, 2, 2) and plan.uniform
  assert plan.lengths == (10, 4, 4, 3, 3, 3, 3, 3, 3)
  with pytest.raises(ValueError, match='branches must be >= 1'):
    tp.plan_rollout_tree(10, 0, 4, 6, 3)
  with pytest.raises(ValueError, match='leaves must be a multiple of branches'):
    tp.plan_rollout_tree(10, 4, 4, 6, 3)


def test_arguments_are_checked():
  with pytest.raises(ValueError, match=r'parents\[2\] must be -1 or an earlier node'):
    tp.plan_tree_prefill([-1, 0, 2], [3, 4, 5])
  with pytest.raises(ValueError, match=r'lengths\[1\] must be >= 1'):
    tp.plan_tree_prefill([-1, 0], [3, 0])
  with pytest.raises(ValueError, match='one entry per node'):
    tp.plan_tree_prefill([-1, 0], [3])
  with pytest.raises(ValueError, match='capacities must be one per depth'):
    tp.plan_tree_prefill([-1, 0], [3, 4], capacities=[3, 3])
  layout = tp.plan_tree_prefill([-1, 0, 0], [5, 3, 2]).to_device()
  x = jnp.zeros((1, 5, 2, 8))
  with pytest.raises(ValueError, match='level_kv must hold one array a level'):
    tp.write_tree_kv(layout, [x])
  with pytest.raises(ValueError, match=r'level_kv\[1\] must be \[2, 3, ...\]'):
    tp.write_tree_kv(layout, [x, jnp.zeros((2, 4, 2, 8))])
  k = tp.write_tree_kv(layout, [x, jnp.zeros((2, 3, 2, 8))])
  with pytest.raises(ValueError, match=r'level_q\[1\] must be \[2, 3, N, H\]'):
    tp.tree_prefill_attention([jnp.zeros((1, 5, 4, 8)), jnp.zeros((2, 4, 4, 8))], k, k, layout)
  with pytest.raises(ValueError, match='buffer must be'):
    tp.path_sequences(layout, k[:-1])


def _check_speedups(records, variants, kind, baselines):
  """Each variant's record is written as it ends, then the point's `speedups` record: the tree's
  speedup over each baseline timed beside it (none without a timed tree)."""
  kinds = [r['kind'] for r in records]
  speedups = [r for r in records if r['kind'] == 'speedups']
  timed_tree = variants['tree_xla']['status'] == 'ok'
  assert len(speedups) == int(timed_tree), kinds
  if not timed_tree:
    return
  assert kinds.index('speedups') > max(i for i, k in enumerate(kinds) if k == kind), kinds
  (speedups,) = speedups
  assert speedups['impl'] == 'tree_xla' and speedups['P'] == 24, speedups
  for name in baselines:
    timed = variants[name]['status'] == 'ok'
    assert (f'speedup_vs_{name}' in speedups) == timed, speedups
    if timed:
      want = variants[name]['time_s'] / variants['tree_xla']['time_s']
      assert speedups[f'speedup_vs_{name}'] == pytest.approx(want), speedups


def test_train_tree_bench_smoke(tmp_path):
  """The rollout-tree benchmark's CPU smoke: every variant runs, agrees with the per-sequence
  baseline at the leaves, and the tree's speedups (where both were timed), table, plot and
  README are written."""
  import json
  import subprocess
  import sys

  cmd = [sys.executable, '-m', 'experiments.train_tree_bench', '--points=24:2:8:4:8',
         '--repeats=1', '--target_ms=1', f'--workdir={tmp_path}']
  subprocess.run(cmd, check=True, capture_output=True, timeout=600)
  records = [json.loads(line) for line in (tmp_path / 'results.jsonl').read_text().splitlines()]
  points = {r['impl']: r for r in records if r['kind'] == 'attention'}
  assert set(points) == {'per_seq_xla', 'prefill_xla', 'tree_xla'}
  # A time at or below the timer's noise (a loaded machine) is recorded as untimeable.
  assert all(r['status'] in ('ok', 'untimeable') for r in points.values()), points
  assert points['tree_xla']['rel_err'] < 1e-5 and points['prefill_xla']['rel_err'] < 1e-5
  _check_speedups(records, points, 'attention', ('per_seq_xla', 'prefill_xla'))
  assert points['tree_xla']['flops'] < points['prefill_xla']['flops'] < points['per_seq_xla'][
      'flops']
  for name in ('table.md', 'time.png', 'README.md'):
    assert (tmp_path / name).stat().st_size > 0, name


def test_train_tree_step_smoke(tmp_path):
  """The rollout-tree GRPO step benchmark's CPU smoke: the tree, one-level sharing and the
  per-sequence model give the same loss; the tree's speedups (where both were timed), table,
  plot and README are written."""
  import json
  import subprocess
  import sys

  cmd = [sys.executable, '-m', 'experiments.train_tree_step', '--points=24:2:8:4:8',
         '--layers=1', '--repeats=1', '--target_ms=1', f'--workdir={tmp_path}']
  subprocess.run(cmd, check=True, capture_output=True, timeout=600)
  records = [json.loads(line) for line in (tmp_path / 'results.jsonl').read_text().splitlines()]
  steps = {r['impl']: r for r in records if r['kind'] == 'step'}
  assert set(steps) == {'per_seq_xla', 'prompt_shared_xla', 'tree_xla'}
  assert all(r['status'] in ('ok', 'untimeable') for r in steps.values()), steps
  assert np.isfinite(steps['per_seq_xla']['loss']) and steps['per_seq_xla']['loss'] != 0
  for name in ('prompt_shared_xla', 'tree_xla'):
    assert steps[name]['loss_rel_err'] < 1e-4, steps[name]
  _check_speedups(records, steps, 'step', ('per_seq_xla', 'prompt_shared_xla'))
  assert steps['tree_xla']['flops'] < steps['prompt_shared_xla']['flops'] < steps[
      'per_seq_xla']['flops']
  for name in ('table.md', 'time.png', 'README.md'):
    assert (tmp_path / name).stat().st_size > 0, name

# `make test` keeps these cases (conftest: `representative_cases`; `()`: the whole test is left
# to `make test-all`, another test of the default run covering its path).
representative_cases = {
    'test_states_and_gradients_match_the_dense_oracle': ('GQA_bf16',),
    'test_train_tree_step_smoke': (),
    'test_train_tree_bench_smoke': (),
}
