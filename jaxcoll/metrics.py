"""What a user watches during training: JSONL, TensorBoard, progress, timing.

Only process 0 writes (``is_chief``); every process may call the methods.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any, TextIO

import numpy as np
import tqdm


def _plain(value: Any) -> Any:
  """JSON-friendly scalars: numpy/jax scalars to float/int, NaN kept as None
  (a list or tuple of them, e.g. ``process_time_s``, element by element)."""
  if isinstance(value, (bool, str)) or value is None:
    return value
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  if isinstance(value, (int, np.integer)):
    return int(value)
  try:
    f = float(value)
  except (TypeError, ValueError):
    return str(value)
  return None if math.isnan(f) else f


class MetricsWriter:
  """Appends one JSON line per logged step to ``metrics.jsonl`` and writes
  the same scalars as TensorBoard event files (``tensorboard/``).

  Example:
    >>> w = MetricsWriter("/tmp/run")  # doctest: +SKIP
    >>> w.write(10, {"loss": 0.5, "step_time_s": 0.01})  # doctest: +SKIP
  """

  def __init__(self, workdir: str, *, is_chief: bool = True, tensorboard: bool = True,
               start_step: int = 0):
    """``start_step``: the step a resumed run starts from; rows of later
    steps (logged before a crash, after the checkpoint) are dropped so that
    each step has one line."""
    self.is_chief = is_chief
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._file: TextIO | None = None
    self._tb = None
    if not is_chief:
      return
    os.makedirs(workdir, exist_ok=True)
    _truncate_after(self.path, start_step)
    self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()
    if tensorboard:
      from tensorboardX import SummaryWriter  # noqa: PLC0415 - import cost only when used

      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, scalars: Mapping[str, Any]) -> None:
    if not self.is_chief:
      return
    row = {"step": int(step)} | {k: _plain(v) for k, v in scalars.items()}
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in row.items():
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
          self._tb.add_scalar(k, v, global_step=int(step))
      self._tb.flush()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None


class TornLineWarning(UserWarning):
  """The last line of metrics.jsonl was cut off (a kill or a full disk) and is dropped."""


def _read_rows(path: str) -> list[tuple[str, dict[str, Any]]]:
  """``(line, row)`` of every row of ``path``; a torn last line is dropped
  with a :class:`TornLineWarning`, any other unreadable line raises."""
  with open(path) as f:
    lines = [line for line in f if line.strip()]
  rows = []
  for i, line in enumerate(lines):
    try:
      row = json.loads(line)
      if not isinstance(row, dict):
        raise ValueError("not a JSON object")
    except ValueError as e:
      if i == len(lines) - 1:
        warnings.warn(
            f"dropping the torn last line of {path} ({e}): {line[:80]!r}", TornLineWarning,
            stacklevel=3,
        )
        break
      raise ValueError(
          f"{path} line {i + 1} is not a JSON row ({e}); repair or move that file away."
      ) from None
    rows.append((line if line.endswith("\n") else line + "\n", row))
  return rows


def _truncate_after(path: str, step: int) -> None:
  """Keeps the rows of ``path`` up to ``step`` (atomic rewrite); drops a torn last line."""
  if not os.path.exists(path):
    return
  with open(path) as f:
    original = f.read()
  kept = "".join(line for line, row in _read_rows(path) if row.get("step", 0) <= step)
  if kept == original:
    return
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(kept)
  os.replace(tmp, path)


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
    if self.is_chief and self.interactive:
      self._bar = tqdm.tqdm(total=total, initial=start, file=self.stream, unit=unit,
                            dynamic_ncols=True, leave=True)

  def update(self, step: int, scalars: Mapping[str, Any] | str) -> None:
    """Shows that ``step`` of ``total`` is reached, with ``scalars`` (or a text)."""
    if not self.is_chief:
      return
    if isinstance(scalars, str):
      shown = scalars
    else:
      shown = " ".join(f"{k}={_format(v)}" for k, v in scalars.items())
    if self._bar is not None:
      self._bar.n = step
      self._bar.set_postfix_str(shown, refresh=False)
      self._bar.refresh()
      if step >= self.total:
        self.close()
    else:
      self.stream.write(f"{self.unit} {step}/{self.total} {shown}\n")
      self.stream.flush()

  def close(self) -> None:
    """Ends the bar's line (a no-op for log lines, or when already closed)."""
    if self._bar is not None:
      self._bar.close()
      self._bar = None


def _format(v: Any) -> str:
  v = _plain(v)
  if isinstance(v, float):
    return f"{v:.4g}"
  return str(v)
