"""A step watchdog: a run that stops making progress exits instead of hanging.

A collective whose peer died, a deadlocked input pipeline or a wedged device
makes a training loop wait forever. The watchdog runs in a daemon thread; the
loop calls :meth:`StepWatchdog.beat` after every step, and when no beat has
come for ``timeout_s`` seconds the watchdog prints the last step that finished
and ends the process with :data:`EXIT_WATCHDOG` (``os._exit``: a thread
cannot interrupt a thread blocked inside XLA). The launcher then stops the
other processes, and ``--max_restarts`` can start the job again.
"""

from __future__ import annotations

import os
import sys
import threading
import time

EXIT_WATCHDOG = 86


class StepWatchdog:
  """Exits the process when no step finished for ``timeout_s`` seconds.

  Example:
    >>> dog = StepWatchdog(600.0)
    >>> for step in range(3):
    ...   dog.beat(step)
    >>> dog.stop()
  """

  def __init__(self, timeout_s: float, *, poll_s: float | None = None, stream=None):
    if not timeout_s > 0:
      raise ValueError(f"`timeout_s` must be > 0 seconds; got {timeout_s!r}. Use 0 to disable.")
    self.timeout_s = float(timeout_s)
    self._poll_s = poll_s or min(1.0, self.timeout_s / 4)
    self._stream = stream or sys.stderr
    self._last_step: int | None = None
    self._last_time = time.monotonic()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._watch, name="jaxcoll-watchdog", daemon=True)
    self._thread.start()

  def beat(self, step: int) -> None:
    """Records that ``step`` finished."""
    self._last_step = step
    self._last_time = time.monotonic()

  def pause(self) -> None:
    """Suspends the deadline (e.g. while compiling or checkpointing); the
    next :meth:`beat` re-arms it."""
    self._last_time = float("inf")

  def stop(self) -> None:
    self._stop.set()
    self._thread.join(timeout=5)

  def _watch(self) -> None:
    while not self._stop.wait(self._poll_s):
      idle = time.monotonic() - self._last_time
      if idle > self.timeout_s:
        last = "none yet" if self._last_step is None else str(self._last_step)
        self._stream.write(
            f"watchdog: no training step finished for {self.timeout_s:g} s "
            f"(last finished step: {last}); exiting with status {EXIT_WATCHDOG} instead of "
            "waiting forever. A peer process may have died or hung.\n"
        )
        self._stream.flush()
        os._exit(EXIT_WATCHDOG)
