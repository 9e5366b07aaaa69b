"""Hooks the training loop calls at fixed points, and the fault injectors.

The loop in :mod:`jaxcoll.train.loop` has no fault injection of its own: it
calls every :class:`Hook` of its hook list before each step and before each
checkpoint save. The reliability tests install faults as hooks (or through
the config fields ``fail_at_step``, ``hang_at_step``, ``nan_at_step`` and
``desync_at_step``, which :func:`from_config` turns into hooks).

Example:
  >>> from jaxcoll.train import hooks
  >>> [type(h).__name__ for h in hooks.from_config({"nan_at_step": 3})]
  ['NanAt']
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from jaxcoll.train import state as state_lib

ENV_RESTART = "JAXCOLL_RESTART"
EXIT_INJECTED_FAULT = 17


class Hook:
  """A no-op hook; subclasses override the points they act at."""

  def before_step(self, step: int, batch, state):
    """Called before step ``step`` (1-based) runs; returns ``(batch, state)``."""
    del step
    return batch, state

  def before_save(self, step: int) -> None:
    """Called inside the watched region of the save of checkpoint ``step``."""
    del step


def _first_attempt_on_process_0() -> bool:
  return jax.process_index() == 0 and int(os.environ.get(ENV_RESTART, "0") or 0) == 0


class FailAt(Hook):
  """Process 0 exits abruptly (status 17) before step ``step``, first attempt only."""

  def __init__(self, step: int):
    self.step = step

  def before_step(self, step, batch, state):
    if step == self.step and _first_attempt_on_process_0():
      logging.warning("fail_at_step=%d: process 0 exits abruptly (fault injection).", step)
      os._exit(EXIT_INJECTED_FAULT)
    return batch, state


class HangAt(Hook):
  """Process 0 stops making progress before step ``step``, first attempt only."""

  def __init__(self, step: int):
    self.step = step

  def before_step(self, step, batch, state):
    if step == self.step and _first_attempt_on_process_0():
      logging.warning("hang_at_step=%d: process 0 hangs (fault injection).", step)
      while True:
        time.sleep(3600)
    return batch, state


class NanAt(Hook):
  """The batch of step ``step`` becomes non-finite (every attempt)."""

  def __init__(self, step: int):
    self.step = step

  def before_step(self, step, batch, state):
    if step == self.step:
      batch = jax.tree.map(
          lambda x: x * jnp.nan if jnp.issubdtype(x.dtype, jnp.floating) else x, batch
      )
    return batch, state


class DesyncAt(Hook):
  """One replica of the first parameter on process 0 drifts before step
  ``step`` (first attempt only)."""

  def __init__(self, step: int):
    self.step = step

  def before_step(self, step, batch, state):
    if step == self.step and _first_attempt_on_process_0():
      leaves, treedef = jax.tree.flatten(state.params)
      leaves[0] = state_lib.perturb_replica(leaves[0])
      state = state._replace(params=treedef.unflatten(leaves))
    return batch, state


class StallSave(Hook):
  """The save of checkpoint ``step`` stalls for ``seconds`` (as a peer stuck
  in orbax's commit barrier would), every attempt."""

  def __init__(self, step: int, seconds: float = 3600.0):
    self.step, self.seconds = step, seconds

  def before_save(self, step):
    if step == self.step:
      time.sleep(self.seconds)


_FROM_CONFIG = {
    "fail_at_step": FailAt,
    "hang_at_step": HangAt,
    "nan_at_step": NanAt,
    "desync_at_step": DesyncAt,
}


def from_config(config: Mapping[str, Any]) -> list[Hook]:
  """The fault-injection hooks the config's ``*_at_step`` fields ask for
  (a field at 0 or absent installs nothing)."""
  return [make(int(config[field])) for field, make in _FROM_CONFIG.items()
          if config.get(field, 0)]
