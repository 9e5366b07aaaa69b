"""Byte counts as people write them: ``"64K"`` in, ``"64K"`` / ``"1.5 MiB"`` out.

K, M, G and T are powers of 1024 (as nccl-tests' ``-b 8 -e 128M``).

Example:
  >>> from jaxcoll import sizes
  >>> sizes.parse_size("64K")
  65536
  >>> sizes.human_bytes(65536), sizes.format_bytes(1.5 * 2**20)
  ('64K', '1.5 MiB')
"""

from __future__ import annotations

import re

from jaxcoll import checks

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"\s*(\d+)\s*([kKmMgGtT]?)(i?[bB])?\s*")


def parse_size(text: str | int, what: str = "size") -> int:
  """Parses a byte count: ``"64K"`` -> 65536; also ``64KB``, ``64KiB``, integers.

  Args:
    text: the size, a positive integer or text with an optional suffix.
    what: the argument's name, shown in backticks in the error (e.g.
      ``--max_bytes``).

  Raises:
    ValueError: not a positive integer with an optional K, M, G or T suffix.
  """
  if checks.is_int(text) and text >= 1:
    return int(text)
  m = _SIZE.fullmatch(str(text)) if isinstance(text, str) else None
  if not m or int(m.group(1)) < 1:
    raise ValueError(
        f"`{what}`={text!r} is not a size; use a positive integer with an optional "
        "K, M or G suffix (powers of 1024), e.g. 1K, 64M, 4G."
    )
  return int(m.group(1)) * UNITS[m.group(2).upper()]


def human_bytes(n: int) -> str:
  """``65536`` -> ``"64K"``: the largest whole unit; other sizes stay in bytes."""
  for unit in ("T", "G", "M", "K"):
    if n >= UNITS[unit] and n % UNITS[unit] == 0:
      return f"{n // UNITS[unit]}{unit}"
  return str(int(n))


def format_bytes(n: float) -> str:
  """``1.5 * 2**20`` -> ``"1.5 MiB"``, ``4 * 2**30`` -> ``"4 GiB"`` (IEC units, 3 digits)."""
  if abs(n) < 1024:
    return f"{n:.0f} B"
  value = float(n)
  for unit in ("KiB", "MiB", "GiB", "TiB"):
    value /= 1024
    if abs(value) < 1024 or unit == "TiB":
      break
  return f"{value:.0f} {unit}" if value.is_integer() else f"{value:.3g} {unit}"
