"""APPS records, the APPS output rules, the checker's verdicts and pass@k."""

import itertools
import json
import math
import os

import pytest

from hydrajax.evaluation import apps, checker, metrics, sandbox
from hydrajax.evaluation.checker import Status

CONFIG = checker.CheckConfig(
    test_timeout_s=1.0, workers=2,
    limits=sandbox.SandboxLimits(wall_s=3.0, cpu_s=2, memory_bytes=512 << 20, max_processes=4))


# ---------------------------------------------------------------------------
# pass@k


def _pass_at_k_by_enumeration(n, c, k):
  """The definition: the share of k-subsets of n samples holding at least one correct one."""
  samples = [True] * c + [False] * (n - c)
  subsets = list(itertools.combinations(range(n), k))
  return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize('n,c,k', [(5, 0, 1), (5, 1, 1), (5, 2, 3), (6, 5, 2), (7, 3, 7), (4, 4, 2)])
def test_pass_at_k_matches_the_definition(n, c, k):
  assert math.isclose(metrics.pass_at_k(n, c, k), _pass_at_k_by_enumeration(n, c, k),
                      rel_tol=1e-12)


def test_pass_at_k_closed_forms():
  assert metrics.pass_at_k(10, 3, 1) == pytest.approx(0.3)
  assert metrics.pass_at_k(200, 0, 100) == 0.0
  assert metrics.pass_at_k(200, 150, 100) == 1.0
  # 1 - C(8, 2) / C(10, 2) = 1 - 28 / 45
  assert metrics.pass_at_k(10, 2, 2) == pytest.approx(17 / 45)
  assert metrics.mean_pass_at_k([(10, 3), (10, 0), (1, 1)], 1) == pytest.approx(
      (0.3 + 0 + 1) / 3)
  assert metrics.mean_pass_at_k([(1, 1)], 2) is None


def test_pass_at_k_rejects_bad_arguments():
  with pytest.raises(ValueError, match='k must be'):
    metrics.pass_at_k(3, 1, 4)
  with pytest.raises(ValueError, match='c <= n'):
    metrics.pass_at_k(3, 4, 1)


# ---------------------------------------------------------------------------
# Output rules


@pytest.mark.parametrize('output,expected', [
    ('3\n', '3\n'),
    ('3', '3\n'),                       # trailing newline
    ('  3  \n\n', '3'),                  # whitespace at the ends
    ('1 2\n3\n', ['1 2', '3']),          # expected given as lines
    ('1 2 \n 3\n', '1 2\n3\n'),          # per-line strip
    ('0.3333333\n', '0.33333333\n'),     # float tolerance (allclose)
    ('2 1\n', '1 2\n'),                  # APPS' lenient set rule: token order within a line
    ('1.0001 2\n', '1.00012 2\n'),       # rounded to 3 decimals in the set rule
    ('3\n3\n', '3\n'),                   # APPS' set rule also collapses repeated lines (a quirk)
])
def test_stdout_matches(output, expected):
  assert apps.stdout_matches(output, expected)


@pytest.mark.parametrize('output,expected', [
    ('4\n', '3\n'),
    ('3\n4\n', '3\n'),
    ('0.34\n', '0.33\n'),
    ('', '3\n'),
    ('YES\n', 'yes\n'),
])
def test_stdout_mismatches(output, expected):
  assert not apps.stdout_matches(output, expected)


def test_call_output_rules():
  assert apps.call_output_matches(3, [3])               # APPS wraps outputs in a list
  assert apps.call_output_matches([1, 2], [1, 2])
  assert apps.call_output_matches([1, 2], [[1, 2]])
  assert apps.call_output_matches({1: 'a'}, {'1': 'a'})  # JSON keys made ints again
  assert not apps.call_output_matches(4, [3])
  assert not apps.call_output_matches([2, 1], [1, 2])
  assert apps.call_inputs([{'1': 2}]) == [{1: 2}]


# ---------------------------------------------------------------------------
# Records and loading


def _record(**kw):
  io = {'inputs': ['1 2\n'], 'outputs': ['3\n']}
  base = dict(question='Add.', input_output=json.dumps(io), starter_code='',
              solutions=json.dumps(['print(sum(map(int, input().split())))']),
              difficulty='introductory')
  base.update(kw)
  return base


def test_load_jsonl_and_folder(tmp_path):
  path = tmp_path / 'p.jsonl'
  records = [dict(_record(), problem_id='a'), dict(_record(input_output=''), problem_id='no tests'),
             dict(_record(difficulty='interview'), problem_id='b')]
  path.write_text('\n'.join(json.dumps(r) for r in records) + '\n')
  problems = apps.load_problems(path)
  assert [p.problem_id for p in problems] == ['a', 'b']
  assert problems[0].inputs == ('1 2\n',) and problems[0].solutions[0].startswith('print')
  assert [p.problem_id for p in apps.load_problems(path, difficulty='interview')] == ['b']
  # The release's layout: one folder per problem.
  for name in ('0010', '0002'):
    folder = tmp_path / 'release' / name
    folder.mkdir(parents=True)
    r = _record()
    (folder / 'question.txt').write_text(r['question'])
    (folder / 'input_output.json').write_text(r['input_output'])
    (folder / 'solutions.json').write_text(r['solutions'])
    (folder / 'metadata.json').write_text(json.dumps({'difficulty': 'introductory'}))
  loaded = apps.load_problems(tmp_path / 'release')
  assert [p.problem_id for p in loaded] == ['0002', '0010']
  assert loaded[0].difficulty == 'introductory'
  assert apps.Problem.from_record(loaded[0].to_record()) == loaded[0]


def test_bad_records_name_the_field():
  with pytest.raises(ValueError, match='input_output'):
    apps.Problem.from_record({'question': 'q'})
  with pytest.raises(ValueError, match='inputs'):
    apps.Problem.from_record({'question': 'q', 'input_output': '{"x": 1}'})
  with pytest.raises(ValueError, match='no APPS problems'):
    apps.load_problems('/nonexistent/path')


# ---------------------------------------------------------------------------
# The checker


STDIN = apps.Problem('sum', 'Sum the numbers of each line.', ('1 2\n3 4\n', ['5 5', '1 1']),
                     ('3\n7\n', '10\n2\n'))
CALL = apps.Problem('twice', 'Return x twice as a pair.', ([1], [5]), ([[1, 1]], [[5, 5]]),
                    fn_name='twice', starter_code='class Solution:\n    def twice(self, x):\n')


def test_verdicts_of_each_kind():
  programs = [
      'import sys\nfor line in sys.stdin:\n  print(sum(map(int, line.split())))\n',   # passes
      'import sys\nfor line in sys.stdin:\n  print(0)\n',                             # wrong
      'print(1/0)\n',                                                                  # raises
      'import time\ntime.sleep(10)\n',                                                 # too slow
      'def f(:\n',                                                                     # syntax
      'import sys\nlines = sys.stdin.read().split("\\n")\n'                            # second
      'if lines[0] == "5 5":\n  print(1)\nelse:\n  print(3)\n  print(7)\n',            # test fails
  ]
  report = checker.check_programs(STDIN, programs, CONFIG)
  got = [(r.status, r.tests_passed) for r in report.results]
  assert got == [(Status.PASSED, 2), (Status.FAILED, 0), (Status.RUNTIME_ERROR, 0),
                 (Status.TIMED_OUT, 0), (Status.COMPILE_ERROR, 0), (Status.FAILED, 1)]
  assert 'ZeroDivisionError' in report.results[2].detail
  assert report.num_correct == 1
  assert report.pass_at_k(1) == pytest.approx(1 / 6)
  assert report.counts() == dict(passed=1, failed=2, timed_out=1, runtime_error=1, compile_error=1,
                                output_too_large=0, error=0)


def test_call_based_class_and_function():
  programs = [
      'class Solution:\n    def twice(self, x):\n        return (x, x)\n',   # tuple -> list
      'def twice(x):\n    return [x, x]\n',                                  # plain function
      'class Solution:\n    def twice(self, x):\n        return [x]\n',
      'class Solution:\n    def other(self, x):\n        return [x, x]\n',   # no such method
  ]
  report = checker.check_programs(CALL.to_record(), programs, CONFIG)
  assert [r.status for r in report.results] == [Status.PASSED, Status.PASSED, Status.FAILED,
                                                 Status.RUNTIME_ERROR]


def test_embedded_problem_set_solutions_pass():
  path = os.path.join(os.path.dirname(__file__), '..', 'experiments', 'data', 'apps_mini.jsonl')
  problems = apps.load_problems(path)
  assert len(problems) >= 20
  assert any(p.call_based for p in problems) and any(not p.call_based for p in problems)
  programs = [(p, s) for p in problems for s in p.solutions]
  config = checker.CheckConfig(test_timeout_s=4.0, workers=2)
  for problem in problems:
    report = checker.check_programs(problem, problem.solutions, config)
    assert report.num_correct == len(problem.solutions), (problem.problem_id, report.results)
  assert programs
