"""Every notebook under colab/ runs top to bottom on CPU, its install cell skipped.

Each notebook starts with a note on the runtime and on installing, then an install cell (tagged
`install`) that pip-installs what `HYDRAJAX_SOURCE` names (the wheel `make wheel` builds, a
checkout, a git URL) with the runtime's accelerator extra; the tests run from the checkout instead.
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
def test_notebook_starts_with_runtime_note_and_install_cell(path):
  notebook = json.loads(path.read_text())
  cells = notebook['cells']
  intro = ''.join(cells[0]['source'])
  assert 'Runtime' in intro and 'make wheel' in intro and 'HYDRAJAX_SOURCE' in intro
  assert 'OWNER' not in path.read_text()  # no placeholder links
  install = cells[1]
  assert install['cell_type'] == 'code' and 'install' in install['metadata'].get('tags', [])
  source = ''.join(install['source'])
  assert "HYDRAJAX_SOURCE = ''" in source and 'pip' in source
  assert "'[cuda12]'" in source and "'[tpu]'" in source
  accelerator = 'TPU' if path.stem == 'tpu' else 'GPU'
  assert notebook['metadata']['accelerator'] == accelerator
  assert notebook['metadata']['colab']['gpuType'] == ('V28' if accelerator == 'TPU' else 'T4')


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: p.stem)
def test_install_cell_says_what_to_set_before_installing_anything(path):
  source = ''.join(json.loads(path.read_text())['cells'][1]['source'])
  with pytest.raises(ValueError, match='HYDRAJAX_SOURCE is not set.*make wheel'):
    exec(compile(source, 'install', 'exec'), {})
  missing = source.replace("HYDRAJAX_SOURCE = ''", "HYDRAJAX_SOURCE = '/no/such/hydrajax.whl'")
  with pytest.raises(FileNotFoundError, match='does not exist on this runtime'):
    exec(compile(missing, 'install', 'exec'), {})


def _runs(path):
  """Notebooks on the real model compile its 30 layers several times: `make test-slow` runs them."""
  slow = 'load_smollm2' in path.read_text()
  return pytest.param(path, id=path.stem, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize('path', [_runs(p) for p in NOTEBOOKS])
def test_notebook_runs(path):
  namespace = {'__name__': '__main__'}
  exec(compile(_code(path), str(path), 'exec'), namespace)  # asserts inside the notebook must hold
