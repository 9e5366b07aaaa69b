"""Drift detection and the responses to it: the run watches itself.

Signals, from what the step already returns (README "Incidents and rollback"):

- ``loss_spike`` / ``grad_norm_spike``: the step's loss (or gradient norm)
  has a robust z-score ``(x - median) / scale`` above ``spike_z`` against
  the last ``spike_window`` steps, where ``scale`` is ``1.4826 * MAD``
  (the standard deviation for normal data) but at least ``spike_floor`` x
  ``|median|`` (so that a plateau's tiny noise does not make every wiggle a
  spike). Checked from step ``spike_min_steps + 1``; a flagged value does
  not enter the window (a bad stretch never becomes the norm).
- ``non_finite``: the loss or the gradient norm is NaN / infinite (or
  ``nan_policy="skip"`` dropped the step).
- ``eval_regression``: the eval metric (``eval_metric``; ``eval_mode``: ``min``,
  ``max`` or ``auto``, from its name: :func:`jaxcoll.run.config.eval_direction`) is
  worse than the best so far by more than ``eval_margin`` x ``|best|``.
- ``throughput_regression``: the median step time of the last
  ``throughput_rows`` logged rows exceeds ``throughput_factor`` x the
  run's own baseline (the median of its first ``throughput_rows`` rows
  after the first) and the baseline by more than ``throughput_min_excess_s``
  (default 50 ms: less can be a loaded host's noise, as for the straggler
  report).
- ``straggler``: the straggler report of :mod:`jaxcoll.run.timing`.

Each signal's response (``incidents.<signal>``): ``off``, ``warn`` (log
it), ``skip`` (drop the batch: the state before the step is kept; the
batch-level signals only), ``rollback`` (restore the newest verified
checkpoint at least ``rollback_steps`` before the anomaly, or the initial
state, and skip the batches from that checkpoint's through the anomalous
one, at least ``skip_batches`` of them; at most ``max_rollbacks`` times,
then ``stop``), ``stop`` (a final checkpoint, marked as taken in an anomaly
window, and exit status 5).

Every process takes the same decision at the same step with no collective
of its own: the loss, gradient norm and eval metrics are outputs of the
step's all-reduce (the same bits everywhere), the straggler report works on
the logged rows' gathered times, and the throughput signal's step times
travel in that same allgather of each logged row (:meth:`Watch.row_gather`).

When a step is judged (``defer_reads``; ``auto`` is ``on``): its loss and
gradient norm wait on the devices, unread, and are read and judged with the
others, in step order, at the next step :func:`judged_at_once` names (logged,
saved, evaluated or the last) or at the :data:`WAIT_MAX`-th waiting step, so
an incident is answered at most ``min(log_every, WAIT_MAX) - 1`` steps late.
The first read after a step costs ~140 us on CPU devices, every further one
~8 us, and the logged step's row pays the first one anyway. The decisions
are those of judging at once: a save step is judged first; a rollback starts
from the incident's own step and the waiting steps after it are never judged
(it abandons them); ``skip`` responses judge every step at once; only a late
``stop`` keeps the steps up to the judging one in its final checkpoint (its
message says so). ``off``: every step right after it.

Incidents go to ``WORKDIR/incidents.jsonl`` (process 0; appended, so a
resumed run keeps the log), one warning line each, a TensorBoard scalar
``incident/<signal>`` at the step, and counts in summary.json (a stop's too,
through :attr:`IncidentStop.summary_update`). After a rollback the loop marks
the rows of the abandoned steps (:meth:`jaxcoll.observe.metrics.MetricsWriter.rewind`).

Decisions a hard kill must not lose go to ``WORKDIR/incident_state.json``
(:data:`STATE_NAME`; process 0, atomically, before they act): a rollback's
(number, target, skipped batches, the checkpoints it sets aside), a skip's
(step, batch and the values it was judged on: a resume before the next
checkpoint judges that step on them again), a step ``nan_policy="skip"`` skipped inside the
trainer (:meth:`Watch.trainer_skip`, whatever ``non_finite`` says: a resume skips it again)
and an eval flag (raised after its step's save) with its answer. The skips at or before the
oldest retained checkpoint are pruned (:meth:`Watch.prune_skips`). At a resume the loop calls
:meth:`Watch.load_state`, :meth:`Watch.settle` (the checkpoints a recorded
rollback abandoned go aside) and, after the restore, :meth:`Watch.resume` (the
rollbacks the restored checkpoint does not carry are taken again; the rows the attempts before
logged for the steps trained again are not logged twice).

Example:
  >>> spike = RobustSpike(z=6.0, window=20, min_steps=5, floor=0.05)
  >>> [spike.update(v)[0] for v in [1.0, 1.01, 0.99, 1.0, 1.02, 0.98]]
  [False, False, False, False, False, False]
  >>> flagged, z, threshold = spike.update(5.0)
  >>> flagged, round(threshold, 2)
  (True, 1.3)
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import difflib
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging

from jaxcoll import errors
from jaxcoll.atomic_write import write_atomic
from jaxcoll.observe import metrics as metrics_lib
from jaxcoll.run import config as run_config

LOG_NAME = "incidents.jsonl"
SIGNALS = run_config.SIGNALS
BATCH_SIGNALS = run_config.BATCH_SIGNALS  # those `skip` can answer
ACTIONS = run_config.ACTIONS
_RANK = {a: i for i, a in enumerate(ACTIONS)}  # the strongest response of a step wins
EXIT_INCIDENT_STOP = errors.EXIT_INCIDENT_STOP  # 5
IncidentStop = errors.IncidentStop
ROLLED_BACK_DIR = "checkpoints_rolled_back"
# The decisions a hard kill must not lose (a rollback's, an eval flag raised after its step's
# save): written atomically by process 0 the moment they are taken, read back at a resume.
STATE_NAME = "incident_state.json"
STATE_FORMAT = 1

DEFAULTS: dict[str, Any] = dataclasses.asdict(run_config.IncidentsConfig())
DEFER_READS = run_config.DEFER_READS  # incidents.defer_reads: auto | on | off
WAIT_MAX = 50  # defer_reads: a step is judged at most WAIT_MAX - 1 steps late


class RobustSpike:
  """Upward spikes of a series against its running median / MAD.

  The window is kept sorted (``bisect``), so the median is a lookup; the
  MAD is computed only for a value above ``median + z * floor * |median|``
  (below it no value can be a spike): a few microseconds a step.

  Args:
    z: robust z-score above which a value is a spike (> 0).
    window: values the median and MAD are taken over.
    min_steps: values seen before any is judged.
    floor: the scale is at least ``floor * |median|``.
  """

  def __init__(self, z: float, window: int, min_steps: int, floor: float):
    self.z, self.min_steps, self.floor = float(z), int(min_steps), float(floor)
    self.window = int(window)
    self.values: collections.deque[float] = collections.deque()
    self._sorted: list[float] = []

  def extend(self, values) -> None:
    """Appends ``values`` to the window (oldest first)."""
    for x in values:
      x = float(x)
      self.values.append(x)
      bisect.insort(self._sorted, x)
      if len(self.values) > self.window:
        old = self.values.popleft()
        del self._sorted[bisect.bisect_left(self._sorted, old)]

  def _median(self) -> float:
    s, n = self._sorted, len(self._sorted)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])

  def update(self, x: float) -> tuple[bool, float, float]:
    """``(flagged, z-score, threshold value)`` for ``x`` (NaN z unless judged
    above the floor's bound)."""
    x = float(x)
    if not math.isfinite(x):
      return False, math.nan, math.nan
    values, ordered = self.values, self._sorted
    z = threshold = math.nan
    if len(values) >= self.min_steps:
      median = self._median()
      floor = max(self.floor * abs(median), 1e-12)
      if x > median + self.z * floor:  # else not a spike whatever the MAD
        mad = float(np.median(np.abs(np.asarray(ordered) - median)))
        scale = max(1.4826 * mad, floor)
        z, threshold = (x - median) / scale, median + self.z * scale
        if z > self.z:  # flagged: kept out of the window
          return True, z, threshold
    values.append(x)  # extend((x,)), inline: this runs every step
    bisect.insort(ordered, x)
    if len(values) > self.window:
      del ordered[bisect.bisect_left(ordered, values.popleft())]
    return False, z, threshold


def settings_from_config(config) -> dict[str, Any]:
  """``config.incidents`` as a dict (:class:`jaxcoll.run.config.IncidentsConfig`:
  its defaults are :data:`DEFAULTS`), checked there.

  Raises:
    ConfigError: (a ``ValueError``) an unknown signal or setting, an unknown
      action (or ``skip`` for a signal that is not about one batch), a
      threshold <= 0, or ``rollback`` with checkpoints off.
  """
  return dataclasses.asdict(run_config.parse(config).incidents)


def judged_at_once(done: int, *, steps: int, log_every: int, checkpoint_every: int = 0,
                   eval_every: int = 0) -> bool:
  """Whether the loop judges step ``done`` at once rather than during the
  next step (:meth:`Watch.after_step`): its loss is logged (read anyway),
  or it is a checkpoint, an eval or the last step (those must see its
  incidents first).

  >>> [d for d in range(1, 13) if judged_at_once(d, steps=12, log_every=5, checkpoint_every=4)]
  [4, 5, 8, 10, 12]
  """
  return (done % log_every == 0 or done == steps
          or bool(checkpoint_every) and done % checkpoint_every == 0
          or bool(eval_every) and done % eval_every == 0)


class StepRange:
  """The loop's steps ``start..stop-1`` (0-based), restartable by a rollback."""

  def __init__(self, start: int, stop: int):
    self.next, self.stop, self.restarted = int(start), int(stop), False

  def __iter__(self):
    return self

  def __next__(self) -> int:
    if self.next >= self.stop:
      raise StopIteration
    self.next += 1
    return self.next - 1

  def restart(self, step: int) -> None:
    """The next step is ``step`` (0-based: the state is after ``step`` steps)."""
    self.next, self.restarted = int(step), True


class Watch:
  """The run's detectors, its incident log and its responses.

  Args:
    settings: :func:`settings_from_config`.
    workdir: where ``incidents.jsonl`` and set-aside checkpoints go.
    is_chief: process 0 (writes the log and prints).
    process_count: processes of the job.
    gather: step time -> every process's (one allgather; ``None`` with one
      process).
  """

  def __init__(self, settings: Mapping[str, Any], workdir: str, *, is_chief: bool,
               process_count: int = 1,
               gather: Callable[[float], list[float]] | None = None):
    self.s = dict(settings)
    self.workdir, self.is_chief, self.process_count = workdir, is_chief, int(process_count)
    self._gather = gather
    spike = dict(z=self.s["spike_z"], window=self.s["spike_window"],
                 min_steps=self.s["spike_min_steps"], floor=self.s["spike_floor"])
    self._loss, self._grad = RobustSpike(**spike), RobustSpike(**spike)
    self._best_eval: float | None = None  # of eval_metric, in eval_mode's direction
    self._eval_mode = (run_config.eval_direction(self.s["eval_metric"], self.s["eval_mode"])
                       if self.s["eval_regression"] != "off" else None)
    self._said_new_best = False  # _saved_best_eval's line, once
    self._rows: list[float] = []  # agreed step time of each logged row
    self._slow = False  # in a throughput-regression episode
    self._row_times: list[float] | None = None  # every process's step time of this row
    self.pending: list[dict[str, Any]] = []  # this step's flagged signals
    self.flagged_steps: set[int] = set()
    self._last_flag: dict[str, int] = {}  # signal -> its last flagged step
    self.rollbacks = 0
    self.stopping: dict[str, Any] | None = None
    self.keeps = any(self.s[x] == "skip" for x in BATCH_SIGNALS)
    self.defers = _defers(self.s["defer_reads"]) and not self.keeps
    self._per_step = any(self.s[x] != "off" for x in BATCH_SIGNALS)
    self.path = os.path.join(workdir, LOG_NAME)
    self.written: list[dict[str, Any]] = []  # this attempt's incidents
    self.last: list[dict[str, Any]] = []  # the last step's
    self._attempt_start = 0
    self._spike_signals = tuple(s for s in ("loss_spike", "grad_norm_spike") if self.s[s] != "off")
    self._waiting: list[tuple] = []  # (step, loss, grad_norm, skipped, batch): not judged yet
    self.state_path = os.path.join(workdir, STATE_NAME)
    self._state: dict[str, Any] = {"format": STATE_FORMAT, "rollbacks": [], "flags": [],
                                   "skips": []}
    self._judged: tuple | None = None  # (step, loss, grad_norm, skipped) last judged
    self._replays: dict[int, dict[str, Any]] = {}  # step -> a recorded skip to judge again
    self._recovered_rows: list[dict[str, Any]] = []  # rows of the last record (load_state)
    # (step, signal, action) -> count: rows the attempts before a resume logged for the steps
    # this attempt trains again (checkpoint..kill): not logged twice (resume)
    self._logged_before: collections.Counter = collections.Counter()
    self.restored_extra: Mapping[str, Any] | None = None  # the last rollback's target's extra
    # The oldest retained checkpoint (None: none), for pruning the recorded skips (the loop
    # sets it; process 0 calls it when writing the state file).
    self.oldest_checkpoint: Callable[[], int | None] | None = None

  @classmethod
  def from_config(cls, config, workdir: str, *, eval_metrics: Sequence[str] | None = None,
                  **kwargs) -> Watch:
    """The watch ``config.incidents`` describes (``kwargs``: :class:`Watch`'s).

    Args:
      eval_metrics: the metrics the run's evaluation reports
        (:meth:`jaxcoll.run.evaluate.Evaluator.metric_names`; None: no evaluation).

    Raises:
      ConfigError: a bad setting (:func:`settings_from_config`), or an ``eval_metric`` the
        evaluation does not report while ``eval_regression`` is on (it never fired).
    """
    settings = settings_from_config(config)
    metric = settings["eval_metric"]
    if eval_metrics is not None and settings["eval_regression"] != "off" and (
        metric not in eval_metrics):
      close = difflib.get_close_matches(metric, eval_metrics, n=1)
      fix = (f"the evaluation reports {', '.join(eval_metrics) or 'no metric'}; name one of "
             f"them, e.g. --config.incidents.eval_metric={(close or [*eval_metrics, '?'])[0]} "
             "(or turn the signal off: --config.incidents.eval_regression=off)")
      if metric != DEFAULTS["eval_metric"]:
        raise errors.ConfigError(f"`config.incidents.eval_metric`={metric!r}: {fix}.")
      if kwargs.get("is_chief"):  # the default, with an eval_fn that reports no loss: said
        logging.warning("incidents: eval_regression watches nothing: `config.incidents."
                        "eval_metric`=%r (the default); %s", metric, fix)
    return cls(settings, workdir, **kwargs)

  # -- signals ------------------------------------------------------------------

  def _flag(self, step: int, signal: str, value, threshold, **more) -> dict[str, Any] | None:
    if self.s[signal] == "off":
      return None
    self.flagged_steps.add(int(step))
    previous, self._last_flag[signal] = self._last_flag.get(signal), int(step)
    if self.s[signal] == "warn" and previous == step - 1:  # the same episode: logged once
      return None
    incident = {"step": int(step), "signal": signal, "value": _plain(value),
                "threshold": _plain(threshold), "action": self.s[signal], **more}
    self.pending.append(incident)
    return incident

  def flush(self) -> None:
    """Judges the waiting steps now (before a stop on a signal)."""
    waiting, self._waiting = self._waiting, []
    self._judge_all(waiting)

  def after_step(self, step: int, metrics: Mapping[str, Any], batch: int | None = None, *,
                 defer: bool = False) -> None:
    """Feeds step ``step``'s loss and gradient norm (every process, every step).

    ``defer=True`` (``defer_reads`` on; the loop passes ``not judged_at_once(...)``):
    the step waits, its metrics on the devices, and is judged at the next step
    fed with ``defer=False`` (logged, saved, evaluated or the last) or at the
    :data:`WAIT_MAX`-th waiting step, in step order before it. The first read
    of a step's output costs ~150 us on CPU devices, every further one ~10 us
    (README "Incidents and rollback"); the logged step's row pays that first
    read anyway. The incidents are answered at that step, before it is
    logged, saved or evaluated: every process takes the same decision at the
    same step. A step after an incident answered by anything but ``warn`` is
    never judged (the response abandons it, as an answer at once would never
    have run it). Always judged at once while a response is ``skip`` (it
    keeps only the state before this step).
    """
    if not self._per_step:
      return
    entry = (step, metrics["loss"], metrics["grad_norm"], metrics.get("skipped"), batch)
    replay = self._replays.pop(int(step), None)
    if replay is not None and (batch is None or int(replay["batch"]) == int(batch)):
      # A skip recorded before a resume: judged on the values the attempt before judged (a
      # transient fault need not come back), at once, so that it is answered as it was.
      loss, grad, skipped = replay["judged"]
      entry = (step, float(loss), float(grad), skipped, batch)
      defer = False
    waiting = self._waiting
    if defer and self.defers and len(waiting) < WAIT_MAX - 1:
      waiting.append(entry)
      return
    if waiting:
      self._waiting = []
      self._judge_all(waiting)
    self._judge_all((entry,), current=True)

  def _judge_all(self, entries, *, current: bool = False) -> None:
    """Judges ``entries`` in step order; none after an incident answered by anything but
    ``warn`` (the response abandons them)."""
    read = float if current else _host  # float() keeps the value on the array: the row's
    # read of it is then free; a waiting step's from one device's copy: ~8 us, float() ~12
    for step, loss, grad, skipped, batch in entries:
      if any(i["action"] != "warn" and i["step"] < step for i in self.pending):
        return
      self._judge(step, read(loss), read(grad), skipped, batch)

  def _judge(self, step: int, loss: float, grad: float, skipped, batch: int | None) -> None:
    # skipped: None unless nan_policy != "none" (the loop has read it: a lookup).
    nan_skipped = skipped is not None and bool(int(skipped))
    self._judged = (int(step), loss, grad, None if skipped is None else int(skipped))
    if nan_skipped or not (math.isfinite(loss) and math.isfinite(grad)):
      where = {} if batch is None else {"batch": int(batch)}
      self._flag(step, "non_finite", loss if not math.isfinite(loss) else grad, "finite",
                 **where, nan_skipped=nan_skipped, processes="all")
      return
    for signal in self._spike_signals:  # those not off
      detector, value = (self._loss, loss) if signal == "loss_spike" else (self._grad, grad)
      flagged, z, threshold = detector.update(value)
      if flagged:
        where = {} if batch is None else {"batch": int(batch)}
        self._flag(step, signal, value, threshold, z=_plain(z), **where, processes="all")

  def row_gather(self, timer: Callable[[], Any]) -> Callable[[float], list[float]] | None:
    """A gather for :class:`jaxcoll.run.timing.StepTimer` that shares each
    process's step time in the same allgather as its own time (so the
    throughput signal adds no collective); None (the timer's own) when
    there is one process or the signal is off. ``timer`` returns the timer."""
    if self.process_count == 1 or self.s["throughput_regression"] == "off":
      return None

    def gather(own: float) -> list[float]:
      from jax.experimental import multihost_utils  # noqa: PLC0415

      both = np.asarray(multihost_utils.process_allgather(
          np.asarray([own, timer().step_time_s], np.float64))).reshape(-1, 2)
      self._row_times = [float(t) for t in both[:, 1]]
      return [float(t) for t in both[:, 0]]

    return gather

  def after_row(self, step: int, row: Mapping[str, Any]) -> None:
    """Feeds a logged row's step time (every process, every logged row)."""
    if self.s["throughput_regression"] == "off":
      return
    own = float(row["step_time_s"])
    if self._row_times is not None:  # shared by the timer's allgather (row_gather)
      times, self._row_times = self._row_times, None
    elif self._gather is not None and self.process_count > 1:
      times = self._gather(own)
    else:
      times = [own]
    self._rows.append(float(np.median(times)))
    n = self.s["throughput_rows"]
    if len(self._rows) < 2 * n + 1:  # the first row warms up; the next n are the baseline
      return
    baseline = float(np.median(self._rows[1:n + 1]))
    recent = float(np.median(self._rows[-n:]))
    threshold = self.s["throughput_factor"] * baseline
    # Tens of milliseconds more can be a loaded host's noise (as for the straggler report).
    slow = recent > threshold and recent - baseline > self.s["throughput_min_excess_s"]
    if slow and not self._slow:
      self._flag(step, "throughput_regression", recent, threshold, baseline=baseline,
                 processes="all")
    self._slow = slow

  def after_eval(self, step: int, evaluated: Mapping[str, Any]) -> None:
    """Feeds an eval's metrics (every process)."""
    name = self.s["eval_metric"]
    if self.s["eval_regression"] == "off" or name not in evaluated:
      return
    value = float(evaluated[name])
    higher = self._eval_mode == "max"
    best = self._best_eval
    finite = math.isfinite(value)  # NaN compared False both ways: never flagged, and as the
    # first eval it became the best, after which nothing was ever flagged again
    if finite and (best is None or (value > best if higher else value < best)):
      self._best_eval = value
      return
    if best is None:  # a non-finite first eval
      threshold = "finite"
    else:
      margin = self.s["eval_margin"] * abs(best)
      threshold = best - margin if higher else best + margin
    if not finite or ((value < threshold) if higher else (value > threshold)):
      incident = self._flag(step, "eval_regression", value, threshold, best=best, metric=name,
                            mode=self._eval_mode, processes="all")
      # Raised after this step's save: durable now, so that a resume (even after a hard kill
      # before the response) treats that checkpoint as flagged and answers the incident.
      flags = [f for f in self._state["flags"] if f["step"] != int(step)]
      flags.append({"step": int(step), "signal": "eval_regression", "rollbacks": self.rollbacks,
                    "answered": incident is None, "incident": incident})
      self._state["flags"] = flags
      self._save_state()

  def straggler_warning(self, warn: Callable[[str], None] | None) -> Callable[[str], None]:
    """The straggler report's callback: an incident, then ``warn`` (process 0's)."""

    def report(message: str) -> None:
      # The rule's own figures (jaxcoll.run.timing.StragglerReport): the ratio over the
      # median against straggler_factor, for straggler_steps rows (the text's ratio is
      # rounded: 1.54x read back as 1.5, not over a factor of 1.5).
      found = getattr(message, "process", None)
      if found is not None:
        self._flag(message.step, "straggler", message.ratio, message.factor,
                   rows=message.rows, processes=[int(found)])
      if warn is not None:
        warn(str(message))

    return report

  # -- responses ----------------------------------------------------------------

  def keep(self, state, step: int | None = None):
    """A copy of the state before the step, when a response may be ``skip`` (else None):
    ``skip`` is a response, or step ``step`` (1-based) is a recorded skip judged again."""
    if not self.keeps and (step is None or int(step) not in self._replays):
      return None
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    return jax.tree.map(jnp.copy, state)

  def trainer_skip(self, step: int, state, kept, metrics: Mapping[str, Any],
                   batch: int) -> tuple[Any, Mapping[str, Any]]:
    """``nan_policy="skip"``: step ``step`` (1-based, on batch ``batch``) as the trainer took
    it, made durable. Returns ``(state, metrics)`` to go on with.

    A step the trainer skipped (its ``skipped`` is 1; the state is the one before it) is
    recorded in :data:`STATE_NAME` with the loss and gradient norm it had, whatever the
    ``non_finite`` response (``off`` included). A step recorded so that a resume trains it
    again (a kill before the next checkpoint) is skipped again though its batch may be finite
    now (a transient fault): ``kept`` (:meth:`keep`, the state before it) and the recorded
    values come back, so the resumed run equals the uninterrupted one. Every process calls it;
    a read of ``metrics["skipped"]`` each step (the loop reads it anyway).
    """
    skipped = int(metrics.get("skipped", 0))
    replay = self._replays.get(int(step))
    if replay is not None and int(replay["batch"]) == int(batch):
      recorded = replay["judged"][2]
      if recorded is not None and int(recorded) and not skipped and kept is not None:
        loss, grad, _ = replay["judged"]
        if self.is_chief:
          logging.warning("step %d: skipped again, as nan_policy='skip' skipped it before the "
                          "resume (recorded in %s; batch %d is finite now)", step, STATE_NAME,
                          batch)
        return kept, {**metrics, "loss": float(loss), "grad_norm": float(grad), "skipped": 1}
      return state, metrics
    if skipped:
      loss, grad = float(metrics["loss"]), float(metrics["grad_norm"])
      skips = [d for d in self._state["skips"] if int(d["step"]) != int(step)]
      skips.append({"step": int(step), "batch": int(batch), "signal": "nan_policy",
                    "rollbacks": self.rollbacks, "judged": [_plain(loss), _plain(grad), 1]})
      self._state["skips"] = skips
      self._save_state()  # durable before the next step (a kill replays from a checkpoint)
    return state, metrics

  def prune_skips(self) -> None:
    """After a save: the recorded skips no retained checkpoint's replay needs (at or before
    the oldest committed checkpoint, :attr:`oldest_checkpoint`) leave :data:`STATE_NAME`
    (rewritten only when one does)."""
    if self.is_chief and self._prune_skips():
      self._save_state()

  def _prune_skips(self) -> bool:
    """Drops the recorded skips at or before the oldest retained checkpoint: a resume starts
    there or later and replays only the steps after it (a rollback's target is a retained
    checkpoint, or the initial state, which drops every later skip). Returns whether any went.
    With no checkpoint (none saved yet, or ``checkpoint_every=0``) a resume starts from step 0
    and every skip is kept."""
    oldest = self.oldest_checkpoint() if self.oldest_checkpoint is not None else None
    skips = self._state["skips"]
    if oldest is None or not skips:
      return False
    kept = [d for d in skips if int(d["step"]) > int(oldest)]
    self._state["skips"] = kept
    return len(kept) != len(skips)

  def respond(self, step: int, state, kept, *, ckpt, trainer, train_input, init):
    """Logs this step's incidents and acts on the strongest response.

    Returns ``(state, restart)``: the state to go on with and, after a
    rollback, the step to restart from (else None). After ``stop`` the loop
    saves a final checkpoint and raises :meth:`stop_error`.
    """
    incidents, self.pending = self.pending, []
    self.last = incidents
    for incident in incidents:  # a waiting step's (defer_reads): answered at this step
      if incident["signal"] in BATCH_SIGNALS and incident["step"] != step:
        incident["judged_at_step"] = int(step)
    action = max((i["action"] for i in incidents), key=_RANK.get)
    restart = None
    # The strongest; of equals the earliest step's (judged at once, it would have come first).
    first = max(incidents, key=lambda i: (_RANK[i["action"]], -i["step"]))
    if action == "rollback" and self.rollbacks >= self.s["max_rollbacks"]:
      first["action"] = action = "stop"
      first["why"] = f"max_rollbacks ({self.s['max_rollbacks']}) reached"
    plan = None
    if action == "skip":
      if kept is not None:
        state = kept
      first["batches_skipped"] = [first.get("batch", step)] * 2
    elif action == "rollback":  # from the incident's step (the one before `step` if deferred)
      plan = self._plan_rollback(first["step"], ckpt=ckpt, trainer=trainer,
                                 train_input=train_input, init=init)
      first.update(plan["detail"])
      if plan["target"] is None:
        first["action"] = action = "stop"
        plan = None
    if action == "stop":
      self.stopping = first
      if first["step"] != step:
        first["stopped_after_step"] = int(step)
    for incident in incidents:  # one response a step, the strongest's: the others name it
      if incident is not first and incident["action"] != "warn":
        incident["answered_with"] = first["signal"]
    now = time.time()  # one time for the rows of one response (_rows_after pairs them)
    rows = [self._row(incident, now) for incident in incidents]
    skip = first if action == "skip" else None
    self._record(step, incidents, rows, plan, skip)  # durable before it acts (a kill keeps it)
    if plan is not None:
      state, restart = self._act(plan, ckpt=ckpt, train_input=train_input)
      self._waiting = []  # steps of the abandoned stretch
    if plan is not None:  # the steps after its target are a new stretch: nothing logged yet
      self._logged_before = collections.Counter(
          {k: n for k, n in self._logged_before.items() if k[0] <= plan["target"]})
    for row in rows:
      key = (int(row["step"]), row["signal"], row["action"])
      if self._logged_before[key] > 0:  # the attempt before the resume logged it
        self._logged_before[key] -= 1
        if self.is_chief:
          logging.warning("%s; logged before the resume (step %d is trained again), not "
                          "logged twice", describe(row), row["step"])
        continue
      self._emit(row)
    return state, restart

  def _plan_rollback(self, step: int, *, ckpt, trainer, train_input, init) -> dict[str, Any]:
    """The rollback's decision, nothing changed on disk yet: the newest good checkpoint at
    least rollback_steps before ``step`` (the initial state if none is), restored (verified
    against its fingerprints), the checkpoints after it (to set aside) and the batches to
    skip. ``target`` None: no rollback (``detail`` says why)."""
    limit = step - self.s["rollback_steps"]
    if limit < 0:
      return {"target": None, "detail": {"why": f"step {step} is less than rollback_steps "
                                                f"({self.s['rollback_steps']}) from the start"}}
    ckpt.wait()
    target, restored = None, None
    for c in reversed(ckpt.all_steps()):
      if c > limit:
        continue
      try:
        extra = ckpt.metadata(c).get("extra") or {}
      except ValueError:  # damaged: never a target
        continue
      # Marked when saved, or saved just before a flag of this run (an eval's, which comes
      # after the step's save): neither is a target.
      if extra.get("incident_window") or any(
          c - self.s["rollback_steps"] < f <= c for f in self.flagged_steps):
        continue
      try:  # verified against its fingerprints; the newer ones are still in place
        restored = ckpt.restore(trainer, step=c, residual_notice=log_line)
      except ValueError:
        continue
      target = c
      break
    if target is None:  # the initial state is known exactly: it is checkpoint 0
      target, restored = 0, (init(), 0, {})
    state, _, extra = restored
    newer = self._agreed_newer(ckpt, target)
    first = train_input.batch_number(target + 1)
    last = max(train_input.batch_number(step), first + self.s["skip_batches"] - 1)
    number = self.rollbacks + 1
    aside = _agree(self._aside(step, newer) if _process_index() == 0 else None)
    return {"target": target, "step": int(step), "state": state, "extra": extra,
            "newer": newer, "first": first, "last": last, "rollback": number, "aside": aside,
            "detail": {"checkpoint_restored": target, "batches_skipped": [first, last],
                       "data_skip": f"{first}:{last}", "checkpoints_set_aside": newer,
                       "rollback": number}}

  def _act(self, plan: Mapping[str, Any], *, ckpt, train_input):
    """Carries out a recorded rollback: sets the abandoned checkpoints aside, puts the input
    and the detectors back at the target, skips the batches. Returns ``(state, target)``."""
    target, extra = plan["target"], plan["extra"]
    self._move(ckpt, plan["newer"], plan["step"], plan["aside"])
    train_input.restore(target, extra)
    train_input.skip(plan["first"], plan["last"])
    self._rewind(target, extra)
    self.rollbacks = max(self.rollbacks + 1, plan["rollback"])
    self._replays = {k: d for k, d in self._replays.items() if k <= target}  # abandoned
    self.restored_extra = extra
    return plan["state"], target

  def _rewind(self, target: int, extra: Mapping[str, Any] | None) -> None:
    """The detectors as they were at checkpoint ``target`` (its ``extra``; empty for the
    initial state), as a resume from it would have them: the abandoned steps' values leave
    the windows, and their flags (numbered as the replayed steps will be) mark no replayed
    checkpoint as taken in an anomaly window. The rollbacks so far are kept."""
    saved = (extra or {}).get("incident_detectors") or {}
    spike = dict(z=self.s["spike_z"], window=self.s["spike_window"],
                 min_steps=self.s["spike_min_steps"], floor=self.s["spike_floor"])
    self._loss, self._grad = RobustSpike(**spike), RobustSpike(**spike)
    self._loss.extend(saved.get("loss", []))
    self._grad.extend(saved.get("grad_norm", []))
    self._best_eval = self._saved_best_eval(extra)
    self.flagged_steps = {f for f in self.flagged_steps if f <= target}
    self._last_flag = {k: v for k, v in self._last_flag.items() if v <= target}

  def _agreed_newer(self, ckpt, target: int) -> list[int]:
    """The checkpoints after ``target`` (process 0's listing, for every process)."""
    return sorted(int(c) for c in _agree([int(c) for c in ckpt.all_steps() if c > target]))

  def _aside(self, step: int, steps) -> str:
    """Where the checkpoints ``steps`` a rollback at ``step`` abandons go, relative to the
    workdir: ``checkpoints_rolled_back/incident_step_<step>``, or ``..._<step>.<n>`` when an
    earlier rollback at the same step number set aside a checkpoint of the same number
    there (never moved into it, never mixed)."""
    name, n = os.path.join(ROLLED_BACK_DIR, f"incident_step_{step}"), 1
    where = name
    while any(os.path.exists(os.path.join(self.workdir, where, str(c))) for c in steps):
      n += 1
      where = f"{name}.{n}"
    return where

  def _move(self, ckpt, steps, step: int, where: str | None = None) -> list[int]:
    """Moves checkpoints ``steps`` (an abandoned stretch) to ``WORKDIR/<where>``
    (default :meth:`_aside`): never restored or resumed from, never lost. Every
    process calls it; process 0 moves."""
    import jax  # noqa: PLC0415
    from jax.experimental import multihost_utils  # noqa: PLC0415

    steps = sorted(int(c) for c in steps)
    if not steps:
      return []
    if jax.process_index() == 0:
      where = os.path.join(self.workdir, where or self._aside(step, steps))
      os.makedirs(where, exist_ok=True)
      for c in steps:
        source = os.path.join(str(ckpt.directory), str(c))
        if os.path.exists(source):  # a resume completing a move a hard kill cut short
          shutil.move(source, os.path.join(where, str(c)))
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"jaxcoll_incident_set_aside_{step}_{steps[0]}")
    ckpt._manager.reload()  # noqa: SLF001  (orbax forgets the moved steps; restore reloads too)
    return steps

  # -- the decisions a hard kill must not lose (WORKDIR/incident_state.json) ------

  def _record(self, step: int, incidents, rows, plan, skip=None) -> None:
    """Makes this step's durable decisions durable before anything acts on them: a
    rollback's (its number, target, skipped batches, the checkpoints it sets aside), a
    skip's (its step, batch and the values it was judged on: a resume before the next
    checkpoint judges that step on them again, :meth:`resume`) and the answer to an eval
    flag; ``rows`` (their log rows) come back at a resume if a hard kill comes before they
    reach the log."""
    evals = {i["step"] for i in incidents if i["signal"] == "eval_regression"}
    if plan is None and not evals and skip is None:
      return
    if skip is not None and self._judged is not None and self._judged[0] == skip["step"]:
      _, loss, grad, skipped = self._judged
      skips = [d for d in self._state["skips"] if int(d["step"]) != int(skip["step"])]
      skips.append({"step": int(skip["step"]), "batch": int(skip["batches_skipped"][0]),
                    "signal": skip["signal"], "rollbacks": self.rollbacks,
                    "judged": [_plain(loss), _plain(grad), skipped]})
      self._state["skips"] = skips
    flags = self._state["flags"]
    for flag in flags:
      if flag["step"] in evals:
        flag["answered"], flag["incident"] = True, None
    if plan is not None:
      self._state["rollbacks"].append({
          "rollback": plan["rollback"], "step": plan["step"], "judged_at_step": int(step),
          "checkpoint_restored": plan["target"],
          "batches_skipped": [plan["first"], plan["last"]],
          "checkpoints_set_aside": plan["newer"],
          "set_aside_to": plan["aside"],
          "time": time.time()})
      # Flags and skips after the target belong to the abandoned stretch (numbered as the
      # replayed steps will be): never judged again.
      self._state["flags"] = [f for f in flags if f["step"] <= plan["target"]]
      self._state["skips"] = [d for d in self._state["skips"]
                              if int(d["step"]) <= plan["target"]]
    self._save_state(rows)

  def _save_state(self, rows=()) -> None:
    """Writes the decisions (process 0; whole or not at all: then the directory is synced,
    so a power loss keeps the rename too)."""
    if not self.is_chief:
      return
    self._prune_skips()
    text = json.dumps({**self._state, "rows": list(rows)}, indent=1)
    write_atomic(self.state_path, text + "\n")
    with contextlib.suppress(OSError):
      fd = os.open(self.workdir, os.O_RDONLY)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)

  def load_state(self) -> None:
    """Reads ``WORKDIR/incident_state.json`` at the start of an attempt (process 0's copy,
    for every process; absent in a new workdir or one written before it existed).

    Raises:
      ConfigError: the file is not one this version wrote; nothing is changed.
    """
    text = None
    if _process_index() == 0 and os.path.exists(self.state_path):
      with open(self.state_path) as f:
        text = f.read()
    text = _agree(text)
    if text is None:
      return
    try:
      state = json.loads(text)
      if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise ValueError(f"format {state.get('format') if isinstance(state, dict) else '?'}, "
                         f"not {STATE_FORMAT}")
      rollbacks = [dict(d) for d in state.get("rollbacks", [])]
      for d in rollbacks:
        int(d["rollback"]), int(d["checkpoint_restored"]), int(d["step"])
        first, last = (int(x) for x in d["batches_skipped"])
      flags = [dict(f) for f in state.get("flags", [])]
      for f in flags:
        int(f["step"])
      skips = [dict(d) for d in state.get("skips", [])]
      for d in skips:
        int(d["step"]), int(d["batch"])
        loss, grad, skipped = d["judged"]
        float(loss), float(grad), None if skipped is None else int(skipped)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
      raise errors.ConfigError(
          f"{self.state_path} is not an incident state this jaxcoll wrote ({e}); it records "
          "the rollbacks a resume must repeat. Restore it, or move it away to resume without "
          "them (the resumed run then trains on the batches they skipped again).") from None
    self._state = {"format": STATE_FORMAT, "rollbacks": rollbacks, "flags": flags,
                   "skips": skips}
    self._recovered_rows = [r for r in state.get("rows", []) if isinstance(r, dict)]

  def last_rollback_target(self) -> int | None:
    """The checkpoint the newest recorded rollback restored (0: the initial state), or None."""
    rollbacks = self._state["rollbacks"]
    if not rollbacks:
      return None
    return int(max(rollbacks, key=lambda d: int(d["rollback"]))["checkpoint_restored"])

  def abandoned(self, step: int, extra: Mapping[str, Any] | None) -> bool:
    """Whether checkpoint ``step`` (its ``extra``) belongs to a stretch a recorded rollback
    abandoned (saved before that rollback, after its target): it is set aside, never resumed
    from. Only a hard kill between the rollback's record and its set-aside leaves one."""
    return abandoning_rollback(self._state["rollbacks"], step, extra) is not None

  def unsettled(self, step: int, extra: Mapping[str, Any] | None) -> bool:
    """Whether checkpoint ``step`` has a decision still to carry out: it was abandoned by a
    recorded rollback (:meth:`abandoned`), or an eval incident of its step was raised but not
    answered (a hard kill right after the eval; the resumed run answers it first)."""
    return self.abandoned(step, extra) or any(
        f["step"] == int(step) and not f.get("answered") for f in self._state["flags"])

  def settle(self, ckpt) -> list[int]:
    """At a resume, before the restore: completes the set-aside of a recorded rollback that a
    hard kill cut short (the checkpoints it abandoned go to ``checkpoints_rolled_back/``).
    Returns the steps moved."""
    if not self._state["rollbacks"]:
      return []
    moves: dict[str, list[int]] = {}
    for c in ckpt.all_steps():  # every process: orbax's metadata read is a collective
      try:
        extra = ckpt.metadata(c).get("extra") or {}
      except ValueError:  # damaged: the restore skips it
        continue
      d = abandoning_rollback(self._state["rollbacks"], c, extra)
      if d is not None:
        moves.setdefault(str(d["rollback"]), []).append(int(c))
    moved = []
    by_number = {str(d["rollback"]): d for d in self._state["rollbacks"]}
    for number, steps in sorted(_agree(moves).items(), key=lambda kv: int(kv[0])):
      d = by_number[number]
      where = d.get("set_aside_to") or os.path.join(ROLLED_BACK_DIR, f"incident_step_{d['step']}")
      moved += self._move(ckpt, steps, int(d["step"]), where)
      if self.is_chief:
        logging.warning(
            "checkpoint(s) %s: saved in the stretch rollback %s (to checkpoint %s, recorded in "
            "%s) abandoned, before the previous attempt ended; set aside to %s, never resumed "
            "from", steps, number, d["checkpoint_restored"], STATE_NAME, where)
    return sorted(moved)

  def resume(self, start: int, extra: Mapping[str, Any] | None, train_input) -> list[int]:
    """After the restore of checkpoint ``start`` (``extra``; 0 and None for a fresh start):
    the recorded rollbacks that checkpoint does not carry are taken again (their batches
    skipped, their count toward ``max_rollbacks``), the eval flags up to ``start`` mark their
    checkpoints, an eval incident left unanswered at ``start`` is pending (the loop answers it
    before the first step), and log rows a hard kill kept from the log are written. Returns
    the rollback numbers taken again."""
    start, n = int(start), _rollbacks_in(extra)
    again = [d for d in self._state["rollbacks"] if int(d["rollback"]) > n]
    for d in again:
      first, last = (int(x) for x in d["batches_skipped"])
      train_input.skip(first, last)
      self.rollbacks = max(self.rollbacks, int(d["rollback"]))
    if again and self.is_chief:
      logging.warning(
          "resuming from %s with %d rollback(s) recorded in %s after it: skipping batches %s, "
          "%d of max_rollbacks (%d) used", f"checkpoint {start}" if start else "the start",
          len(again), STATE_NAME, ", ".join("{}..{}".format(*d["batches_skipped"]) for d in again),
          self.rollbacks, self.s["max_rollbacks"])
    # Skips after `start` (a hard kill before the next checkpoint): those steps are judged
    # again on the values recorded, so they are answered as before (the kept state).
    self._replays = {int(d["step"]): d for d in self._state["skips"] if int(d["step"]) > start}
    if self._replays and self.is_chief:
      logging.warning(
          "resuming from %s with %d skipped step(s) recorded in %s after it: step(s) %s are "
          "judged again on the values recorded then (a transient fault is answered as it "
          "was)", f"checkpoint {start}" if start else "the start", len(self._replays),
          STATE_NAME, ", ".join(str(k) for k in sorted(self._replays)))
    kept = [f for f in self._state["flags"] if f["step"] <= start]  # later steps are replayed
    self.flagged_steps.update(int(f["step"]) for f in kept)
    for f in kept:
      if f["step"] == start and not f.get("answered") and f.get("incident"):
        self.pending.append(dict(f["incident"]))
    self._recover_rows()
    self._logged_before = self._rows_after(start)
    if len(kept) != len(self._state["flags"]):
      self._state["flags"] = kept
      self._save_state()
    return [int(d["rollback"]) for d in again]

  def _rows_after(self, start: int) -> collections.Counter:
    """(step, signal, action) -> count of the log's rows for the steps after ``start`` that a
    resume from ``start`` trains again: those the attempts before logged on the timeline it
    follows (not in a stretch a later rollback abandoned: rows before a rollback row, of steps
    after its target; nor the rollback rows, whose decisions a resume takes from the record),
    ``stop`` rows aside (a stop again is news). Process 0's answer, for every process."""
    live = None
    if self.is_chief:
      rows = [r for r in read_log(self.workdir) if isinstance(r.get("step"), int)]
      rolled = {}  # (time, attempt) of a response that rolled back -> its target
      for r in rows:
        if r.get("action") == "rollback" and not r.get("answered_with") and isinstance(
            r.get("checkpoint_restored"), int):
          rolled[(r.get("time"), r.get("attempt_start_step"))] = r["checkpoint_restored"]
      live = []
      for r in rows:
        step, target = r["step"], rolled.get((r.get("time"), r.get("attempt_start_step")))
        if target is not None:  # the response that rolled back: its rows past the target too
          live = [x for x in live if x[0] <= target]
          if r.get("action") == "rollback" or step > target:
            continue
        if step > start and r.get("action") != "stop":
          live.append([step, r.get("signal"), r.get("action")])
    return collections.Counter(tuple(r) for r in _agree(live) or [])

  def _recover_rows(self) -> None:
    rows, self._recovered_rows = self._recovered_rows, []
    if not rows or not self.is_chief:
      return
    logged = {(r.get("step"), r.get("signal"), r.get("time")) for r in read_log(self.workdir)}
    for row in rows:
      if (row.get("step"), row.get("signal"), row.get("time")) not in logged:
        self._emit({**row, "logged_at_resume": True})

  def checkpoint_extra(self, step: int) -> dict[str, Any]:
    """For a checkpoint's ``extra``: the detectors' state (a resumed run
    judges as an uninterrupted one would) and whether it was taken in an
    anomaly window (a flagged step at most ``rollback_steps`` before it, or
    a stop)."""
    recent = any(step - self.s["rollback_steps"] < f <= step for f in self.flagged_steps)
    window = {"incident_window": True} if recent or self.stopping else {}
    keep = [f for f in self.flagged_steps if f > step - self.s["rollback_steps"] - 1]
    last = {k: v for k, v in self._last_flag.items() if v == step}  # an episode going on
    return {**window, "incident_detectors": {
        "loss": list(self._loss.values), "grad_norm": list(self._grad.values),
        "best_eval": self._best_eval, "best_eval_metric": self.s["eval_metric"],
        "best_eval_mode": self._eval_mode, "rollbacks": self.rollbacks, "flagged_steps": keep,
        "last_flags": last}}

  def restore(self, extra: Mapping[str, Any] | None) -> None:
    """The detectors' state from a checkpoint's ``extra`` (at a resume)."""
    saved = (extra or {}).get("incident_detectors")
    if not saved:
      return
    self._loss.extend(saved.get("loss", []))
    self._grad.extend(saved.get("grad_norm", []))
    self._best_eval = self._saved_best_eval(extra)
    self.rollbacks = int(saved.get("rollbacks", 0))
    self.flagged_steps.update(int(f) for f in saved.get("flagged_steps", []))
    self._last_flag.update({str(k): int(v) for k, v in (saved.get("last_flags") or {}).items()})

  def _saved_best_eval(self, extra: Mapping[str, Any] | None) -> float | None:
    """The best eval a checkpoint's ``extra`` holds, if it is of this run's ``eval_metric``
    and ``eval_mode``; else None (the best starts afresh, said once: a run resumed with
    another metric compared an accuracy against the old run's best loss)."""
    saved = (extra or {}).get("incident_detectors") or {}
    best = saved.get("best_eval")
    if best is None or self._eval_mode is None:
      return best
    old_config = ((extra or {}).get("config") or {}).get("incidents") or {}
    metric = saved.get("best_eval_metric", old_config.get("eval_metric", "eval_loss"))
    mode = saved.get("best_eval_mode")
    if mode is None:  # a checkpoint from before best_eval_mode was kept: the name's rule then
      mode = "max" if "acc" in str(metric) else "min"
    if (metric, mode) == (self.s["eval_metric"], self._eval_mode):
      return best
    if self.is_chief and not self._said_new_best:
      logging.warning(
          "incidents: the checkpoint's best eval is of %s (%s), this run watches %s (%s): "
          "eval_regression's best starts afresh at the next eval", metric, mode,
          self.s["eval_metric"], self._eval_mode)
    self._said_new_best = True
    return None

  @property
  def may_save(self) -> bool:
    """False when stopping on a non-finite state (never written)."""
    return not (self.stopping and self.stopping["signal"] == "non_finite"
                and not self.stopping.get("nan_skipped"))

  def stop_error(self, step: int, saved: bool) -> IncidentStop:
    why = self.stopping.get("why", "") if self.stopping else ""
    at = self.stopping.get("step", step) if self.stopping else step
    if at != step:  # judged at a later step (Watch.after_step(defer=True))
      late = f"the incident is step {at}'s, judged at step {step} (incidents.defer_reads)"
      if saved:
        late += (f": the final checkpoint is step {step}'s, steps {at + 1}..{step} included"
                 if at + 1 < step else f": the final checkpoint is step {step}'s, included")
      why = "; ".join(x for x in (why, late) if x)
    error = IncidentStop(step, saved, self.stopping["signal"] if self.stopping else "?",
                         f" ({why})" if why else "")
    error.summary_update = self.summary()  # summary.json's counts (jaxcoll.run.attempts)
    return error

  # -- the log ------------------------------------------------------------------

  def begin(self, start_step: int) -> None:
    self._attempt_start = int(start_step)

  def _row(self, incident: Mapping[str, Any], now: float | None = None) -> dict[str, Any]:
    """An incident's log row (its ``time`` ``now``, default the present)."""
    incident = dict(incident)
    row = {"step": incident.pop("step"), "signal": incident.pop("signal"),
           "value": incident.pop("value"), "threshold": incident.pop("threshold"),
           "action": incident.pop("action"),
           "checkpoint_restored": incident.pop("checkpoint_restored", None),
           "batches_skipped": incident.pop("batches_skipped", None),
           "processes": incident.pop("processes", "all"),
           **incident, "attempt_start_step": self._attempt_start,
           "time": time.time() if now is None else now}
    if row["processes"] == "all":
      row["processes"] = list(range(self.process_count))
    return row

  def _write(self, incident: Mapping[str, Any]) -> None:
    self._emit(self._row(incident))

  def _emit(self, row: dict[str, Any]) -> None:
    """Appends ``row`` to the log (process 0) and prints its line."""
    self.written.append(row)
    if not self.is_chief:
      return
    metrics_lib.append_line(self.path, json.dumps(row), fsync=True)
    logging.warning("%s", describe(row))

  def summary(self) -> dict[str, Any]:
    """summary.json's fields: counts per signal and action over the whole log."""
    rows = read_log(self.workdir) if self.is_chief else self.written
    by_signal = collections.Counter(r["signal"] for r in rows)
    by_action = collections.Counter(r["action"] for r in rows)
    return {"incidents": {"total": len(rows), "by_signal": dict(by_signal),
                          "by_action": dict(by_action),
                          "rollbacks": sum(r["action"] == "rollback" and not r.get("answered_with")
                                           for r in rows)}}


def abandoning_rollback(rollbacks: Sequence[Mapping[str, Any]], step: int,
                        extra: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
  """The recorded rollback (of ``incident_state.json``'s ``rollbacks``) that abandoned
  checkpoint ``step`` (its metadata's ``extra``): the first one it was saved before (its
  rollback count is below that rollback's number) and after whose target it lies; None when
  none did. A resume sets such a checkpoint aside and never restores it; the run report
  (:func:`jaxcoll.observe.run_report.checkpoints_on_disk`) says so with the same rule."""
  n = _rollbacks_in(extra)
  for d in rollbacks:
    if int(step) > int(d["checkpoint_restored"]) and n < int(d["rollback"]):
      return d
  return None


def _rollbacks_in(extra: Mapping[str, Any] | None) -> int:
  """The rollbacks a checkpoint's run had taken when it was saved (0 before any)."""
  saved = (extra or {}).get("incident_detectors") or {}
  try:
    return int(saved.get("rollbacks", 0) or 0)
  except (TypeError, ValueError):
    return 0


def _process_index() -> int:
  import jax  # noqa: PLC0415

  return jax.process_index()


def _agree(value):
  """Process 0's ``value`` (JSON-able) on every process: one broadcast of its length and
  one of its bytes (none with one process)."""
  import jax  # noqa: PLC0415

  if jax.process_count() == 1:
    return value
  from jax.experimental import multihost_utils  # noqa: PLC0415

  data = json.dumps(value).encode() if jax.process_index() == 0 else b""
  size = int(np.asarray(multihost_utils.broadcast_one_to_all(np.int32(len(data)))))
  buf = np.zeros(max(size, 1), np.uint8)
  if jax.process_index() == 0:
    buf[:size] = np.frombuffer(data, np.uint8)
  buf = np.asarray(multihost_utils.broadcast_one_to_all(buf)).astype(np.uint8)
  return json.loads(bytes(buf[:size]).decode())


def log_line(message: str) -> None:
  """A library warning as one of the run's log lines (no Python warning, no source line)."""
  logging.warning("%s", message)


def _defers(setting: str) -> bool:
  """``defer_reads``: ``auto`` is ``on`` (measured cheaper on CPU devices:
  README "Incidents and rollback"; not measured on accelerators)."""
  return setting != "off"


def _host(x) -> float:
  """A replicated scalar's value from one device's copy (a float as is)."""
  data = getattr(x, "addressable_data", None)
  return float(np.asarray(data(0)) if data is not None else x)


def describe(row: Mapping[str, Any]) -> str:
  """The one console line of an incident."""
  value, threshold = row.get("value"), row.get("threshold")
  text = f"incident at step {row['step']}: {row['signal']} {_g(value)}"
  if isinstance(threshold, (int, float)):  # an eval that improves upward regresses below it
    text += f" {'<' if row.get('mode') == 'max' else '>'} threshold {_g(threshold)}"
  if row.get("z") is not None:
    text += f" (robust z {_g(row['z'])})"
  action = row["action"]
  if row.get("answered_with"):
    text += f"; {action}: answered by the {row['answered_with']} incident's response"
  elif action == "rollback":
    first, last = row["batches_skipped"]
    text += (f"; rolled back to checkpoint {row['checkpoint_restored']}, skipping batches "
             f"{first}..{last} (replay: --config.data.skip={first}:{last})")
  elif action == "skip":
    text += f"; batch {row['batches_skipped'][0]} skipped (state before the step kept)"
  elif action == "stop":
    text += "; stopping" + (f" ({row['why']})" if row.get("why") else "")
  else:
    text += f"; {action}"
  if row.get("processes") and row["signal"] == "straggler":
    text += f"; process {row['processes']}"
  return text


def read_log(workdir: str) -> list[dict[str, Any]]:
  """The incidents of ``workdir``: its rows with an integer ``step``, a ``signal`` and an
  ``action``. A line that is not such a JSON row (a torn write, a hand edit) is skipped,
  with a :class:`jaxcoll.errors.TornLineWarning` naming it where it is not JSON, not an
  object or has no integer step (such a line, ``[1, 2]``, stopped the run's resume and its
  summary with a TypeError)."""
  return [r for r in metrics_lib.read_step_rows(os.path.join(workdir, LOG_NAME))
          if isinstance(r.get("signal"), str) and "action" in r]


def _g(value) -> str:
  return f"{value:.4g}" if isinstance(value, (int, float)) else str(value)


def _plain(value):
  if value is None or isinstance(value, str):
    return value
  value = float(value)
  return value if math.isfinite(value) else str(value)
