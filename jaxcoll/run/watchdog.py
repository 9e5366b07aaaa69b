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
stopping the job), SIGINT (Ctrl-C), SIGHUP and SIGUSR1 (the stop request mpirun forwards to
every rank: its own SIGTERM and Ctrl-C give them 1 s before SIGKILL) into a request the loop
sees after the current step: it saves a final checkpoint and ends with ``128 + signal``
(:data:`EXIT_TERMINATED` for SIGTERM, :data:`EXIT_INTERRUPTED` for SIGINT).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from jaxcoll.errors import EXIT_HANGUP as EXIT_HANGUP
from jaxcoll.errors import EXIT_INTERRUPTED as EXIT_INTERRUPTED
from jaxcoll.errors import EXIT_STOP_REQUEST as EXIT_STOP_REQUEST
from jaxcoll.errors import EXIT_TERMINATED as EXIT_TERMINATED
from jaxcoll.errors import EXIT_WATCHDOG as EXIT_WATCHDOG
from jaxcoll.errors import StopRequested as StopRequested
from jaxcoll.run import config as run_config
from jaxcoll.runtime import liveness

SAVE_LIMIT_FACTOR = run_config.SAVE_LIMIT_FACTOR  # the default save limit: 4 x watchdog_s
# JAX aborts a job whose peer stopped sending heartbeats up to ~20 s before
# its heartbeat timeout (measured: 22 s after a SIGSTOP with a 40 s timeout,
# 81 s with 100 s). A job's heartbeat timeout must therefore exceed twice the
# watchdog's longest limit plus this margin for the watchdog to speak first.
HEARTBEAT_MARGIN_S = 30


def limits(config) -> tuple[float, float] | None:
  """``(step limit, save limit)`` in seconds from ``config.watchdog_s`` and
  ``config.save_timeout_s`` (0: ``SAVE_LIMIT_FACTOR`` x ``watchdog_s``);
  None when the watchdog is off or the config is bad (:func:`jaxcoll.run.config.parse`
  names it)."""
  try:
    config = run_config.parse(config)
  except ValueError:
    return None
  step, save = config.watchdog_s, config.save_timeout_s  # finite and >= 0
  if not step:
    return None
  return step, save or SAVE_LIMIT_FACTOR * step


def heartbeat_needed_s(config) -> int | None:
  """The shortest JAX heartbeat timeout under which ``config``'s watchdog
  fires before JAX aborts a job with a hung peer: twice its longest limit
  plus ``HEARTBEAT_MARGIN_S``; None when the watchdog is off."""
  found = limits(config)
  if found is None:
    return None
  return int(2 * max(found) + HEARTBEAT_MARGIN_S + 0.999)


class StopSignal:
  """Sees SIGTERM, SIGINT, SIGHUP (a closed terminal; its output then goes
  to /dev/null) and SIGUSR1 (a stop request: Open MPI's mpirun forwards it to every rank,
  while its own SIGTERM gives them 1 s before SIGKILL). One process: a handler of our
  own (a second signal ends the process at once, with ``128 + signal``). Several: JAX's
  preemption service already catches SIGTERM and agrees on a step across processes;
  ``multihost_utils.reached_preemption_sync_point`` reports it, so every
  process saves the same final step (SIGINT, SIGHUP and SIGUSR1 are passed on to it
  as SIGTERM). An ignored SIGINT / SIGHUP / SIGUSR1 (``cmd &``, ``nohup``) stays
  ignored, and SIGUSR1 is taken only where nothing handles it (Python has no handler of
  its own for it: one there is the user's code's, a Slurm requeue handler, or
  ``faulthandler.register``'s). ``signum`` is the signal that arrived (SIGTERM until one
  does).

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
    self._previous: dict[int, object] = {}
    self.signum = int(signal.SIGTERM)
    self._shared = (
        jax.process_count() > 1 and distributed.global_state.preemption_sync_manager is not None
    )
    if threading.current_thread() is threading.main_thread():
      ours = (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1) + (
          () if self._shared else (signal.SIGTERM,))
      for signum in ours:
        if signum != signal.SIGTERM and signal.getsignal(signum) == signal.SIG_IGN:
          continue  # a background job (`cmd &`) or nohup: Ctrl-C / hang-up are not ours
        if signum == signal.SIGUSR1 and _handled_elsewhere(signum):
          continue  # no default of Python's: the user's code took it (a requeue handler)
        self._previous[signum] = signal.signal(signum, self._handle)

  def _handle(self, signum, frame) -> None:
    del frame
    if self._requested:  # asked twice: do not wait for the step
      with contextlib.suppress(OSError):
        os.write(2, f"{signal.Signals(signum).name} again: exiting at once, without a final "
                    "checkpoint (the checkpoints already written are intact).\n".encode())
      os._exit(128 + signum)
    self._requested, self.signum = True, int(signum)
    if signum == signal.SIGHUP:  # the terminal is gone: writes to it would fail (EIO)
      _detach_terminal()
    if self._shared:  # JAX's preemption notifier sees SIGTERM only
      os.kill(os.getpid(), signal.SIGTERM)

  def requested(self, step: int) -> bool:
    """Whether to stop after ``step`` (every process must call it every step)."""
    if self._shared:
      from jax.experimental import multihost_utils  # noqa: PLC0415

      return bool(multihost_utils.reached_preemption_sync_point(int(step)))
    return self._requested

  def arrived(self) -> bool:
    """Whether a signal has arrived in this one-process run (between steps, e.g. during an
    evaluation, which can then be cut short). Always False with several processes: there
    they stop at a step they agree on (:meth:`requested`), never inside an evaluation, whose
    batches are collectives every process must run."""
    return self._requested and not self._shared

  def stopped(self, step: int, saved: bool) -> StopRequested:
    """The :class:`StopRequested` to raise after ``step``, naming the signal."""
    return StopRequested(step, saved=saved, signum=self.signum)

  def close(self) -> None:
    """Puts the previous SIGTERM / SIGINT / SIGHUP / SIGUSR1 handlers back."""
    for signum, previous in self._previous.items():
      signal.signal(signum, signal.SIG_DFL if previous is None else previous)
    self._previous = {}


def _handled_elsewhere(signum: int) -> bool:
  """Whether something in this process handles ``signum``: a handler of Python's
  (``signal.signal``), or one installed below Python (``faulthandler.register``, a C
  library), which ``signal.getsignal`` does not see (it says SIG_DFL): that one is asked of
  the OS (sigaction(2), where libc is at hand; else only Python's is known)."""
  if signal.getsignal(signum) != signal.SIG_DFL:
    return True
  try:
    import ctypes  # noqa: PLC0415  (only here)

    old = ctypes.create_string_buffer(256)  # a struct sigaction, its handler first
    if ctypes.CDLL(None).sigaction(int(signum), None, old) != 0:
      return False
    return ctypes.c_void_p.from_buffer(old).value not in (None, 0)  # 0: SIG_DFL
  except (OSError, AttributeError, TypeError):
    return False


def _detach_terminal() -> None:
  """Points stdout / stderr at /dev/null where they are a terminal."""
  for fd in (1, 2):
    try:
      if os.isatty(fd):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except OSError:
      pass


class StepWatchdog:
  """Exits the process when no step finished for ``timeout_s`` seconds.

  Example:
    >>> dog = StepWatchdog(600.0)
    >>> for step in range(3):
    ...   dog.beat(step)
    >>> dog.stop()

  Args:
    timeout_s: the longest a step may take.
    save_timeout_s: the longest a checkpoint save (or an evaluation) may
      take (default ``4 * timeout_s``): see :meth:`saving`.
    on_fire: called with the line the watchdog prints, before it exits; given
      ``liveness.ON_END_LIMIT_S`` at most (a hung disk may be why no step finished), as
      every ``jaxcoll.runtime.liveness.on_end`` callback, which hear ``(86, line)`` too
      (the training loop records its attempt's end there).

  The watchdog ends the process through :func:`jaxcoll.runtime.liveness.end_now`: in a
  multi-process job the others hear that it failed and end too (exit 76, naming it).
  """

  def __init__(self, timeout_s: float, *, save_timeout_s: float | None = None,
               poll_s: float | None = None, stream=None,
               on_fire: Callable[[str], object] | None = None):
    if not timeout_s > 0:
      raise ValueError(f"`timeout_s` must be > 0 seconds; got {timeout_s!r}. Use 0 to disable.")
    self.timeout_s = float(timeout_s)
    self.save_timeout_s = float(save_timeout_s or SAVE_LIMIT_FACTOR * self.timeout_s)
    self._limit_s = self.timeout_s
    self._waiting_for: str | None = None  # None: a training step
    self._poll_s = poll_s or min(1.0, self.timeout_s / 4)
    self._stream = stream or sys.stderr
    self._on_fire = on_fire
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
        line = (f"watchdog: {what} (last finished step: {last}); exiting with status "
                f"{EXIT_WATCHDOG} instead of waiting forever. A peer process may have died or "
                "hung.")
        if self._on_fire is not None:  # with the on_end callbacks, under their limit
          on_fire = self._on_fire
          liveness.on_end(lambda status, said: on_fire(said))
        liveness.end_now(EXIT_WATCHDOG, line, stream=self._stream)
