"""The step's loss as optax's ``value`` extra argument of ``optimizer.update``.

Some optax transformations decide on the loss itself (``optax.contrib.reduce_on_plateau``
scales the updates down when it stops improving; ``optax.polyak_sgd`` takes its step
size from it): their ``update`` requires ``value=``, as optax's own loops call it,
``opt.update(grads, state, params, value=loss)``. :func:`needs_value` finds such an
optimizer by tracing its update (nothing computed); the trainer then gives the plan
:func:`with_value` of it and sets the step's global mean loss with :func:`loss_value`
around the update, so every device (each on its own rows under ZeRO) sees the loss
one device would. Other optimizers are left as they are (no extra collective).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import optax

_VALUE: contextvars.ContextVar = contextvars.ContextVar("jaxcoll_loss_value", default=None)


def needs_value(optimizer, params_like) -> bool:
  """Whether ``optimizer.update`` fails without ``value=`` and traces with it."""
  if not isinstance(optimizer, optax.GradientTransformationExtraArgs):
    return False

  def update(grads, params, *value):
    state = optimizer.init(params)
    return optimizer.update(grads, state, params, **({"value": value[0]} if value else {}))

  def traces(*value) -> bool | str:
    try:
      jax.eval_shape(update, params_like, params_like, *value)
    except TypeError as e:  # e.g. "missing 1 required keyword-only argument: 'value'"
      return str(e)
    except Exception:  # noqa: BLE001  (the step reports an optimizer that fails)
      return "fails"
    return True

  without = traces()
  return (without is not True and "value" in without
          and traces(jax.ShapeDtypeStruct((), jnp.float32)) is True)


def with_value(optimizer) -> optax.GradientTransformationExtraArgs:
  """``optimizer`` whose ``update`` gets ``value=`` the loss :func:`loss_value` set
  (a zero outside a step: the plans' shape-only traces of the update)."""

  def update(updates, state, params=None, **extra):
    value = _VALUE.get()
    extra.setdefault("value", jnp.zeros((), jnp.float32) if value is None else value)
    return optimizer.update(updates, state, params, **extra)

  return optax.GradientTransformationExtraArgs(optimizer.init, update)


@contextlib.contextmanager
def loss_value(value):
  """The loss the update of a :func:`with_value` optimizer sees inside this block."""
  token = _VALUE.set(value)
  try:
    yield
  finally:
    _VALUE.reset(token)
