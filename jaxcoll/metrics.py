"""What a user watches during training: JSONL, TensorBoard, progress, timing.

Only process 0 writes (``is_chief``); every process may call the methods.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from collections.abc import Mapping
from typing import Any, TextIO

import numpy as np


def _plain(value: Any) -> Any:
  """JSON-friendly scalars: numpy/jax scalars to float/int, NaN kept as None."""
  if isinstance(value, (bool, str)) or value is None:
    return value
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
  """A progress bar on an interactive terminal, plain log lines otherwise."""

  def __init__(self, total: int, *, start: int = 0, stream: TextIO | None = None,
               is_chief: bool = True, width: int = 30):
    self.total, self.start = total, start
    self.stream = stream or sys.stderr
    self.is_chief = is_chief
    self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())
    self.width = width
    self._t0 = time.perf_counter()

  def update(self, step: int, scalars: Mapping[str, Any]) -> None:
    if not self.is_chief:
      return
    shown = " ".join(f"{k}={_format(v)}" for k, v in scalars.items())
    if self.interactive:
      frac = min(max(step / max(self.total, 1), 0.0), 1.0)
      filled = int(frac * self.width)
      bar = "#" * filled + "." * (self.width - filled)
      eta = self._eta(step)
      self.stream.write(f"\r[{bar}] {step}/{self.total} {shown} eta {eta}   ")
      if step >= self.total:
        self.stream.write("\n")
    else:
      self.stream.write(f"step {step}/{self.total} {shown}\n")
    self.stream.flush()

  def _eta(self, step: int) -> str:
    done = step - self.start
    if done <= 0:
      return "?"
    left = (time.perf_counter() - self._t0) / done * (self.total - step)
    return f"{left:.0f}s"


def _format(v: Any) -> str:
  v = _plain(v)
  if isinstance(v, float):
    return f"{v:.4g}"
  return str(v)
