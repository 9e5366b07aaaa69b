"""Step time that means something, per process, and the straggler report.

The training loop feeds a :class:`StepTimer` four instants of every step::

  timer.start_data()            # before train_input.batch(step)
  ...batch, hooks' before_step...
  timer.start_step()            # the batch is ready: dispatch begins
  state, m = trainer.step(state, batch)
  timer.dispatched()            # the host has handed the step to the devices
  jax.block_until_ready((state, m))
  timer.end_step()              # the step's outputs are ready

and, at each logged step, :meth:`StepTimer.row` returns the row's timing
fields (means over the steps since the last row):

- ``step_time_s``: dispatch to ready (``start_step`` to ``end_step``), this
  process's. Never data loading, eval, checkpoint or profiler time: those
  happen outside the four instants.
- ``data_time_s``: getting the batch (``train_input.batch`` and the hooks'
  ``before_step``).
- ``examples_per_s``: global batch / ``step_time_s``.
- ``process_time_s``: every process's *own time* per step (a list indexed by
  process id), gathered with one small
  ``jax.experimental.multihost_utils.process_allgather`` on every process,
  only at logged steps; ``slowest_process`` / ``fastest_process`` and their
  times.
- ``process_step_time_s``: every process's ``step_time_s`` (dispatch to
  ready), gathered the same way: what the report plots as step time per
  process.

What *own time* measures: the host time a process spends on a step before
its devices can run it, ``data_time_s`` + the dispatch call (input, hooks
and host work). In a synchronous step every process waits inside the
step's collectives for the last one to arrive, so dispatch-to-ready is about
the same everywhere (the fast processes' includes the wait); the time before
dispatch is what differs, and the process with the most of it is the one
the others wait for. What it cannot see: a slow *device* (or a slow link)
inside a collective makes every process wait equally, so it shows as a
larger ``step_time_s`` on all of them and names no one; find it in a
profiler trace (``profile_steps``).

:class:`StragglerDetector` names a process whose own time exceeds
``factor`` x the median of the other processes for ``steps`` logged rows in a
row, in one warning per straggling episode.

Example:
  >>> clock = iter([0.0, 0.1, 0.1, 0.5]).__next__
  >>> timer = StepTimer(clock=clock, gather=lambda own: [own])
  >>> timer.start_data(); timer.start_step(); timer.dispatched(); timer.end_step()
  >>> r = timer.row(global_batch=8)
  >>> round(r["data_time_s"], 3), round(r["step_time_s"], 3), round(r["examples_per_s"], 1)
  (0.1, 0.4, 20.0)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging

from jaxcoll.run import config as run_config

# Own time less than this over the median is host scheduling noise (a
# loaded machine's jitter), never reported as a straggler.
MIN_EXCESS_S = 0.02


def gather_process_times(own_time_s: float) -> list[float]:
  """Every process's ``own_time_s``, indexed by process id.

  Every process must call it at the same steps (one ``process_allgather`` of
  a float vector); a one-process run returns ``[own_time_s]`` without a
  collective.
  """
  import jax  # noqa: PLC0415 - the unit tests of this module run without JAX
  from jax.experimental import multihost_utils  # noqa: PLC0415

  if jax.process_count() == 1:
    return [float(own_time_s)]
  gathered = multihost_utils.process_allgather(np.asarray([own_time_s], np.float64))
  return [float(t) for t in np.asarray(gathered).reshape(-1)]


class StragglerReport(str):
  """A straggler warning (the text) with what it found, for the ``straggler`` incident
  (:meth:`jaxcoll.run.incidents.Watch.straggler_warning`): ``process``, ``ratio`` (its own
  time over the median), ``factor`` and ``rows`` (the rule's ``straggler_factor`` and
  ``straggler_steps``) and ``step`` (the row that completed the episode)."""

  process: int
  ratio: float
  factor: float
  rows: int
  step: int


class StragglerDetector:
  """Names a process that is slower than the others for several logged rows.

  A process is *straggling* on a row when its own time exceeds
  ``factor`` x the median of the other processes' (and that median by more than
  ``min_excess_s``). After ``steps`` straggling rows in a row it is named in
  one warning; it is named again only after a row where it was not
  straggling (a new episode).

  Args:
    factor: how many times the median counts as slow (> 1).
    steps: straggling logged rows in a row before the warning (>= 1).
    min_excess_s: own time this close to the median is noise.

  Raises:
    ConfigError: (a ``ValueError``) a bad ``factor`` or ``steps``.

  Example:
    >>> d = StragglerDetector(factor=1.5, steps=2)
    >>> d.update(10, [0.01, 0.3])
    []
    >>> print(d.update(20, [0.01, 0.3])[0].split(",")[0])
    straggler: process 1 spent 0.300 s per step before dispatch
  """

  def __init__(self, factor: float = 1.5, steps: int = 3, *,
               min_excess_s: float = MIN_EXCESS_S):
    number, steps = run_config.check_straggler(factor, steps)  # the config's own check
    self.factor, self.steps, self.min_excess_s = number, steps, float(min_excess_s)
    self._run: dict[int, int] = {}  # process -> straggling rows in a row

  @classmethod
  def from_config(cls, config: run_config.RunConfig | Mapping[str, Any]) -> StragglerDetector:
    """From ``config.straggler_factor`` / ``config.straggler_steps``."""
    config = run_config.parse(config)
    return cls(config.straggler_factor, config.straggler_steps)

  def update(self, step: int, times: Sequence[float]) -> list[str]:
    """Feeds one logged row's own times (indexed by process id).

    Returns:
      The warnings of the episodes that start being reported at this row
      (usually none).
    """
    if len(times) < 2:
      return []
    messages = []
    for process, median in enumerate(_medians_of_the_others(times)):
      own = float(times[process])
      slow = own > self.factor * median and own - median > self.min_excess_s
      run = self._run.get(process, 0) + 1 if slow else 0
      self._run[process] = run
      if run == self.steps:
        ratio = own / median if median > 0 else math.inf
        report = StragglerReport(
            f"straggler: process {process} spent {own:.3f} s per step before dispatch, "
            f"{ratio:.1f}x the median {median:.3f} s of the other {len(times) - 1} "
            f"process{'es' if len(times) > 2 else ''}; for "
            f"{run} logged rows in a row (up to step {step}) the others waited for it. "
            "Look at that host's input pipeline, hooks and load."
        )
        report.process, report.ratio, report.factor = process, ratio, self.factor
        report.rows, report.step = run, int(step)
        messages.append(report)
    return messages


def _medians_of_the_others(times: Sequence[float]) -> list[float]:
  """For each process, the median of the other processes' times (O(N log N)): against a
  median that counts its own time, a straggler of 2 processes had to be 3x the other's at
  straggler_factor=1.5 and was never named at 2 or more.

  >>> _medians_of_the_others([0.1, 0.3, 0.2])
  [0.25, 0.15000000000000002, 0.2]
  """
  order = np.argsort(times, kind="stable")
  ordered = np.asarray(times, np.float64)[order]
  rank = np.empty(len(order), int)
  rank[order] = np.arange(len(order))
  m = len(ordered) - 1  # the others
  out = []
  for r in rank:
    kth = lambda k, r=r: float(ordered[k if k < r else k + 1])  # noqa: E731
    out.append(kth(m // 2) if m % 2 else 0.5 * (kth(m // 2 - 1) + kth(m // 2)))
  return out


class StepTimer:
  """Times each step, apart from its batch; returns the row's timing fields.

  Args:
    clock: seconds (``time.perf_counter``).
    gather: own time -> every process's, indexed by process id
      (:func:`gather_process_times`); called on every process at each row.
    straggler: the straggler rule, fed at each row (``None``: no report).
    warn: where the straggler warnings go (``absl.logging.warning``; pass
      ``None`` on processes other than 0).
  """

  def __init__(self, *, clock: Callable[[], float] = time.perf_counter,
               gather: Callable[[float], Sequence[float]] = gather_process_times,
               straggler: StragglerDetector | None = None,
               warn: Callable[[str], None] | None = logging.warning):
    self._clock, self._gather, self._straggler, self._warn = clock, gather, straggler, warn
    self._t_data = self._t_step = self._t_dispatched = math.nan
    self._reset()

  def _reset(self) -> None:
    self._steps, self._data, self._dispatch, self._step = 0, 0.0, 0.0, 0.0

  def start_data(self) -> None:
    """Before the step's batch is fetched."""
    self._t_data = self._clock()

  def start_step(self) -> None:
    """The batch is ready (hooks included); the step is dispatched now."""
    self._t_step = self._clock()

  def dispatched(self) -> None:
    """The step call returned (the devices have it)."""
    self._t_dispatched = self._clock()

  def end_step(self) -> None:
    """The step's outputs are ready (after ``block_until_ready``)."""
    end = self._clock()
    self._steps += 1
    self._data += self._t_step - self._t_data
    self._dispatch += self._t_dispatched - self._t_step
    self._step += end - self._t_step

  def row(self, global_batch: int, step: int = 0) -> dict[str, Any]:
    """The timing fields of a logged row; starts the next row's window.

    Call it on every process at the same steps (it gathers every process's
    own time). ``step`` only names the row in a straggler warning.
    """
    n = max(self._steps, 1)
    step_time, data_time = self._step / n, self._data / n
    own = (self._data + self._dispatch) / n
    self._reset()
    self.step_time_s = step_time  # for a gather that shares it too (jaxcoll.run.incidents)
    times = [float(t) for t in self._gather(own)]
    step_times = [float(t) for t in self._gather(step_time)]  # dispatch to ready, everyone's
    slowest, fastest = int(np.argmax(times)), int(np.argmin(times))
    if self._straggler is not None:
      for message in self._straggler.update(step, times):
        if self._warn is not None:
          self._warn(message)
    return {
        "step_time_s": step_time,
        "data_time_s": data_time,
        "examples_per_s": global_batch / step_time if step_time > 0 else None,
        "process_time_s": times,
        "process_step_time_s": step_times,
        "slowest_process": slowest,
        "slowest_process_time_s": times[slowest],
        "fastest_process": fastest,
        "fastest_process_time_s": times[fastest],
    }
