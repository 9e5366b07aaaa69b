"""Hooks the training loop calls at fixed points, and the fault injectors.

The loop in :mod:`jaxcoll.train.loop` has no fault injection of its own: it
calls every :class:`Hook` of its hook list before each step and before each
checkpoint save. The reliability tests install faults as hooks (or through
the config fields ``fail_at_step``, ``hang_at_step`` (on process ``fail_process``),
``nan_at_step`` and ``desync_at_step``, ``slow_process`` with ``slow_seconds``, and
``corrupt_batches``, which
:func:`from_config` turns into hooks).

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

from jaxcoll import errors
from jaxcoll.train import state as state_lib
from jaxcoll.run import config as run_config
from jaxcoll.run.config_error import fail as _fail

ENV_RESTART = "JAXCOLL_RESTART"
EXIT_INJECTED_FAULT = errors.EXIT_INJECTED_FAULT


class Hook:
  """A no-op hook; subclasses override the points they act at."""

  def before_step(self, step: int, batch, state):
    """Called before step ``step`` (1-based) runs; returns ``(batch, state)``."""
    del step
    return batch, state

  def before_save(self, step: int) -> None:
    """Called inside the watched region of the save of checkpoint ``step``."""
    del step


def _first_attempt_on(process: int) -> bool:
  return jax.process_index() == process and int(os.environ.get(ENV_RESTART, "0") or 0) == 0


class FailAt(Hook):
  """Process ``process`` (0: the one serving JAX's coordinator) exits abruptly (status 17)
  before step ``step``, first attempt only: as a process killed there would (no goodbye)."""

  def __init__(self, step: int, process: int = 0):
    self.step, self.process = step, process

  def before_step(self, step, batch, state):
    if step == self.step and _first_attempt_on(self.process):
      logging.warning("fail_at_step=%d: process %d exits abruptly (fault injection).", step,
                      self.process)
      os._exit(EXIT_INJECTED_FAULT)
    return batch, state


class HangAt(Hook):
  """Process ``process`` stops making progress before step ``step``, first attempt only."""

  def __init__(self, step: int, process: int = 0):
    self.step, self.process = step, process

  def before_step(self, step, batch, state):
    if step == self.step and _first_attempt_on(self.process):
      logging.warning("hang_at_step=%d: process %d hangs (fault injection).", step,
                      self.process)
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
    if step == self.step and _first_attempt_on(0):
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


class SlowProcess(Hook):
  """Process ``process`` sleeps ``seconds`` before every step (every
  attempt): a straggler, for the straggler report of
  :mod:`jaxcoll.train.timing`. The sleep counts as that process's batch
  time, as a slow input pipeline's would."""

  def __init__(self, process: int, seconds: float):
    self.process, self.seconds = process, seconds

  def before_step(self, step, batch, state):
    if jax.process_index() == self.process:
      time.sleep(self.seconds)
    return batch, state


class CorruptBatches(Hook):
  """Batches ``first..last`` (numbered as :mod:`jaxcoll.run.data_skip`
  numbers them: batch n is the one step n trains on when nothing is skipped)
  arrive corrupted, every attempt: floating-point inputs scaled by ``scale``
  and integer columns (labels) shuffled, by rolling them half the batch
  along the batch axis. Keyed on the batch, not the step, as bad data is: a
  run that skips those batches (``data.skip``, or an incident's rollback)
  never sees them. ``batch_number`` maps a step to its batch (the loop binds
  it to its input's, :meth:`bind`); unbound, batch n is step n.

  Example:
    >>> import numpy as np
    >>> hook = CorruptBatches(2, 3)
    >>> b, _ = hook.before_step(2, {"x": np.ones(4, np.float32), "y": np.arange(4)}, None)
    >>> b["x"].tolist(), b["y"].tolist()
    ([100.0, 100.0, 100.0, 100.0], [2, 3, 0, 1])
  """

  def __init__(self, first: int, last: int, scale: float = 100.0):
    self.first, self.last, self.scale = int(first), int(last), float(scale)
    self.batch_number = lambda step: step
    self.corrupted: list[int] = []  # the batch numbers it corrupted

  def bind(self, batch_number) -> None:
    """Steps map to batches through ``batch_number`` (``TrainInput.batch_number``)."""
    self.batch_number = batch_number

  def before_step(self, step, batch, state):
    number = self.batch_number(step)
    if self.first <= number <= self.last:
      self.corrupted.append(number)
      batch = {k: _corrupt(v, self.scale) for k, v in batch.items()}
    return batch, state


def _corrupt(x, scale: float):
  """``x * scale`` (floating point) or ``x`` rolled half the batch (integers),
  with ``x``'s own sharding."""
  floating = jnp.issubdtype(x.dtype, jnp.floating)

  def corrupt(v):
    if floating:
      return v * jnp.asarray(scale, v.dtype)
    return jnp.roll(v, v.shape[0] // 2, axis=0) if v.ndim else v

  sharding = getattr(x, "sharding", None)
  if isinstance(x, jax.Array) and sharding is not None:
    return jax.jit(corrupt, out_shardings=sharding)(x)
  import numpy as np  # noqa: PLC0415 - host arrays (the docstring's example)

  return np.asarray(corrupt(jnp.asarray(x)))


def _corrupt_batches(config: run_config.RunConfig) -> list[Hook]:
  """``[CorruptBatches]`` from ``config.corrupt_batches`` ("A:B"; "" = off)."""
  value = config.corrupt_batches  # one range "A:B" (RunConfig checks it)
  if not value:
    return []
  from jaxcoll.run import data_skip  # noqa: PLC0415 - the same range syntax as data.skip

  (first_last,) = data_skip.parse_skip(value, "corrupt_batches")
  return [CorruptBatches(*first_last, scale=float(config.corrupt_scale))]


def bind_input(hooks, batch_number) -> None:
  """Binds every :class:`CorruptBatches` of ``hooks`` to the run's batch numbering."""
  for hook in hooks:
    if isinstance(hook, CorruptBatches):
      hook.bind(batch_number)


def _slow_process(config: run_config.RunConfig) -> list[Hook]:
  """``[SlowProcess]`` when ``config.slow_seconds`` > 0; checks both fields."""
  number, process = config.slow_seconds, config.slow_process  # >= 0 (RunConfig checks)
  if number == 0:
    return []
  count = jax.process_count()
  if process >= count:
    raise _fail("slow_process", process,
                f"must be a process id from 0 to {count - 1} (this job has {count} "
                f"process{'es' if count > 1 else ''}), e.g. --config.slow_process=0.")
  return [SlowProcess(process, number)]


def _process_faults(config: run_config.RunConfig) -> list[Hook]:
  """``fail_at_step`` / ``hang_at_step`` on process ``fail_process`` (checked against the
  job's process count when one of them is set)."""
  faults = [make(getattr(config, field), config.fail_process)
            for field, make in (("fail_at_step", FailAt), ("hang_at_step", HangAt))
            if getattr(config, field)]
  count = jax.process_count()
  if faults and config.fail_process >= count:
    raise _fail("fail_process", config.fail_process,
                f"must be a process id from 0 to {count - 1} (this job has {count} "
                f"process{'es' if count > 1 else ''}), e.g. --config.fail_process=0.")
  return faults


_FROM_CONFIG = {
    "nan_at_step": NanAt,
    "desync_at_step": DesyncAt,
}


def from_config(config: run_config.RunConfig | Mapping[str, Any]) -> list[Hook]:
  """The fault-injection hooks the config's ``*_at_step`` fields (with ``fail_process``,
  and ``slow_process`` / ``slow_seconds``) ask for; a field at 0 or absent installs nothing.

  Raises:
    ConfigError: (a ``ValueError``) a bad ``slow_seconds``, ``slow_process`` or
      ``fail_process``.
  """
  config = run_config.parse(config)
  return [*_process_faults(config),
          *(make(getattr(config, field)) for field, make in _FROM_CONFIG.items()
            if getattr(config, field)), *_slow_process(config), *_corrupt_batches(config)]
