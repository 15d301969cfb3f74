"""APPS problem records (Hendrycks et al., 2021) and the APPS harness' output comparison.

A record (one JSONL line, or one folder of the public release's layout) holds

  question      the statement (str)
  input_output  JSON (str or dict): {"inputs": [...], "outputs": [...], "fn_name": optional}
  starter_code  str, often empty ('class Solution:\n    def f(self, ...):' for call-based)
  solutions     JSON (str or list) of reference programs, optional
  difficulty    'introductory' | 'interview' | 'competition', optional
  problem_id    optional (a folder's name when read from the release)

Standard-input problems give inputs as stdin strings and outputs as stdout strings; call-based
problems (`fn_name` present) give each input as the list of positional arguments and each output
as the return value (often wrapped in a one-element list).

`outputs_match` re-implements the acceptance rules of APPS' `eval/testing_util.py::run_test`
(written from its logic, not copied). A test passes when any of these holds:

stdin/stdout (the program's stdout is split into lines):
  1. the lines joined by '\n' (as printed, and with each line stripped) equal the expected
     string once both are stripped at the ends;
  2. the stripped lines equal the expected output's non-empty stripped lines;
  3. both are all numbers, as many, and `np.allclose` (rtol 1e-5, atol 1e-8) line by line (APPS
     compares one number per line this way);
  4. APPS' lenient set rule: the set of per-line token sets equals the expected one (order of
     lines and of tokens within a line is ignored, and repeated lines collapse, as in APPS);
  5. the same with every token rounded to 3 decimals.
call-based (the return value as the Python object it was; a top-level tuple becomes a list):
  1. it equals the expected output, or
  2. equals expected[0] when the expected output is a non-empty list (APPS wraps results), or
  3. its items are tuples and, as lists, they equal expected[0].
A first argument / expected output that is a dict gets int keys back (JSON made them strings)
as APPS does: `call_inputs`, `call_expected`.
"""

import dataclasses
import json
import math
import os
from typing import Any, Iterable, Sequence


@dataclasses.dataclass(frozen=True)
class Problem:
  """One APPS record, parsed.

  Attributes:
    problem_id: its id (str).
    question: the statement.
    inputs, outputs: the tests (stdin strings / stdout strings, or argument lists / return values).
    fn_name: the function to call for call-based problems, else None.
    starter_code: code the prompt starts the solution with ('' if none).
    solutions: reference programs (may be empty).
    difficulty: the APPS split name, or ''.
  """

  problem_id: str
  question: str
  inputs: tuple[Any, ...]
  outputs: tuple[Any, ...]
  fn_name: str | None = None
  starter_code: str = ''
  solutions: tuple[str, ...] = ()
  difficulty: str = ''

  def __post_init__(self):
    if len(self.inputs) != len(self.outputs):
      raise ValueError(f'problem {self.problem_id}: {len(self.inputs)} inputs but '
                       f'{len(self.outputs)} outputs')
    if not self.inputs:
      raise ValueError(f'problem {self.problem_id}: input_output holds no tests')

  @property
  def call_based(self) -> bool:
    return self.fn_name is not None

  @classmethod
  def from_record(cls, record: dict[str, Any], problem_id: str | None = None) -> 'Problem':
    """From an APPS record dict (JSON strings or already-parsed values)."""
    for key in ('question', 'input_output'):
      if key not in record:
        raise ValueError(f'APPS record {problem_id or record.get("problem_id")!r} has no {key!r}')
    io = _json(record['input_output'])
    if not isinstance(io, dict) or 'inputs' not in io or 'outputs' not in io:
      raise ValueError('input_output must be a JSON object with "inputs" and "outputs", got '
                       f'{str(record["input_output"])[:80]!r}')
    solutions = _json(record.get('solutions') or '[]')
    if isinstance(solutions, str):
      solutions = [solutions]
    pid = problem_id if problem_id is not None else record.get('problem_id', '')
    return cls(
        problem_id=str(pid),
        question=str(record['question']),
        inputs=tuple(io['inputs']),
        outputs=tuple(io['outputs']),
        fn_name=io.get('fn_name') or None,
        starter_code=record.get('starter_code') or '',
        solutions=tuple(str(s) for s in solutions),
        difficulty=record.get('difficulty') or '',
    )

  def to_record(self) -> dict[str, Any]:
    """The APPS record (input_output and solutions as JSON strings, as the release has them)."""
    io: dict[str, Any] = {'inputs': list(self.inputs), 'outputs': list(self.outputs)}
    if self.fn_name:
      io['fn_name'] = self.fn_name
    return dict(problem_id=self.problem_id, question=self.question,
                input_output=json.dumps(io), starter_code=self.starter_code,
                solutions=json.dumps(list(self.solutions)), difficulty=self.difficulty)


def _json(value):
  return json.loads(value) if isinstance(value, str) else value


def load_problems(path: str | os.PathLike, *, difficulty: str | None = None,
                  limit: int | None = None) -> list[Problem]:
  """APPS problems from a JSONL file, or a folder in the release's layout.

  A folder holds either one sub-folder per problem (question.txt, input_output.json,
  optional starter_code.py, solutions.json, metadata.json with "difficulty"), or *.jsonl files.
  Problems without tests (an empty or missing input_output) are skipped, as APPS' own evaluation
  does. `difficulty` keeps one split; `limit` the first n (in id order for folders).
  """
  path = os.fspath(path)
  if os.path.isfile(path):
    problems = _from_jsonl(path)
  elif os.path.isdir(path):
    jsonl = sorted(f for f in os.listdir(path) if f.endswith('.jsonl'))
    if jsonl:
      problems = [p for f in jsonl for p in _from_jsonl(os.path.join(path, f))]
    else:
      problems = _from_folders(path)
  else:
    raise ValueError(f'no APPS problems at {path!r} (want a .jsonl file or a folder)')
  if difficulty:
    problems = [p for p in problems if p.difficulty == difficulty]
  return problems[:limit] if limit else problems


def _from_jsonl(path: str) -> list[Problem]:
  out = []
  with open(path) as f:
    for i, line in enumerate(f):
      if not line.strip():
        continue
      record = json.loads(line)
      if not record.get('input_output'):
        continue
      out.append(Problem.from_record(record, str(record.get('problem_id', i))))
  return out


def _from_folders(root: str) -> list[Problem]:
  def key(name):
    return (0, int(name)) if name.isdigit() else (1, name)

  out = []
  for name in sorted(os.listdir(root), key=key):
    folder = os.path.join(root, name)
    io_file = os.path.join(folder, 'input_output.json')
    if not os.path.isdir(folder) or not os.path.exists(io_file):
      continue
    record = {'input_output': open(io_file).read()}
    if not record['input_output'].strip():
      continue
    record['question'] = open(os.path.join(folder, 'question.txt')).read()
    for file, field in (('starter_code.py', 'starter_code'), ('solutions.json', 'solutions')):
      if os.path.exists(os.path.join(folder, file)):
        record[field] = open(os.path.join(folder, file)).read()
    meta = os.path.join(folder, 'metadata.json')
    if os.path.exists(meta):
      record['difficulty'] = json.load(open(meta)).get('difficulty', '')
    out.append(Problem.from_record(record, name))
  return out


# ---------------------------------------------------------------------------
# Output comparison (APPS rules; see the module docstring)


def _int_keyed(d: dict) -> dict:
  return {int(k): v for k, v in d.items()}


def call_inputs(inputs):
  """The positional arguments of one call-based test, as APPS passes them.

  APPS undoes JSON's string keys for a first argument that is a dict: when every key converts
  with int(), the arguments become [that dict, int-keyed] (any others are dropped, as in APPS);
  when one does not, the arguments are left as they are.
  """
  try:
    if isinstance(inputs[0], dict):
      return [_int_keyed(inputs[0])]
  except (TypeError, ValueError, KeyError, IndexError):
    pass
  return inputs


def call_expected(expected):
  """A call-based test's expected output, as APPS compares it: a dict, or a list whose first item
  is a dict, becomes [that dict, int-keyed] when every key converts with int()."""
  for candidate in (lambda: expected, lambda: expected[0]):
    try:
      value = candidate()
      if isinstance(value, dict):
        return [_int_keyed(value)]
    except (TypeError, ValueError, KeyError, IndexError):
      pass
  return expected


def call_output_matches(output: Any, expected: Any) -> bool:
  """Call-based rule on the program's return value, a Python object (tuples, int keys kept)."""
  expected = call_expected(expected)
  if isinstance(output, tuple):
    output = list(output)
  if output == expected:
    return True
  if isinstance(expected, list) and expected and output == expected[0]:
    return True
  try:  # a sequence of tuples against lists
    if isinstance(output[0], tuple) and [list(x) for x in output] == expected[0]:
      return True
  except (TypeError, KeyError, IndexError):
    pass
  return False


def stdout_matches(output: str, expected: Any) -> bool:
  """Standard-input rule: `output` is everything the program printed."""
  if isinstance(expected, list):
    expected = '\n'.join(str(e) for e in expected)
  expected = str(expected)
  lines = output.splitlines()
  # 1. whole string, stripped at the ends (as printed, and with each line stripped)
  if '\n'.join(lines).strip() == expected.strip():
    return True
  stripped = [line.strip() for line in lines]
  if '\n'.join(stripped).strip() == expected.strip():
    return True
  # 2. non-empty stripped lines
  got = [s for s in stripped if s]
  want = [s.strip() for s in expected.split('\n') if s.strip()]
  if got == want:
    return True
  # 3. numbers, line by line
  try:
    a, b = [float(x) for x in got], [float(x) for x in want]
    if len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b)):
      return True
  except ValueError:
    pass
  # 4. APPS' set rule: set of per-line token sets
  got_sets = {frozenset(s.split()) for s in got}
  want_sets = {frozenset(s.split()) for s in want}
  if got_sets == want_sets:
    return True
  # 5. the same with numbers rounded to 3 decimals
  try:
    return ({frozenset(round(float(t), 3) for t in s.split()) for s in got}
            == {frozenset(round(float(t), 3) for t in s.split()) for s in want})
  except ValueError:
    return False


def _close(a: float, b: float) -> bool:
  """np.allclose's rule for one pair (rtol 1e-5, atol 1e-8); nan never matches."""
  if math.isinf(a) or math.isinf(b):
    return a == b
  return abs(a - b) <= 1e-8 + 1e-5 * abs(b)


def iter_tests(problem: Problem) -> Iterable[tuple[Any, Any]]:
  """(input, expected) pairs; stdin inputs given as lists of lines are joined, as APPS does."""
  for inp, out in zip(problem.inputs, problem.outputs):
    if not problem.call_based and isinstance(inp, list):
      inp = '\n'.join(str(x) for x in inp)
    yield inp, out


def stdin_text(inputs: Sequence[Any]) -> list[str]:
  return [i if isinstance(i, str) else '\n'.join(map(str, i)) for i in inputs]
