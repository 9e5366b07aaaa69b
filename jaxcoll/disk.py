"""A full disk, recognised wherever it surfaces.

Python's own writes raise ``OSError(ENOSPC)``; orbax's array writes go
through tensorstore, which raises a ``ValueError`` whose text ends with
``No space left on device [os_error_code='28']``, often several exceptions
deep (asyncio, orbax's futures). :func:`is_full` looks through the whole
chain; :class:`DiskFullError` is the one-line error the runner reports with
exit status 74.

Example:
  >>> import errno
  >>> is_full(ValueError("wrapped")) , is_full(OSError(errno.ENOSPC, "No space left on device"))
  (False, True)
  >>> str(DiskFullError("disk full: no room for checkpoint 3"))
  'disk full: no room for checkpoint 3'
"""

from __future__ import annotations

import errno

from jaxcoll.errors import EXIT_DISK_FULL as EXIT_DISK_FULL
from jaxcoll.errors import DiskFullError as DiskFullError

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
