"""The run report: one PNG and a short text, drawn from a run's own files.

``python -m experiments.report --workdir=DIR`` reads ``DIR/metrics.jsonl``
(train rows, eval rows, checkpoint rows) and ``DIR/summary.json`` (its
``attempts``, the one-off figures) and writes ``DIR/report.png``, a grid of
panels on the step axis with checkpoints and restarts marked, and
``DIR/report.txt``, the summary it prints. The rows of eval-only runs
(``python -m experiments.eval``: ``DIR/evals.jsonl``, and that of any other
directory given, e.g. the ``--out_dir`` of a read-only workdir) are shown
apart from the in-training evals: one summary line, and crosses on the loss
and eval panels.

Example:
  >>> run = jaxcoll.run_report.load_run("/tmp/run")  # doctest: +SKIP
  >>> print(jaxcoll.run_report.summarize(run))  # doctest: +SKIP
  >>> jaxcoll.run_report.draw(run, "/tmp/run/report.png")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import statistics
import textwrap
from collections import Counter
from collections.abc import Sequence
from typing import Any

from jaxcoll.observe import metrics
from jaxcoll.atomic_write import write_atomic

FIGURE_INCHES, FIGURE_DPI = (16, 10), 100  # 1600 x 1000 pixels
MAX_STEPS_LISTED = 6  # checkpoint steps named in the summary (the newest ones)
MAX_PROCESS_LINES = 8  # more processes: a min-max band, the median and the usual slowest
# Eval fields that are not a metric curve.
_EVAL_NOT_CURVES = ("eval_time_s", "eval_examples")


@dataclasses.dataclass
class Run:
  """A run's rows, split by kind, and its summary.

  Attributes:
    workdir: the run directory.
    train: train rows (those with ``loss``), in file order.
    evals: eval rows (those with an ``eval_...`` metric).
    checkpoints: checkpoint rows (those with ``checkpoint_time_s``).
    summary: ``summary.json``, or None when the run has not written one.
    abandoned: the rows a rollback abandoned (``"abandoned": true``: the
      steps after its checkpoint, replayed on other batches); train, evals
      and checkpoints hold the kept trajectory only.
    eval_only: the rows of ``evals.jsonl`` (``python -m experiments.eval``:
      a checkpoint evaluated without training), oldest first.
    no_metrics: None when ``metrics.jsonl`` has rows; else why it has none
      (missing, empty): the report then says what summary.json and the
      checkpoints hold.
  """

  workdir: str
  train: list[dict[str, Any]]
  evals: list[dict[str, Any]]
  checkpoints: list[dict[str, Any]]
  summary: dict[str, Any] | None
  abandoned: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  eval_only: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  no_metrics: str | None = None

  @property
  def attempts(self) -> list[dict[str, Any]]:
    """``summary.json``'s attempts (empty when it has none)."""
    attempts = (self.summary or {}).get("attempts") or []
    return [a for a in attempts if isinstance(a, dict)]

  @property
  def restarts(self) -> list[int]:
    """The start step of every attempt after the first (without an attempts
    history: summary.json's ``start_step`` when the last attempt resumed)."""
    if not self.attempts:
      start = (self.summary or {}).get("start_step")
      return [int(start)] if isinstance(start, int) and start > 0 else []
    return [int(a["start_step"]) for a in self.attempts[1:] if a.get("start_step") is not None]

  @property
  def incidents(self) -> list[dict[str, Any]]:
    """The rows of ``incidents.jsonl`` (README "Incidents and rollback"); a torn line is skipped."""
    return metrics.read_step_rows(os.path.join(self.workdir, "incidents.jsonl"))

  def step_range(self) -> tuple[int, int]:
    """0 to the last step of any row (and a margin): the step axis of every panel."""
    last = max([r["step"] for r in self.train + self.evals + self.checkpoints + self.eval_only]
               + [1])
    return 0, last + max(1, last // 50)

  def eval_curves(self) -> list[str]:
    """The eval metric names, in the order the rows give them."""
    names = dict.fromkeys(k for r in self.evals + self.eval_only for k in r
                          if k.startswith("eval_") and isinstance(r[k], (int, float)))
    return [k for k in names if k not in _EVAL_NOT_CURVES]


def load_run(workdir: str, *, eval_dirs: Sequence[str] = ()) -> Run:
  """Reads the rows and the summary of ``workdir`` (and the eval-only rows of
  ``workdir`` and of ``eval_dirs``: :func:`jaxcoll.observe.metrics.read_eval_rows`).

  Raises:
    ValueError: ``workdir`` is not a directory, or its ``metrics.jsonl`` is
      missing or has no rows and it holds no ``summary.json`` and no
      ``checkpoints/`` either (with those, the run loads with no rows and
      ``no_metrics`` saying why), or ``summary.json`` is not JSON.
  """
  if not os.path.isdir(workdir):
    raise ValueError(f"`--workdir` {workdir!r} is not a directory; pass the --workdir of a "
                     "training run (it holds metrics.jsonl).")
  path = os.path.join(workdir, "metrics.jsonl")
  # A run killed before its first row, or a metrics.jsonl a full disk cut to nothing, still
  # has what the report says besides the curves (summary.json, the checkpoints): it is a run.
  other = [name for name in ("summary.json", "checkpoints")
           if os.path.exists(os.path.join(workdir, name))]
  if not os.path.isfile(path) and not other:
    run = metrics.inside_run(workdir)
    if run is not None:  # RUN/checkpoints or RUN/checkpoints/N: its run is one level up
      what = "the checkpoints/ directory" if run[1] is None else f"checkpoint {run[1]}"
      raise ValueError(f"`--workdir` {workdir!r} is {what} of the run {run[0]}, not a run's "
                       f"workdir; pass --workdir={run[0]}.")
    raise ValueError(f"`--workdir` {workdir!r} has no metrics.jsonl; pass the --workdir of a "
                     "training run that logged at least one step.")
  rows = metrics.read_metrics(workdir) if os.path.isfile(path) else []
  if not rows and not other:
    raise ValueError(f"{path} has no rows; train at least `log_every` steps first.")
  no_metrics = None
  if not rows:
    no_metrics = ("metrics.jsonl is missing" if not os.path.isfile(path) else
                  "metrics.jsonl is empty" if os.path.getsize(path) == 0 else
                  "metrics.jsonl has no readable row")
  summary = None
  summary_path = os.path.join(workdir, "summary.json")
  if os.path.isfile(summary_path):
    with open(summary_path) as f:
      try:
        summary = json.load(f)
      except ValueError as e:
        raise ValueError(f"{summary_path} is not JSON ({e}); move it away to report the "
                         "rows alone.") from None
  abandoned = [r for r in rows if r.get("abandoned")]
  rows = [r for r in rows if not r.get("abandoned")]  # the kept trajectory
  return Run(
      workdir=workdir,
      abandoned=abandoned,
      train=[r for r in rows if "loss" in r],
      evals=[r for r in rows if any(k.startswith("eval_") and k not in _EVAL_NOT_CURVES
                                    for k in r)],
      checkpoints=[r for r in rows if "checkpoint_time_s" in r],
      summary=summary if isinstance(summary, dict) else None,
      eval_only=metrics.read_eval_rows(workdir, *eval_dirs),
      no_metrics=no_metrics,
  )


def _rows(items: Sequence, kind: str = "") -> str:
  """``"1 train row"``, ``"20 train rows"``."""
  return f"{len(items)} {kind}row{'' if len(items) == 1 else 's'}"


def _series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
  """(steps, values) of the rows where ``key`` is a number."""
  pairs = [(r["step"], r[key]) for r in rows
           if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
  return [p[0] for p in pairs], [float(p[1]) for p in pairs]


def _median(values: Sequence[float]) -> float | None:
  return statistics.median(values) if values else None


def _per_process(run: Run, key: str) -> dict[int, tuple[list[int], list[float]]]:
  """Per process id: (steps, values) from the rows' ``key`` lists."""
  per: dict[int, tuple[list[int], list[float]]] = {}
  for row in run.train:
    times = row.get(key)
    if not isinstance(times, list):
      continue
    for pid, t in enumerate(times):
      if isinstance(t, (int, float)):
        per.setdefault(pid, ([], []))[0].append(row["step"])
        per[pid][1].append(float(t))
  return per


def process_times(run: Run) -> dict[int, tuple[list[int], list[float]]]:
  """Per process id: (steps, host time before dispatch) from the rows'
  ``process_time_s`` lists (data + dispatch: the straggler signal, not the
  step time); falls back to ``{0: step_time_s}`` for rows without them."""
  per = _per_process(run, "process_time_s")
  return per or ({0: _series(run.train, "step_time_s")} if run.train else {})


def process_step_times(run: Run) -> dict[int, tuple[list[int], list[float]]]:
  """Per process id: (steps, step time, dispatch to ready) from the rows'
  ``process_step_time_s`` lists; ``{}`` for rows without them (older runs)."""
  return _per_process(run, "process_step_time_s")


def _g(value: float | None, unit: str = "") -> str:
  return "n/a" if value is None else f"{value:.4g}{unit}"


def _medians(per: dict[int, float | None]) -> str:
  """``0: 1 s, 1: 2 s``, or the extremes and the median for many processes."""
  if len(per) > MAX_PROCESS_LINES:
    fast, slow = min(per, key=per.get), max(per, key=per.get)
    return (f"fastest {fast}: {_g(per[fast], ' s')}, median "
            f"{_g(_median(list(per.values())), ' s')}, slowest {slow}: {_g(per[slow], ' s')}")
  return ", ".join(f"{p}: {_g(t, ' s')}" for p, t in per.items())


def _lock_held(workdir: str) -> bool:
  """Whether a live process holds ``workdir``'s ``jaxcoll.lock`` (``jaxcoll.run.lock``'s
  flock; a file left by a killed job is not held)."""
  import fcntl  # noqa: PLC0415

  try:
    fd = os.open(os.path.join(workdir, "jaxcoll.lock"), os.O_RDONLY)
  except OSError:
    return False
  try:
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
  except OSError:
    return True
  finally:
    os.close(fd)  # closing drops a lock it took
  return False


def _steps_text(steps: Sequence[int]) -> str:
  shown = ", ".join(map(str, steps[-MAX_STEPS_LISTED:]))
  return shown if len(steps) <= MAX_STEPS_LISTED else f"{len(steps)} steps, ..., {shown}"


def checkpoints_on_disk(workdir: str) -> str | None:
  """The line that says which checkpoints ``workdir`` holds now (a resume
  starts from the newest) and which saves did not finish; None without a
  ``checkpoints`` directory. The rows' checkpoint count is not that: a row is
  written when a save starts (it finishes in the background), and older steps
  are pruned, so after a crash the newest row can name a save that never
  finished."""
  from jaxcoll import disk  # noqa: PLC0415  (orbax's marker name: only when asked)

  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    return None
  dirs = disk.step_dirs(directory)
  committed_steps = [step for step, committed in dirs if committed]
  # A committed step whose state/ directory was deleted by hand (`rm -rf checkpoints/6/state`)
  # is one a resume skips as damaged (Checkpointer.restore): it is not where a resume starts.
  gone = [step for step in committed_steps
          if not os.path.isdir(os.path.join(directory, str(step), "state"))]
  complete = [step for step in committed_steps if step not in gone]
  # The ones a recorded rollback abandoned (a kill between its record and its set-aside
  # leaves them here): a resume sets them aside first and never restores them.
  with contextlib.ExitStack() as stack:
    opened = []

    def view():  # one read-only Checkpointer for every step read, opened when first needed
      if not opened:
        from jaxcoll.train import checkpoint  # noqa: PLC0415  (only for a workdir with steps)

        opened.append(stack.enter_context(
            checkpoint.Checkpointer(directory, keep=None, read_only=True)))
      return opened[0]

    abandoned, damaged = _abandoned_and_damaged(workdir, directory, complete, view)
  complete = [step for step in complete if step not in abandoned and step not in damaged]
  unfinished = sorted({step for step, committed in dirs if not committed}
                      | set(disk.unfinished_saves(directory)))
  line = (f"checkpoints on disk: {_steps_text(complete)} (newest {complete[-1]}: a resume "
          "starts there)" if complete else "checkpoints on disk: none complete (a resume "
          "starts from step 0)")
  if gone:
    line += (f"; damaged: {_steps_text(gone)} (its state/ directory is gone: a resume skips "
             "it)")
  for step, why in sorted(damaged.items()):
    line += f"; damaged: {step} ({why}: a resume skips it)"
  for step, d in sorted(abandoned.items()):
    where = d.get("set_aside_to") or f"checkpoints_rolled_back/incident_step_{d.get('step')}"
    line += (f"; abandoned: {step} (saved in the stretch that rollback {d.get('rollback')} to "
             f"checkpoint {d.get('checkpoint_restored')} abandoned, recorded in "
             f"incident_state.json: a resume sets it aside to {where}, never resumes from it)")
  if unfinished:
    line += (f"; not finished: {_steps_text(unfinished)} (a save in flight, or cut short by "
             "the job's end: never read, removed by the next run)")
  return line


def _abandoned_and_damaged(workdir: str, directory: str, complete: Sequence[int],
                           view) -> tuple[dict[int, Any], dict[int, str]]:
  """The checkpoints among ``complete`` that a recorded rollback abandoned (a kill between its
  record and its set-aside leaves them here: a resume sets them aside first and never
  restores them), and the newest of the others whose bytes are not those saved (or do not
  read): a resume skips them as damaged (Checkpointer.restore), so the resume point is the
  newest that checks out. ``view()``: the read-only Checkpointer both read through."""
  abandoned = _abandoned(workdir, view, complete)
  damaged: dict[int, str] = {}
  # Checkpoints of jaxcoll's Checkpointer each have a meta/ (the fingerprints): one without
  # it among those that have it was emptied by hand, and a resume skips it.
  kept = [s for s in complete if s not in abandoned]
  with_meta = any(os.path.isdir(os.path.join(directory, str(s), "meta")) for s in kept)
  for step in reversed(kept):
    why = _damaged(directory, step, view, expect_meta=with_meta)
    if why is None:
      break
    if why:
      damaged[step] = why
  return abandoned, damaged


def _abandoned(workdir: str, view, steps: Sequence[int]) -> dict[int, Any]:
  """The checkpoints among ``steps`` that a rollback recorded in ``workdir``'s
  incident_state.json abandoned, each with that rollback's record (the rule of a resume:
  :func:`jaxcoll.run.incidents.abandoning_rollback`); {} without recorded rollbacks. A state
  file that does not read is left to the resume to refuse (the report names nothing)."""
  from jaxcoll.run import incidents  # noqa: PLC0415  (only for a workdir with checkpoints)

  try:
    with open(os.path.join(workdir, incidents.STATE_NAME)) as f:
      rollbacks = json.load(f).get("rollbacks") or []
    for d in rollbacks:
      int(d["rollback"]), int(d["checkpoint_restored"])
  except (OSError, ValueError, TypeError, KeyError, AttributeError):
    return {}
  if not rollbacks or not steps:
    return {}
  found = {}
  for step in steps:
    try:
      extra = view().metadata(step).get("extra") or {}
    except ValueError:  # damaged metadata: the damage check says it
      continue
    d = incidents.abandoning_rollback(rollbacks, step, extra)
    if d is not None:
      found[step] = d
  return found


VERIFY_MAX_BYTES = 1 << 30  # a checkpoint's arrays the report reads back to check, at most


def _damaged(directory: str, step: int, view, *, expect_meta: bool = True) -> str | None:
  """Why checkpoint ``step`` of ``directory`` is damaged, as a resume would find it: its
  metadata does not read or fails its sha256, its arrays do not read, or their bytes are
  not those saved (the fingerprints of its save, compared leaf by leaf, read on the host
  without a model; ``meta/`` gone, where ``expect_meta``: the run's other checkpoints
  have one). None when it checks out or is not checked (no ``meta/`` directory,
  arrays over ``VERIFY_MAX_BYTES``, leaves it cannot pair with the metadata's); ``""`` when
  it was removed while read (a training job's prune): neither damaged nor the resume point."""
  import numpy as np  # noqa: PLC0415  (only for a workdir with checkpoints)

  from jaxcoll import fingerprint  # noqa: PLC0415

  path = os.path.join(directory, str(step))
  if not os.path.isdir(os.path.join(path, "meta")):  # no fingerprints to check against
    return "its meta/ directory is gone" if expect_meta and os.path.isdir(path) else None
  try:
    leaves = view().metadata(step).get("leaves") or []
  except ValueError as e:  # "the metadata of checkpoint D/N is damaged (...)"
    return "" if not os.path.isdir(path) else f"its metadata does not read back ({e})"
  why, bad = None, []
  try:
    size = sum(int(np.prod(d["shape"])) * np.dtype(d["dtype"]).itemsize for d in leaves)
  except Exception:  # noqa: BLE001  (a dtype numpy does not name, e.g. a PRNG key's: unchecked)
    return None
  try:
    read = _read_arrays(os.path.join(path, "state")) if size <= VERIFY_MAX_BYTES else None
    if read is not None and sorted(read) == sorted(_plain_path(d["path"]) for d in leaves):
      import jax  # noqa: PLC0415

      with jax.default_device(jax.devices("cpu")[0]):  # never on an accelerator in use
        prints = fingerprint.fingerprint([read[_plain_path(d["path"])] for d in leaves])
      bad = [d["path"] for d, f in zip(leaves, prints) if int(f) != int(d["fingerprint"])]
  except Exception as e:  # noqa: BLE001  (any failure to read is damage, as for a restore)
    said = " ".join(str(e).split(" See full TensorStore details")[0].split())[:200]
    why = f"its arrays cannot be read ({type(e).__name__}: {said})"
  if not os.path.isdir(path):
    return ""
  if bad:
    why = (f"the bytes of {len(bad)} leaf(s) differ from what was saved: "
           + ", ".join(bad[:3]) + (", ..." if len(bad) > 3 else ""))
  return why


def _plain_path(name: str) -> str:
  """A saved leaf's name (jax's keystr of the canonical state: `['opt_state'][0].mu`) as
  read back without that state, where a named tuple's field is a dict key
  (`['opt_state'][0]['mu']`)."""
  import re  # noqa: PLC0415

  return re.sub(r"\.([A-Za-z_]\w*)", r"['\1']", name)


def _read_arrays(state: str) -> dict | None:
  """The arrays of a checkpoint's ``state/`` item as numpy, by :func:`_plain_path` name;
  None where this orbax's metadata has no tree to read them by.

  Raises:
    OSError, ValueError: they cannot be read (damage, as a restore says it).
  """
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  import orbax.checkpoint as ocp  # noqa: PLC0415

  orbax_log = logging.getLogger("absl")  # its "Failed to get item metadata" for damage: ours
  level = orbax_log.level
  orbax_log.setLevel(logging.ERROR)
  try:
    with ocp.PyTreeCheckpointer() as reader:
      found = reader.metadata(state)  # orbax's tree of the saved arrays (shapes, dtypes)
      found = getattr(found, "item_metadata", found)
      if found is None:  # orbax could not read it
        raise ValueError("orbax reads no metadata of its arrays")
      tree = getattr(found, "tree", None)
      if not isinstance(tree, dict):  # another orbax's metadata: not checked here
        return None
      restore = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
      got = reader.restore(state, args=ocp.args.PyTreeRestore(restore_args=restore))
  finally:
    orbax_log.setLevel(level)
  return {_plain_path(jax.tree_util.keystr(p)): np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(got)[0]}


def summarize(run: Run) -> str:
  """The short text summary of the report; every number comes from the rows
  (or summary.json where named)."""
  s = run.summary or {}
  last = run.train[-1] if run.train else None
  lines = [f"run report: {run.workdir}"]
  steps = s.get("steps", last["step"] if last else None)
  ended = (run.attempts or [{}])[-1].get("end_step")
  if "steps" not in s and ended is not None:  # stopped (SIGTERM, an incident) after its last row
    steps = ended
  lines.append(f"steps: {steps} ({_rows(run.train, 'train ')}, {_rows(run.evals, 'eval ')}, "
               f"{_rows(run.checkpoints, 'checkpoint ')})")
  if run.no_metrics:
    lines.append(f"no metrics logged: {run.no_metrics} (a run killed before its first row, or "
                 "the file cut short, e.g. by a full disk); no curves, no step times; what "
                 "follows is from summary.json and checkpoints/")
  if run.incidents:
    kinds = ", ".join(f"{r['signal']} {r.get('action')} at {r['step']}" for r in run.incidents[:8])
    lines.append(f"incidents: {len(run.incidents)} ({kinds}"
                 + (", ..." if len(run.incidents) > 8 else "") + ")")
  if run.abandoned:
    rolled = sorted({r.get("abandoned_by_rollback") for r in run.abandoned} - {None})
    lines.append(f"abandoned rows: {len(run.abandoned)} (steps after the checkpoint of "
                 f"rollback {', '.join(map(str, rolled)) or '?'}, replayed on other batches; "
                 "not plotted, kept in metrics.jsonl with abandoned=true)")
  if run.attempts:
    statuses = ", ".join(str(a.get("status", "?")) for a in run.attempts)
    restarts = ", ".join(str(step) for step in run.restarts) or "none"
    lines.append(f"attempts: {len(run.attempts)} ({statuses}); restarts at step: {restarts}")
    final = run.attempts[-1]
    if final.get("status") == "failed" and final.get("reason"):  # the watchdog, a peer's end
      lines.append(f"  the last attempt failed after step {final.get('end_step')} (exit "
                   f"{final.get('exit_status')}): {final['reason']}")
    if run.attempts[-1].get("status") == "running" and not _lock_held(run.workdir):
      # A SIGKILLed or crashed job never writes its end: "running" would read as alive.
      lines.append("  the last attempt is not running (no process holds jaxcoll.lock): it "
                   "ended without a word (killed, or its host lost); the next run in this "
                   "workdir marks it interrupted and resumes from the newest checkpoint")
  elif run.summary is None:
    lines.append("attempts: unknown (no summary.json: the run has not finished)")
  elif run.restarts:
    lines.append(f"attempts: at least 2, the last resumed from step {run.restarts[0]} "
                 "(summary.json has no attempts history)")
  else:
    lines.append("attempts: 1 (summary.json has no attempts history)")
  if last is not None:
    lines.append(f"final loss: {_g(last.get('loss'))} at step {last['step']}")
  if run.evals:
    final = run.evals[-1]
    shown = ", ".join(f"{k}={_g(final[k])}" for k in run.eval_curves() if k in final)
    lines.append(f"final eval: {shown} at step {final['step']}")
  if run.eval_only:
    latest = run.eval_only[-1]
    shown = ", ".join(f"{k}={_g(latest[k])}" for k in run.eval_curves()
                      if isinstance(latest.get(k), (int, float)))
    lines.append(f"eval-only (experiments.eval): {_rows(run.eval_only)}; latest: {shown} at "
                 f"checkpoint {latest['step']} ({latest.get('eval_examples')} examples: "
                 f"{latest.get('eval_data')}, {latest.get('strategy')} on "
                 f"{latest.get('num_devices')} devices)")
  _, step_times = _series(run.train, "step_time_s")
  _, rates = _series(run.train, "examples_per_s")
  lines.append(f"step time: median {_g(_median(step_times), ' s')} over {_rows(step_times)}; "
               f"examples/s: median {_g(_median(rates))}")
  true = process_step_times(run)
  if true:
    lines.append("median step time per process (dispatch to ready): "
                 + _medians({p: _median(v) for p, (_, v) in sorted(true.items())}))
  slowest = [r["slowest_process"] for r in run.train if r.get("slowest_process") is not None]
  if slowest:
    pid, count = Counter(slowest).most_common(1)[0]
    per = {p: _median(v) for p, (_, v) in sorted(process_times(run).items())}
    lines.append(f"slowest process (most host time before dispatch): {pid} in {count} of "
                 f"{_rows(slowest)}; median host time before dispatch (data + dispatch) per "
                 f"process: {_medians(per)}")
  _, data_times = _series(run.train, "data_time_s")
  _, save_times = _series(run.checkpoints, "checkpoint_time_s")
  _, eval_times = _series(run.evals, "eval_time_s")
  lines.append(f"data time: median {_g(_median(data_times), ' s')} per step; checkpoints: "
               f"{len(run.checkpoints)} (median save {_g(_median(save_times), ' s')}); evals: "
               f"{len(run.evals)} (median {_g(_median(eval_times), ' s')})")
  on_disk = checkpoints_on_disk(run.workdir)
  if on_disk:
    lines.append(on_disk)
  _, skipped = _series(run.train, "skipped_steps")
  if skipped or "skipped_steps" in s:
    lines.append(f"skipped steps: {int(skipped[-1] if skipped else s['skipped_steps'])}")
  for key, what in (("comm_share_estimate", "comm share (cost-model estimate)"),
                    ("comm_share_measured", "comm share (measured from the trace)")):
    if isinstance(s.get(key), (int, float)):
      line = f"{what}: {100 * float(s[key]):.1f}% of the step"
      if key == "comm_share_estimate" and float(s[key]) > 1:
        # A share of more than the whole step is not a share: the cost model priced this
        # machine's collectives (with no overlap) above the step's measured time.
        priced = s.get("comm_time_estimate_s")
        priced = f" ({_g(float(priced), ' s')})" if isinstance(priced, (int, float)) else ""
        line += (f": more than the whole step, so the cost model's price of the step's "
                 f"collectives{priced} is too high for this machine, not a share; trace steps "
                 "(--config.profile_steps=A:B) for the measured one")
      source = s.get("comm_share_measured_from")
      if key == "comm_share_measured" and isinstance(source, dict):
        steps = source.get("steps")
        where = (f"steps {steps[0]}-{steps[1]} of " if isinstance(steps, list) and len(steps) == 2
                 else "")
        line += f" ({where}attempt {source.get('attempt', '?')})"
      lines.append(line)
  if s.get("memory_note"):  # summary.json's peak RSS beside XLA's peak x local devices
    lines.append(f"memory: {s['memory_note']}")
  return "\n".join(lines)


def _mark_events(ax, run: Run) -> None:
  """Checkpoints (grey dotted), restarts (red dashed) and incidents (purple
  dash-dot; thick for a rollback or stop) on the step axis."""
  for row in run.checkpoints:
    ax.axvline(row["step"], color="0.6", linestyle=":", linewidth=1, zorder=0)
  for row in run.incidents:
    strong = row.get("action") in ("rollback", "stop")
    ax.axvline(row["step"], color="tab:purple", linestyle="-.", linewidth=2 if strong else 1,
               zorder=0)
    if row.get("action") == "rollback" and isinstance(row.get("checkpoint_restored"), int):
      # where the kept trajectory goes on from (the abandoned rows are not plotted)
      ax.axvline(row["checkpoint_restored"], color="tab:purple", linestyle="-", linewidth=2.5,
                 alpha=0.5, zorder=0)
  for step in run.restarts:
    ax.axvline(step, color="tab:red", linestyle="--", linewidth=1.5, zorder=0)


def _log_if_spread(ax, values: Sequence[float]) -> bool:
  """A log scale when the values span more than 20x (spikes hide the rest)."""
  positive = [v for v in values if v > 0]
  if positive and len(positive) == len(values) and max(positive) > 20 * min(positive):
    ax.set_yscale("log")
    return True
  return False


def _honest(ax, values: Sequence[float], *, log: bool = False) -> None:
  """An axis that shows the scale: from 0 for values that cannot be negative
  (unless log), and the span of the values printed in the panel's corner."""
  values = [v for v in values if v == v]  # not NaN
  if not values:
    return
  if not log and min(values) >= 0:
    ax.set_ylim(bottom=0, top=max(values) * 1.08 if max(values) > 0 else 1)
  low, high = min(values), max(values)
  ax.text(0.01, 0.98, f"span {_g(low)} to {_g(high)}" + (" (log scale)" if log else ""),
          transform=ax.transAxes, ha="left", va="top", fontsize="small", color="0.35")


def _title(ax, what: str, measures: str) -> None:
  """The panel's title and, under it, what it measures."""
  ax.set_title(f"{what}\n{measures}", fontsize=10, loc="center")


def _empty(ax, text: str) -> None:
  ax.set_yticks([])
  ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")


def _loss_panel(ax, run: Run) -> None:
  _title(ax, "loss", "train: mean over the global batch at logged steps; eval: whole eval set")
  shown = _series(run.train, "loss")
  ax.plot(*shown, label="train loss")
  values = list(shown[1])
  if "eval_loss" in run.eval_curves():
    if run.evals:
      ax.plot(*_series(run.evals, "eval_loss"), marker="o", label="eval loss")
      values += _series(run.evals, "eval_loss")[1]
    if run.eval_only:
      ax.plot(*_series(run.eval_only, "eval_loss"), "x", markersize=9,
              label="eval loss (eval-only runs)")
      values += _series(run.eval_only, "eval_loss")[1]
  _honest(ax, values)
  ax.legend(fontsize="small", loc="upper right")


def _eval_panel(ax, run: Run) -> None:
  curves = [k for k in run.eval_curves() if k != "eval_loss"]
  if curves:
    _title(ax, "eval metrics", "over the whole eval set, each example once (eval_every)")
    values = []
    for key in curves:
      if _series(run.evals, key)[0]:
        ax.plot(*_series(run.evals, key), marker="o", label=key)
        values += _series(run.evals, key)[1]
      if _series(run.eval_only, key)[0]:
        ax.plot(*_series(run.eval_only, key), "x", markersize=9, label=f"{key} (eval-only)")
        values += _series(run.eval_only, key)[1]
    _honest(ax, values)
    ax.legend(fontsize="small", loc="upper right")
    return
  _title(ax, "gradient norm and learning rate",
         "global L2 norm before clipping; the rate of the logged step's update")
  norm_steps, norm = _series(run.train, "grad_norm")
  lr_steps, lr = _series(run.train, "learning_rate")
  if not norm and not lr:
    _empty(ax, "no eval metrics, gradient norms or learning rates in the rows")
    return
  ax.plot(norm_steps, norm, label="grad_norm")
  _honest(ax, norm)
  ax.legend(loc="upper left", fontsize="small", bbox_to_anchor=(0, 0.92))
  if lr:
    twin = ax.twinx()
    twin.plot(lr_steps, lr, color="tab:green", label="learning_rate")
    twin.set_ylim(bottom=0, top=max(lr) * 1.08 if max(lr) > 0 else 1)
    twin.legend(loc="upper right", fontsize="small")


def _step_time_panel(ax, run: Run) -> None:
  true, own = process_step_times(run), _per_process(run, "process_time_s")
  if not true:  # rows of an older run: process 0's step time (and the own times, so named)
    true = {0: _series(run.train, "step_time_s")} if run.train else {}
  _title(ax, "step time per process (s)",
         "solid: dispatch to ready; dashed: host time before dispatch")
  shown = []
  if len(true) > MAX_PROCESS_LINES:  # a band, and the process that was slowest most often
    rows = [r for r in run.train if isinstance(r.get("process_step_time_s"), list)]
    steps = [r["step"] for r in rows]
    times = [[t for t in r["process_step_time_s"] if isinstance(t, (int, float))] for r in rows]
    ax.fill_between(steps, [min(t) for t in times], [max(t) for t in times], alpha=0.25,
                    label=f"fastest to slowest of {len(true)} processes")
    ax.plot(steps, [statistics.median(t) for t in times], label="median process")
    shown += [t for ts in times for t in ts]
    slowest = Counter(r.get("slowest_process") for r in run.train).most_common(1)[0][0]
    if slowest in own:
      ax.plot(*own[slowest], linestyle="--", color="tab:red",
              label=f"process {slowest}: host time before dispatch")
      shown += own[slowest][1]
  else:
    for pid, (steps, times) in sorted(true.items()):
      line, = ax.plot(steps, times, marker=".", label=f"process {pid}")
      shown += times
      if pid in own:
        ax.plot(*own[pid], linestyle="--", linewidth=1, color=line.get_color())
        shown += own[pid][1]
  if not true:
    _empty(ax, "no step times in the rows")
    return
  _honest(ax, shown, log=_log_if_spread(ax, shown))
  ax.legend(fontsize="small", ncol=2 if len(true) > 4 else 1, loc="upper right")


def _throughput_panel(ax, run: Run) -> None:
  _title(ax, "examples / s", "global batch / step time (dispatch to ready) of process 0")
  steps, rates = _series(run.train, "examples_per_s")
  ax.plot(steps, rates, marker=".")
  _honest(ax, rates)


def _overhead_panel(ax, run: Run) -> None:
  _title(ax, "data, checkpoint and eval time (s)",
         "data: per step, outside the step time; saves and evals: each one")
  shown = []
  for rows, key, marker in ((run.train, "data_time_s", None),
                            (run.checkpoints, "checkpoint_time_s", "s"),
                            (run.evals, "eval_time_s", "^")):
    steps, values = _series(rows, key)
    if values:  # data time is per step (a line); saves and evals are events (markers)
      ax.plot(steps, values, linestyle="-" if marker is None else "none",
              marker=marker or ".", label=key)
      shown += values
  if shown:
    _honest(ax, shown, log=_log_if_spread(ax, shown))
    ax.legend(fontsize="small", loc="upper right")
  else:
    _empty(ax, "no data / checkpoint / eval times in the rows")


def _skipped_panel(ax, run: Run) -> None:
  _title(ax, "skipped steps (total)", "steps left out for non-finite gradients (nan_policy)")
  steps, skipped = _series(run.train, "skipped_steps")
  if skipped:
    ax.step(steps, skipped, where="post")
    _honest(ax, skipped)
  else:
    _empty(ax, "not counted (nan_policy='none')")


_PANELS = (_loss_panel, _eval_panel, _step_time_panel, _throughput_panel, _overhead_panel,
           _skipped_panel)


def _figure_title(run: Run) -> str:
  s = run.summary or {}
  config = s.get("config") if isinstance(s.get("config"), dict) else {}
  parts = [f"{k}={config[k]}" for k in ("model", "strategy", "algorithm") if k in config]
  if "num_devices" in s:
    parts.append(f"{s['num_devices']} devices, {s.get('num_processes', 1)} process(es)")
  title = f"{run.workdir}" + (f" ({', '.join(parts)})" if parts else "")
  return textwrap.fill(title, 120)  # fits the figure's width


def draw(run: Run, path: str) -> None:
  """Writes the report PNG (1600 x 1000 pixels, 2 x 3 panels) to ``path``.

  Raises:
    ImportError: matplotlib is not installed.
  """
  try:
    import matplotlib  # noqa: PLC0415
  except ImportError:
    raise ImportError(
        "the run report needs matplotlib, which is not installed; pip install 'jaxcoll[plot]' "
        "(or matplotlib)."
    ) from None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  from matplotlib.lines import Line2D  # noqa: PLC0415

  fig, axs = plt.subplots(2, 3, figsize=FIGURE_INCHES, layout="constrained")
  for ax, panel in zip(axs.flat, _PANELS):
    panel(ax, run)
    _mark_events(ax, run)
    ax.set_xlim(*run.step_range())
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
  for ax in fig.axes:  # twins too: a line of one point (a run of one logged step) is no line
    for line in ax.get_lines():
      if len(line.get_xdata()) == 1 and line.get_marker() in ("None", "", None, " "):
        line.set_marker("o")
  fig.suptitle(_figure_title(run))
  fig.legend(
      handles=[Line2D([], [], color="0.6", linestyle=":", label="checkpoint"),
               Line2D([], [], color="tab:red", linestyle="--", label="restart (new attempt)"),
               Line2D([], [], color="tab:purple", linestyle="-.", label="incident"),
               Line2D([], [], color="tab:purple", linewidth=2.5, alpha=0.5,
                      label="rolled back to (abandoned steps not plotted)")],
      loc="outside lower center", ncol=4, fontsize="small",  # the title holds the top row
  )
  tmp = f"{path}.tmp{os.getpid()}.png"
  fig.savefig(tmp, dpi=FIGURE_DPI)
  plt.close(fig)
  os.replace(tmp, path)


def write_report(workdir: str) -> str:
  """Writes ``workdir/report.png`` and ``workdir/report.txt``; returns the text.

  Raises:
    ValueError: see :func:`load_run`; nothing is written.
    ImportError: matplotlib is not installed; nothing is written.
  """
  run = load_run(workdir)
  text = summarize(run)
  draw(run, os.path.join(workdir, "report.png"))
  write_atomic(os.path.join(workdir, "report.txt"), text + "\n")
  return text
