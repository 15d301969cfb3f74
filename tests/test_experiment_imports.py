"""Tests import experiment modules in-process; at most one of those (with what they import) may
define absl flags. absl's flags are global: two modules that define one name (`--seed`) in one
pytest worker fail with DuplicateFlagError, depending on how xdist spreads the tests. Commands'
code that tests need lives in flag-free modules (e.g. `experiments.grpo_toy`)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).parent.parent


def _experiment_imports(path: pathlib.Path) -> set[str]:
  """Names of the experiments modules a file imports (anywhere in it)."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module == 'experiments':
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and (node.module or '').startswith('experiments.'):
      names.add(node.module.split('.')[1])
    elif isinstance(node, ast.Import):
      names.update(a.name.split('.')[1] for a in node.names if a.name.startswith('experiments.'))
  return names


def _defines_flags_on_import(path: pathlib.Path) -> bool:
  """Whether the module's top level calls a flag-defining function (`flags.DEFINE_x(...)` or
  `cli.workdir_flag(...)`); a function that defines flags when called does not count."""
  for node in ast.parse(path.read_text()).body:
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
      name = getattr(call.func, 'attr', getattr(call.func, 'id', ''))
      if name.startswith('DEFINE') or name == 'workdir_flag':
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
          return True
  return False


def test_tests_import_at_most_one_flag_defining_experiment():
  seen, todo = set(), set()
  for path in (ROOT / 'tests').glob('*.py'):
    todo |= _experiment_imports(path)
  while todo:  # and what those import, transitively
    name = todo.pop()
    source = ROOT / 'experiments' / f'{name}.py'
    if name in seen or not source.exists():
      continue
    seen.add(name)
    todo |= _experiment_imports(source)
  defining = sorted(n for n in seen if _defines_flags_on_import(ROOT / 'experiments' / f'{n}.py'))
  assert len(seen) > 3, seen  # the walk found the imports
  assert len(defining) <= 1, f'imported in-process by tests, each defining absl flags: {defining}'
