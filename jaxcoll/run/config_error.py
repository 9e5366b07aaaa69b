"""The bad-configuration error of the training loop and its helpers, and :func:`fail`.

``experiments.train`` reports a :class:`ConfigError` (defined in
:mod:`jaxcoll.errors`) in one line with exit status 2; any other exception
shows its traceback. :func:`fail` lives apart from ``loop.py`` so that the
modules the loop imports (inputs, optim) raise it without importing the loop
back.
"""

from __future__ import annotations

from typing import Any

from jaxcoll.errors import ConfigError as ConfigError


def fail(field: str, value: Any, fix: str) -> ConfigError:
  """``ConfigError("`config.FIELD`=VALUE: FIX")``, to raise."""
  return ConfigError(f"`config.{field}`={value!r}: {fix}")
