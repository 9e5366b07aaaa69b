"""Collapses gloo's connection chatter in a process's own stdout.

Under ``python -m jaxcoll.launch`` the launcher collapses each process's
``[Gloo] Rank N is connected to M peer ranks...`` lines into one; under
``mpirun`` and ``srun`` nobody reads our output first, so
:func:`jaxcoll.distributed.initialize` puts this filter between the process
and its stdout: ``python -I gloo_filter.py`` copies its stdin to its stdout
whole line by whole line, the first line of chatter becoming ``gloo:
connected to M peer rank(s) (further gloo connection lines hidden)`` and
the rest of it dropped (:class:`jaxcoll.runtime.launch.GlooChatter`, loaded
from its file: this script imports nothing of jaxcoll's package, so it
starts in milliseconds). It ignores SIGINT and SIGTERM (a scheduler
signals every process of a job step) and exits when its input ends, after
writing everything it got: a process that dies loses no output.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys


def _launch_module():
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch.py")
  spec = importlib.util.spec_from_file_location("_jaxcoll_launch_lines", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)  # stdlib imports only
  return module


def main() -> int:
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  lines = _launch_module()
  gloo, buffer, sink = lines.GlooChatter(), lines.LineBuffer(), sys.stdout.buffer
  while chunk := os.read(0, 65536):
    out = [o for o in map(gloo.filter, buffer.feed(chunk)) if o is not None]
    if out:
      sink.write(b"".join(out))
      sink.flush()
  tail = buffer.flush()
  if tail is not None and (out := gloo.filter(tail)) is not None:
    sink.write(out)
  sink.flush()
  return 0


if __name__ == "__main__":
  sys.exit(main())
