"""A full disk, recognised wherever it surfaces; a checkpoints directory's listing.

Python's own writes raise ``OSError(ENOSPC)``; orbax's array writes go
through tensorstore, which raises a ``ValueError`` whose text ends with
``No space left on device [os_error_code='28']``, often several exceptions
deep (asyncio, orbax's futures). :func:`is_full` looks through the whole
chain; :class:`DiskFullError` is the one-line error the runner reports with
exit status 74.

Example:
  >>> import errno

from etils import epath
  >>> is_full(ValueError("wrapped")) , is_full(OSError(errno.ENOSPC, "No space left on device"))
  (False, True)
  >>> str(DiskFullError("disk full: no room for checkpoint 3"))
  'disk full: no room for checkpoint 3'
"""

from __future__ import annotations

import errno

from etils import epath

from jaxcoll.errors import EXIT_DISK_FULL as EXIT_DISK_FULL
from jaxcoll.errors import DiskFullError as DiskFullError

try:  # The name orbax gives the marker it writes just before the rename.
  from orbax.checkpoint._src.path.atomicity_types import COMMIT_SUCCESS_FILE
except ImportError:  # pragma: no cover - a future orbax moved it
  COMMIT_SUCCESS_FILE = "commit_success.txt"

_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_TEXTS = ("No space left on device", "Disk quota exceeded",
          f"os_error_code='{errno.ENOSPC}'", f"os_error_code='{errno.EDQUOT}'")


def is_full(exc: BaseException | None) -> bool:
  """Whether ``exc`` or an error it wraps (cause, context, an exception
  group's members) is a full disk or quota."""
  seen, todo = set(), [exc]
  while todo:
    e = todo.pop()
    if e is None or id(e) in seen:
      continue
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno in _ERRNOS:
      return True
    if any(text in str(e) for text in _TEXTS):
      return True
    todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
  return False


def message(exc: BaseException) -> str:
  """The one line for a full disk: a :class:`DiskFullError`'s own message,
  else the first line of the error with what to do."""
  if isinstance(exc, DiskFullError):
    return str(exc)
  first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:500]
  return (f"disk full: {first}; free space or use another --workdir (the checkpoints already "
          "written are intact).")


def step_of(name: str) -> int | None:
  """The step that the name of an entry of a checkpoints directory stands for, else None.

  Only orbax's own names count: ``7``, not ``007`` (a copy so named is a stray) nor ``²``
  (a digit to ``str.isdigit``, which ``int()`` refuses)."""
  if name.isascii() and name.isdigit() and name == str(int(name)):
    return int(name)
  return None


def step_dirs(directory) -> list[tuple[int, bool]]:
  """``(step, committed)`` of every step directory in ``directory`` (a
  checkpoints directory), oldest first; committed: orbax's commit marker is in
  it. Only orbax's own names count (``7``, not ``007``: a copy so named is a
  stray, never counted); a save in flight or cut short is
  :func:`unfinished_saves`."""
  root = epath.Path(directory)
  if not root.is_dir():
    return []
  found = []
  for path in root.iterdir():
    if (step := step_of(path.name)) is not None and path.is_dir():
      found.append((step, (path / COMMIT_SUCCESS_FILE).exists()))
  return sorted(found)


_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's name for a step being written


def unfinished_saves(directory) -> list[int]:
  """The steps whose save is in flight in ``directory`` or was cut short (a
  killed job): orbax's ``<step>.orbax-checkpoint-tmp*`` directories, never
  read, removed when the next :class:`Checkpointer` opens ``directory``."""
  root = epath.Path(directory)
  if not root.is_dir():
    return []
  steps = set()
  for path in root.iterdir():
    head, sep, _ = path.name.partition(_TMP_SUFFIX)
    if sep and (step := step_of(head)) is not None and path.is_dir():
      steps.add(step)
  return sorted(steps)
