"""The APPS workload (prompt trees, KV accounting), the tiny coder, apps_eval end to end."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import apps_workload as aw
from hydrajax.evaluation import ByteTokenizer, load_problems
from models import generate as gen
from models import prompt_plan as pp
from models.saved_params import restore_params
from models.kv_cache import DenseKVCache
from models.sampling import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def tiny_coder():
  return restore_params(os.path.join(aw.DATA, 'tiny_coder'), dtype=jnp.float32)


@pytest.mark.parametrize('mode', aw.MODES)
def test_kv_tokens_match_the_planned_layout(mode):
  fewshot, problems = list(range(1, 38)), [list(range(5, 17)), list(range(40, 43)), [9] * 20]
  forest = aw.prompt_forest(fewshot, problems, 3, mode)
  tp = pp.plan_prompts(forest, max_new_tokens=20)
  assert tp.plan.kv_tokens == aw.kv_tokens(mode, 37, [12, 3, 20], 3, 20)
  assert tp.num_rows == 9
  # Every row's prompt is the few-shot tokens then its problem's, whatever is shared.
  full = [[t for j in tp.plan.path(r) for t in tp.nodes[j][0]] for r in range(tp.num_rows)]
  order = np.lexsort((tp.sample_ids, tp.prompt_ids))
  assert [full[r] for r in order] == [fewshot + p for p in problems for _ in range(3)]


def test_max_problems_follows_the_budget():
  lens = [10, 20, 30, 40]
  per_token = 4
  budget = aw.kv_tokens('two_level', 300, lens[:2], 4, 64) * per_token
  assert aw.max_problems('two_level', 300, lens, 4, 64, per_token, budget) == 2
  assert aw.max_problems('one_level', 300, lens, 4, 64, per_token, budget) == 1
  assert aw.max_problems('no_sharing', 300, lens, 4, 64, per_token, budget) == 0
  assert aw.max_problems('two_level', 300, lens, 4, 64, per_token, 10**9) == 4


def test_text_helpers():
  assert aw.pad_tokens([1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1]
  assert aw.pad_tokens([1, 2, 3], 2) == [1, 2]
  assert aw.pad_tokens([1, 2], 0) == [1, 2]
  assert aw.program_from_completion('print(1)\nEND_OF_EXAMPLE\nQUESTION: x') == 'print(1)\n'
  problem = load_problems(os.path.join(aw.DATA, 'apps_mini.jsonl'))[-1]
  assert problem.call_based
  prompt = aw.problem_prompt(problem)
  assert prompt.startswith('QUESTION:\n') and 'Use Call-Based format\nANSWER:\n' in prompt
  assert problem.starter_code in prompt
  tok = ByteTokenizer()
  assert tok.decode(tok.encode('héllo')) == 'héllo'
  assert tok.encode('a')[0] == tok.bos_id and tok.decode([97, tok.eos_id, -1]) == 'a'


def test_training_forward_equals_the_models_naive_forward(tiny_coder):
  from models.training.forward import causal_logits
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 258, (2, 24)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(24, dtype=jnp.int32), (2, 24))
  expected, _ = tiny_coder.forward_naive(
      tokens, positions, DenseKVCache.zeros(tiny_coder.config, 2, 24, jnp.float32))
  got = causal_logits(tiny_coder, tokens)
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-4, atol=1e-4)


def test_greedy_samples_are_the_same_in_every_sharing_mode(tiny_coder):
  tok = ByteTokenizer()
  problems = load_problems(os.path.join(aw.DATA, 'apps_mini.jsonl'))[:2]
  fewshot = tok.encode(aw.fewshot_text(load_problems(os.path.join(aw.DATA, 'apps_fewshot.jsonl'))[:1]))
  ids = [tok.encode(aw.problem_prompt(p), add_bos=False) for p in problems]
  outs = {}
  for mode in aw.MODES:
    run = aw.run_batch(tiny_coder, aw.prompt_forest(fewshot, ids, 2, mode), max_new_tokens=48,
                       sampling=SamplingParams(), seed=0, stop_tokens=tok.eos_ids, impl='xla')
    outs[mode] = run.tokens
  np.testing.assert_array_equal(outs['one_level'], outs['two_level'])
  np.testing.assert_array_equal(outs['no_sharing'], outs['two_level'])
  # The memorised solution of the first problem comes out greedily.
  assert tok.decode(outs['two_level'][0]).startswith(problems[0].solutions[0][:20])


def _run(args, tmp_path):
  out = subprocess.run([sys.executable, '-m', 'experiments.apps_eval', f'--workdir={tmp_path}',
                        *args], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                       capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  assert f'results in {tmp_path}' in out.stdout  # where the results went
  assert '[process=0]' not in out.stderr  # orbax's INFO lines stay out of the terminal
  return [json.loads(l) for l in open(tmp_path / ('solutions.jsonl' if '--check_solutions' in args
                                                   else 'results.jsonl'))]


def test_apps_eval_end_to_end(tmp_path):
  records = _run(['--num_problems=3', '--samples=2', '--new_tokens=96', '--k=1,2',
                  '--memory_budget_gb=0.000477', '--test_timeout_s=2', '--time_batches=0'], tmp_path)
  settings = {r['setting']: r for r in records if 'setting' in r}
  assert set(settings) >= set(aw.MODES)
  # 1000 KV tokens (512 bytes each) fit 2 problems with two levels of sharing, 1 with one level
  # (kv_tokens: two_level 896 / 1216, one_level 640 / 1152, no_sharing 768 / 1536 for 1 / 2 problems).
  assert [settings[m]['batch_problems'] for m in aw.MODES] == [1, 1, 2]
  assert settings['two_level_matched']['batch_problems'] == 1
  for name, r in settings.items():
    assert r['status'] in ('ok', 'does_not_fit'), r
    if r['status'] == 'ok':  # steady state and compiling apart; the wall time holds both
      assert r['compile_s'] > 0 and r['total_s'] > 0 and r['wall_s'] >= r['compile_s']
  summary = [r for r in records if r.get('kind') == 'pass_at_k'][0]
  assert summary['problems'] == 3 and summary['pass@1'] > 0
  for name in ('table.md', 'README.md', 'time.png', 'kv.png'):
    assert (tmp_path / name).exists()
  # --resume keeps every setting that ran (and the sampled programs, checked again the same).
  again = _run(['--num_problems=3', '--samples=2', '--new_tokens=96', '--k=1,2',
                '--memory_budget_gb=0.000477', '--test_timeout_s=2', '--time_batches=0', '--resume'],
               tmp_path)
  kept = {r['setting']: r for r in again if 'setting' in r}
  assert {k: r['timestamp'] for k, r in kept.items()} == {
      k: r['timestamp'] for k, r in settings.items()}
  again_summary = [r for r in again if r.get('kind') == 'pass_at_k'][0]
  assert again_summary['pass@1'] == summary['pass@1']


def test_compile_clock_counts_compiles_only():
  f = jax.jit(lambda x: jnp.sin(x) * 3.0 + 0.25)  # a fresh function: its first call compiles
  with aw.CompileClock() as first:
    f(jnp.ones(7)).block_until_ready()
  with aw.CompileClock() as again:
    f(jnp.ones(7)).block_until_ready()
  assert first.seconds > 0 and again.seconds == 0


def test_check_solutions_mode(tmp_path):
  rows = _run(['--check_solutions', '--num_problems=4'], tmp_path)
  assert len(rows) == 4 and all(r['passed'] == r['solutions'] for r in rows)


@pytest.mark.parametrize('chunk, call_tokens', [(16, None), (512, None), (16, 24)])
def test_lean_prefill_equals_generates_prefill(tiny_coder, chunk, call_tokens):
  rng = np.random.default_rng(1)
  doc = rng.integers(0, 256, 70).tolist()
  kids = [pp.prompt_node(rng.integers(0, 256, n).tolist(), num_samples=s)
          for n, s in ((5, 2), (19, 1), (3, 3))]
  forest = [pp.prompt_node(doc, [pp.prompt_node(rng.integers(0, 256, 9).tolist(), kids)]),
            pp.prompt_node(rng.integers(0, 256, 30).tolist(), num_samples=2)]
  tp = pp.plan_prompts(forest, max_new_tokens=8)
  calls = aw.lean_prefill_calls(tp, chunk, call_tokens)
  assert sum(c.tokens.size for c in calls) < sum(c.tokens.size for c in pp.prefill_calls(tp, chunk))
  if call_tokens is not None:  # split by rows: a call holds one row or at most call_tokens
    assert all(c.tokens.shape[0] == 1 or c.tokens.size <= call_tokens for c in calls)
    assert len(calls) > len(aw.lean_prefill_calls(tp, chunk))
  empty = lambda: gen.KVCache.zeros(tiny_coder.config, tp.plan.kv_tokens, jnp.float32)
  expected, expected_cache = gen.prefill(tiny_coder, tp, empty(), impl='xla', chunk=chunk)
  got, cache = aw.lean_prefill(tiny_coder, tp, empty(), impl='xla', chunk=chunk,
                               call_tokens=call_tokens)
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
  prompt_slots = np.concatenate([np.arange(s.kv_start, s.kv_start + s.kv_length)
                                 for s in tp.plan.segments])
  np.testing.assert_allclose(np.asarray(cache.k)[:, prompt_slots],
                             np.asarray(expected_cache.k)[:, prompt_slots], rtol=1e-5, atol=1e-5)


def test_lean_prefill_skips_nodes_already_written(tiny_coder):
  """`written=`: a document's KV copied in from another plan gives the same logits and cache as
  prefilling it (what needle_qa does across its points); a node that ends a row is refused."""
  seed = int(np.random.SeedSequence().entropy % 2**31)  # a fresh case each run, named on failure
  rng = np.random.default_rng(seed)
  doc = rng.integers(0, 256, 70).tolist()
  question = lambda: pp.prompt_node(rng.integers(0, 256, int(rng.integers(3, 9))).tolist())
  empty = lambda tp: gen.KVCache.zeros(tiny_coder.config, tp.plan.kv_tokens, jnp.float32)
  first = pp.plan_prompts([pp.prompt_node(doc, [question() for _ in range(2)])],
                           max_new_tokens=8)
  _, cache1 = aw.lean_prefill(tiny_coder, first, empty(first), impl='xla', chunk=32)
  tp = pp.plan_prompts([pp.prompt_node(doc, [question() for _ in range(5)])], max_new_tokens=8)
  assert (tp.plan.segments[0].kv_start, tp.plan.segments[0].kv_length) == (0, len(doc))
  expected, full = aw.lean_prefill(tiny_coder, tp, empty(tp), impl='xla', chunk=32)
  start = empty(tp)
  start = gen.KVCache(start.k.at[:, :70].set(cache1.k[:, :70]), start.v.at[:, :70].set(cache1.v[:, :70]))
  got, cache = aw.lean_prefill(tiny_coder, tp, start, impl='xla', chunk=32, written=frozenset({0}))
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5,
                             err_msg=f'seed {seed}')
  slots = np.concatenate([np.arange(s.kv_start, s.kv_start + s.kv_length) for s in tp.plan.segments])
  np.testing.assert_allclose(np.asarray(cache.k)[:, slots], np.asarray(full.k)[:, slots],
                             rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match='written'):
    aw.lean_prefill(tiny_coder, tp, start, impl='xla', chunk=32,
                    written=frozenset({int(tp.row_node[0])}))


def test_run_batch_reuses_a_root_kv_across_calls(tiny_coder):
  """`root_kv=`: the second forest under the same root copies its KV and decodes the same tokens
  as a run that prefills everything."""
  rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**31))
  doc = rng.integers(0, 256, 70).tolist()
  forest = lambda q: [pp.prompt_node(doc, [pp.prompt_node(rng.integers(0, 256, 5).tolist())
                                            for _ in range(q)])]
  run = lambda f, root_kv: aw.run_batch(tiny_coder, f, max_new_tokens=6,
                                        sampling=SamplingParams(), seed=0, stop_tokens=(),
                                        impl='xla', prefill_chunk=32, prefill_call_tokens=64,
                                        root_kv=root_kv)
  root_kv = {}
  run(forest(2), root_kv)
  assert root_kv['kv'][0].shape[1] == len(doc)
  second = forest(3)
  assert aw._root_segment(second, pp.plan_prompts(second, max_new_tokens=6)) == 0  # reused
  np.testing.assert_array_equal(run(second, root_kv).tokens, run(second, None).tokens)

# `make test` keeps these cases (conftest: `representative_cases`; `()`: the whole test is left
# to `make test-all`, another test of the default run covering its path).
representative_cases = {
    'test_lean_prefill_equals_generates_prefill': ('16-24',),
}
