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

from jaxcoll.run.config_error import fail as _fail

SCHEDULES = ("constant", "cosine", "linear")
OPTIMIZERS = ("adam", "adamw", "sgd", "momentum", "lion", "adafactor")


def build_schedule(config) -> optax.Schedule:
  """The learning rate at each update count, as ``config`` says.

  Raises:
    ValueError: (through the loop's config error) for an unknown schedule or a
      ``warmup_steps`` outside ``0 .. steps``.
  """
  lr = float(config.learning_rate)
  name = config.get("schedule", "constant") or "constant"
  warmup = config.get("warmup_steps", 0)
  steps = int(config.steps)
  if name not in SCHEDULES:
    raise _fail("schedule", name, f"valid schedules: {', '.join(SCHEDULES)}.")
  if isinstance(warmup, bool) or not isinstance(warmup, int) or not 0 <= warmup <= steps:
    raise _fail("warmup_steps", warmup, f"must be an integer in 0..steps ({steps}).")
  if name == "cosine":
    if warmup == steps:
      raise _fail("warmup_steps", warmup, f"cosine needs warmup_steps < steps ({steps}).")
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
  lr = build_schedule(config) if schedule is None else schedule
  name = config.optimizer
  wd = float(config.get("weight_decay", 0.0))
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
  raise _fail("optimizer", name, f"valid optimizers: {', '.join(OPTIMIZERS)}.")
