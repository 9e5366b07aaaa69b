"""What a user watches during training: JSONL, TensorBoard, progress, timing.

Only process 0 writes (``is_chief``); every process may call the methods.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Mapping
from typing import Any, TextIO

import numpy as np
import tqdm

from jaxcoll.atomic_write import write_atomic
from jaxcoll.errors import TornLineWarning as TornLineWarning


INCIDENT_PREFIX = "incident/"  # the TensorBoard markers of jaxcoll.run.incidents


def _plain(value: Any) -> Any:
  """JSON-friendly values: numpy/jax scalars to float/int, NaN and infinity as None,
  lists (and tuples, 1-D arrays) element by element."""
  if isinstance(value, (bool, str)) or value is None:
    return value
  if isinstance(value, (int, np.integer)):
    return int(value)
  if isinstance(value, (list, tuple)) or (isinstance(value, np.ndarray) and value.ndim > 0):
    return [_plain(v) for v in value]
  try:
    f = float(value)
  except (TypeError, ValueError):
    return str(value)
  return f if math.isfinite(f) else None


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


class MetricsWriter:
  """The one writer of a run: ``metrics.jsonl`` rows and TensorBoard events.

  ``write(step, row)`` appends one JSON line to ``metrics.jsonl`` and writes
  the row's numbers as TensorBoard scalars (lists, such as
  ``process_time_s``, go to the JSONL only). ``write_run_info(config,
  figures)``, once per attempt, writes the config (as text and as hparams)
  and the one-off figures (text, and scalars at the start step).

  TensorBoard: one run per workdir, ``DIR/tensorboard``. The event file is
  made on the first TensorBoard write, so a writer that writes nothing leaves
  no file; a resumed attempt adds its own file to the same directory (named
  so that files sort in time order; TensorBoard reads them as one run) and
  purges the steps after ``start_step`` that the previous attempt logged
  after its last checkpoint, as ``metrics.jsonl`` drops them.

  Example:
    >>> w = MetricsWriter("/tmp/run")  # doctest: +SKIP
    >>> w.write_run_info({"steps": 100, "model": "mlp"}, {"param_count": 1e6})  # doctest: +SKIP
    >>> w.write(10, {"loss": 0.5, "step_time_s": 0.01})  # doctest: +SKIP
  """

  def __init__(self, workdir: str, *, is_chief: bool = True, tensorboard: bool = True,
               start_step: int = 0):
    """``start_step``: the step a resumed run starts from; rows of later
    steps (logged before a crash, after the checkpoint) are dropped so that
    each step has one line."""
    self.is_chief = is_chief
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.tensorboard_dir = os.path.join(workdir, "tensorboard") if tensorboard else None
    self.start_step = int(start_step)
    self._file: TextIO | None = None
    self._tb = None
    if not is_chief:
      return
    os.makedirs(workdir, exist_ok=True)
    _truncate_after(self.path, start_step)
    self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()

  def _summary_writer(self):
    """tensorboardX's writer, made (with its event file) on first use."""
    if self._tb is None:
      from tensorboardX import SummaryWriter  # noqa: PLC0415 - import cost only when used

      # Nanoseconds and pid in the name: two attempts in one second (or one
      # process) never share a file (tensorboardX opens it with "wb"), and the
      # names sort in time order, the order TensorBoard reads a run's files in.
      self._tb = SummaryWriter(
          self.tensorboard_dir, filename_suffix=f".{time.time_ns()}.{os.getpid()}",
          purge_step=self.start_step + 1 if self.start_step else None,
      )
    return self._tb

  def write(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Appends the row ``{"step": step, **scalars}``; its numbers also go to TensorBoard."""
    if not self.is_chief:
      return
    row = {"step": int(step)} | {k: _plain(v) for k, v in scalars.items()}
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()
    numbers = {k: v for k, v in row.items() if k != "step" and _is_number(v)}
    if self.tensorboard_dir is not None and numbers:
      tb = self._summary_writer()
      for k, v in numbers.items():
        tb.add_scalar(k, v, global_step=int(step))
      tb.flush()

  def write_run_info(self, config: Mapping[str, Any], figures: Mapping[str, Any]) -> None:
    """Writes what describes the whole run to TensorBoard, at the start step.

    The config as a text table (tag ``config``) and as hparams (its scalar
    fields flattened to ``a.b`` names, in the same event file; the hparams
    table's metrics are ``loss`` and the numeric figures); the one-off
    ``figures`` (e.g. ``comm_bytes_per_step``, ``memory_bytes_per_device``,
    ``param_count``) as a text table (tag ``run_figures``) and the numeric
    ones as scalars. Nothing goes to ``metrics.jsonl`` (``summary.json``
    holds the figures).

    Args:
      config: the run's config, e.g. ``config.to_dict()``.
      figures: one-off figures of the run: name -> number (or a list / text,
        shown in the text table only).
    """
    if not self.is_chief or self.tensorboard_dir is None:
      return
    from tensorboardX.summary import hparams  # noqa: PLC0415

    flat = flatten_config(config)
    numbers = [k for k, v in figures.items() if _is_number(_plain(v))]
    tb = self._summary_writer()
    tb.add_text("config", markdown_table(flat, ("field", "value")), global_step=self.start_step)
    hparam_values = {k: v for k, v in flat.items() if v is not None}
    for summary in hparams(hparam_values, dict.fromkeys(["loss", *numbers])):
      tb.file_writer.add_summary(summary, global_step=self.start_step)
    tb.flush()
    self.write_figures(figures)

  def write_figures(self, figures: Mapping[str, Any], step: int | None = None) -> None:
    """Writes one-off figures to TensorBoard: a text table (tag
    ``run_figures``) and the numeric ones as scalars, at ``step`` (default
    the start step). :meth:`write_run_info` calls it; call it yourself for a
    figure known only later in the attempt (e.g. a share measured from a
    profiler trace).

    Args:
      figures: name -> number (or a list / text, shown in the table only).
      step: the step to show them at; default the attempt's start step.
    """
    plain = {k: _plain(v) for k, v in figures.items()}
    if not self.is_chief or self.tensorboard_dir is None or not plain:
      return
    step = self.start_step if step is None else int(step)
    tb = self._summary_writer()
    tb.add_text("run_figures", markdown_table(plain, ("figure", "value")), global_step=step)
    for k, v in plain.items():
      if _is_number(v):
        tb.add_scalar(k, v, global_step=step)
    tb.flush()

  def rewind(self, step: int, *, rollback: int) -> int:
    """After a rollback to checkpoint ``step``: the rows logged after it (the
    abandoned stretch, about to be replayed on other batches) stay in
    ``metrics.jsonl`` marked ``"abandoned": true`` and
    ``"abandoned_by_rollback": rollback`` (so the file keeps what happened,
    and a reader keeps the trajectory the run went on with:
    ``[r for r in rows if not r.get("abandoned")]``); TensorBoard gets a
    restart marker at ``step + 1`` (``SessionLog.START``), on which it drops
    the abandoned steps' events from display as it does for a resumed run's.
    Rows of incident markers only (``incident/<signal>``) are never marked
    (and are written to TensorBoard again after the restart marker).
    Returns how many rows were marked."""
    if not self.is_chief:
      return 0
    self._file.close()
    marked, lines, markers = 0, [], []
    for line, row in _read_rows(self.path):
      later = row.get("step", 0) > step
      if later and all(k.startswith(INCIDENT_PREFIX) for k in row if k != "step"):
        markers.append(row)  # an incident's marker: what happened, never abandoned
      elif later and not row.get("abandoned"):
        row = {**row, "abandoned": True, "abandoned_by_rollback": int(rollback)}
        line, marked = json.dumps(row) + "\n", marked + 1
      lines.append(line)
    if marked:
      write_atomic(self.path, "".join(lines))
    self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()
    if self.tensorboard_dir is not None:
      from tensorboardX.proto import event_pb2  # noqa: PLC0415

      tb = self._summary_writer()
      tb.file_writer.add_event(event_pb2.Event(
          step=int(step) + 1, session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
      for row in markers:  # the purge drops them too: written again after it
        for k, v in row.items():
          if k != "step" and _is_number(v):
            tb.add_scalar(k, v, global_step=int(row["step"]))
      tb.flush()
    return marked

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: scalars kept, lists and tuples
  as compact JSON text (hparams take numbers, strings and booleans)."""
  flat: dict[str, Any] = {}
  for key, value in config.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping):
      flat |= flatten_config(value, f"{name}.")
      continue
    plain = _plain(value)
    flat[name] = json.dumps(plain) if isinstance(plain, list) else plain
  return flat


def markdown_table(values: Mapping[str, Any], header: tuple[str, str]) -> str:
  """A two-column markdown table (TensorBoard's text plugin renders it)."""
  lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
  for key, value in values.items():
    shown = json.dumps(value) if isinstance(value, list) or value == "" else str(value)
    lines.append(f"| {key} | {shown.replace('|', '&#124;')} |")
  return "\n".join(lines)


def _read_rows(path: str, bad: list[str] | None = None, *, needs_step: bool = False,
               stacklevel: int = 3) -> list[tuple[str, dict[str, Any]]]:
  """``(line, row)`` of every row of ``path``; a line that is not a JSON row
  (a torn last one, a damaged one in the middle; with ``needs_step``, also an
  object without an integer ``step``) is dropped with a :class:`TornLineWarning`
  naming its line number in the file; the ones before the last are appended to ``bad``."""
  with open(path, errors="replace") as f:
    lines = [(number, line) for number, line in enumerate(f, 1) if line.strip()]
  rows = []
  for i, (number, line) in enumerate(lines):
    try:
      row = json.loads(line)
      if not isinstance(row, dict):
        raise ValueError("not a JSON object")
      if needs_step and (not isinstance(row.get("step"), int) or isinstance(row["step"], bool)):
        raise ValueError('no integer "step"')
    except ValueError as e:
      where = "the torn last line" if i == len(lines) - 1 else f"line {number} (not a JSON row)"
      warnings.warn(f"dropping {where} of {path} ({e}): {line[:80]!r}", TornLineWarning,
                    stacklevel=stacklevel)
      if bad is not None and i < len(lines) - 1:
        bad.append(line if line.endswith("\n") else line + "\n")
      continue
    rows.append((line if line.endswith("\n") else line + "\n", row))
  return rows


def _truncate_after(path: str, step: int) -> None:
  """Keeps the rows of ``path`` up to ``step`` (atomic rewrite), and the rows a
  rollback marked abandoned (what happened: never replayed, whatever the step
  a resume starts from, e.g. the rollback's target after a hard kill). Lines
  that are not JSON rows are dropped; all but a torn last one are kept aside in
  ``metrics.jsonl.unreadable-<unix time>`` (named in the warning)."""
  if not os.path.exists(path):
    return
  with open(path, errors="replace") as f:
    original = f.read()
  bad: list[str] = []
  kept = "".join(line for line, row in _read_rows(path, bad)
                 if row.get("step", 0) <= step or row.get("abandoned"))
  if kept == original:
    return
  if bad:
    name = f"{path}.unreadable-{time.time():.0f}"
    while os.path.exists(name):
      name += "+"
    write_atomic(name, "".join(bad))
    warnings.warn(f"kept the {len(bad)} unreadable line(s) of {path} aside in {name}",
                  TornLineWarning, stacklevel=2)
  write_atomic(path, kept)


def inside_run(workdir: str) -> tuple[str, int | None] | None:
  """(the run directory, the step or None) when ``workdir`` is a run's ``checkpoints/``
  directory or one checkpoint in it (``RUN/checkpoints/4``), a path a user passes as
  ``--workdir`` by mistake; else None."""
  from jaxcoll import disk  # orbax's names; imported here, metrics stays light
  path = os.path.abspath(workdir)
  name, parent = os.path.basename(path), os.path.dirname(path)
  if name == "checkpoints":
    return parent, None
  if (step := disk.step_of(name)) is not None and os.path.basename(parent) == "checkpoints":
    return os.path.dirname(parent), step
  return None


EVALS_NAME = "evals.jsonl"  # eval-only rows (python -m experiments.eval), apart from metrics.jsonl


def append_eval_row(row: Mapping[str, Any], directory: str) -> str:
  """Appends ``row`` to ``directory/evals.jsonl`` (created, with ``directory``, if missing)
  in one ``write`` (a reader never sees half a row of a finished write); returns the path.

  Raises:
    OSError: ``directory`` cannot be written (a read-only workdir): nothing is written.
  """
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, EVALS_NAME)
  append_line(path, json.dumps({k: _plain(v) for k, v in row.items()}))
  return path


def append_line(path: str, text: str, *, fsync: bool = False) -> None:
  """Appends ``text`` and a newline to the JSON Lines file ``path`` (created if missing) in
  one ``write``, on a line of its own: after a torn last line (a writer killed mid-row) a
  newline first, else the row was glued to it and lost with it to every reader.
  ``fsync``: on disk before it returns (``incidents.jsonl``'s rows)."""
  line = (text + "\n").encode()
  fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
  try:
    size = os.fstat(fd).st_size
    if size and os.pread(fd, 1, size - 1) != b"\n":
      line = b"\n" + line
    os.write(fd, line)
    if fsync:
      os.fsync(fd)
  finally:
    os.close(fd)


def read_eval_rows(*directories: str) -> list[dict[str, Any]]:
  """The eval-only rows of ``directories``' ``evals.jsonl`` (each directory once, missing
  files skipped, a torn or foreign line skipped), in the order they were written."""
  rows, seen = [], set()
  for d in directories:
    if not d or os.path.abspath(d) in seen:
      continue
    seen.add(os.path.abspath(d))
    rows += read_step_rows(os.path.join(d, EVALS_NAME))
  return sorted(rows, key=lambda r: r.get("evaluated_at") or 0)


def read_step_rows(path: str) -> list[dict[str, Any]]:
  """The JSON-object rows with an integer ``step`` of the JSON Lines file ``path``, in file
  order; a missing file is no rows. A torn or foreign line (not JSON, not an object, no
  integer ``step``) is skipped with a :class:`TornLineWarning` naming the file, the line
  number and its start (it was skipped without a word)."""
  if not os.path.isfile(path):
    return []
  return [row for _, row in _read_rows(path, needs_step=True, stacklevel=4)]


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """The rows of ``workdir/metrics.jsonl`` (for tests and notebooks); a torn
  last line is dropped with a :class:`TornLineWarning`."""
  return [row for _, row in _read_rows(os.path.join(workdir, "metrics.jsonl"))]


class Progress:
  """A tqdm progress bar on an interactive terminal, plain log lines otherwise.

  The one progress display of jaxcoll: the training loop shows steps with
  their scalars, the benchmark (``jaxcoll.bench.ProgressLine``) its cases.

  Args:
    total: the count at which the work is done.
    start: the count already done (a resumed run).
    stream: where to write; default ``sys.stderr``.
    is_chief: only the chief process writes.
    unit: what is counted, as the log lines and the bar name it.
  """

  def __init__(self, total: int, *, start: int = 0, stream: TextIO | None = None,
               is_chief: bool = True, unit: str = "step"):
    self.total, self.start, self.unit = total, start, unit
    self.stream = stream or sys.stderr
    self.is_chief = is_chief
    self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())
    self._bar = None
    self._scalars: dict[str, Any] = {}  # the last update's, for show_eval on the bar
    self._evals: list[tuple[int, dict[str, Any]]] = []  # (step, metrics) of each eval shown
    self._around_logs: tuple[logging.Handler, logging.Handler] | None = None
    if self.is_chief and self.interactive:
      self._open(start)

  def _open(self, initial: int) -> None:
    self._bar = bar = tqdm.tqdm(total=self.total, initial=initial, file=self.stream,
                                unit=self.unit, dynamic_ncols=True, leave=True)
    # A log line while the bar shows (an incident, a straggler): the bar's line is cleared
    # first and drawn again after it (it was glued to the half-drawn bar). The root
    # logger's handlers run in order: the first clears, the last draws.
    self._around_logs = (_Call(bar.clear), _Call(bar.refresh))
    root = logging.getLogger()
    root.handlers.insert(0, self._around_logs[0])
    root.handlers.append(self._around_logs[1])

  def update(self, step: int, scalars: Mapping[str, Any] | str) -> None:
    """Shows that ``step`` of ``total`` is reached, with ``scalars`` (or a text)."""
    if not self.is_chief:
      return
    if isinstance(scalars, str):
      shown = scalars
    else:
      self._scalars = dict(scalars)
      shown = " ".join(f"{k}={_format(v)}" for k, v in scalars.items()) + self._eval_text(step)
    if self._bar is None and self.interactive and step < self.total:
      self._open(step)  # a rollback after the last step's row: steps again, on a new bar
    if self._bar is not None:
      self._bar.n = step
      self._bar.set_postfix_str(shown, refresh=False)
      self._bar.refresh()
      if step >= self.total:
        self.close()
    else:
      self.stream.write(f"{self.unit} {step}/{self.total} {shown}\n")
      self.stream.flush()

  def show_eval(self, step: int, scalars: Mapping[str, Any]) -> None:
    """The eval metrics of ``step``: shown now (a line of their own, or on the
    bar with the last scalars), and carried by every later line and the bar
    as ``... eval_loss=... (eval at step N)`` until the next eval."""
    self._evals.append((step, dict(scalars)))
    if not self.is_chief:
      return
    if self._bar is not None:
      self.update(max(step, self._bar.n), self._scalars)
    else:
      shown = " ".join(f"{k}={_format(v)}" for k, v in scalars.items())
      self.stream.write(f"{self.unit} {step}/{self.total} {shown}\n")
      self.stream.flush()

  def rewind(self, step: int) -> None:
    """After a rollback to checkpoint ``step``: the evals of later steps (the abandoned
    stretch's, shown on every line as ``(eval at step N)`` while the replay counted up to N
    again, then as the replayed step's own) are no longer carried; the latest one up to
    ``step`` is again."""
    self._evals = [e for e in self._evals if e[0] <= step]

  def _eval_text(self, step: int) -> str:
    if not self._evals:
      return ""
    at, scalars = self._evals[-1]
    shown = " ".join(f"{k}={_format(v)}" for k, v in scalars.items())
    return f" {shown}" + ("" if at == step else f" (eval at step {at})")

  def close(self) -> None:
    """Ends the bar's line (a no-op for log lines, or when already closed)."""
    if self._around_logs is not None:
      for handler in self._around_logs:
        with contextlib.suppress(ValueError):
          logging.getLogger().removeHandler(handler)
      self._around_logs = None
    if self._bar is not None:
      self._bar.close()
      self._bar = None


class _Call(logging.Handler):
  """A log handler that calls ``fn()`` for every record (:class:`Progress`'s bar)."""

  def __init__(self, fn):
    super().__init__()
    self.fn = fn

  def emit(self, record: logging.LogRecord) -> None:
    del record
    with contextlib.suppress(Exception):  # the bar is a courtesy: never a logging error
      self.fn()


def _format(v: Any) -> str:
  """A value as the console shows it: ``2.403``, and NaN / infinity as ``nan`` / ``inf`` /
  ``-inf`` (JSON's None is for the files: a non-finite loss showed as ``loss=None``)."""
  if not isinstance(v, (bool, str)) and v is not None and np.ndim(v) == 0:
    with contextlib.suppress(TypeError, ValueError):
      f = float(v)
      if not math.isfinite(f):
        return str(f)
  v = _plain(v)
  if isinstance(v, float):
    return f"{v:.4g}"
  return str(v)
