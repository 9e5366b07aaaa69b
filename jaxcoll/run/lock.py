"""One job per workdir: a lock file that names its holder.

``WORKDIR/jaxcoll.lock`` holds the pid and host of the job's process 0 and an
exclusive ``fcntl.flock`` while the job runs. The kernel drops the flock when
the process ends however it ends (SIGKILL included), so a lock file left by
a dead job is stale and the next job takes it over; a live holder makes the
second job fail with :class:`WorkdirBusyError` naming it. The file is
removed on every exit the process survives to run ``release``.

Example:
  >>> import tempfile
  >>> from jaxcoll.train import lock
  >>> with lock.WorkdirLock(tempfile.mkdtemp()) as held:
  ...   held.holder()["pid"] > 0
  True
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
from typing import Any

from jaxcoll.errors import WorkdirBusyError as WorkdirBusyError
from jaxcoll.errors import WorkdirLockError as WorkdirLockError

LOCK_NAME = "jaxcoll.lock"


class WorkdirLock:
  """An exclusive lock on ``workdir`` for this process (acquired on ``__enter__``)."""

  def __init__(self, workdir: str):
    self.path = os.path.join(os.fspath(workdir), LOCK_NAME)
    self._fd: int | None = None

  def acquire(self) -> None:
    """Takes the lock (a stale one is taken over).

    Raises:
      WorkdirBusyError: a live process holds it (its pid and host named).
      WorkdirLockError: the lock path is not a usable file (a directory, a
        file this process may not open).
    """
    while True:
      fd = self._open()
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError:
        holder = _read(fd)
        os.close(fd)
        raise WorkdirBusyError(
            f"`--workdir` {os.path.dirname(self.path)!r} is in use by pid "
            f"{holder.get('pid', '?')} on host {holder.get('host', '?')} (lock {self.path}); "
            "wait for that job to end, stop it, or use another --workdir."
        ) from None
      try:
        if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
          break
      except FileNotFoundError:
        pass
      os.close(fd)  # the holder removed the file as we opened it: take the new one
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
    os.fsync(fd)
    self._fd = fd

  def _open(self) -> int:
    try:
      return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except IsADirectoryError:
      raise WorkdirLockError(
          f"`--workdir` lock {self.path} is a directory, not a lock file; remove it "
          f"(`rmdir {self.path}`) or use another --workdir."
      ) from None
    except OSError as e:
      if e.errno == errno.ENOSPC:  # a full disk has its own status
        raise
      raise WorkdirLockError(
          f"`--workdir` lock {self.path} cannot be opened ({e.strerror}); if no job runs in "
          f"that workdir, remove it (`rm -f {self.path}`), else use another --workdir."
      ) from None

  def holder(self) -> dict[str, Any]:
    """The pid and host written in the lock file."""
    with open(self.path) as f:
      return json.loads(f.read() or "{}")

  def release(self) -> None:
    """Removes the lock file and drops the lock (idempotent)."""
    if self._fd is None:
      return
    try:
      os.remove(self.path)
    except FileNotFoundError:
      pass
    os.close(self._fd)
    self._fd = None

  def __enter__(self) -> WorkdirLock:
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()


def _read(fd: int) -> dict[str, Any]:
  try:
    return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
  except (OSError, ValueError):
    return {}
