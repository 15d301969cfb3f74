"""Checking generated programs against an APPS problem: per-program verdicts and pass@k.

Each program runs in its own sandboxed subprocess (`hydrajax.evaluation.sandbox`) with a small
runner script that, like the APPS harness, runs every test inside that one process: stdin
problems `exec` the program once per test with `sys.stdin`/`sys.stdout` replaced (SystemExit ends
a test normally); call-based problems `exec` the program once, then call `Solution().fn_name(*args)`
(or the function `fn_name` when there is no class Solution) per test. Each test has its own
timeout (SIGALRM in the runner); the whole run has the sandbox's wall and CPU limits as a
backstop. Expected outputs never enter the sandbox: the runner returns what the program printed or
returned, and this process compares (`apps.stdout_matches`, `apps.call_output_matches`).

Verdict of a program: COMPILE_ERROR if it does not compile, else the first test (in order) that
does not pass decides: RUNTIME_ERROR (exception, or the process died), TIMED_OUT (test timeout,
wall or CPU limit), FAILED (wrong output); PASSED when every test passes.
"""

import concurrent.futures
import dataclasses
import enum
import json
import os
from typing import Any, Sequence

from hydrajax.evaluation import apps, metrics, sandbox


class Status(enum.Enum):
  PASSED = 'passed'
  FAILED = 'failed'
  TIMED_OUT = 'timed_out'
  RUNTIME_ERROR = 'runtime_error'
  COMPILE_ERROR = 'compile_error'


@dataclasses.dataclass(frozen=True)
class ProgramResult:
  """The verdict of one program.

  Attributes:
    status: the verdict.
    tests_passed: tests passed (before the first that did not; all when PASSED).
    num_tests: tests of the problem.
    detail: why it did not pass (the exception, the mismatch), '' when it passed.
    wall_s: seconds its sandbox ran.
  """

  status: Status
  tests_passed: int
  num_tests: int
  detail: str
  wall_s: float

  @property
  def passed(self) -> bool:
    return self.status is Status.PASSED


@dataclasses.dataclass(frozen=True)
class CheckReport:
  """Verdicts of a list of programs for one problem, in order."""

  problem_id: str
  results: tuple[ProgramResult, ...]

  @property
  def num_correct(self) -> int:
    return sum(r.passed for r in self.results)

  def pass_at_k(self, k: int) -> float:
    return metrics.pass_at_k(len(self.results), self.num_correct, k)

  def counts(self) -> dict[str, int]:
    out = {s.value: 0 for s in Status}
    for r in self.results:
      out[r.status.value] += 1
    return out


@dataclasses.dataclass(frozen=True)
class CheckConfig:
  """How programs are run.

  Attributes:
    test_timeout_s: per-test timeout (APPS uses 4 s).
    limits: the sandbox's limits; its wall_s / cpu_s are raised to cover every test's timeout.
    workers: programs checked at once (threads, each driving one subprocess).
  """

  test_timeout_s: float = 4.0
  limits: sandbox.SandboxLimits = sandbox.SandboxLimits()
  workers: int = 2

  def __post_init__(self):
    if not self.test_timeout_s > 0:
      raise ValueError(f'test_timeout_s must be > 0, got {self.test_timeout_s}')
    if self.workers < 1:
      raise ValueError(f'workers must be >= 1, got {self.workers}')


CPU_LIMIT_EXIT = 152  # the runner's exit status on SIGXCPU

# The runner: stdlib only, Python >= 3.8 (the sandbox may use the system's python3).
RUNNER = r'''
import builtins, io, json, signal, sys

class _TestTimeout(BaseException):
  pass

def _alarm(signum, frame):
  raise _TestTimeout()

def _xcpu(signum, frame):  # as PID 1 of a PID namespace the default action would be ignored
  sys.stderr.write('cpu limit\n'); sys.stderr.flush()
  import os; os._exit(152)  # CPU_LIMIT_EXIT

def _block_network():
  import socket
  def blocked(*a, **k):
    raise OSError('network access is disabled in the sandbox')
  socket.socket = blocked
  socket.create_connection = blocked
  socket.socketpair = blocked
  socket.getaddrinfo = blocked

def _jsonable(x):
  try:
    return json.loads(json.dumps(x))
  except (TypeError, ValueError, OverflowError, RecursionError):
    return {'__unserializable__': repr(x)[:200]}

def main():
  with open('spec.json') as f:
    spec = json.load(f)
  out = open('results.jsonl', 'w', buffering=1)
  def emit(**record):
    out.write(json.dumps(record) + '\n')
  with open('program.py') as f:
    source = f.read()
  try:
    code = compile(source, 'program.py', 'exec')
  except BaseException as e:
    emit(compile_error=type(e).__name__ + ': ' + str(e)[:500]); return
  emit(compiled=True)
  signal.signal(signal.SIGALRM, _alarm)
  signal.signal(signal.SIGXCPU, _xcpu)
  if spec['block_network']:
    _block_network()
  timeout = spec['timeout_s']
  real_stdin, real_stdout = sys.stdin, sys.stdout
  if spec['fn_name'] is not None:
    scope = {'__name__': 'program', '__builtins__': builtins}
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
      exec(code, scope)
      target = scope.get('Solution')
      fn = getattr(target(), spec['fn_name']) if target is not None else scope[spec['fn_name']]
    except _TestTimeout:
      emit(test=0, status='timeout', error='timeout while loading'); return
    except BaseException as e:
      emit(test=0, status='error', error=type(e).__name__ + ': ' + str(e)[:500]); return
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)
  for i, args in enumerate(spec['inputs']):
    captured = io.TextIOWrapper(io.BytesIO(), encoding='utf-8', write_through=True)
    try:
      signal.setitimer(signal.ITIMER_REAL, timeout)
      if spec['fn_name'] is not None:
        value = fn(*args)
        result = _jsonable(list(value) if isinstance(value, tuple) else value)
      else:
        sys.stdin = io.TextIOWrapper(io.BytesIO(args.encode()), encoding='utf-8')
        sys.stdout = captured
        try:
          exec(code, {'__name__': '__main__', '__builtins__': builtins})
        except SystemExit:
          pass
        sys.stdout.flush()
        result = captured.buffer.getvalue().decode('utf-8', 'replace')
      signal.setitimer(signal.ITIMER_REAL, 0)
    except _TestTimeout:
      sys.stdin, sys.stdout = real_stdin, real_stdout
      emit(test=i, status='timeout', error='test timeout'); return
    except BaseException as e:
      signal.setitimer(signal.ITIMER_REAL, 0)
      sys.stdin, sys.stdout = real_stdin, real_stdout
      emit(test=i, status='error', error=type(e).__name__ + ': ' + str(e)[:500]); return
    sys.stdin, sys.stdout = real_stdin, real_stdout
    emit(test=i, status='ok', output=result)

main()
'''


def _limits_for(problem: apps.Problem, config: CheckConfig) -> sandbox.SandboxLimits:
  n = len(problem.inputs)
  budget = config.test_timeout_s * (n + 1)  # every test's timeout, and loading
  return dataclasses.replace(
      config.limits,
      wall_s=max(config.limits.wall_s, budget + 2.0),
      cpu_s=max(config.limits.cpu_s, int(budget) + 1),
  )


def check_program(problem: apps.Problem, program: str,
                  config: CheckConfig = CheckConfig()) -> ProgramResult:
  """Runs one program on every test of `problem` in a sandbox; returns its verdict."""
  tests = list(apps.iter_tests(problem))
  inputs = [apps.call_inputs(i) for i, _ in tests] if problem.call_based else [i for i, _ in tests]
  limits = _limits_for(problem, config)
  iso = sandbox.isolation(limits.use_namespaces, limits.base_uid)
  spec = dict(inputs=inputs, fn_name=problem.fn_name, timeout_s=config.test_timeout_s,
              block_network=iso.network != 'namespace')
  run = sandbox.run(['runner.py'], files={'runner.py': RUNNER, 'program.py': program,
                                          'spec.json': json.dumps(spec)},
                    limits=limits, read_back=['results.jsonl'])
  return _verdict(problem, tests, run)


def _verdict(problem, tests, run: sandbox.SandboxResult) -> ProgramResult:
  n = len(tests)
  records = []
  for line in run.files.get('results.jsonl', b'').decode('utf-8', 'replace').splitlines():
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      break  # a line cut by a limit, or written by the program itself: stop trusting the file

  def result(status, passed, detail):
    return ProgramResult(status, passed, n, detail[:1000], run.wall_s)

  if records and 'compile_error' in records[0]:
    return result(Status.COMPILE_ERROR, 0, records[0]['compile_error'])
  passed = 0
  for r in records[1:]:
    if r.get('test') != passed:
      break
    if r.get('status') == 'timeout':
      return result(Status.TIMED_OUT, passed, r.get('error', ''))
    if r.get('status') == 'error':
      return result(Status.RUNTIME_ERROR, passed, r.get('error', ''))
    expected = tests[passed][1]
    output = r.get('output')
    ok = (apps.call_output_matches(output, expected) if problem.call_based
          else isinstance(output, str) and apps.stdout_matches(output, expected))
    if not ok:
      return result(Status.FAILED, passed,
                    f'test {passed}: got {str(output)[:200]!r}, expected {str(expected)[:200]!r}')
    passed += 1
  if passed == n:
    return result(Status.PASSED, n, '')
  stderr = run.stderr.decode('utf-8', 'replace')[-300:]
  if run.timed_out or run.returncode == CPU_LIMIT_EXIT:
    return result(Status.TIMED_OUT, passed, f'sandbox limit (wall or CPU); {stderr}')
  if not records:
    return result(Status.RUNTIME_ERROR, 0, f'runner did not start (exit {run.returncode}): {stderr}')
  return result(Status.RUNTIME_ERROR, passed, f'process ended (exit {run.returncode}): {stderr}')


def check_programs(problem: apps.Problem | dict[str, Any], programs: Sequence[str],
                   config: CheckConfig = CheckConfig(), *, progress=None) -> CheckReport:
  """Verdicts of `programs` on one APPS problem (a `Problem` or an APPS record dict).

  Args:
    problem: the problem.
    programs: program sources.
    config: timeouts, sandbox limits, parallel workers.
    progress: optional callable called once per finished program (e.g. a tqdm bar's update).
  """
  if isinstance(problem, dict):
    problem = apps.Problem.from_record(problem)
  results: list[ProgramResult | None] = [None] * len(programs)
  with concurrent.futures.ThreadPoolExecutor(max_workers=config.workers) as pool:
    futures = {pool.submit(check_program, problem, p, config): i for i, p in enumerate(programs)}
    for future in concurrent.futures.as_completed(futures):
      results[futures[future]] = future.result()
      if progress is not None:
        progress()
  return CheckReport(problem.problem_id, tuple(results))


def default_workers() -> int:
  return max(1, min(4, (os.cpu_count() or 2)))
