"""Flax models with learnable synthetic data, packaged as workloads.

Each model comes as a :class:`Workload`: ``init_params(rng)``,
``loss_fn(params, batch) -> (loss, aux)`` for
``jaxcoll.Trainer(w.loss_fn, optimizer, mesh, strategy, has_aux=w.has_aux)``,
``make_batch(step, batch_size)`` (deterministic in the step), ``eval_fn`` and
``num_params``. Models with state (ResNet's BatchNorm statistics) carry it in
``params["batch_stats"]``, return the update in ``aux["batch_stats"]``, and
:func:`merge_aux` writes it back.

Example:
  >>> from jaxcoll import models
  >>> models.names()
  ('mlp', 'resnet', 'transformer', 'recommender')
  >>> w = models.make_workload("mlp", widths=(16,))
  >>> w.num_params
  698
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from jaxcoll.models import layers as layers
from jaxcoll.models import mlp as mlp
from jaxcoll.models import recommender as recommender
from jaxcoll.models import resnet as resnet
from jaxcoll.models import transformer as transformer
from jaxcoll.models.workload import Workload as Workload
from jaxcoll.models.workload import count_params as count_params
from jaxcoll.models.workload import merge_aux as merge_aux

_FACTORIES: dict[str, Callable[..., Workload]] = {
    "mlp": mlp.make_workload,
    "resnet": resnet.make_workload,
    "transformer": transformer.make_workload,
    "recommender": recommender.make_workload,
}


def names() -> tuple[str, ...]:
  """Names of the available workloads."""
  return tuple(_FACTORIES)


def get(name: str) -> Callable[..., Workload]:
  """The factory ``make_workload(**overrides)`` of workload ``name``.

  Raises:
    ValueError: for an unknown name; the message lists the valid ones.
  """
  if name not in _FACTORIES:
    raise ValueError(f"`name` must be one of {names()}, got {name!r}.")
  return _FACTORIES[name]


def make_workload(name: str, **overrides: Any) -> Workload:
  """Workload ``name`` with its defaults, except the keyword ``overrides``.

  Args:
    name: one of :func:`names`.
    **overrides: keyword arguments of the model's ``make_workload`` (e.g.
      ``width=64`` for ``"resnet"``).

  Returns:
    The :class:`Workload`.

  Raises:
    ValueError: for an unknown name or override; the message lists the valid
      ones.
  """
  factory = get(name)
  valid = tuple(inspect.signature(factory).parameters)
  unknown = sorted(set(overrides) - set(valid))
  if unknown:
    raise ValueError(
        f"Unknown override(s) {unknown} for workload {name!r}; valid: {valid}."
    )
  return factory(**overrides)
