"""`Workload`: a model, its synthetic data set and its loss, in one bundle.

A workload plugs into ``jaxcoll.Trainer(loss_fn, optimizer, mesh, strategy,
has_aux=...)``:

- ``params`` is a flax variables dict: ``{"params": ...}``, plus
  ``{"batch_stats": ...}`` for models with BatchNorm. The whole dict is the
  trainer's params pytree, so ZeRO shards and checkpoints the statistics with
  the weights.
- ``loss_fn(params, batch) -> (loss, aux)``: the mean loss over the (local)
  batch, and ``aux``, a dict of scalar metrics (e.g. ``accuracy``) plus, for
  a model with state, the *updated* state collections under their names
  (``aux["batch_stats"]``). The trainer averages ``aux`` across the data axis.
  The loss does not depend on the stored statistics in training mode, so
  their gradient is zero.
- after a step, :func:`merge_aux` writes the updated state back:
  ``params = merge_aux(params, aux)``. Whatever the optimizer did to the
  state leaves (e.g. AdamW's weight decay) is overwritten by it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from jaxcoll import data
from jaxcoll.data import _check_positive as check_positive

Params = dict[str, Any]
Batch = Mapping[str, Any]


def merge_aux(params: Params, aux: Mapping[str, Any]) -> Params:
  """``params`` with its state collections replaced by those in ``aux``.

  Args:
    params: flax variables dict, e.g. ``{"params": ..., "batch_stats": ...}``.
    aux: the ``aux`` a workload's ``loss_fn`` returned (after the trainer's
      average across the data axis).

  Returns:
    A new dict: every collection of ``params`` other than ``"params"`` that
    also appears in ``aux`` takes ``aux``'s value; the rest is unchanged.

  Example:
    >>> w = jaxcoll.models.make_workload("resnet")  # doctest: +SKIP
    >>> grad_fn = jax.value_and_grad(w.loss_fn, has_aux=True)  # doctest: +SKIP
    >>> (loss, aux), grads = grad_fn(params, batch)  # doctest: +SKIP
    >>> params = merge_aux(apply_updates(params, grads), aux)  # doctest: +SKIP
  """
  merged = dict(params)
  for name in params:
    if name != "params" and name in aux:
      merged[name] = aux[name]
  return merged


def count_params(tree: Any) -> int:
  """Number of scalar entries in a pytree of arrays or shape structs."""
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True, eq=False)
class Workload:
  """A flax model, its teacher-labelled data set and its loss.

  Attributes:
    name: registry name (``"mlp"``, ``"resnet"``, ...).
    model: the flax linen module.
    dataset: the synthetic data set (:mod:`jaxcoll.data`).
    init_params: ``init_params(rng) -> params`` (a flax variables dict;
      ``rng`` is a ``jax.random`` key or an int seed).
    loss_fn: ``loss_fn(params, batch) -> (loss, aux)``; ``loss`` is the mean
      over the batch given (the local batch under a data-parallel trainer).
    eval_fn: ``eval_fn(params, batch) -> dict`` of scalar metrics (``loss``
      and more) in inference mode (BatchNorm uses its running statistics).
    has_aux: always True: ``loss_fn`` returns ``(loss, aux)``.
    state_collections: variable collections that are model state, not
      trained by gradients (``("batch_stats",)`` for ResNet, else ``()``).
    config: the keyword arguments the workload was built with.
  """

  name: str
  model: Any
  dataset: data.SyntheticDataset
  init_params: Callable[[Any], Params]
  loss_fn: Callable[[Params, Batch], tuple[jax.Array, dict[str, Any]]]
  eval_fn: Callable[[Params, Batch], dict[str, jax.Array]]
  has_aux: bool = True
  state_collections: tuple[str, ...] = ()
  config: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def make_batch(
      self, step: int, batch_size: int, rows: slice | None = None, split: str = "train"
  ) -> dict[str, np.ndarray]:
    """The global batch of ``step`` (numpy), optionally only rows ``rows``.

    Deterministic: ``(config seed, step, batch_size)`` fixes the batch, so a
    resumed run sees the same data. See :meth:`SyntheticDataset.batch`.
    """
    return self.dataset.batch(step, batch_size, rows=rows, split=split)

  @functools.cached_property
  def param_shapes(self) -> Params:
    """Shape/dtype structs of ``init_params``'s output, without computing it."""
    return jax.eval_shape(self.init_params, jax.random.key(0))

  @property
  def num_params(self) -> int:
    """Number of trained parameters (the ``"params"`` collection only)."""
    return count_params(self.param_shapes["params"])

  def merge_aux(self, params: Params, aux: Mapping[str, Any]) -> Params:
    """Writes the updated model state in ``aux`` back into ``params``."""
    return merge_aux(params, aux)


def as_key(rng: Any) -> jax.Array:
  """A ``jax.random`` key from a key or an int seed."""
  if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
    return jax.random.key(int(rng))
  return rng


def check_widths(widths: Any, name: str) -> tuple[int, ...]:
  """``widths`` as a tuple of positive ints, or ValueError naming ``name``."""
  try:
    widths = tuple(widths)
  except TypeError:
    raise ValueError(f"`{name}` must be a tuple of positive ints, got {widths!r}.") from None
  for w in widths:
    check_positive(w, name)
  return tuple(int(w) for w in widths)
