"""Every ```python block of README.md runs as written (CPU, the README's own small settings).

The blocks run top to bottom in one namespace, as a reader pasting them into one Python session
would: a block may use what an earlier block defined (the engine block uses the Llama block's
`model`), and nothing else. Each block is compiled under the name `README.md:<line>`, so a failure
points at the README line. One test runs them all: blocks depend on each other, so they are not
split into items that pytest-xdist could send to different processes.
"""

import contextlib
import importlib.util
import io
import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).parent.parent / 'README.md'
_FENCE = re.compile(r'^```(\w*)[^\n]*\n(.*?)^```[ \t]*$', re.MULTILINE | re.DOTALL)


def code_blocks(text: str, language: str) -> list[tuple[int, str]]:
  """(first line number of the code, code) of every fenced block in `language`, in order."""
  return [(text.count('\n', 0, m.start(2)) + 1, m.group(2))
          for m in _FENCE.finditer(text) if m.group(1) == language]


def run_blocks(blocks: list[tuple[int, str]], name: str, checks=None) -> dict:
  """Executes the blocks in order in one fresh namespace; returns that namespace.

  `checks`: {text: fn(namespace)}; fn runs right after the block whose code holds text (a
  later block may rebind the names it reads), and every text must name some block.
  """
  namespace = {'__name__': '__readme__'}
  unmatched = dict(checks or {})
  for line, code in blocks:
    # Blank lines first, so the compiled code's line numbers are the README's.
    source = '\n' * (line - 1) + code
    with contextlib.redirect_stdout(io.StringIO()):
      exec(compile(source, name, 'exec'), namespace)  # noqa: S102 (the README is the test)
    for text in [t for t in unmatched if t in code]:
      unmatched.pop(text)(namespace)
  assert not unmatched, f'no README block holds {sorted(unmatched)}'
  return namespace


def _max_diff(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def _check_prepared_attention(ns):  # "# 0.0"
  assert _max_diff(ns['out'], ns['expected'].out) == 0.0


def _check_generation(ns):  # "[7 sequences, 16]"
  assert ns['out'].tokens.shape == (7, 16)


def _check_engine(ns):  # "8 samples of 32 tokens"
  assert [len(o) for o in ns['outputs'].values()] == [32] * 8


def _check_policy(ns):  # the demoted segments, and "the same attention, up to float rounding"
  segments = lambda plan: [(s.kv_length, s.num_rows) for s in plan.segments]
  assert segments(ns['plan']) == [(4096, 8), (256, 4), (256, 4)]
  assert segments(ns['per_row']) == [(4096, 8)]
  assert _max_diff(ns['shared'].out, ns['demoted'].out) < 1e-5


def _check_sharded(ns):  # "the same attention as on one device"
  assert _max_diff(ns['out'], ns['shared'].out) < 1e-5


def _check_training(ns):  # a step that ran: finite metrics
  assert all(np.all(np.isfinite(np.asarray(v))) for v in ns['metrics'].values())


README_CLAIMS = {
    'expected = hj.tree_attention': _check_prepared_attention,
    'print(out.tokens.shape)': _check_generation,
    'engine.samples(rid)': _check_engine,
    'per_row = hj.SharingPolicy': _check_policy,
    'hj.tree_attention_sharded(': _check_sharded,
    'grpo.make_train_step': _check_training,
}


def test_code_blocks_finds_blocks_and_their_lines():
  text = 'a\n```python\nx = 1\n```\n```bash\nls\n```\n\n```python\ny = x + 1\n```\n'
  assert code_blocks(text, 'python') == [(3, 'x = 1\n'), (10, 'y = x + 1\n')]
  assert code_blocks(text, 'bash') == [(6, 'ls\n')]
  seen = []
  assert run_blocks(code_blocks(text, 'python'), 'text', {'y =': lambda ns: seen.append(ns['y'])}
                    )['y'] == 2
  assert seen == [2]


def test_readme_python_blocks_run_in_order():
  blocks = code_blocks(README.read_text(), 'python')
  assert len(blocks) >= 3, 'README.md should hold its quick start, Llama and engine examples'
  run_blocks(blocks, str(README), checks=README_CLAIMS)  # what the blocks' comments claim


def test_readme_commands_name_modules_that_exist():
  """`python -m <module>` in a README bash block or table names a module of this repository."""
  modules = set(re.findall(r'python3? -m (\w+(?:\.\w+)*)', README.read_text()))
  assert modules, 'README.md should show how to run the experiments'
  missing = sorted(m for m in modules if importlib.util.find_spec(m) is None)
  assert not missing, f'README.md names modules that do not exist: {missing}'
