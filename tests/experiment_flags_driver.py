"""Runs experiments' commands with given flags in this one process; prints a JSON line a run.

    python tests/experiment_flags_driver.py '{"apps_eval": [["--samples=-2"], ["--help"]]}'

Each run: the module's `main` through `experiments.cli.run`, as `python -m experiments.NAME
FLAGS` runs it, with its exit status and what it wrote to stderr and stdout. Experiments define
absl flags on import, some of the same names: after a module's runs its flags are removed before
the next is imported. A run whose flags are not refused would do the experiment's work: an alarm
ends it (`timed_out`).
"""

import contextlib
import importlib
import io
import json
import signal
import sys

from absl import flags

from experiments import cli

_ALARM_S = 60


class _TimedOut(Exception):
  pass


def _alarm(signum, frame):
  raise _TimedOut()


def run_one(module, argv: list[str]) -> dict:
  sys.argv = [f'experiments.{module.__name__.split(".")[-1]}', *argv]
  flags.FLAGS.unparse_flags()
  out, err = io.StringIO(), io.StringIO()
  code, timed_out = 0, False
  signal.alarm(_ALARM_S)
  try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      cli.run(module.main, workdir=None)
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if isinstance(e.code, str):
      err.write(e.code)
  except _TimedOut:
    code, timed_out = None, True
  finally:
    signal.alarm(0)
  return dict(argv=argv, code=code, timed_out=timed_out, stderr=err.getvalue()[-3000:],
              stdout=out.getvalue()[-3000:])


def main():
  cases = json.loads(sys.argv[1])
  signal.signal(signal.SIGALRM, _alarm)
  for name, runs in cases.items():
    before = set(flags.FLAGS)
    module = importlib.import_module(f'experiments.{name}')
    for argv in runs:
      print(json.dumps(dict(experiment=name, **run_one(module, argv))), flush=True)
    for flag in set(flags.FLAGS) - before:
      delattr(flags.FLAGS, flag)


if __name__ == '__main__':
  main()
