r"""What the sandbox costs per program: one checked program, with and without the sandbox.

The same APPS runner and the same one-test program run `--repeats` times each way, one at a time:

* plain: `python -I runner.py` in a scratch dir, no sandbox (the floor: the interpreter's start,
  the runner, the program);
* sandboxed: `hydrajax.evaluation.check_program` (the launcher, namespaces, the private tmpfs root,
  the uid lease, the total-memory watch, the parent's parsing and comparison);

and, for the bare mechanism, `python -I -S -c pass` plain against `sandbox.run` of the same.
The per-program overhead is the difference of the medians, in wall seconds and in CPU seconds
(this process and every process it waited for). On a loaded machine wall times grow; CPU
seconds say more.

  PYTHONPATH=. python -m experiments.sandbox_overhead
"""

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from absl import flags

from experiments import cli
from experiments.benchmarking import report
from hydrajax.evaluation import apps, checker, sandbox

_REPEATS = flags.DEFINE_integer('repeats', 20, 'runs of each kind')
_WORKDIR = cli.workdir_flag('sandbox_overhead')
cli.at_least(1, 'repeats')

PROBLEM = apps.Problem('add', 'Print a + b.', ('1 2\n',), ('3\n',))
PROGRAM = 'a, b = map(int, input().split())\nprint(a + b)\n'


def _cpu_s() -> float:
  me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
  return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _timed(fn, repeats: int, bar) -> dict:
  walls, cpus = [], []
  for _ in range(repeats):
    cpu, wall = _cpu_s(), time.perf_counter()
    fn()
    walls.append(time.perf_counter() - wall)
    cpus.append(_cpu_s() - cpu)
    bar.update()
  return dict(wall_s=statistics.median(walls), cpu_s=statistics.median(cpus),
              wall_min_s=min(walls))


def _plain_runner(folder: str) -> None:
  out = subprocess.run([sys.executable, '-I', 'runner.py'], cwd=folder, capture_output=True,
                       timeout=60)
  if not out.stdout.endswith(b'3\n'):  # the runner's last frame: the test's output
    raise RuntimeError(f'the plain runner failed: {out.stderr[-500:]!r}')


def _sandboxed() -> None:
  result = checker.check_program(PROBLEM, PROGRAM)
  if not result.passed:
    raise RuntimeError(f'the sandboxed program did not pass: {result}')


def main(argv):
  del argv
  os.makedirs(_WORKDIR.value, exist_ok=True)
  writer = report.fresh_jsonl(os.path.join(_WORKDIR.value, 'results.jsonl'))
  iso = sandbox.isolation()
  n = _REPEATS.value
  bar = report.progress_counter(total=4 * n, desc='runs')
  with tempfile.TemporaryDirectory() as folder:
    spec = dict(inputs=list(PROBLEM.inputs), fn_name=None, timeout_s=4.0,
                max_output_bytes=1 << 20, block_network=False)
    for name, text in (('runner.py', checker.RUNNER), ('program.py', PROGRAM),
                       ('spec.json', json.dumps(spec))):
      with open(os.path.join(folder, name), 'w') as f:
        f.write(text)
    rows = [
        dict(kind='program', way='plain', **_timed(lambda: _plain_runner(folder), n, bar)),
        dict(kind='program', way='sandboxed', **_timed(_sandboxed, n, bar)),
        dict(kind='python -c pass', way='plain', **_timed(
            lambda: subprocess.run([sys.executable, '-I', '-S', '-c', 'pass'], check=True), n,
            bar)),
        dict(kind='python -c pass', way='sandboxed', **_timed(
            lambda: sandbox.run(['-I', '-S', '-c', 'pass']), n, bar)),
    ]
  bar.close()
  for row in rows:
    writer.append(dict(row, isolation=iso.mode, repeats=n))
  overhead = {k: rows[1][k] - rows[0][k] for k in ('wall_s', 'cpu_s')}
  bare = {k: rows[3][k] - rows[2][k] for k in ('wall_s', 'cpu_s')}
  writer.append(dict(kind='overhead', program=overhead, bare=bare, isolation=iso.mode))
  summary = (f'sandbox ({iso.mode} mode{": " + iso.reason if iso.reason else ""}), medians of {n} '
             f'runs, os.cpu_count()={os.cpu_count()}, load average {os.getloadavg()[0]:.1f}: '
             f'per-program overhead {overhead["wall_s"] * 1e3:.0f} ms wall, '
             f'{overhead["cpu_s"] * 1e3:.0f} ms CPU (bare mechanism: {bare["wall_s"] * 1e3:.0f} ms '
             f'wall, {bare["cpu_s"] * 1e3:.0f} ms CPU)')
  table = report.markdown_table(rows, [('what', 'kind'), ('way', 'way'), ('wall s', 'wall_s'),
                                       ('fastest wall s', 'wall_min_s'), ('CPU s', 'cpu_s')])
  report.plot_bars(['program wall', 'program CPU', 'bare wall', 'bare CPU'],
                   {'plain': [rows[0]['wall_s'], rows[0]['cpu_s'], rows[2]['wall_s'],
                              rows[2]['cpu_s']],
                    'sandboxed': [rows[1]['wall_s'], rows[1]['cpu_s'], rows[3]['wall_s'],
                                  rows[3]['cpu_s']]},
                   path=os.path.join(_WORKDIR.value, 'overhead.png'), ylabel='seconds (median)',
                   title='one checked program, with and without the sandbox', logy=False)
  report.write_workdir_readme(_WORKDIR.value, 'Per-program overhead of the sandbox',
                              summary + '\n\n' + table, writer.meta)
  print(summary)
  print(table)


if __name__ == '__main__':
  cli.run(main)
