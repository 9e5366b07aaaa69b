"""Profiler traces of chosen training steps, and the run's communication share.

``--config.profile_steps=A:B`` traces steps A..B (1-based, inclusive) with
``jax.profiler``: the trace starts just before step A and stops once step B's
result is ready, and each traced step runs inside
``jax.profiler.StepTraceAnnotation("train", step_num=N)``, so xprof /
TensorBoard's profile plugin show one row per step and Perfetto shows the
steps by name. Python function calls are not traced (the Python tracer is
off); XLA's ops, the runtime's events and the annotations are.

A single-process run writes ``DIR/profile/``; in a multi-process job every
process traces its own devices into ``DIR/profile/pN`` (N = process index:
one process's trace cannot see the others', and a slow process is what one
looks for; one directory each, as processes on one host would write files of
the same host name). Each attempt adds a
``plugins/profile/<time>/`` directory holding ``*.xplane.pb`` (xprof,
TensorBoard) and ``perfetto_trace.json.gz`` (ui.perfetto.dev). A run resumed
past B traces nothing; one resumed inside A..B traces the steps it still runs.
A rollback (``jaxcoll.run.incidents``) ends a trace still running (it holds the
abandoned stretch's steps, kept where it is), and the steps of A..B the run trains
again are traced anew into ``DIR/profile/rollback_N`` (N: the rollback's number): one
trace per stretch, never written into another's directory.

The loop uses :class:`StepProfiler` in three lines around the step call, and
:func:`share_figures` once at the end of an attempt.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import statistics
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from absl import logging

from jaxcoll.observe import comm_share
from jaxcoll.run.config_error import fail

STEP_NAME = "train"  # the StepTraceAnnotation name of a training step
_FIX = ('use "A:B", the first and last step to trace (1-based, inclusive), e.g. '
        '--config.profile_steps=2:4; "" turns profiling off.')


def parse_profile_steps(value: Any, steps: int) -> tuple[int, int] | None:
  """``"A:B"`` -> ``(A, B)``; ``""`` -> None (no trace).

  Args:
    value: ``config.profile_steps``.
    steps: ``config.steps``, the run's last step.

  Raises:
    ConfigError: not ``"A:B"`` with ``1 <= A <= B <= steps``; the message
      names ``--config.profile_steps``, the value and the fix.
  """
  if value is None or value == "":
    return None
  match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", value) if isinstance(value, str) else None
  if match is None:
    raise fail("profile_steps", value, _FIX)
  first, last = int(match.group(1)), int(match.group(2))
  if first < 1:
    raise fail("profile_steps", value,
               f"steps count from 1; use --config.profile_steps=1:{max(last, 1)}.")
  if last < first:
    raise fail("profile_steps", value,
               f"the last step comes first; use --config.profile_steps={last}:{first}.")
  if last > steps:
    raise fail("profile_steps", value,
               f"step {last} is past the run's last step ({steps}); use "
               f"--config.profile_steps={min(first, steps)}:{steps} or raise --config.steps.")
  return first, last


def profile_dir(workdir: str) -> str:
  """``DIR/profile``, or ``DIR/profile/pN`` for process N of a multi-process job."""
  base = os.path.join(workdir, "profile")
  return base if jax.process_count() == 1 else os.path.join(base, f"p{jax.process_index()}")


class StepProfiler(contextlib.AbstractContextManager):
  """Traces steps ``first..last`` of a run (a context manager: leaving it
  stops a trace still running, e.g. when a traced step raised).

  Example:
    >>> with StepProfiler((2, 3), "/tmp/run") as profiler:  # doctest: +SKIP
    ...   for n in range(1, 5):
    ...     with profiler.step(n):
    ...       state, metrics = jax.block_until_ready(trainer.step(state, batch))
  """

  def __init__(self, steps: tuple[int, int] | None, workdir: str, *, start_step: int = 0):
    """``steps``: from :func:`parse_profile_steps`; ``start_step``: the step a
    resumed run starts from (steps up to it are not run, so not traced)."""
    self.directory = profile_dir(workdir)
    self._logdir = self.directory  # this stretch's: DIR/profile/rollback_N after rollback N
    self._steps = steps
    self.first = self.last = None
    if steps is not None and steps[1] > start_step:
      self.first, self.last = max(steps[0], start_step + 1), steps[1]
    self.trace_path: str | None = None  # this attempt's perfetto_trace.json.gz, once stopped
    self.traced: tuple[int, int] | None = None  # the steps of trace_path (first, last)
    self._active = False
    self._before: set[str] = set()
    self._started_at = self._reached = 0  # the running trace's first and latest step

  def restart(self, step: int, *, rollback: int) -> None:
    """After rollback number ``rollback`` to checkpoint ``step``: a trace still running
    stops (it holds the abandoned steps); the steps of the range after ``step``, trained
    again, are traced into ``DIR/profile/rollback_<rollback>`` (a rollback to a step past
    the range traces nothing more, and the trace of the kept steps stays the one to read)."""
    if self._active:
      self._stop(abandoned=rollback)
    if self._steps is None or self._steps[1] <= step:
      self.first = self.last = None
      return
    self.first, self.last = max(self._steps[0], int(step) + 1), self._steps[1]
    self._logdir = os.path.join(self.directory, f"rollback_{int(rollback)}")

  @contextlib.contextmanager
  def step(self, step: int) -> Iterator[None]:
    """Runs the body as step ``step``: traced and annotated when in range."""
    if self.first is None or not self.first <= step <= self.last:
      yield
      return
    if step == self.first:
      self._start()
    with jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=step):
      yield
    self._reached = step
    if step == self.last:
      self._stop()

  def __exit__(self, *exc: Any) -> None:
    if self._active:
      try:
        self._stop()
      except Exception as e:  # noqa: BLE001 - never hide the error that ended the run
        logging.warning("Stopping the profiler trace failed: %s", e)

  def _start(self) -> None:
    os.makedirs(self._logdir, exist_ok=True)
    self._before = set(self._runs())
    options = jax.profiler.ProfileOptions()
    # No Python tracer: on a 4-step CPU run it made the trace 20x larger
    # (3.9 MB vs 0.18 MB) and the run 60% slower; XLA's and the runtime's
    # events and the step annotations stay.
    options.python_tracer_level = 0
    jax.profiler.start_trace(self._logdir, create_perfetto_trace=True, profiler_options=options)
    self._active = True
    self._started_at = self._reached = self.first

  def _stop(self, abandoned: int | None = None) -> None:
    self._active = False
    jax.profiler.stop_trace()
    runs = sorted(set(self._runs()) - self._before) or sorted(self._runs())
    if runs:
      path = os.path.join(runs[-1], "perfetto_trace.json.gz")
      self.trace_path = path if os.path.exists(path) else None
      self.traced = (self._started_at, self._reached) if self.trace_path else None
    if abandoned is None:
      logging.info("Profiler trace of steps %d-%d in %s", self._started_at, self._reached,
                   self._logdir)
    else:
      logging.warning("rollback %d: the profiler trace of steps %d-%d (the stretch it "
                      "abandons) ends here, kept in %s; the steps trained again are traced "
                      "anew", abandoned, self._started_at, self._reached, self._logdir)

  def _runs(self) -> list[str]:
    return glob.glob(os.path.join(self._logdir, "plugins", "profile", "*"))


def share_figures(comm_time_s: float, step_times: Sequence[float], compiled: Any,
                  profiler: StepProfiler | None = None) -> dict[str, float]:
  """The one-off communication-share figures of an attempt.

  ``comm_share_estimate`` = ``comm_time_s`` over the median ``step_time_s`` of
  the attempt's logged rows, the first row left out (warm-up) when there are
  more; ``comm_share_measured`` from the profiler's trace when one was
  captured (:func:`jaxcoll.comm_share.measured_comm_share` of ``compiled``,
  the step program).

  Returns:
    ``{"comm_share_estimate", "comm_share_measured"}``, each key only when it
    can be computed (no rows: no estimate; no trace: no measurement).
  """
  figures: dict[str, float] = {}
  times = [t for t in step_times if t is not None]
  times = times[1:] if len(times) > 1 else times
  share = comm_share.comm_share(comm_time_s, statistics.median(times) if times else None)
  if share is not None:
    figures["comm_share_estimate"] = share
  if profiler is not None and profiler.trace_path is not None:
    measured = comm_share.measured_comm_share(profiler.trace_path, compiled, step_name=STEP_NAME)
    if measured is not None:
      figures["comm_share_measured"] = measured["comm_share_measured"]
  return figures
