"""Files a reader sees whole or not at all: summary.json, metrics.jsonl
rewrites, report.txt.

Example:
  >>> import os, tempfile
  >>> path = os.path.join(tempfile.mkdtemp(), "summary.json")
  >>> write_atomic(path, '{"steps": 3}')
  >>> open(path).read()
  '{"steps": 3}'
"""

from __future__ import annotations

import os


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
  """Writes ``data`` to ``path`` through a temporary file in the same
  directory, flushed to disk, then renamed over ``path``: a crash leaves the
  old file or the new one, never a torn one, and no temporary file."""
  path = os.fspath(path)
  tmp = f"{path}.tmp{os.getpid()}"
  try:
    with open(tmp, "wb") as f:
      f.write(data.encode("utf-8") if isinstance(data, str) else data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
