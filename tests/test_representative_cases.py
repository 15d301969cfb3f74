"""Every test and case a `representative_cases` table names (conftest) exists: a renamed one
would otherwise drop from `make test` unseen, or be left out of it by a stale entry."""

import importlib
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parent.parent
MODULES = tuple(sorted(p.stem for p in (ROOT / 'tests').glob('test_*.py')
                       if 'representative_cases = {' in p.read_text()))


def _tables(module):
  """(test-id prefix, {test name: ids}) of a module and of its classes."""
  yield f'tests/{module.__name__.split(".")[-1]}.py', getattr(module, 'representative_cases', {})
  for name, cls in vars(module).items():
    if isinstance(cls, type) and 'representative_cases' in vars(cls):
      yield f'tests/{module.__name__.split(".")[-1]}.py::{name}', cls.representative_cases


def test_representative_cases_name_real_tests_and_cases():
  listed = set(subprocess.run(
      [sys.executable, '-m', 'pytest', '--co', '-q', '-p', 'no:cacheprovider', '--all-cases',
       *[f'tests/{m}.py' for m in MODULES]],
      capture_output=True, text=True, cwd=ROOT, check=True).stdout.splitlines())
  tests = {line.split('[')[0] for line in listed}
  count = 0
  for name in MODULES:
    for prefix, table in _tables(importlib.import_module(f'tests.{name}')):
      for test, ids in table.items():
        assert f'{prefix}::{test}' in tests, (prefix, test)
        for case in ids:
          assert f'{prefix}::{test}[{case}]' in listed, (prefix, test, case)
        count += 1
  assert count >= 60  # every table was found
