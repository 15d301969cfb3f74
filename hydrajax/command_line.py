"""absl's `app.run` for every command of the package, with `--help` that exits 0.

absl prints the flags for `--help` and exits 1, which scripts and `make` read as a failure:
asking for help is a success. `-h` is taken as `--help`.
"""

import sys
from typing import Callable

from absl import app

HELP_FLAGS = ('--help', '-?', '--helpshort', '--helpfull', '-h')


def run(main: Callable) -> None:
  """`app.run(main)`; the help flags print the flags and exit 0."""
  wants_help = any(a in HELP_FLAGS for a in sys.argv[1:])
  if '-h' in sys.argv[1:]:
    sys.argv[sys.argv.index('-h')] = '--help'
  try:
    app.run(main)
  except SystemExit as done:
    if wants_help and done.code == 1:
      raise SystemExit(0) from None
    raise
