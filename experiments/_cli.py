"""What every experiment shares: bad input is one line on stderr and exit 2."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shlex
import sys
import warnings
from collections.abc import Callable

from absl import flags
from absl import logging as absl_logging

VERBOSE_ENV = "JAXCOLL_VERBOSE"
_VERBOSE = flags.DEFINE_bool(
    "verbose", False,
    f"Show the expected messages jaxcoll hides (also {VERBOSE_ENV}=1): JAX's probe for a TPU "
    "backend, orbax's 'Metadata file does not exist' on processes that did not write it and "
    "its 'Reached preemption sync point' at a SIGTERM stop.")

# (logger, message) pairs that are expected in a healthy run and say nothing to act on.
EXPECTED_NOISE = (
    ("jax._src.xla_bridge", re.compile(r"Unable to initialize backend 'tpu'")),  # no TPU here
    ("absl", re.compile(r"Metadata file does not exist")),  # orbax, reading a step's metadata
    # orbax, on every process of a SIGTERM stop (the stop's own line says what happened)
    ("absl", re.compile(r"Reached preemption sync point")),
)


class _Expected(logging.Filter):
  def __init__(self, pattern: re.Pattern):
    super().__init__()
    self.pattern = pattern

  def filter(self, record: logging.LogRecord) -> bool:
    return not self.pattern.search(record.getMessage())


def is_verbose() -> bool:
  """``--verbose`` (once flags are parsed) or ``JAXCOLL_VERBOSE=1``."""
  env = os.environ.get(VERBOSE_ENV, "").strip().lower()
  return (flags.FLAGS.is_parsed() and _VERBOSE.value) or env not in ("", "0", "false", "no")


def quiet_logs(verbose: bool | None = None) -> bool:
  """Hides :data:`EXPECTED_NOISE` unless ``verbose`` (default: ``--verbose``
  or ``JAXCOLL_VERBOSE=1``); returns whether it hid them. Idempotent."""
  verbose = is_verbose() if verbose is None else verbose
  for name in dict(EXPECTED_NOISE):  # each logger's filters cleared once, then all its own
    logger = logging.getLogger(name)
    for f in [f for f in logger.filters if isinstance(f, _Expected)]:
      logger.removeFilter(f)
  for name, pattern in EXPECTED_NOISE if not verbose else ():
    logging.getLogger(name).addFilter(_Expected(pattern))
  return not verbose


def _ours(category: type, filename: str) -> bool:
  """A warning jaxcoll gave: its class is jaxcoll's (``jaxcoll.errors``), or it is a plain
  ``UserWarning`` warned from jaxcoll's own code."""
  if category.__module__.split(".")[0] == "jaxcoll":
    return True
  package = sys.modules.get("jaxcoll")
  where = os.path.dirname(os.path.abspath(getattr(package, "__file__", "") or "")) + os.sep
  return (category is UserWarning and package is not None and where != os.sep
          and os.path.abspath(filename).startswith(where))


def one_line_warnings(prog: str) -> None:
  """jaxcoll's own warnings (:func:`_ours`) print as one line each on stderr,
  ``prog: warning: CorruptCheckpointWarning: message`` with its whitespace collapsed, instead
  of Python's ``file:line: Category: message`` followed by the source line of the call. Every
  other warning prints as Python prints it, and the filters (which warnings show, how often)
  are untouched. Idempotent."""
  previous = getattr(warnings.showwarning, "jaxcoll_previous", warnings.showwarning)

  def show(message, category, filename, lineno, file=None, line=None):  # noqa: PLR0917
    if not _ours(category, filename):
      return previous(message, category, filename, lineno, file, line)
    import tqdm  # noqa: PLC0415

    stream = sys.stderr if file is None else file
    try:  # a progress bar on that stream: its line cleared first, drawn again after
      with tqdm.tqdm.external_write_mode(file=stream):
        stream.write(f"{prog}: warning: {category.__name__}: "
                     f"{' '.join(str(message).split())}\n")
        stream.flush()
    except (OSError, ValueError):  # a closed stream, as Python's own showwarning allows
      pass
    return None

  show.jaxcoll_previous = previous
  warnings.showwarning = show


_READER_LEFT = (errno.EPIPE, errno.EIO)  # a closed pipe (`| head`), a closed terminal


class _ReaderMayLeave:
  """``sys.stdout`` / ``sys.stderr`` whose reader may leave (:func:`outlive_closed_readers`):
  the first write or flush that finds it gone points the descriptor at ``/dev/null`` (every
  other object writing to it, absl's log handler and tqdm included, then writes there too)
  and the command goes on; everything else is the stream's own."""

  def __init__(self, stream):
    self._stream = stream
    self._gone = False  # a stream without a descriptor to repoint: writes are dropped

  def _reader_left(self) -> None:
    try:
      fd = self._stream.fileno()
      devnull = os.open(os.devnull, os.O_WRONLY)
      os.dup2(devnull, fd)
      os.close(devnull)
    except (OSError, ValueError, AttributeError):
      self._gone = True

  def write(self, text):
    if self._gone:
      return len(text)
    try:
      return self._stream.write(text)
    except OSError as e:
      if e.errno not in _READER_LEFT:
        raise
      self._reader_left()
      return len(text)

  def writelines(self, lines):
    for line in lines:
      self.write(line)

  def flush(self):
    if self._gone:
      return
    try:
      self._stream.flush()
    except OSError as e:
      if e.errno not in _READER_LEFT:
        raise
      self._reader_left()
      with contextlib.suppress(OSError):  # what the buffer held goes to /dev/null now
        self._stream.flush()

  def __getattr__(self, name):
    return getattr(self._stream, name)


def outlive_closed_readers() -> None:
  """Every command goes on when the reader of its output leaves (``jaxcoll train ... 2>&1 |
  head -3``, a closed terminal): writes to a closed stdout / stderr are dropped instead of
  raising ``BrokenPipeError`` in the middle of the work (a training run ended at its next
  progress line, with a traceback nobody read), and the command ends as it would have, its
  files written. Installs :class:`_ReaderMayLeave` as ``sys.stdout`` and ``sys.stderr`` and
  in the log handlers that write to them. Idempotent."""
  for name in ("stdout", "stderr"):
    stream = getattr(sys, name)
    if stream is None or isinstance(stream, _ReaderMayLeave):
      continue
    guarded = _ReaderMayLeave(stream)
    setattr(sys, name, guarded)
    handlers = [absl_logging.get_absl_handler().python_handler, *logging.getLogger().handlers]
    handlers += [h for log in list(logging.Logger.manager.loggerDict.values())
                 for h in getattr(log, "handlers", ())]
    for handler in handlers:
      if isinstance(handler, logging.StreamHandler) and handler.stream is stream:
        handler.stream = guarded


def stopped(prog: str, message: str, status: int) -> None:
  """Prints ``prog: message`` (one line, not an error: a graceful stop) and
  exits with ``status``."""
  print(f"{prog}: {' '.join(str(message).split())}", file=sys.stderr)
  sys.exit(status)


def fail(prog: str, message: str, status: int = 2) -> None:  # 2: jaxcoll.errors.EXIT_USAGE
  """Prints ``prog: error: message`` (one line) and exits with ``status``
  (2, bad input, unless told otherwise)."""
  print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
  sys.exit(status)


def no_positional(prog: str, argv: list[str], path_flag: str | None = None) -> None:
  """Exit 2 when ``argv`` (absl's, the program first) holds arguments that are not flags;
  one that names an existing path, where the command takes one as ``--path_flag``, is shown
  as that flag (``report /tmp/run`` was "unexpected arguments ['/tmp/run']")."""
  extra = argv[1:]
  if not extra:
    return
  if path_flag and len(extra) == 1 and os.path.exists(extra[0]):
    fail(prog, f"unexpected argument {extra[0]!r}; every option is a --flag: "
               f"--{path_flag}={shlex.quote(extra[0])}")
  fail(prog, f"unexpected arguments {extra}; every option is a --flag.")


def whole_number(text: str) -> int | None:
  """The int of a count given as text (``"8"``, ``" 8 "``), or None when it is not one.

  ``str.isdigit`` also takes superscripts (``"²"``), which ``int()`` refuses: a list flag
  checked with it (``--leaves=²``) was a ValueError traceback, or the error line of Python's
  ``invalid literal for int()`` that named no flag.
  """
  text = text.strip()
  return int(text) if text.isascii() and text.isdigit() else None


def writable_dir(flag: str, path: str, directory: str | None = None) -> None:
  """One line (ValueError) naming ``--flag`` when ``directory`` (default ``path``) cannot hold
  what the command writes, checked before anything is measured or simulated (a traceback from
  os.makedirs / open came after, and the results were lost). Nothing is created here: the
  nearest existing folder up the path must be a directory that takes a file; an empty ``path``
  (``--out=``) is an error too (it would write nothing, silently)."""
  import tempfile  # noqa: PLC0415

  if directory is None and not path:  # `--out=`: it would write nothing, silently
    raise ValueError(f"`--{flag}` is empty; give the directory to write in, e.g. "
                     f"--{flag}=/tmp/{flag}, or leave --{flag} out.")
  directory = path if directory is None else directory
  if os.path.exists(directory) and not os.path.isdir(directory):
    raise ValueError(f"`--{flag}`={path!r}: {directory!r} is a file, not a directory; give "
                     "a directory you can write.")
  existing = os.path.abspath(directory)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  try:
    if not os.path.isdir(existing):
      raise NotADirectoryError(20, "Not a directory")
    with tempfile.TemporaryFile(dir=existing):  # root passes os.access even on /proc
      pass
  except OSError as e:
    raise ValueError(f"`--{flag}`={path!r}: cannot write in the directory {directory!r} "
                     f"({e.strerror or e}); give a directory you can write.") from None


def writable_file(flag: str, path: str, example: str) -> None:
  """:func:`writable_dir` for a file ``--flag`` writes: not a directory, and its directory
  takes files (``example``: a file name to suggest); an empty ``path`` (``--csv=``) is an
  error too (it would write nothing, silently)."""
  kind = os.path.splitext(example)[1][1:].upper()  # JSON, CSV, PNG
  if not path:
    raise ValueError(f"`--{flag}` is empty; give the {kind} file to write, e.g. "
                     f"--{flag}={example}, or leave --{flag} out.")
  if os.path.isdir(path):
    raise ValueError(f"`--{flag}`={path!r} is a directory; give the {kind} file to write, "
                     f"e.g. {os.path.join(path, example)}.")
  writable_dir(flag, path, os.path.dirname(path) or ".")


def use_shipped_configs(prog: str) -> str:
  """The start of every command that takes ``--config``: puts the directory holding
  ``experiments/`` and ``configs/`` (the checkout, or the wheel's ``jaxcoll/_shipped``) first
  on ``sys.path`` (configs/*.py import ``configs.base``), resolves ``--config=NAME`` in
  ``sys.argv`` to its shipped file (:func:`resolve_config_name`; an unknown name is
  :func:`fail` with ``prog``) and returns that directory."""
  outlive_closed_readers()
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if repo not in sys.path:
    sys.path.insert(0, repo)
  try:
    resolve_config_name(os.path.join(repo, "configs"))
  except ValueError as e:
    fail(prog, str(e))
  return repo


def config_flags(argv: list[str]) -> list[tuple[int, str, str]]:
  """Each ``--config`` of ``argv``, as absl reads it (``--config=X`` or ``--config X``):
  ``(index of the item holding the value, what precedes the value there, the value)``."""
  found = []
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      found.append((i, "--config=", arg[len("--config="):]))
    elif arg == "--config" and i + 1 < len(argv):
      found.append((i + 1, "", argv[i + 1]))
  return found


def config_flag(argv: list[str], default: str | None = "") -> str | None:
  """The value of ``--config`` in ``argv`` (the last one given wins, as in absl), else
  ``default``."""
  given = config_flags(argv)
  return given[-1][2] if given else default


def resolve_config_name(configs_dir: str, argv: list[str] | None = None) -> None:
  """``--config=NAME[:variant]`` names a shipped config: rewritten in place
  (``sys.argv`` by default) to its path in ``configs_dir``.

  A value that is an existing file is left alone. ``NAME``, ``NAME.py`` and
  ``configs/NAME.py`` (the checkout's path, from another directory) are
  the shipped ``configs_dir/NAME.py`` when it exists.

  Raises:
    ValueError: neither a file nor a shipped config; the message lists them.
  """
  argv = sys.argv if argv is None else argv
  for i, flag, value in config_flags(argv):
    path, colon, variant = value.partition(":")
    if path.startswith("~") and os.path.exists(os.path.expanduser(path)):
      argv[i] = f"{flag}{os.path.expanduser(path)}{colon}{variant}"  # as --workdir=~/...
      continue
    if not path or os.path.exists(path):
      continue
    name = os.path.basename(path) if os.path.dirname(path) in ("", "configs") else None
    name = name[:-3] if name and name.endswith(".py") else name
    shipped = os.path.join(configs_dir, f"{name}.py") if name else ""
    if shipped and not name.startswith("_") and name != "base" and os.path.isfile(shipped):
      argv[i] = f"{flag}{shipped}{colon}{variant}"
      continue
    names = sorted(f[:-3] for f in os.listdir(configs_dir)
                   if f.endswith(".py") and not f.startswith("_") and f != "base.py")
    raise ValueError(
        f"`--config={path}`: no such file, nor a shipped config; shipped configs: "
        f"{', '.join(names)}; e.g. --config={names[0]}:smoke or --config=path/to/my_config.py."
    )


_HELP_FLAG = re.compile(r"^--?(help|helpfull|helpshort|helpxml|\?)$")


def asks_for_help(argv: list[str]) -> bool:
  """Whether ``argv`` (program name first) holds one of absl's help flags
  before a ``--`` that ends the flags."""
  for arg in argv[1:]:
    if arg == "--":
      return False
    if _HELP_FLAG.match(arg):
      return True
  return False


_PATH_FLAGS = ("workdir", "out_dir", "out")  # directories the commands write or read


def expand_home(flag_values) -> None:
  """``~`` in a directory flag is the home directory, as the data globs take it
  (``--config.data.train=~/data/*.parquet``): ``--workdir=~/runs/a`` is not expanded by the
  shell (a ``~`` after ``=``), and the run was written to a directory named ``~`` in the
  current one (a later ``rm -rf ~`` to clean it up removes the home directory)."""
  for name in _PATH_FLAGS:
    if name in flag_values and isinstance(flag_values[name].value, str):
      flag_values[name].value = os.path.expanduser(flag_values[name].value)


def flags_parser(prog: str) -> Callable[[list[str]], list[str]]:
  """absl's flag parser for ``app.run(main, flags_parser=...)``, except that a
  bad flag (unknown, malformed, or an unknown ``--config.field``) is one line
  on stderr and exit status 2 instead of absl's usage dump and status 1, and
  ``--help`` (``--helpfull``, ...) exits 0 after printing the flags, as
  ``jaxcoll --help`` and ``jaxcoll launch --help`` do (absl exits 1)."""

  def parse(argv: list[str]) -> list[str]:
    outlive_closed_readers()  # every command outlives a reader of its output that leaves
    try:
      rest = flags.FLAGS(argv)
      expand_home(flags.FLAGS)
      quiet_logs()
      one_line_warnings(prog)
    except SystemExit as e:  # absl's --help & co print the flags, then exit 1
      if e.code == 1 and asks_for_help(argv):
        raise SystemExit(0) from None  # help that was asked for is a success
      raise
    except (KeyError, AttributeError) as e:  # an unknown --config.field
      fail(prog, explain_config_error(e))
    except (flags.Error, ValueError, TypeError, OSError) as e:
      fail(prog, config_load_error(str(e)) or f"{e}; see --help.")
      raise  # unreachable: fail exits
    try:
      check_config_variant(argv)
    except ValueError as e:
      fail(prog, str(e))
    return rest

  return parse


def check_config_variant(argv: list[str]) -> None:
  """``--config=FILE:VARIANT`` each of whose comma-separated parts changes the config
  (``default.py:smok``, a typo, ran the full config; ``:smoke,smok`` the smoke one).

  A part changes nothing when ``get_config`` of that part alone equals ``get_config``
  with no variant and the variant without it equals the whole (a part that another part
  makes redundant, ``:smoke,tiny`` where ``smoke`` sets what ``tiny`` sets, is still a
  variant the file has, and so is one the file reads only beside another); a variant whose
  whole changes nothing is named whole (a file that reads ``variant == "smoke"`` has no
  ``:smoke,files``). Uses the module config_flags loaded (it keeps it in ``sys.modules``
  as ``config_config``), so the file is executed once per run.

  Raises:
    ValueError: a part that changes nothing, with the variants the file handles.
  """
  path, _, variant = config_flag(argv[1:]).partition(":")
  module = sys.modules.get("config_config")
  if not variant or module is None or not hasattr(module, "get_config") or (
      os.path.abspath(getattr(module, "__file__", "") or "") != os.path.abspath(path)):
    return

  def config_of(parts: list[str]) -> dict | None:
    try:
      return module.get_config(*([",".join(parts)] if parts else [])).to_dict()
    except Exception:  # noqa: BLE001  (a get_config that needs a variant: not ours to judge)
      return None

  parts = [p.strip() for p in variant.split(",") if p.strip()]
  whole, default = config_of(parts), config_of([])
  if whole is None or default is None:
    return
  if whole == default:  # the variant as a whole (a file that reads `variant == "smoke"`)
    unknown, of = [variant], ""
  else:
    unknown = [p for p in parts if config_of([p]) == default  # nothing alone, nor beside
               and config_of([q for q in parts if q != p]) == whole]  # the others
    of = f" (of {variant!r})"
  if not unknown:
    return
  with open(path) as f:  # the names the file compares `variant` with, kept if they act
    mentioned = {name for line in f if "variant" in line
                 for name in re.findall(r"[\"'](\w+)[\"']", line)}
  known = sorted(n for n in mentioned if config_of([n]) not in (None, default))
  example = f":{'smoke' if 'smoke' in known else known[0]}" if known else ""
  raise ValueError(
      f"`--config` variant {unknown[0]!r}{of} of {path} changes nothing (an unknown "
      f"variant?); variants it handles: {', '.join(known) or 'none'}; e.g. --config={path}"
      f"{example}"
  )


_PARSING = "Error whilst parsing config file:"


def config_load_error(text: str) -> str | None:
  """config_flags' error for a ``--config`` file whose ``get_config`` raised when called (its
  whole traceback in the message) as one line: the exception, and for ``FILE:VARIANT`` on a
  ``get_config()`` that takes no variant, the fix. None for any other flag error."""
  if _PARSING not in text:
    return None
  lines = [line.strip() for line in text.split(_PARSING, 1)[1].splitlines() if line.strip()]
  last = lines[-1] if lines else ""
  given = config_flag(sys.argv[1:])
  path, _, variant = given.partition(":")
  if variant and re.search(r"get_config\(\) takes 0 positional arguments", last):
    return (f"`--config={given}`: {path}'s get_config() takes no variant, but `:{variant}` "
            f"gives one; drop `:{variant}`, or define get_config(variant=None) and handle "
            f"variant == {variant!r} there.")
  cast = re.search(r"Could not override field '([^']+)' \(reference\)\. (.*) is of original "
                   r"type <class '(\w+)'> and cannot be casted to type <class '(\w+)'>", last)
  if cast:  # ml_collections' type-safe field, set to another type by the file
    field, value, got, want = cast.groups()

    def a(kind):
      return f"an {kind}" if kind[:1] in "aeiou" else f"a {kind}"

    fix = (" name your model function by its import path, a string: c.model = "
           "'my_model:make' (module:function)" if field == "model" and got == "function" else
           f" give it {a(want)}")
    return (f"cannot load `--config`: {path}'s get_config() sets {field!r} to "
            f"{value[:80]} ({a(got)}), but the field takes {a(want)} "
            f"(configs.base.base_config()'s default);{fix}.")
  return f"cannot load `--config`: {last}"


def explain_config_error(error: Exception, default_config: str | None = None) -> str:
  """A one-line message for a bad ``--config.field=value`` override.

  config_flags reports an unknown field as a bare ``KeyError('name')``; this
  names the field and lists the valid ones, read from the config file that
  ``--config`` names (or ``default_config``).
  """
  argv = sys.argv[1:]
  overrides = [a[len("--config."):].split("=", 1)[0] for a in argv if a.startswith("--config.")]
  path = config_flag(argv, default_config)
  config = _load_config(path) if path else None
  for override in overrides if config is not None else ():
    node, walked = config, []
    for part in override.split("."):
      if not hasattr(node, "keys") or part not in node.keys():
        where = ".".join(walked) or "the config"
        valid = ", ".join(sorted(node.keys())) if hasattr(node, "keys") else "(none)"
        default = _run_config_default(override)
        if default is not _NO_FIELD:  # a field of every run, which this config left out
          return (
              f"`--config.{override}`: {path.partition(':')[0]}'s get_config() returns a config "
              f"without {override!r} (a field of every run, default "
              f"{default!r}), and the command line sets only the fields a "
              "config has; build it from configs.base.base_config() (every field with its "
              f"default), or set {override!r} in the file; its fields: {valid}."
          )
        return (
            f"unknown config field {override!r} (from --config.{override}); "
            f"{_did_you_mean(config, part, walked)}valid fields of {where}: {valid}."
            + (_whole_overrides_hint(node, part, argv) if walked == ["model_overrides"] else "")
        )
      node, walked = node[part], [*walked, part]
  return f"bad --config or --config.field override: {error}; see --helpfull."


def _whole_overrides_hint(own, key: str, argv: list[str]) -> str:
  """For ``--config.model_overrides.KEY=VALUE`` with a KEY the config's overrides lack (a
  keyword of the user's own model function, ``width``): the command line can only change the
  keys a config has, so the fix is the whole mapping, ``--config.model_overrides='{...}'``
  (the close spelling of the config's own key, ``widths``, is another model's argument)."""
  import ast  # noqa: PLC0415
  import json  # noqa: PLC0415

  flag = f"--config.model_overrides.{key}="
  text = next((a[len(flag):] for a in reversed(argv) if a.startswith(flag)), "")
  try:
    value = ast.literal_eval(text)
    json.dumps(value)
  except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
    value = text
  whole = json.dumps({key: value})
  try:
    theirs = f" ({dict(own.items())!r})" if len(own.keys()) else ""
  except Exception:  # noqa: BLE001 - only to improve an error message
    theirs = ""
  return (f" To pass a keyword argument the config's model_overrides do not have to the model "
          f"function, give them all as one mapping, which replaces the config's own{theirs}: "
          f"--config.model_overrides='{whole}'.")


_NO_FIELD = object()  # _run_config_default's answer for a field RunConfig lacks


def _run_config_default(field: str):
  """The default of ``field`` (``data.prefetch``) in jaxcoll's RunConfig, or
  :data:`_NO_FIELD` if it has none (or RunConfig cannot say: only a message depends on it)."""
  try:
    from jaxcoll.run import config as run_config  # noqa: PLC0415

    node = run_config.RunConfig().to_config_dict()
    for part in field.split("."):
      if not hasattr(node, "keys") or part not in node.keys():
        return _NO_FIELD
      node = node[part]
  except Exception:  # noqa: BLE001 - only to improve an error message
    return _NO_FIELD
  return node


def _did_you_mean(config, part: str, walked: list[str]) -> str:
  """``"did you mean 'global_batch_size'? "`` for an unknown field ``part`` (under
  ``walked``): a close spelling, a field that contains it (``batch_size``), or the same
  name in another section (``data.eval_every``: ``eval_every``); the device count, which
  no field sets, gets its own hint."""
  import difflib  # noqa: PLC0415

  fields = []  # every field's dotted path, sections first-level only
  for key in config.keys():
    fields.append(key)
    if hasattr(config[key], "keys"):
      fields.extend(f"{key}.{sub}" for sub in config[key].keys())
  prefix = "".join(f"{w}." for w in walked)
  here = [f[len(prefix):] for f in fields if f.startswith(prefix) and "." not in f[len(prefix):]]
  elsewhere = [f for f in fields if f.rsplit(".", 1)[-1] == part]
  if elsewhere:
    return f"did you mean {elsewhere[0]!r}? "
  short = {"lr": "learning_rate", "wd": "weight_decay", "bs": "global_batch_size"}.get(part)
  close = ([short] if short in here else difflib.get_close_matches(part, here, n=1)
           or sorted((f for f in here if part in f), key=len)[:1])
  if close:
    return f"did you mean {prefix + close[0]!r}? "
  if part in ("devices", "num_devices", "device_count", "n_devices"):
    return ("the device count is the job's, not a config field (on CPU: JAXCOLL_CPU_DEVICES=N "
            "in the environment; --config.mesh_shape lays the devices out); ")
  return ""


def _load_config(path: str):
  import runpy  # noqa: PLC0415

  file, _, variant = path.partition(":")
  try:
    return runpy.run_path(file)["get_config"](*([variant] if variant else []))
  except Exception:  # noqa: BLE001 - only to improve an error message
    return None
