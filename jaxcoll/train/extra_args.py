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
import re

import jax
import jax.numpy as jnp
import optax

_VALUE: contextvars.ContextVar = contextvars.ContextVar("jaxcoll_loss_value", default=None)


def needs_value(optimizer, params_like) -> bool:
  """Whether ``optimizer.update`` fails without ``value=`` and traces with it.

  Probed first on a one-leaf tree of ``params_like``'s first dtype (whether an
  update takes ``value=`` is in its signature, not in the tree: every optax
  combinator, ``multi_transform`` included, calls each inner update); only when
  that probe is undecided (an optimizer that fails on a tree not of the model's
  structure: a mask or label tree) on ``params_like`` itself. Every ``optax.chain``
  and ``adam`` is a ``GradientTransformationExtraArgs``, so the full-tree probe
  cost each build 0.3-0.6 s for 400 leaves.

  Raises:
    ValueError: an update that calls a function of the parameters (a line search,
      ``optax.lbfgs``: ``value_fn=``; ``optax.contrib.sophia``: ``obj_fn=``;
      ``optax.contrib.sam(opaque_mode=True)``: ``grad_fn=``).
  """
  if not isinstance(optimizer, optax.GradientTransformationExtraArgs):
    return False
  leaves = jax.tree.leaves(params_like)
  if leaves:
    small = _needs_value(optimizer, jax.ShapeDtypeStruct((2, 2), leaves[0].dtype))
    if small is not None:
      return small
  return bool(_needs_value(optimizer, params_like))


def _needs_value(optimizer, params_like) -> bool | None:
  """:func:`needs_value` on ``params_like``; None where the update fails either way.

  Raises:
    ValueError: the update needs a function of the parameters (:data:`_LOSS_FUNCTIONS`).
  """

  def update(grads, params, *value):
    state = optimizer.init(params)
    return optimizer.update(grads, state, params, **({"value": value[0]} if value else {}))

  def traces(*value) -> bool | str:
    try:
      jax.eval_shape(update, params_like, params_like, *value)
    except TypeError as e:  # e.g. "missing 1 required keyword-only argument: 'value'"
      return str(e)
    except ValueError as e:  # sophia: "obj_fn must be provided to hutchinson update ..."
      return str(e) if _needs_function(str(e)) else "fails"
    except Exception:  # noqa: BLE001  (the step reports an optimizer that fails)
      return "fails"
    return True

  without = traces()
  if without is True:
    return False
  argument = _needs_function(without)
  if argument is not None:
    raise ValueError(_refusal(argument, without))
  if "value" in without and traces(jax.ShapeDtypeStruct((), jnp.float32)) is True:
    return True
  return None


# The function arguments of optax updates that evaluate the loss themselves ->
# (what such an optimizer is, an example, the way out).
_LOSS_FUNCTIONS = {
  "value_fn": ("is a line search", "e.g. optax.lbfgs", "or optax's own L-BFGS loop on one device"),
  "obj_fn": ("evaluates the loss itself",
             "optax.contrib.sophia's Hessian estimate",
             "or optax's own loop on one device with obj_fn="),
  "grad_fn": ("evaluates the loss itself",
              "optax.contrib.sam with opaque_mode=True",
              "or optax.contrib.sam(..., opaque_mode=False), whose adversarial step is a "
              "step of its own"),
}


def _needs_function(error: str) -> str | None:
  """The function argument (``value_fn``, ``obj_fn``, ``grad_fn``) an update's error
  says it lacks: ``missing ... arguments: 'value' and 'value_fn'`` (a line search),
  ``obj_fn must be provided`` (sophia), ``grad_fn must be provided when
  opaque_mode=True`` (sam)."""
  found = re.search(r"missing .*'(\w+_fn)'|\b(\w+_fn) must be provided", error)
  if found is None:
    return None
  name = found.group(1) or found.group(2)
  return name if name in _LOSS_FUNCTIONS else None


def _refusal(argument: str, error: str) -> str:
  kind, example, way_out = _LOSS_FUNCTIONS[argument]
  name = re.search(r"(\w+)\.<locals>", error)
  where = name.group(1) if name else "its update"
  return (
    f"`optimizer` {kind} ({where} needs {argument}=, {example}): it re-evaluates the "
    "loss at other parameters inside its update, which a Trainer step (one gradient, one "
    "update, on every device's batch) does not do. Use a one-update-per-gradient optimizer "
    f"(optax.adam, sgd, ...), {way_out}.")


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
