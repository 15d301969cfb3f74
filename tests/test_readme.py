"""Every ```python block of README.md runs as written, on its own (CPU, the README's small settings).

The README promises that each block can be pasted alone into a fresh Python session, so each block
is its own test item and runs in a fresh namespace: a block that used a name an earlier block
defined fails here. Each block is compiled under the name `README.md:<line>`, so a failure points
at the README line, and what its comments claim is checked on the names it leaves behind.
"""

import contextlib
import importlib.util
import io
import pathlib
import re

import numpy as np
import pytest

README = pathlib.Path(__file__).parent.parent / 'README.md'
_FENCE = re.compile(r'^```(\w*)[^\n]*\n(.*?)^```[ \t]*$', re.MULTILINE | re.DOTALL)


def code_blocks(text: str, language: str) -> list[tuple[int, str]]:
  """(first line number of the code, code) of every fenced block in `language`, in order."""
  return [(text.count('\n', 0, m.start(2)) + 1, m.group(2))
          for m in _FENCE.finditer(text) if m.group(1) == language]


def run_block(line: int, code: str, name: str) -> tuple[dict, str]:
  """Executes one block in a fresh namespace; returns (namespace, what it printed)."""
  namespace = {'__name__': '__readme__'}
  # Blank lines first, so the compiled code's line numbers are the README's.
  source = '\n' * (line - 1) + code
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    exec(compile(source, name, 'exec'), namespace)  # noqa: S102 (the README is the test)
  return namespace, printed.getvalue()


def _max_diff(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def _check_quick_start(ns):  # "float rounding only"
  assert _max_diff(ns['out'], ns['expected'].out) < 1e-4


def _check_prepared_attention(ns):  # "# 0.0"
  assert _max_diff(ns['outs'][2], ns['expected'].out) == 0.0


def _check_generation(ns):  # "[7 sequences, 16]"
  assert ns['out'].tokens.shape == (7, 16)


def _check_engine(ns):  # "4 samples of 16 tokens"
  assert [len(o) for o in ns['outputs'].values()] == [16] * 4


def _check_policy(ns):  # the demoted segments, and "the same attention, up to float rounding"
  segments = lambda plan: [(s.kv_length, s.num_rows) for s in plan.segments]
  assert segments(ns['plan']) == [(4096, 8), (256, 4), (256, 4)]
  assert segments(ns['per_row']) == [(4096, 8)]
  assert _max_diff(ns['shared'].out, ns['demoted'].out) < 1e-5


def _check_sharded(ns):  # "the same attention as on one device"
  assert _max_diff(ns['out'], ns['one_device'].out) < 1e-5


def _check_training(ns):  # a step that ran: finite metrics
  assert all(np.all(np.isfinite(np.asarray(v))) for v in ns['metrics'].values())


# {text that identifies a block: check of its namespace}; every block must have one, so a block
# added to the README without a check of what it claims fails `test_every_block_is_checked`.
README_CLAIMS = {
    'expected = hj.naive_tree_attention': _check_quick_start,
    'hj.attend(': _check_prepared_attention,
    'print(out.tokens.shape)': _check_generation,
    'engine.samples(rid)': _check_engine,
    'per_row = hj.SharingPolicy': _check_policy,
    'hj.tree_attention_sharded(': _check_sharded,
    'grpo.make_train_step': _check_training,
}


def _check_of(code: str):
  matches = [check for text, check in README_CLAIMS.items() if text in code]
  assert len(matches) <= 1, 'a README block matches several claims'
  return matches[0] if matches else None


_BLOCKS = code_blocks(README.read_text(), 'python')


def test_code_blocks_finds_blocks_and_their_lines():
  text = 'a\n```python\nx = 1\n```\n```bash\nls\n```\n\n```python\ny = x + 1\n```\n'
  assert code_blocks(text, 'python') == [(3, 'x = 1\n'), (10, 'y = x + 1\n')]
  assert code_blocks(text, 'bash') == [(6, 'ls\n')]
  namespace, printed = run_block(3, 'x = 1\nprint(x)\n', 'text')
  assert namespace['x'] == 1 and printed == '1\n'
  with pytest.raises(NameError):  # a block alone does not see another block's names
    run_block(10, 'y = x + 1\n', 'text')


def test_every_block_is_checked():
  assert len(_BLOCKS) >= 3, 'README.md should hold its tour of Python examples'
  unchecked = [line for line, code in _BLOCKS if _check_of(code) is None]
  assert not unchecked, f'README.md blocks at lines {unchecked} have no check in README_CLAIMS'
  used = {text for text in README_CLAIMS for _, code in _BLOCKS if text in code}
  assert used == set(README_CLAIMS), f'no README block holds {sorted(set(README_CLAIMS) - used)}'


@pytest.mark.parametrize('line, code', _BLOCKS, ids=[f'line{line}' for line, _ in _BLOCKS])
def test_readme_python_block_runs_alone(line, code):
  namespace, printed = run_block(line, code, f'{README}:{line}')
  assert printed.strip(), f'README.md:{line}: the block prints nothing'
  check = _check_of(code)
  if check is not None:
    check(namespace)


def test_readme_commands_name_modules_that_exist():
  """`python -m <module>` in a README bash block or table names a module of this repository."""
  modules = set(re.findall(r'python3? -m (\w+(?:\.\w+)*)', README.read_text()))
  assert modules, 'README.md should show how to run the experiments'
  missing = sorted(m for m in modules if importlib.util.find_spec(m) is None)
  assert not missing, f'README.md names modules that do not exist: {missing}'
