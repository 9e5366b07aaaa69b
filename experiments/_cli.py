"""What every experiment shares: bad input is one line on stderr and exit 2."""

from __future__ import annotations

import sys
from collections.abc import Callable

from absl import flags


def fail(prog: str, message: str, status: int = 2) -> None:  # 2: jaxcoll.errors.EXIT_USAGE
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
    except (KeyError, AttributeError) as e:  # an unknown --config.field
      fail(prog, explain_config_error(e))
    except (flags.Error, ValueError, TypeError, OSError) as e:
      fail(prog, f"{e}; see --help.")
      raise  # unreachable: fail exits

  return parse


def explain_config_error(error: Exception, default_config: str | None = None) -> str:
  """A one-line message for a bad ``--config.field=value`` override.

  config_flags reports an unknown field as a bare ``KeyError('name')``; this
  names the field and lists the valid ones, read from the config file that
  ``--config`` names (or ``default_config``).
  """
  argv = sys.argv[1:]
  overrides = [a[len("--config."):].split("=", 1)[0] for a in argv if a.startswith("--config.")]
  path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), default_config)
  config = _load_config(path) if path else None
  for override in overrides if config is not None else ():
    node, walked = config, []
    for part in override.split("."):
      if not hasattr(node, "keys") or part not in node.keys():
        where = ".".join(walked) or "the config"
        valid = ", ".join(sorted(node.keys())) if hasattr(node, "keys") else "(none)"
        return (
            f"unknown config field {override!r} (from --config.{override}); valid fields of "
            f"{where}: {valid}."
        )
      node, walked = node[part], [*walked, part]
  return f"bad --config or --config.field override: {error}; see --helpfull."


def _load_config(path: str):
  import runpy  # noqa: PLC0415

  file, _, variant = path.partition(":")
  try:
    return runpy.run_path(file)["get_config"](*([variant] if variant else []))
  except Exception:  # noqa: BLE001 - only to improve an error message
    return None
