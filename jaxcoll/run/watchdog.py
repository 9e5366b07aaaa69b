"""A step watchdog: a run that stops making progress exits instead of hanging.

A collective whose peer died, a deadlocked input pipeline or a wedged device
makes a training loop wait forever. The watchdog runs in a daemon thread; the
loop calls :meth:`StepWatchdog.beat` after every step, and when no beat has
come for ``timeout_s`` seconds the watchdog prints the last step that finished
and ends the process with :data:`EXIT_WATCHDOG` (``os._exit``: a thread
cannot interrupt a thread blocked inside XLA). The launcher then stops the
other processes, and ``--max_restarts`` can start the job again. A checkpoint
save is watched too, under its own (longer) limit: :meth:`StepWatchdog.saving`.

:class:`StopSignal` turns SIGTERM (a preemption notice, or the launcher
stopping the job) into a request the loop sees after the current step: it
saves a final checkpoint and ends with :data:`EXIT_TERMINATED`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

from jaxcoll.errors import EXIT_TERMINATED as EXIT_TERMINATED
from jaxcoll.errors import EXIT_WATCHDOG as EXIT_WATCHDOG
from jaxcoll.errors import StopRequested as StopRequested


class StopSignal:
  """Sees SIGTERM. One process: a handler of our own (a second SIGTERM ends
  the process at once). Several: JAX's preemption service already catches
  SIGTERM and agrees on a step across processes;
  ``multihost_utils.reached_preemption_sync_point`` reports it, so every
  process saves the same final step.

  Example:
    >>> stop = StopSignal()
    >>> stop.requested(1)
    False
    >>> stop.close()
  """

  def __init__(self):
    import jax  # noqa: PLC0415  (this module is light without JAX)
    from jax._src import distributed  # noqa: PLC0415  (no public equivalent)

    self._requested = False
    self._previous = None
    self._shared = (
        jax.process_count() > 1 and distributed.global_state.preemption_sync_manager is not None
    )
    if not self._shared and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame) -> None:
    del frame
    if self._requested:  # asked twice: do not wait for the step
      os._exit(128 + signum)
    self._requested = True

  def requested(self, step: int) -> bool:
    """Whether to stop after ``step`` (every process must call it every step)."""
    if self._shared:
      from jax.experimental import multihost_utils  # noqa: PLC0415

      return bool(multihost_utils.reached_preemption_sync_point(int(step)))
    return self._requested

  def close(self) -> None:
    """Puts the previous SIGTERM handler back."""
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None


class StepWatchdog:
  """Exits the process when no step finished for ``timeout_s`` seconds.

  Example:
    >>> dog = StepWatchdog(600.0)
    >>> for step in range(3):
    ...   dog.beat(step)
    >>> dog.stop()

  Args:
    timeout_s: the longest a step may take.
    save_timeout_s: the longest a checkpoint save may take (default
      ``4 * timeout_s``): see :meth:`saving`.
  """

  def __init__(self, timeout_s: float, *, save_timeout_s: float | None = None,
               poll_s: float | None = None, stream=None):
    if not timeout_s > 0:
      raise ValueError(f"`timeout_s` must be > 0 seconds; got {timeout_s!r}. Use 0 to disable.")
    self.timeout_s = float(timeout_s)
    self.save_timeout_s = float(save_timeout_s or 4 * self.timeout_s)
    self._limit_s = self.timeout_s
    self._waiting_for: str | None = None  # None: a training step
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
    self._limit_s, self._waiting_for = self.timeout_s, None
    self._last_time = time.monotonic()

  def saving(self, step: int | None = None):
    """Watches the save of checkpoint ``step`` (default: the save in flight)
    under ``save_timeout_s``; afterwards the step deadline starts again (the
    last finished step stays)."""
    return self._watching(
        "the checkpoint save in flight" if step is None else f"the checkpoint save of step {step}"
    )

  def evaluating(self, step: int):
    """Watches the evaluation after ``step`` under ``save_timeout_s``, as :meth:`saving`."""
    return self._watching(f"the evaluation after step {step}")

  @contextlib.contextmanager
  def _watching(self, what: str):
    self._limit_s, self._waiting_for = self.save_timeout_s, what
    self._last_time = time.monotonic()
    try:
      yield
    finally:
      self._limit_s, self._waiting_for = self.timeout_s, None
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
      limit, waiting_for = self._limit_s, self._waiting_for
      idle = time.monotonic() - self._last_time
      if idle > limit:
        last = "none yet" if self._last_step is None else str(self._last_step)
        what = (
            f"no training step finished for {limit:g} s" if waiting_for is None
            else f"{waiting_for} did not finish within {limit:g} s"
        )
        self._stream.write(
            f"watchdog: {what} (last finished step: {last}); exiting with status "
            f"{EXIT_WATCHDOG} instead of waiting forever. A peer process may have died or hung.\n"
        )
        self._stream.flush()
        os._exit(EXIT_WATCHDOG)
