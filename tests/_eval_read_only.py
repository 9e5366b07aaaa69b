"""``python -m _eval_read_only ARGS``: ``python -m experiments.eval ARGS`` in a workdir
that cannot be written (root writes through chmod, so the file system's answer is made
here): opening any file under ``$JAXCOLL_TEST_READ_ONLY_DIR`` for writing raises EROFS."""

import errno
import os
import runpy

_READ_ONLY = os.path.abspath(os.environ["JAXCOLL_TEST_READ_ONLY_DIR"]) + os.sep
_WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_real_open = os.open


def _open(path, flags, *args, **kwargs):
  if flags & _WRITES and os.path.abspath(os.fspath(path)).startswith(_READ_ONLY):
    raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))
  return _real_open(path, flags, *args, **kwargs)


os.open = _open
runpy.run_module("experiments.eval", run_name="__main__", alter_sys=True)
