"""Every notebook under colab/ runs top to bottom on CPU, its install cell skipped.

Each notebook starts with an "Open in Colab" badge, a note on picking a runtime and an install
cell (tagged `install`) that pip-installs this repository on a fresh Colab runtime; the tests run
from the checkout instead.
"""

import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / 'colab').glob('*.ipynb'))


def _code(path: pathlib.Path) -> str:
  cells = json.loads(path.read_text())['cells']
  lines = []
  for cell in cells:
    if 'install' in cell.get('metadata', {}).get('tags', []):
      continue
    if cell['cell_type'] == 'code':
      # Shell and magic lines (installs) are Colab's business, not the test's.
      lines += [l for l in ''.join(cell['source']).splitlines() if not l.lstrip().startswith(('!', '%'))]
  return '\n'.join(lines)


def test_there_are_notebooks():
  assert NOTEBOOKS, 'colab/ should hold at least one notebook'


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_starts_with_badge_runtime_note_and_install_cell(path):
  cells = json.loads(path.read_text())['cells']
  intro = ''.join(cells[0]['source'])
  assert 'colab-badge.svg' in intro and 'Runtime' in intro
  install = cells[1]
  assert install['cell_type'] == 'code' and 'install' in install['metadata'].get('tags', [])
  assert 'REPO_URL' in ''.join(install['source']) and 'pip install' in ''.join(install['source'])


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path):
  namespace = {'__name__': '__main__'}
  exec(compile(_code(path), str(path), 'exec'), namespace)  # asserts inside the notebook must hold
