"""jaxcoll.checks: the one copy of the finite-number and mesh-axis-size checks."""

import math

import numpy as np
import pytest

from jaxcoll import checks
from jaxcoll.run import timing
from jaxcoll.runtime import distributed


@pytest.mark.parametrize("value, expected", [
    (1, 1.0), (0, 0.0), (-2.5, -2.5), ("2.5", 2.5), (np.float32(0.5), 0.5), (np.int64(3), 3.0),
])
def test_finite_number_is_the_float(value, expected):
  assert checks.finite_number(value) == expected


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "inf", "nan", "x", None,
                                   True, False, [1], {}])
def test_finite_number_is_none_for_anything_else(value):
  assert checks.finite_number(value) is None


def test_real_scalar_takes_numbers_and_0d_real_arrays_not_bool_text_or_nan():
  import jax.numpy as jnp  # noqa: PLC0415

  for value, expected in [(1, 1.0), (0.5, 0.5), (math.inf, math.inf), (np.float32(0.5), 0.5),
                          (np.int64(3), 3.0), (jnp.float32(0.5), 0.5), (jnp.int32(2), 2.0),
                          (jnp.asarray(0.5, jnp.bfloat16), 0.5), (np.asarray(0.25), 0.25)]:
    assert checks.real_scalar(value) == expected, value
  for value in (True, np.bool_(True), jnp.asarray(True), "0.5", None, math.nan,
                jnp.float32(math.nan), 1 + 2j, jnp.complex64(1), jnp.ones(2), [0.5]):
    assert checks.real_scalar(value) is None, value


class _Mesh:  # what axis_size reads of a jax Mesh
  shape = {"node": 2, "local": 4, "model": 3}


@pytest.mark.parametrize("axis, size", [("local", 4), (("node", "local"), 8),
                                        (["node", "local", "model"], 24), ((), 1)])
def test_axis_size(axis, size):
  assert checks.axis_size(_Mesh(), axis) == size


@pytest.mark.parametrize("value, ok", [(0.2, True), ("0.2", True), (0, True), (-1, False),
                                       (math.nan, False), ("inf", False), (True, False)])
def test_the_callers_bound_the_finite_number(value, ok):
  # timing (> 1, through run.config.check_straggler) and distributed (> 0) read
  # checks.finite_number, each with its own one-line message.
  if not ok:
    with pytest.raises(ValueError, match="straggler_factor`=.*must be a finite number > 1"):
      timing.StragglerDetector(value)
  assert timing.StragglerDetector("1.5").factor == 1.5
  if ok and checks.finite_number(value) > 0:
    assert distributed._check_timeout(value, "timeout_s") == float(value)
  else:
    with pytest.raises(ValueError, match="`timeout_s` must be a positive number of seconds"):
      distributed._check_timeout(value, "timeout_s")
