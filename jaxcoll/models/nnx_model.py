"""`from_nnx`: a :class:`Workload` from a flax.nnx model and a loss on its outputs.

The trainer takes a pytree of floating parameters and a pure
``loss_fn(params, batch[, rng])``; an nnx model holds its state in
``nnx.Variable`` objects. :func:`from_nnx` splits the model once
(``nnx.split``) and builds what the trainer takes, the way
:func:`jaxcoll.models.from_flax` does for linen:

- ``params`` is a dict of ``nnx.State`` by collection, as linen's variables
  dict: ``{"params": <nnx.Param state>, "batch_stats": <nnx.BatchStat
  state>, ...}``. Every non-``Param`` variable type is a state collection,
  named as flax names it (``variable_name_from_type``). ZeRO shards and
  checkpoints them with the weights; ``nnx.update(model, *params.values())``
  puts trained values back into a model.
- the random streams (``nnx.Rngs``' ``RngKey`` / ``RngCount``, e.g. of
  ``nnx.Dropout``) are not trained state: in training each step reseeds them
  from the trainer's per-step, per-shard ``rng`` (``Trainer(..., rng=...)``),
  so masks do not depend on the device count and a resumed run draws what an
  uninterrupted one would; in evaluation (``rng=None``) the model runs in
  ``model.eval()`` mode (no dropout, BatchNorm's running averages).
- ``loss_fn`` merges the model from its argument (never from a closure, which
  nnx refuses to mutate under a trace), runs it in ``model.train()`` mode
  unless given ``rng=None`` (a model with rng streams needs a key then), and returns the updated state collections in ``aux``;
  ``Trainer(..., merge_aux=workload.merge_aux)`` writes them back.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcoll.models.workload import TRAINING, Batch, Workload, as_key


def _nnx():
  from flax import nnx  # noqa: PLC0415 - flax.nnx only for nnx models

  return nnx


def is_nnx_module(obj: Any) -> bool:
  """Whether ``obj`` is a ``flax.nnx.Module`` (without importing nnx for others)."""
  import sys  # noqa: PLC0415

  nnx = sys.modules.get("flax.nnx")
  return nnx is not None and isinstance(obj, nnx.Module)


def collection_name(variable_type: type) -> str:
  """The collection an nnx variable type belongs to: flax's registered name
  (``Param`` -> ``"params"``, ``BatchStat`` -> ``"batch_stats"``), else the
  type's name in snake case (``MyStat`` -> ``"my_stat"``)."""
  from flax.nnx import variablelib  # noqa: PLC0415

  try:
    return variablelib.variable_name_from_type(variable_type)
  except ValueError:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", variable_type.__name__).lower()


class _Split:
  """An nnx model's graph and the types of its variables, by collection."""

  def __init__(self, abstract_model: Any, what: str):
    nnx = _nnx()
    self.graphdef, state = nnx.split(abstract_model)
    types: dict[str, type] = {}
    tags: set[str] = set()
    for path, var in nnx.to_flat_state(state):
      kind = type(var)
      if issubclass(kind, nnx.RngState):
        if isinstance(var, nnx.RngKey):
          tags.add(var.tag)
        continue
      dtype = jnp.result_type(var.get_value())
      # A subclass of Param (nnx.LoRAParam, a user's own) is trained, as nnx's own filter
      # `nnx.Param` takes it: it was listed as an (empty) state collection 'lo_r_a_param'.
      trained = issubclass(kind, nnx.Param)
      name = "params" if trained else collection_name(kind)
      if not jnp.issubdtype(dtype, jnp.inexact):
        where = "/".join(str(p) for p in path)
        raise ValueError(
            f"{what}: variable {where} ({kind.__name__}) has dtype {dtype}; every nnx "
            "variable jaxcoll trains or carries must be floating point (the trainer "
            "averages state over devices). Keep integer state out of the model (e.g. a "
            "step counter in the batch), make it a float, or train it outside jaxcoll.")
      if trained:
        kind = nnx.Param  # its filter, which takes the subclasses too
      elif name in types and types[name] is not kind:
        raise ValueError(
            f"{what}: nnx variable types {types[name].__name__} and {kind.__name__} both "
            f"map to collection {name!r}; give one of them another name with "
            "flax.nnx.register_variable_name.")
      types[name] = kind
    if "params" not in types:
      raise ValueError(f"{what} has no nnx.Param variables: nothing to train.")
    self.collections = ("params",) + tuple(sorted(n for n in types if n != "params"))
    self.filters = tuple(types[n] for n in self.collections)
    self.tags = tuple(sorted(tags))
    # The random streams' state, as shape structs: remade as zeros in each trace.
    parts = nnx.split(abstract_model, *self.filters, ...)
    self.graphdef, self.rng_like = parts[0], parts[-1]

  def params(self, model: Any) -> dict[str, Any]:
    parts = _nnx().split(model, *self.filters, ...)[1:-1]
    return dict(zip(self.collections, parts))

  def merge(self, params: Mapping[str, Any]) -> Any:
    rng_state = jax.tree.map(_zeros_like, self.rng_like)
    return _nnx().merge(self.graphdef, *[params[c] for c in self.collections], rng_state)


def _zeros_like(x: Any) -> jax.Array:
  dtype = jnp.result_type(x)
  if jnp.issubdtype(dtype, jax.dtypes.prng_key):
    return jax.random.wrap_key_data(jnp.zeros(np.shape(x) + (2,), jnp.uint32))
  return jnp.zeros(np.shape(x), dtype)


def from_nnx(
    model: Any,
    loss: Callable[[Any, Batch], Any],
    *,
    inputs: tuple[str, ...] = ("inputs",),
    sample_batch: Mapping[str, Any] | None = None,
    name: str | None = None,
    dataset: Any = None,
    config: Mapping[str, Any] | None = None,
    label_classes: Mapping[str, int] | None = None,
) -> Workload:
  """A :class:`Workload` from a flax.nnx model and a loss on its outputs.

  The model is called as ``model(*[batch[k] for k in inputs])``. Its
  ``nnx.Param`` variables are the trained parameters (``params["params"]``);
  every other floating variable type is a state collection carried as linen's
  ``batch_stats`` is (see the module docstring); the random streams are
  reseeded from the trainer's ``rng`` each step.

  Args:
    model: an ``nnx.Module`` (``MyModel(rngs=nnx.Rngs(0))``: its current
      values are ``init_params``' output, whatever the rng), or a function
      ``make(rngs: nnx.Rngs) -> nnx.Module`` (``init_params(rng)`` builds
      ``make(nnx.Rngs(rng))``, so ``Trainer.init_from(workload.init_params,
      key)`` never holds the whole model; pass a ``jax.random`` key then).
    loss: ``loss(outputs, batch) -> loss`` or ``-> (loss, {metric: scalar})``,
      the mean over the batch given.
    inputs: the batch keys passed to the model, in order.
    sample_batch: optional, a dict with the ``inputs`` columns: their per-row
      shapes become ``input_shapes`` (file columns are checked against them).
    name: the workload's name (default: the model's class name).
    dataset: an optional synthetic data set (:mod:`jaxcoll.data`).
    config: what the workload was built with (kept for reference).
    label_classes: integer label columns and their class counts.

  Returns:
    The workload: ``loss_fn(params, batch, rng=TRAINING)`` (training with an rng
    or with two arguments, evaluation with ``rng=None``), ``init_params``, ``merge_aux``; ``model`` is the
    nnx model or function given.

  Raises:
    ValueError: ``model`` is not an nnx Module or such a function (a linen
      module: use ``from_flax``), it has no ``nnx.Param``, or a variable that
      is not floating point (named).

  Example:
    >>> from flax import nnx
    >>> w = from_nnx(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), lambda y, b: ((y - b["y"]) ** 2).mean())
    >>> w.num_params, w.state_collections
    (15, ())
  """
  nnx = _nnx()
  import flax.linen as nn  # noqa: PLC0415

  if isinstance(model, nn.Module):
    raise ValueError(f"`model` {type(model).__name__} is a flax.linen Module; use "
                     "jaxcoll.models.from_flax(module, loss, sample_batch=...) for linen.")
  if isinstance(model, nnx.Module):
    what = f"`model` {type(model).__name__}"
    split = _Split(model, what)

    def init_params(rng):  # noqa: ARG001 - the model's own values
      return split.params(model)

  elif callable(model):
    what = f"`model` {getattr(model, '__name__', model)!r}"
    abstract = nnx.eval_shape(lambda: model(nnx.Rngs(0)))
    if not isinstance(abstract, nnx.Module):
      raise ValueError(f"{what} returned {type(abstract).__name__}, not an nnx.Module; pass "
                       "`make(rngs) -> nnx.Module` or the module itself.")
    split = _Split(abstract, what)

    def init_params(rng):
      return split.params(model(nnx.Rngs(as_key(rng))))

  else:
    raise ValueError(f"`model` must be an nnx.Module or a function make(rngs) -> nnx.Module; "
                     f"got {type(model).__name__}.")
  state = split.collections[1:]

  def loss_fn(params, batch, rng=TRAINING):
    # Training: called with a key (Trainer(rng=...)) or with two arguments (a trainer
    # without rng); evaluation passes rng=None explicitly (Trainer.eval, eval_fn).
    net = split.merge(params)
    if rng is None:
      net.eval()  # deterministic: no dropout, BatchNorm's running averages
    elif rng is TRAINING:
      if split.tags:
        raise ValueError(
          f"{label!r} holds rng streams {list(split.tags)} that it draws from in training, "
          "and the trainer has no key: pass `jaxcoll.Trainer(..., rng=SEED)` "
          "(experiments.train does); they are reseeded from it each step.")
      net.train()
    else:
      net.train()
      if split.tags:  # "match_shape": stacked streams (nnx.vmap'd layers) get one key each
        nnx.reseed(net, policy="match_shape",
                   **{t: jax.random.fold_in(rng, i) for i, t in enumerate(split.tags)})
    out = loss(net(*[batch[k] for k in inputs]), batch)
    value, metrics = out if isinstance(out, tuple) else (out, {})
    if rng is None:  # evaluation only reads the state
      return value, dict(metrics)
    updated = dict(zip(state, nnx.split(net, *split.filters, ...)[2:-1]))
    return value, {**metrics, **updated}

  label = name or (type(model).__name__ if isinstance(model, nnx.Module)
                   else getattr(model, "__name__", "nnx_model"))
  input_shapes = {}
  if sample_batch is not None:
    missing = [k for k in inputs if k not in sample_batch]
    if missing:
      raise ValueError(f"`sample_batch` lacks the input column(s) {missing}; it has "
                       f"{sorted(sample_batch)}. Pass `inputs=` naming the model's columns.")
    input_shapes = {k: tuple(np.shape(sample_batch[k])[1:]) for k in inputs}
  return Workload(
      name=label, model=model, dataset=dataset, init_params=init_params, loss_fn=loss_fn,
      config=dict(config or {}), label_classes=dict(label_classes or {}),
      input_shapes=input_shapes, state_collections=state,
  )
