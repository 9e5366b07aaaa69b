"""The bad-configuration error of the training loop and its helpers, and :func:`fail`.

``experiments.train`` reports a :class:`ConfigError` (defined in
:mod:`jaxcoll.errors`) in one line with exit status 2; any other exception
shows its traceback. :func:`fail` lives apart from ``loop.py`` so that the
modules the loop imports (inputs, optim) raise it without importing the loop
back.
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from typing import Any

from jaxcoll.errors import ConfigError as ConfigError

_JAXCOLL = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARIES = tuple(sorted({os.path.abspath(p) + os.sep for p in (
    sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib"))}))


def fail(field: str, value: Any, fix: str) -> ConfigError:
  """``ConfigError("`config.FIELD`=VALUE: FIX")``, to raise."""
  return ConfigError(f"`config.{field}`={value!r}: {fix}")


def from_user_code(error: BaseException) -> bool:
  """Whether ``error`` was raised in (or passed through) the user's own code:
  a frame of its traceback outside jaxcoll and outside the Python
  installation (the standard library, site-packages), e.g. the user's model
  function named by ``config.model="my_module:make"`` (the frame that caught
  the error is not counted). Such an error is not
  bad configuration of jaxcoll: its traceback must be shown."""
  frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
  for frame in frames[1:]:  # the first is the frame that caught it
    name = frame.f_code.co_filename
    if name.startswith("<"):  # generated code (a dataclass's __init__, <frozen ...>)
      continue
    path = os.path.abspath(name)
    if not path.startswith(_JAXCOLL) and not path.startswith(_LIBRARIES):
      return True
  return False
