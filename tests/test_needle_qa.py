"""The needle document and questions, and the needle_qa experiment end to end (CPU smoke)."""

import json
import os
import subprocess
import sys

import pytest

from hydrajax.evaluation import ByteTokenizer, needle

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_task_plants_every_fact_and_asks_about_them():
  task = needle.make_task(num_chars=4000, num_questions=12, fewshot=5, seed=3)
  assert len(task.document) >= 4000
  for name, color in task.facts.items():
    assert task.document.count(f'The dog named {name} has fur that is {color}.') == 1
  assert len(task.questions) == len(task.answers) == 12
  for q, a in zip(task.questions, task.answers):
    name = q.split('dog named ')[1].split('?')[0]
    assert task.facts[name] == a
    assert q.endswith('Answer:')
  # Few-shot examples close the document with their answers.
  assert task.document.rstrip().endswith(task.facts[list(task.facts)[4]])
  assert needle.make_task(num_chars=4000, num_questions=12, seed=3) == task  # deterministic


def test_answer_parsing_and_validation():
  assert needle.answer_of(' Brown.\nQuestion') == 'brown'
  assert needle.answer_of('') == ''
  with pytest.raises(ValueError, match='num_questions'):
    needle.make_task(num_chars=1000, num_questions=0)


def test_document_tokens_keep_the_fewshot_tail():
  task = needle.make_task(num_chars=3000, num_questions=2)
  tok = ByteTokenizer()
  ids = needle.document_tokens(tok, task, 1000)
  assert len(ids) == 1000
  assert tok.decode(ids).endswith(task.document[task.document.index('\nQuestion:'):])


def test_smoke_run(tmp_path):
  out = subprocess.run(
      [sys.executable, '-m', 'experiments.needle_qa', '--smoke', '--model=tiny_coder',
       '--doc_tokens=400', '--questions=1,3', '--new_tokens=4', f'--workdir={tmp_path}'],
      cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  records = [json.loads(l) for l in open(tmp_path / 'results.jsonl')]
  assert {(r['mode'], r['questions']) for r in records} == {
      (m, q) for m in ('tree', 'no_sharing', 'no_attention') for q in (1, 3)}
  assert all(r['status'] == 'ok' for r in records)
  # Greedy answers are token-identical with and without sharing the document.
  assert [r['identical_to_tree'] for r in records if r['mode'] == 'no_sharing'] == [True, True]
  for name in ('table.md', 'README.md', 'time_vs_questions.png'):
    assert (tmp_path / name).exists()
  # The terminal says why the accuracy is what it is, and where the results went.
  assert 'chance: 10%' in out.stdout and 'trained on code, not on this task' in out.stdout
  assert 'same greedy tokens at every Q' in out.stdout
  assert f'results in {tmp_path}' in out.stdout


def test_resume_keeps_the_points_that_ran(tmp_path):
  # The runs, one after another, share their compiled programs (one writer at a time): a later
  # run loads what an earlier one compiled.
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_COMPILATION_CACHE_DIR=str(tmp_path / 'programs'),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0')

  def run(*flags):
    out = subprocess.run(
        [sys.executable, '-m', 'experiments.needle_qa', '--smoke', '--model=tiny_coder',
         '--doc_tokens=400', '--new_tokens=4', '--modes=tree,no_sharing',
         f'--workdir={tmp_path / "work"}', *flags],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return {(r['mode'], r['questions']): r
            for r in map(json.loads, open(tmp_path / 'work' / 'results.jsonl'))}, out.stderr

  first, _ = run('--questions=1')
  assert (tmp_path / 'work' / 'answers' / 'tree_q1.npy').exists()
  second, log = run('--questions=1,2', '--resume')
  assert 'resuming: 2 points kept, 2 to run' in log
  assert set(second) == {(m, q) for m in ('tree', 'no_sharing') for q in (1, 2)}
  for key in first:  # kept as they were, not run again
    assert second[key]['timestamp'] == first[key]['timestamp']
  assert second[('no_sharing', 2)]['identical_to_tree'] is True
  third, log = run('--questions=2')  # without --resume: a fresh run
  assert set(third) == {('tree', 2), ('no_sharing', 2)} and 'resuming' not in log

# `make test` keeps these cases (conftest: `representative_cases`; `()`: the whole test is left
# to `make test-all`, another test of the default run covering its path).
representative_cases = {
    'test_resume_keeps_the_points_that_ran': (),
}
