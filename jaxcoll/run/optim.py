"""Optimizers and learning-rate schedules from a training config (optax).

``config.schedule``: ``constant``, ``cosine`` (to 0 at ``config.steps``) or
``linear`` (to 0 at ``config.steps``), each after ``config.warmup_steps`` of
linear warm-up from 0 (optax's ``warmup_*`` shapes); ``config.optimizer``:
``adam``, ``adamw``, ``sgd``, ``momentum`` (0.9), ``lion`` or ``adafactor``.
``weight_decay`` applies to ``adamw`` and ``lion`` (optax's decoupled decay).

Example:
  >>> import ml_collections
  >>> c = ml_collections.ConfigDict(dict(learning_rate=1.0, schedule="cosine",
  ...                                    warmup_steps=2, steps=10))
  >>> s = build_schedule(c)
  >>> [round(float(s(i)), 3) for i in (0, 1, 2, 6, 10)]
  [0.0, 0.5, 1.0, 0.5, 0.0]
"""

from __future__ import annotations

import optax

from jaxcoll.run import config as run_config

SCHEDULES = run_config.SCHEDULES
OPTIMIZERS = run_config.OPTIMIZERS


def build_schedule(config) -> optax.Schedule:
  """The learning rate at each update count, as ``config`` says.

  Raises:
    ValueError: (through the loop's config error) for an unknown schedule or a
      ``warmup_steps`` outside ``0 .. steps``.
  """
  config = run_config.parse(config)  # checks schedule and warmup_steps
  lr, warmup, steps = config.learning_rate, config.warmup_steps, config.steps
  name = config.schedule or "constant"
  if name == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, decay_steps=steps)
  if name == "linear":
    decay = optax.linear_schedule(lr, 0.0, max(1, steps - warmup))
  else:
    decay = optax.constant_schedule(lr)
  if not warmup:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), decay], [warmup])


def build_optimizer(config, schedule: optax.Schedule | None = None) -> optax.GradientTransformation:
  """The optax optimizer ``config.optimizer`` driven by ``schedule``.

  Raises:
    ValueError: (through the loop's config error) for an unknown optimizer.
  """
  config = run_config.parse(config)  # checks the optimizer's name
  lr = build_schedule(config) if schedule is None else schedule
  name, wd = config.optimizer, config.weight_decay
  if name == "adam":
    return optax.adam(lr)
  if name == "adamw":
    return optax.adamw(lr, weight_decay=wd)
  if name == "sgd":
    return optax.sgd(lr)
  if name == "momentum":
    return optax.sgd(lr, momentum=0.9)
  if name == "lion":
    return optax.lion(lr, weight_decay=wd)
  if name == "adafactor":
    return optax.adafactor(learning_rate=lr)
  raise AssertionError(f"optimizer {name!r} is in OPTIMIZERS but not built here")
