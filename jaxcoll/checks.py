"""Argument checks shared by the library: one copy of each.

Errors follow the project rule: a ``ValueError`` whose one line names the
argument in backticks, shows the bad value and says what is valid.

Example:
  >>> from jaxcoll import checks
  >>> checks.positive_int(8, "num_devices")
  8
  >>> checks.axis_names("data")
  ('data',)
  >>> checks.finite_number("0.5"), checks.finite_number(float("nan"))
  (0.5, None)
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

AxisName = Hashable | Sequence[Hashable]


def is_int(value: Any) -> bool:
  """Whether ``value`` is a Python or numpy integer (``bool`` is not one)."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def positive_int(value: Any, name: str, *, minimum: int = 1, fix: str = "") -> int:
  """``value`` as an ``int`` when it is an integer ``>= minimum``.

  Args:
    value: the argument to check.
    name: its name, as the caller spells it (shown in backticks).
    minimum: the smallest valid value (1 by default; 0 for counts that may be
      empty, 2 for step factors, ...).
    fix: what to pass instead, appended to the message (e.g. "Use 1 for no
      accumulation.").

  Raises:
    ValueError: ``value`` is not an integer (``True`` is not one) or is below
      ``minimum``.
  """
  if not is_int(value) or value < minimum:
    what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    raise ValueError(f"`{name}` must be {what}, got {value!r}." + (f" {fix}" if fix else ""))
  return int(value)


def axis_names(axis_name: AxisName) -> tuple[Hashable, ...]:
  """One mesh axis name or a tuple / list of them, as a tuple.

  ``"data"`` -> ``("data",)``; ``("node", "local")`` stays as it is.
  """
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def axis_spec(axis_name: AxisName):
  """The ``PartitionSpec`` entry of ``axis_name``: one name, or a tuple of names."""
  axes = axis_names(axis_name)
  return axes[0] if len(axes) == 1 else axes


def axis_size(mesh: Any, axis_name: AxisName) -> int:
  """How many devices ``axis_name`` (one mesh axis or a tuple of them) spans on
  ``mesh``: the product of the axes' sizes. The axes must be the mesh's (callers
  check the names first, with their own message)."""
  return math.prod(int(mesh.shape[a]) for a in axis_names(axis_name))


def is_real(value: Any) -> bool:
  """Whether ``value`` is a Python or numpy real number, not NaN (``bool`` is not one;
  infinity is)."""
  ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
  return ok and not math.isnan(value)


def real_scalar(value: Any) -> float | None:
  """``value`` as a ``float`` when it is a real number, not NaN: one :func:`is_real`
  accepts, or a 0-d array of a real dtype (``jnp.float32(1.0)``, what a jnp expression
  gives); else None (``True``, text, NaN, a complex number, an array of several elements).
  Infinity is one."""
  if not is_real(value):
    import jax.numpy as jnp  # noqa: PLC0415  (only for a value that is not a Python number)

    dtype = getattr(value, "dtype", None)
    if dtype is None or np.shape(value) != () or not (
        jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)):
      return None
  number = float(value)
  return None if math.isnan(number) else number


def finite_number(value: Any) -> float | None:
  """``value`` as a ``float`` when it is a finite real number (``1``, ``0.5``,
  ``"2.5"``, a numpy scalar), else None (NaN, infinity, ``True``, ``"x"``, None).

  The one copy of the check callers then bound (``number is None or number < 0``)
  and word in their own one-line error.
  """
  if isinstance(value, bool):
    return None
  try:
    number = float(value)
  except (TypeError, ValueError):
    return None
  return number if math.isfinite(number) else None


def short_repr(obj: Any, limit: int = 120) -> str:
  """``repr(obj)`` on one line, cut to ``limit`` characters (a model's repr is pages), for
  error lines."""
  text = " ".join(repr(obj).split())
  return text if len(text) <= limit else f"{text[:limit]}... ({type(obj).__name__})"
