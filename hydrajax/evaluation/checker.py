"""Checking generated programs against an APPS problem: per-program verdicts and pass@k.

Each program runs in its own sandbox (`sandbox`) under `apps_runner`, which runs every test in
that one process, as APPS' harness does. Expected outputs never enter the sandbox: the runner
streams back what the program printed or returned, and this process compares
(`apps.stdout_matches`, `apps.call_output_matches`) as each test's output arrives, stopping the
program at the first test that does not pass.

Verdict of a program: COMPILE_ERROR if it does not compile; else the first test (in order) that
does not pass decides: RUNTIME_ERROR (exception, the process died, or the total-memory budget),
TIMED_OUT (test timeout, wall or CPU limit), OUTPUT_TOO_LARGE (one test's output, stdout or
encoded return value, past `CheckConfig.max_output_bytes`, 32 MiB by default), FAILED (wrong
output); PASSED when every test passes. ERROR when the program could not be judged (the sandbox
could not be built, the result stream was not the runner's format, any failure of this process
while judging it): the reason is in `detail`, and the other programs are checked as usual.
"""

import concurrent.futures
import dataclasses
import enum
import json
import os
import pathlib
import signal
from typing import Any, Sequence

from hydrajax.evaluation import apps, apps_runner, metrics, sandbox

RUNNER = pathlib.Path(apps_runner.__file__).read_text()


class Status(enum.Enum):
  PASSED = 'passed'
  FAILED = 'failed'
  TIMED_OUT = 'timed_out'
  RUNTIME_ERROR = 'runtime_error'
  COMPILE_ERROR = 'compile_error'
  OUTPUT_TOO_LARGE = 'output_too_large'
  ERROR = 'error'


@dataclasses.dataclass(frozen=True)
class ProgramResult:
  """The verdict of one program.

  Attributes:
    status: the verdict.
    tests_passed: tests passed (before the first that did not; all when PASSED).
    num_tests: tests of the problem.
    detail: why it did not pass (the exception, the mismatch, why it could not be judged).
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
    limits: the sandbox's limits; its wall_s / cpu_s are raised to cover every test's timeout, its
      file_bytes to hold one test's output.
    workers: programs checked at once (threads, each driving one sandbox).
    max_output_bytes: largest output of one test (stdout bytes, or the encoded return value).
    python: the interpreter that runs programs (default: this process's own).
  """

  test_timeout_s: float = 4.0
  limits: sandbox.SandboxLimits = sandbox.SandboxLimits()
  workers: int = 2
  max_output_bytes: int = 32 << 20
  python: str | None = None

  def __post_init__(self):
    if not self.test_timeout_s > 0:
      raise ValueError(f'test_timeout_s must be > 0, got {self.test_timeout_s}')
    if self.workers < 1:
      raise ValueError(f'workers must be >= 1, got {self.workers}')
    if self.max_output_bytes < 1:
      raise ValueError(f'max_output_bytes must be >= 1, got {self.max_output_bytes}')


def _limits_for(problem: apps.Problem, config: CheckConfig) -> sandbox.SandboxLimits:
  n = len(problem.inputs)
  budget = config.test_timeout_s * (n + 1)  # every test's timeout, and loading
  return dataclasses.replace(
      config.limits,
      wall_s=max(config.limits.wall_s, budget + 2.0),
      cpu_s=max(config.limits.cpu_s, int(budget) + 1),
      file_bytes=max(config.limits.file_bytes, config.max_output_bytes + 1),
  )


class _Judge:
  """Parses the runner's frames as they arrive and compares each test's output at once."""

  def __init__(self, problem: apps.Problem, tests, max_output_bytes: int):
    self.problem, self.tests = problem, tests
    self.frame_cap = max_output_bytes + 4096
    self.buffer = bytearray()
    self.started = False
    self.passed = 0
    self.verdict: tuple[Status, str] | None = None

  def feed(self, chunk: bytes) -> bool:
    """Takes stdout bytes; False once the verdict is known (the sandbox may stop)."""
    self.buffer += chunk
    header = apps_runner.HEADER
    while self.verdict is None and len(self.buffer) >= header.size:
      kind, length = header.unpack_from(self.buffer)
      if length > self.frame_cap:
        self.verdict = (Status.OUTPUT_TOO_LARGE,
                        f'test {self.passed}: a result frame of {length} bytes')
        break
      if len(self.buffer) < header.size + length:
        break
      payload = bytes(self.buffer[header.size:header.size + length])
      del self.buffer[:header.size + length]
      self._frame(kind, payload)
    return self.verdict is None

  def _frame(self, kind: bytes, payload: bytes) -> None:
    text = payload.decode('utf-8', 'replace')
    i = self.passed
    if not self.started:
      if kind == apps_runner.STARTED:
        self.started = True
      elif kind == apps_runner.COMPILE_ERROR:
        self.verdict = (Status.COMPILE_ERROR, text)
      elif kind == apps_runner.LOAD_ERROR:
        self.verdict = (Status.RUNTIME_ERROR, f'loading the program: {text}')
      elif kind == apps_runner.TIMEOUT:
        self.verdict = (Status.TIMED_OUT, 'timeout while loading the program')
      else:
        self.verdict = (Status.ERROR, f'result stream: {kind!r} before the start frame')
    elif i >= len(self.tests):
      self.verdict = (Status.ERROR, f'result stream: a frame past the last test ({kind!r})')
    elif kind == apps_runner.RAISED:
      self.verdict = (Status.RUNTIME_ERROR, f'test {i}: {text}')
    elif kind == apps_runner.TIMEOUT:
      self.verdict = (Status.TIMED_OUT, f'test {i}: test timeout')
    elif kind == apps_runner.TOO_LARGE:
      self.verdict = (Status.OUTPUT_TOO_LARGE, f'test {i}: {text[:40]} bytes of output')
    elif kind == apps_runner.OUTPUT:
      self._compare(payload)
    else:
      self.verdict = (Status.ERROR, f'result stream: unknown frame kind {kind!r}')

  def _compare(self, payload: bytes) -> None:
    i = self.passed
    expected = self.tests[i][1]
    if self.problem.call_based:
      try:
        output = apps_runner.decode_value(json.loads(payload))
      except (ValueError, TypeError, RecursionError) as e:
        self.verdict = (Status.ERROR, f'test {i}: return value not in the runner\'s format: {e}')
        return
      ok = apps.call_output_matches(output, expected)
    else:
      output = payload.decode('utf-8', 'replace')
      ok = apps.stdout_matches(output, expected)
    if ok:
      self.passed += 1
    else:
      self.verdict = (Status.FAILED, f'test {i}: got {_short(output)}, expected {_short(expected)}')


def _short(value: Any) -> str:
  try:
    text = repr(value)
  except Exception:  # noqa: BLE001 - a value's repr is only for the message
    text = '<no repr>'
  return text if len(text) <= 200 else text[:200] + '...'


def check_program(problem: apps.Problem, program: str,
                  config: CheckConfig = CheckConfig()) -> ProgramResult:
  """Runs one program on every test of `problem` in a sandbox; returns its verdict.

  Never raises for the program's sake: a failure to judge it is its ERROR verdict.
  """
  n = len(problem.inputs)
  try:
    return _check(problem, program, config)
  except Exception as e:  # noqa: BLE001 - one program that cannot be judged must not stop a run
    return ProgramResult(Status.ERROR, 0, n, f'{type(e).__name__}: {e}'[:1000], 0.0)


def _check(problem, program, config) -> ProgramResult:
  tests = list(apps.iter_tests(problem))
  if problem.call_based:
    inputs = [apps_runner.encode_value(apps.call_inputs(i)) for i, _ in tests]
  else:
    inputs = [i if isinstance(i, str) else str(i) for i, _ in tests]
  limits = _limits_for(problem, config)
  iso = sandbox.isolation(config.python, limits.use_namespaces)
  spec = dict(inputs=inputs, fn_name=problem.fn_name, timeout_s=config.test_timeout_s,
              max_output_bytes=config.max_output_bytes, block_network=not iso.full)
  judge = _Judge(problem, tests, config.max_output_bytes)
  run = sandbox.run(['-I', 'runner.py'], files={'runner.py': RUNNER, 'program.py': program,
                                                'spec.json': json.dumps(spec)},
                    limits=limits, python=config.python, stdout_sink=judge.feed)
  n = len(tests)

  def result(status, detail):
    return ProgramResult(status, n if status is Status.PASSED else judge.passed, n,
                         detail[:1000], run.wall_s)

  if judge.verdict is not None:
    return result(*judge.verdict)
  if judge.passed == n:
    return result(Status.PASSED, '')
  stderr = run.stderr.decode('utf-8', 'replace')[-300:]
  if run.setup_error:
    return result(Status.ERROR, f'sandbox: {run.setup_error}')
  if run.memory_exceeded:
    return result(Status.RUNTIME_ERROR, f'test {judge.passed}: total memory past '
                  f'{limits.memory_bytes} bytes (all processes killed)')
  if run.timed_out or run.returncode == -signal.SIGXCPU:
    return result(Status.TIMED_OUT, f'test {judge.passed}: sandbox limit (wall or CPU); {stderr}')
  if judge.buffer:
    return result(Status.ERROR, f'result stream cut inside a frame (exit {run.returncode})')
  if not judge.started and run.returncode == 127:
    return result(Status.ERROR, f'the runner did not start: {stderr}')
  return result(Status.RUNTIME_ERROR,
                f'test {judge.passed}: process ended (exit {run.returncode}): {stderr}')


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
