"""What every experiment shares: bad input is one line on stderr and exit 2."""

from __future__ import annotations

import sys
from collections.abc import Callable

from absl import flags


def fail(prog: str, message: str, status: int = 2) -> None:
  """Prints ``prog: error: message`` (one line) and exits with ``status``
  (2, bad input, unless told otherwise)."""
  print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
  sys.exit(status)


def flags_parser(prog: str) -> Callable[[list[str]], list[str]]:
  """absl's flag parser for ``app.run(main, flags_parser=...)``, except that a
  bad flag (unknown, malformed, or an unknown ``--config.field``) is one line
  on stderr and exit status 2 instead of absl's usage dump and status 1."""

  def parse(argv: list[str]) -> list[str]:
    try:
      return flags.FLAGS(argv)
    except (flags.Error, KeyError, AttributeError, ValueError, TypeError, OSError) as e:
      fail(prog, f"{e}; see --help.")
      raise  # unreachable: fail exits

  return parse
