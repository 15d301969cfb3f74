"""Every notebook under colab/ runs top to bottom on CPU."""

import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / 'colab').glob('*.ipynb'))


def _code(path: pathlib.Path) -> str:
  cells = json.loads(path.read_text())['cells']
  lines = []
  for cell in cells:
    if cell['cell_type'] == 'code':
      # Shell and magic lines (installs) are Colab's business, not the test's.
      lines += [l for l in ''.join(cell['source']).splitlines() if not l.lstrip().startswith(('!', '%'))]
  return '\n'.join(lines)


def test_there_are_notebooks():
  assert NOTEBOOKS, 'colab/ should hold at least one notebook'


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path):
  namespace = {'__name__': '__main__'}
  exec(compile(_code(path), str(path), 'exec'), namespace)  # asserts inside the notebook must hold
