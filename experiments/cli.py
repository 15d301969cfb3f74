"""What every experiment's command line shares.

- One output-folder convention: `--workdir`, default `workdir/<experiment>` under the current
  directory (`workdir_flag`); the folder is printed when the run ends.
- Flags are checked while they are parsed, before any model is built or program compiled: a bad
  value stops the command with `FATAL Flags parsing error: flag --NAME=VALUE: why` and exit status
  1 (`at_least`, `int_list`, `choices`, `check_flags`).
- `--help` (`-h`, `-?`, `--helpshort`, `--helpfull`) prints the flags and exits 0 (absl exits 1;
  `hydrajax.command_line`).
- orbax's INFO lines (a dozen per checkpoint restored) stay out of the terminal; its warnings
  and errors still show.

This module defines no flag when imported; an experiment calls `workdir_flag` at its top.
"""

import logging
import os
from typing import Callable, Iterable

from absl import flags
from absl import logging as absl_logging

from hydrajax import command_line

def workdir_flag(experiment: str, about: str = 'output folder') -> flags.FlagHolder:
  """Defines `--workdir`, default `workdir/<experiment>` (relative to the current directory)."""
  default = os.path.join('workdir', experiment)
  return flags.DEFINE_string('workdir', default, f'{about} (default: {default} under the '
                             'current directory)')


def at_least(minimum: float, *names: str) -> None:
  """Each named flag (a number; None allowed) must be >= minimum."""
  for name in names:
    flags.register_validator(name, lambda v, m=minimum: v is None or v >= m,
                             message=f'must be >= {minimum:g}')


def int_list(name: str, minimum: int = 1) -> None:
  """A list flag whose items must be integers >= minimum (e.g. `--batches=1,8,64`)."""
  def ok(values) -> bool:
    try:
      return all(int(v) >= minimum for v in values)
    except ValueError:
      return False
  flags.register_validator(name, ok, message=f'must be integers >= {minimum}, comma-separated')


def number_list(name: str, minimum: float = 0.0, *, strict: bool = True) -> None:
  """A list flag whose items must be numbers > minimum (>= if not strict)."""
  def ok(values) -> bool:
    try:
      return all(float(v) > minimum if strict else float(v) >= minimum for v in values)
    except ValueError:
      return False
  word = '>' if strict else '>='
  flags.register_validator(name, ok, message=f'must be numbers {word} {minimum:g}, comma-separated')


def choices(name: str, allowed: Iterable[str]) -> None:
  """A list (or string) flag whose items must be among `allowed`."""
  allowed = list(allowed)

  def ok(values) -> bool:
    return all(v in allowed for v in ([values] if isinstance(values, str) else values or []))
  flags.register_validator(name, ok, message=f'must be one or more of {allowed}')


def check_flags(names: list[str], check: Callable[[dict], str | None]) -> None:
  """A check across several flags: `check({name: value})` returns None or what is wrong.

  The message names the flags; absl prints it as `flags NAME1=..., NAME2=...: message`.
  """
  def ok(values: dict) -> bool:
    problem = check(values)
    if problem:
      raise flags.ValidationError(problem)
    return True
  flags.register_multi_flags_validator(names, ok)


def _not_orbax_info(record: logging.LogRecord) -> bool:
  return record.levelno > logging.INFO or f'{os.sep}orbax{os.sep}' not in record.pathname


def run(main: Callable, *, workdir: flags.FlagHolder | None = None) -> None:
  """`app.run(main)`, with `--help` exiting 0, orbax's INFO lines dropped and the output folder
  printed at the end."""
  absl_logging.get_absl_logger().addFilter(_not_orbax_info)

  def main_then_say_where(argv):
    result = main(argv)
    if workdir is not None and os.path.isdir(workdir.value):
      print(f'\nresults in {os.path.abspath(workdir.value)}', flush=True)
    return result

  command_line.run(main_then_say_where)
