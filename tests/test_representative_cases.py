"""Every case a `representative_cases` table keeps (conftest) exists: a renamed case would
otherwise drop from `make test` unseen."""

import importlib
import pathlib
import subprocess
import sys

MODULES = ('test_mosaic_gpu_kernels', 'test_mosaic_gpu_training', 'test_engine_data_parallel',
           'test_model_parallel', 'test_data_parallel', 'test_tpu_training_attention')


def _tables(module):
  """(test-id prefix, {test name: ids}) of a module and of its classes."""
  yield f'tests/{module.__name__.split(".")[-1]}.py', getattr(module, 'representative_cases', {})
  for name, cls in vars(module).items():
    if isinstance(cls, type) and 'representative_cases' in vars(cls):
      yield f'tests/{module.__name__.split(".")[-1]}.py::{name}', cls.representative_cases


def test_representative_cases_name_real_cases():
  root = pathlib.Path(__file__).parent.parent
  listed = set(subprocess.run(
      [sys.executable, '-m', 'pytest', '--co', '-q', '-p', 'no:cacheprovider', '--all-cases',
       *[f'tests/{m}.py' for m in MODULES]],
      capture_output=True, text=True, cwd=root, check=True).stdout.splitlines())
  count = 0
  for name in MODULES:
    for prefix, table in _tables(importlib.import_module(f'tests.{name}')):
      for test, ids in table.items():
        for case in ids:
          assert f'{prefix}::{test}[{case}]' in listed, (prefix, test, case)
          count += 1
  assert count >= 40  # every table above was found
