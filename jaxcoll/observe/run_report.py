"""The run report: one PNG and a short text, drawn from a run's own files.

``python -m experiments.report --workdir=DIR`` reads ``DIR/metrics.jsonl``
(train rows, eval rows, checkpoint rows) and ``DIR/summary.json`` (its
``attempts``, the one-off figures) and writes ``DIR/report.png``, a grid of
panels on the step axis with checkpoints and restarts marked, and
``DIR/report.txt``, the summary it prints.

Example:
  >>> run = jaxcoll.run_report.load_run("/tmp/run")  # doctest: +SKIP
  >>> print(jaxcoll.run_report.summarize(run))  # doctest: +SKIP
  >>> jaxcoll.run_report.draw(run, "/tmp/run/report.png")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from jaxcoll.observe import metrics
from jaxcoll.atomic_write import write_atomic

FIGURE_INCHES, FIGURE_DPI = (16, 10), 100  # 1600 x 1000 pixels
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
  """

  workdir: str
  train: list[dict[str, Any]]
  evals: list[dict[str, Any]]
  checkpoints: list[dict[str, Any]]
  summary: dict[str, Any] | None

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
    path = os.path.join(self.workdir, "incidents.jsonl")
    rows = []
    if os.path.isfile(path):
      with open(path) as f:
        for line in f:
          with contextlib.suppress(ValueError):
            row = json.loads(line)
            if isinstance(row, dict) and isinstance(row.get("step"), int):
              rows.append(row)
    return rows

  def step_range(self) -> tuple[int, int]:
    """0 to the last step of any row (and a margin): the step axis of every panel."""
    last = max([r["step"] for r in self.train + self.evals + self.checkpoints] + [1])
    return 0, last + max(1, last // 50)

  def eval_curves(self) -> list[str]:
    """The eval metric names, in the order the rows give them."""
    names = dict.fromkeys(k for r in self.evals for k in r if k.startswith("eval_"))
    return [k for k in names if k not in _EVAL_NOT_CURVES]


def load_run(workdir: str) -> Run:
  """Reads the rows and the summary of ``workdir``.

  Raises:
    ValueError: ``workdir`` is not a directory, has no ``metrics.jsonl``, or
      that file has no rows or an unreadable line.
  """
  if not os.path.isdir(workdir):
    raise ValueError(f"`--workdir` {workdir!r} is not a directory; pass the --workdir of a "
                     "training run (it holds metrics.jsonl).")
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.isfile(path):
    raise ValueError(f"`--workdir` {workdir!r} has no metrics.jsonl; pass the --workdir of a "
                     "training run that logged at least one step.")
  rows = metrics.read_metrics(workdir)
  if not rows:
    raise ValueError(f"{path} has no rows; train at least `log_every` steps first.")
  summary = None
  summary_path = os.path.join(workdir, "summary.json")
  if os.path.isfile(summary_path):
    with open(summary_path) as f:
      try:
        summary = json.load(f)
      except ValueError as e:
        raise ValueError(f"{summary_path} is not JSON ({e}); move it away to report the "
                         "rows alone.") from None
  return Run(
      workdir=workdir,
      train=[r for r in rows if "loss" in r],
      evals=[r for r in rows if any(k.startswith("eval_") and k not in _EVAL_NOT_CURVES
                                    for k in r)],
      checkpoints=[r for r in rows if "checkpoint_time_s" in r],
      summary=summary if isinstance(summary, dict) else None,
  )


def _series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
  """(steps, values) of the rows where ``key`` is a number."""
  pairs = [(r["step"], r[key]) for r in rows
           if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
  return [p[0] for p in pairs], [float(p[1]) for p in pairs]


def _median(values: Sequence[float]) -> float | None:
  return statistics.median(values) if values else None


def process_times(run: Run) -> dict[int, tuple[list[int], list[float]]]:
  """Per process id: (steps, step times) from the rows' ``process_time_s``
  lists; falls back to ``{0: step_time_s}`` for rows without them."""
  per: dict[int, tuple[list[int], list[float]]] = {}
  for row in run.train:
    times = row.get("process_time_s")
    if not isinstance(times, list):
      continue
    for pid, t in enumerate(times):
      if isinstance(t, (int, float)):
        per.setdefault(pid, ([], []))[0].append(row["step"])
        per[pid][1].append(float(t))
  return per or ({0: _series(run.train, "step_time_s")} if run.train else {})


def _g(value: float | None, unit: str = "") -> str:
  return "n/a" if value is None else f"{value:.4g}{unit}"


def summarize(run: Run) -> str:
  """The short text summary of the report; every number comes from the rows
  (or summary.json where named)."""
  s = run.summary or {}
  last = run.train[-1] if run.train else None
  lines = [f"run report: {run.workdir}"]
  steps = s.get("steps", last["step"] if last else None)
  lines.append(f"steps: {steps} ({len(run.train)} train rows, {len(run.evals)} eval rows, "
               f"{len(run.checkpoints)} checkpoint rows)")
  if run.incidents:
    kinds = ", ".join(f"{r['signal']} {r.get('action')} at {r['step']}" for r in run.incidents[:8])
    lines.append(f"incidents: {len(run.incidents)} ({kinds}"
                 + (", ..." if len(run.incidents) > 8 else "") + ")")
  if run.attempts:
    statuses = ", ".join(str(a.get("status", "?")) for a in run.attempts)
    restarts = ", ".join(str(step) for step in run.restarts) or "none"
    lines.append(f"attempts: {len(run.attempts)} ({statuses}); restarts at step: {restarts}")
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
  _, step_times = _series(run.train, "step_time_s")
  _, rates = _series(run.train, "examples_per_s")
  lines.append(f"step time: median {_g(_median(step_times), ' s')} over {len(step_times)} rows; "
               f"examples/s: median {_g(_median(rates))}")
  slowest = [r["slowest_process"] for r in run.train if r.get("slowest_process") is not None]
  if slowest:
    pid, count = Counter(slowest).most_common(1)[0]
    per = {p: _median(v) for p, (_, v) in sorted(process_times(run).items())}
    if len(per) > MAX_PROCESS_LINES:
      fast, slow = min(per, key=per.get), max(per, key=per.get)
      medians = (f"fastest {fast}: {_g(per[fast], ' s')}, median "
                 f"{_g(_median(list(per.values())), ' s')}, slowest {slow}: {_g(per[slow], ' s')}")
    else:
      medians = ", ".join(f"{p}: {_g(t, ' s')}" for p, t in per.items())
    lines.append(f"slowest process: {pid} in {count} of {len(slowest)} rows; median step time "
                 f"per process: {medians}")
  _, data_times = _series(run.train, "data_time_s")
  _, save_times = _series(run.checkpoints, "checkpoint_time_s")
  _, eval_times = _series(run.evals, "eval_time_s")
  lines.append(f"data time: median {_g(_median(data_times), ' s')} per step; checkpoints: "
               f"{len(run.checkpoints)} (median save {_g(_median(save_times), ' s')}); evals: "
               f"{len(run.evals)} (median {_g(_median(eval_times), ' s')})")
  _, skipped = _series(run.train, "skipped_steps")
  if skipped or "skipped_steps" in s:
    lines.append(f"skipped steps: {int(skipped[-1] if skipped else s['skipped_steps'])}")
  for key, what in (("comm_share_estimate", "comm share (cost-model estimate)"),
                    ("comm_share_measured", "comm share (measured from the trace)")):
    if isinstance(s.get(key), (int, float)):
      lines.append(f"{what}: {100 * float(s[key]):.1f}% of the step")
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
  for step in run.restarts:
    ax.axvline(step, color="tab:red", linestyle="--", linewidth=1.5, zorder=0)


def _log_if_spread(ax, values: Sequence[float]) -> None:
  """A log scale when the values span more than 20x (spikes hide the rest)."""
  positive = [v for v in values if v > 0]
  if positive and len(positive) == len(values) and max(positive) > 20 * min(positive):
    ax.set_yscale("log")


def _empty(ax, text: str) -> None:
  ax.set_yticks([])
  ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")


def _loss_panel(ax, run: Run) -> None:
  ax.set_title("loss")
  ax.plot(*_series(run.train, "loss"), label="train loss")
  if "eval_loss" in run.eval_curves():
    ax.plot(*_series(run.evals, "eval_loss"), marker="o", label="eval loss")
  ax.legend(fontsize="small")


def _eval_panel(ax, run: Run) -> None:
  curves = [k for k in run.eval_curves() if k != "eval_loss"]
  if curves:
    ax.set_title("eval metrics")
    for key in curves:
      ax.plot(*_series(run.evals, key), marker="o", label=key)
    ax.legend(fontsize="small")
    return
  ax.set_title("gradient norm and learning rate")
  norm_steps, norm = _series(run.train, "grad_norm")
  lr_steps, lr = _series(run.train, "learning_rate")
  if not norm and not lr:
    _empty(ax, "no eval metrics, gradient norms or learning rates in the rows")
    return
  ax.plot(norm_steps, norm, label="grad_norm")
  ax.legend(loc="upper left", fontsize="small")
  if lr:
    twin = ax.twinx()
    twin.plot(lr_steps, lr, color="tab:green", label="learning_rate")
    twin.legend(loc="upper right", fontsize="small")


def _step_time_panel(ax, run: Run) -> None:
  per = process_times(run)
  has_lists = any(isinstance(r.get("process_time_s"), list) for r in run.train)
  ax.set_title("step time per process (s)" if has_lists else "step time (s)")
  if len(per) > MAX_PROCESS_LINES:  # a band, and the process that was slowest most often
    rows = [r for r in run.train if isinstance(r.get("process_time_s"), list)]
    steps = [r["step"] for r in rows]
    times = [[t for t in r["process_time_s"] if isinstance(t, (int, float))] for r in rows]
    ax.fill_between(steps, [min(t) for t in times], [max(t) for t in times], alpha=0.25,
                    label=f"fastest to slowest of {len(per)} processes")
    ax.plot(steps, [statistics.median(t) for t in times], label="median process")
    slowest = Counter(r.get("slowest_process") for r in rows).most_common(1)[0][0]
    if slowest in per:
      ax.plot(*per[slowest], marker=".", color="tab:red", label=f"process {slowest}")
  else:
    for pid, (steps, times) in sorted(per.items()):
      ax.plot(steps, times, marker=".", label=f"process {pid}" if has_lists else "step_time_s")
  _log_if_spread(ax, [t for _, times in per.values() for t in times])
  if not per:
    _empty(ax, "no step times in the rows")
  else:
    ax.legend(fontsize="small", ncol=2 if len(per) > 4 else 1)


def _throughput_panel(ax, run: Run) -> None:
  ax.set_title("examples / s")
  ax.plot(*_series(run.train, "examples_per_s"), marker=".")


def _overhead_panel(ax, run: Run) -> None:
  ax.set_title("data, checkpoint and eval time (s)")
  shown = []
  for rows, key, marker in ((run.train, "data_time_s", None),
                            (run.checkpoints, "checkpoint_time_s", "s"),
                            (run.evals, "eval_time_s", "^")):
    steps, values = _series(rows, key)
    if values:  # data time is per step (a line); saves and evals are events (markers)
      ax.plot(steps, values, linestyle="-" if marker is None else "none",
              marker=marker or ".", label=key)
      shown += values
  _log_if_spread(ax, shown)
  if shown:
    ax.legend(fontsize="small")
  else:
    _empty(ax, "no data / checkpoint / eval times in the rows")


def _skipped_panel(ax, run: Run) -> None:
  ax.set_title("skipped steps (non-finite gradients, total)")
  steps, skipped = _series(run.train, "skipped_steps")
  if skipped:
    ax.step(steps, skipped, where="post")
  else:
    _empty(ax, "not counted (nan_policy='none')")


_PANELS = (_loss_panel, _eval_panel, _step_time_panel, _throughput_panel, _overhead_panel,
           _skipped_panel)


def _title(run: Run) -> str:
  s = run.summary or {}
  config = s.get("config") if isinstance(s.get("config"), dict) else {}
  parts = [f"{k}={config[k]}" for k in ("model", "strategy", "algorithm") if k in config]
  if "num_devices" in s:
    parts.append(f"{s['num_devices']} devices, {s.get('num_processes', 1)} process(es)")
  return f"{run.workdir}" + (f" ({', '.join(parts)})" if parts else "")


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
  fig.suptitle(_title(run))
  fig.legend(
      handles=[Line2D([], [], color="0.6", linestyle=":", label="checkpoint"),
               Line2D([], [], color="tab:red", linestyle="--", label="restart (new attempt)"),
               Line2D([], [], color="tab:purple", linestyle="-.", label="incident")],
      loc="outside upper right", ncol=3, fontsize="small",
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
