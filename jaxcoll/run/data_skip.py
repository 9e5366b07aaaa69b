"""Which global batch each step trains on, past the batches a run skips.

Batches are numbered as steps are: batch ``n`` is the global batch step
``n`` trains on when nothing is skipped (1-based; its 0-based index ``n-1``
is what the synthetic data set and the file reader's ``next_index`` count).
``--config.data.skip=A:B[,C:D]`` drops batches ``A..B`` (inclusive, as
``profile_steps``) and ``C..D``: step ``A`` then trains on batch ``B+1``.
The schedule is a pure function of the step and the skipped ranges, the
same on every process and for any process count, so a run resumed from a
checkpoint (or rolled back by an incident, :mod:`jaxcoll.run.incidents`,
which adds ranges of its own) sees the batches an uninterrupted run with
the same ranges would.

Example:
  >>> s = BatchSchedule(parse_skip("3:4"))
  >>> [s.batch_number(step) for step in range(1, 6)]
  [1, 2, 5, 6, 7]
  >>> s.add(6, 6)
  >>> [s.batch_number(step) for step in range(1, 6)]
  [1, 2, 5, 7, 8]
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from jaxcoll.run.config_error import fail as _fail

_RANGE = re.compile(r"\s*(-?\d+)\s*:\s*(-?\d+)\s*")
_FIX = "give batch ranges A:B (batch A to batch B, counted from 1 as steps are), comma-separated "


def parse_skip(value: Any, field: str = "data.skip") -> list[tuple[int, int]]:
  """``"A:B,C:D"`` -> ``[(A, B), (C, D)]`` (1-based, inclusive, sorted); ``""`` -> ``[]``.

  Raises:
    ConfigError: (a ``ValueError``) not ``A:B`` ranges, a batch below 1, a
      range that runs backwards, or ranges that overlap.
  """
  if value is None or (isinstance(value, str) and not value.strip()):
    return []
  if not isinstance(value, str):
    raise _fail(field, value, _FIX + f"in one string, e.g. --config.{field}=100:299.")
  ranges = []
  for part in value.split(","):
    match = _RANGE.fullmatch(part)
    if match is None:
      raise _fail(field, value, _FIX + f"e.g. --config.{field}=100:299,500:520.")
    first, last = int(match.group(1)), int(match.group(2))
    if first < 1:
      raise _fail(field, value, f"batches count from 1 (batch n is the one step n trains on); "
                  f"use --config.{field}=1:{max(last, 1)}.")
    if last < 1:  # backwards and below 1: the reversed range would not be one either
      raise _fail(field, value, f"batches count from 1 (batch n is the one step n trains on); "
                  f"use --config.{field}=1:{first}.")
    if last < first:
      raise _fail(field, value, f"the range {first}:{last} runs backwards; write it "
                  f"{last}:{first}.")
    ranges.append((first, last))
  ranges.sort()
  for (a, b), (c, d) in zip(ranges, ranges[1:]):
    if c <= b:
      raise _fail(field, value, f"the ranges {a}:{b} and {c}:{d} overlap; merge them into "
                  f"{a}:{max(b, d)}.")
  return ranges


def format_skip(ranges: Iterable[Sequence[int]]) -> str:
  """``[(3, 4), (9, 9)]`` -> ``"3:4,9:9"`` (what ``--config.data.skip`` takes)."""
  return ",".join(f"{int(a)}:{int(b)}" for a, b in ranges)


class BatchSchedule:
  """Step -> batch number, past sorted, disjoint skipped ranges.

  Args:
    ranges: ``(first, last)`` batch numbers to skip (1-based, inclusive).
  """

  def __init__(self, ranges: Iterable[Sequence[int]] = ()):
    self.ranges: list[tuple[int, int]] = []
    for first, last in ranges:
      self.add(first, last)

  def add(self, first: int, last: int) -> None:
    """Skips batches ``first..last`` too (merged with the ranges it touches)."""
    first, last = int(first), int(last)
    if first < 1 or last < first:
      raise ValueError(f"a skipped range must be 1 <= first <= last; got {first}:{last}.")
    merged = []
    for a, b in self.ranges:
      if b + 1 < first or a > last + 1:
        merged.append((a, b))
      else:
        first, last = min(a, first), max(b, last)
    merged.append((first, last))
    self.ranges = sorted(merged)

  def batch_number(self, step: int) -> int:
    """The batch step ``step`` (1-based) trains on."""
    n = int(step)
    for first, last in self.ranges:
      if first <= n:
        n += last - first + 1
      else:
        break
    return n

  @property
  def skipped(self) -> int:
    """How many batches the ranges hold."""
    return sum(b - a + 1 for a, b in self.ranges)
