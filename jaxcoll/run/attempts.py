"""The attempts of a run: summary.json's history, and the lines a person sees.

Each call of :func:`jaxcoll.train.loop.train_and_evaluate` on a workdir is one
*attempt* (a first run, a resume, a restart after a crash). Process 0 keeps
their history in ``summary.json``'s ``attempts`` list, one entry each::

  {"start_step": 200, "end_step": 400, "wall_time_s": 61.2,
   "started_at": 1795000000.0, "status": "completed"}

An entry is written with status ``"running"`` when its attempt starts and
updated when it ends: ``"completed"``, ``"stopped"`` (SIGTERM, after a final
checkpoint) or ``"failed"`` (an exception; also the step watchdog's exit 86 and the end of
a process whose peer ended, exit 76, which name their ``exit_status`` and ``reason``, the
line they printed). An attempt that died without updating its entry (SIGKILL, a power
cut) leaves it ``"running"``; the next attempt marks it ``"interrupted"``. The top-level
fields stay the last completed attempt's. Every write is atomic (a temporary
file renamed over summary.json), and a torn or unreadable summary.json is
kept aside as ``summary.json.unreadable-<unix time>`` with a warning, never
silently dropped.

The start, resume and "nothing to do" lines are INFO records of the
``jaxcoll`` logger, which ``python -m experiments.train`` shows at its
default verbosity (it keeps orbax and JAX at WARNING); ``--verbosity=-1``
hides them with every other INFO line.

Example:
  >>> import json, os, tempfile
  >>> from jaxcoll.train import attempts
  >>> workdir = tempfile.mkdtemp()
  >>> attempt = attempts.Attempt(workdir, start_step=0, is_chief=True)
  >>> attempt.begin()
  >>> attempt.end("completed", end_step=10, summary={"steps": 10})
  >>> summary = attempts.read_summary(workdir)
  >>> summary["steps"], [a["status"] for a in summary["attempts"]]
  (10, ['completed'])
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shlex
import threading
import time
from collections.abc import Mapping
from typing import Any

from jaxcoll.atomic_write import write_atomic
from jaxcoll.run import hooks as hooks_lib
from jaxcoll.run import watchdog
from jaxcoll.run.config_error import ConfigError

SUMMARY_NAME = "summary.json"
RUNNING, COMPLETED, STOPPED, FAILED, INTERRUPTED = (
    "running", "completed", "stopped", "failed", "interrupted")

log = logging.getLogger(__name__)


def summary_path(workdir: str | os.PathLike) -> str:
  return os.path.join(os.fspath(workdir), SUMMARY_NAME)


def read_summary(workdir: str | os.PathLike, *, set_aside: bool = True) -> dict[str, Any] | None:
  """``workdir``'s summary.json, or None when there is none.

  A file that is not a JSON object (torn by a kill mid-write on a
  filesystem without atomic rename, edited by hand) is renamed to
  ``summary.json.unreadable-<unix time>`` with a warning (unless
  ``set_aside`` is False), and None is returned: its content is kept, and
  the next write starts a new history.
  """
  path = summary_path(workdir)
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as e:
    value, why = None, f"{type(e).__name__}: {e}"
  else:
    why = f"a JSON {type(value).__name__}, not an object"
  if isinstance(value, dict) or not set_aside:
    return value if isinstance(value, dict) else None
  aside = f"{path}.unreadable-{time.time():.0f}"
  while os.path.exists(aside):
    aside += "+"
  os.replace(path, aside)
  log.warning("%s is unreadable (%s); kept as %s, and a new attempts history starts.",
              path, why, aside)
  return None


NON_FINITE_KEY = "non_finite"


def write_summary(workdir: str | os.PathLike, value: Mapping[str, Any]) -> None:
  """Writes summary.json atomically: a reader sees the old or the new file.

  The file is always valid JSON: a NaN or infinite number is written as
  ``null`` and its place named in the top-level list ``"non_finite"``
  (e.g. ``["eval_loss"]``; ``"attempts.0.wall_time_s"`` for a nested one).
  """
  paths: list[str] = []
  plain = _finite(dict(value), "", paths)
  plain.pop(NON_FINITE_KEY, None)
  if paths:
    plain[NON_FINITE_KEY] = paths
  write_atomic(summary_path(workdir), json.dumps(plain, indent=1, default=str, allow_nan=False))


def _finite(value: Any, path: str, paths: list[str]) -> Any:
  """``value`` with every non-finite float replaced by None (its path kept)."""
  if isinstance(value, Mapping):
    prefix = f"{path}." if path else ""
    return {str(k): _finite(v, f"{prefix}{k}", paths) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_finite(v, f"{path}.{i}", paths) for i, v in enumerate(value)]
  if isinstance(value, bool) or value is None or isinstance(value, (str, int)):
    return value
  if hasattr(value, "dtype") and getattr(value, "shape", None) == ():  # numpy / jax scalars
    value = value.item()
    if not isinstance(value, float):
      return value
  if isinstance(value, float):
    if math.isfinite(value):
      return value
    paths.append(path)
    return None
  return value


def _history(previous: Mapping[str, Any] | None) -> list[dict[str, Any]]:
  """The attempts so far; a summary written before attempts were kept counts
  as one completed attempt."""
  if not previous:
    return []
  attempts = previous.get("attempts")
  if isinstance(attempts, list):
    return [dict(a) for a in attempts if isinstance(a, dict)]
  if "steps" not in previous:
    return []
  return [{"start_step": previous.get("start_step"), "end_step": previous.get("steps"),
           "wall_time_s": previous.get("wall_time_s"), "started_at": None,
           "status": COMPLETED}]


class StepReached(hooks_lib.Hook):
  """The last step an attempt is known to have completed: the one before the
  step about to run, or the step being saved."""

  def __init__(self, step: int = 0):
    self.step = step

  def before_step(self, step, batch, state):
    self.step = step - 1
    return batch, state

  def before_save(self, step):
    self.step = step


class Attempt:
  """This attempt's entry in summary.json (written by process 0 only).

  Args:
    workdir: the run's directory.
    start_step: the step it starts from (0, or the restored checkpoint's).
    is_chief: whether this process writes (process 0); the others only
      keep time.
    started_at: when the attempt began (unix time; default: now).
  """

  def __init__(self, workdir: str | os.PathLike, *, start_step: int, is_chief: bool,
               started_at: float | None = None):
    self.workdir = os.fspath(workdir)
    self.is_chief = is_chief
    self.started_at = time.time() if started_at is None else float(started_at)
    self.entry: dict[str, Any] = {
        "start_step": int(start_step), "end_step": None, "wall_time_s": None,
        "started_at": self.started_at, "status": RUNNING,
    }
    self._index: int | None = None  # the entry's position in the history
    self._before: bytes | None = None  # summary.json as it was before begin()
    self.ended = False
    self._lock = threading.RLock()  # end() from the loop, the watchdog or the liveness watch
    self.hook = StepReached(int(start_step))  # put it first in the loop's hooks
    self.history: list[dict[str, Any]] = [self.entry]  # as last written

  @property
  def number(self) -> int | None:
    """This attempt's number in summary.json's history (1 for the first); None on a
    process other than 0, or before :meth:`begin`."""
    return None if self._index is None else self._index + 1

  def on_exit(self, exc_type, exc, tb) -> bool:
    """For ``ExitStack.push``: an exception that ends the attempt is recorded
    (``"stopped"`` for SIGTERM, ``"failed"`` otherwise), and bad
    configuration (exit 2) withdraws the entry, leaving summary.json as it
    was. Returns False: the exception goes on."""
    del tb
    if exc_type is None or self.ended:
      return False
    try:
      if issubclass(exc_type, ConfigError):
        self.withdraw()
      elif issubclass(exc_type, watchdog.StopRequested):  # an incident's stop: its counts too
        self.end(STOPPED, end_step=getattr(exc, "step", self.hook.step),
                 update=getattr(exc, "summary_update", None),
                 detail=getattr(exc, "attempt_detail", None))  # its params' digest
      else:
        self.end(FAILED, end_step=self.hook.step)
    except OSError as e:  # e.g. a full disk: the original error is the one to report
      log.warning("could not record the attempt's end in %s: %s", summary_path(self.workdir), e)
    return False

  def withdraw(self) -> None:
    """Puts summary.json back as it was before :meth:`begin`."""
    self.ended = True
    if not self.is_chief or self._index is None:
      return
    path = summary_path(self.workdir)
    if self._before is None:
      if os.path.exists(path):
        os.remove(path)
      return
    write_atomic(path, self._before)

  def begin(self) -> None:
    """Appends this attempt as ``"running"``; a left-over ``"running"`` entry
    (an attempt that died without a word) becomes ``"interrupted"``."""
    if not self.is_chief:
      return
    summary = read_summary(self.workdir) or {}
    with contextlib.suppress(FileNotFoundError), open(summary_path(self.workdir), "rb") as f:
      self._before = f.read()
    history = _history(summary)
    for entry in history:
      if entry.get("status") == RUNNING:
        entry["status"] = INTERRUPTED
    self._index = len(history)
    self.history = [*history, dict(self.entry)]
    write_summary(self.workdir, {**summary, "attempts": self.history})

  def end_abruptly(self, exit_status: int, reason: str | None) -> None:
    """Records the end of a process that exits at once from another thread (``os._exit``:
    the step watchdog, the liveness watch on a peer's end): ``"failed"`` at the last step
    it completed, with ``exit_status`` and ``reason`` (the line it printed). Nothing when
    the attempt has already ended."""
    with self._lock:
      if self.ended:
        return
      self.end(FAILED, end_step=self.hook.step,
               detail={"exit_status": int(exit_status),
                       "reason": " ".join((reason or "").split()) or None})

  def end(self, status: str, *, end_step: int | None,
          summary: Mapping[str, Any] | None = None,
          update: Mapping[str, Any] | None = None,
          detail: Mapping[str, Any] | None = None) -> None:
    """Records how this attempt ended.

    Args:
      status: ``"completed"``, ``"stopped"`` or ``"failed"``.
      end_step: the last step it completed (None when unknown).
      summary: the new top-level fields (a completed attempt's summary);
        None keeps the previous ones.
      update: top-level fields set over those (e.g. a stopped run's
        ``incidents`` counts), also recorded in this attempt's entry.
      detail: fields of this attempt's entry only (``exit_status``, ``reason``).

    Raises:
      ValueError: an unknown ``status``.
    """
    if status not in (COMPLETED, STOPPED, FAILED):
      raise ValueError(f"`status` must be one of {COMPLETED!r}, {STOPPED!r}, {FAILED!r}; "
                       f"got {status!r}.")
    with self._lock:
      self._end(status, end_step, summary, update, detail)

  def _end(self, status, end_step, summary, update, detail) -> None:
    self.ended = True
    self.entry.update(status=status, end_step=None if end_step is None else int(end_step),
                      wall_time_s=time.time() - self.started_at, **(update or {}),
                      **(detail or {}))
    if not self.is_chief:
      return
    current = read_summary(self.workdir) or {}
    history = _history(current)
    index = self._index
    if index is None or index >= len(history) or (
        history[index].get("started_at") != self.started_at):
      index = len(history)  # summary.json was replaced meanwhile: append
      history.append({})
    history[index] = dict(self.entry)
    self.history = history
    top = dict(summary) if summary is not None else {
        k: v for k, v in current.items() if k != "attempts"}
    write_summary(self.workdir, {**top, **(update or {}), "attempts": history})


# -- the lines a person sees ---------------------------------------------------


def _processes(n: int) -> str:
  return f"{n} process" + ("" if n == 1 else "es")


def auto_note(strategy: str) -> str:
  """What the start / resume line adds for ``auto``: it is not layout-free."""
  if "(auto" not in strategy:
    return ""
  return ("; algorithm auto picks per topology, so another device / process layout (1x8, "
          "2x4) may pick another and end with other params; --config.algorithm=ring gives "
          "the same params on every layout")


def announce_start(*, strategy: str, devices: int, processes: int, steps: int,
                   workdir: str) -> None:
  log.info("Starting: strategy %s on %d devices in %s, %d steps, workdir %s%s",
           strategy, devices, _processes(processes), steps, workdir, auto_note(strategy))


def announce_resume(*, start: int, steps: int, strategy: str, devices: int, processes: int,
                    workdir: str, saved_by: Mapping[str, Any] | None) -> None:
  """The resume line; it says "resharded from ..." when the checkpoint's
  ``saved_by`` metadata names another strategy, device or process count."""
  line = (f"Resuming from step {start} of {steps} in {workdir}: strategy {strategy} on "
          f"{devices} devices in {_processes(processes)}")
  saved = dict(saved_by or {})
  was = (saved.get("device_count"), saved.get("strategy"), saved.get("process_count"))
  if None not in was and was != (devices, strategy, processes):
    line += (f", resharded from {was[0]} devices / strategy {was[1]} in "
             f"{_processes(int(was[2]))}")
  log.info("%s", line + auto_note(strategy))


def announce_nothing_to_do(*, step: int, steps: int, workdir: str) -> None:
  log.info("nothing to do: already at step %d (steps=%d) in %s; pass a larger "
           "--config.steps to train further, or evaluate a checkpoint with python -m "
           "experiments.eval --workdir=%s", step, steps, workdir, shlex.quote(workdir))
