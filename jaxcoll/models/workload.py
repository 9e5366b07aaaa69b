"""`Workload`: a model, its data set and its loss, in one bundle (public).

Build your own with :func:`from_flax` (a flax module + a loss), or construct
a :class:`Workload` directly; ``python -m experiments.train
--config.model=my_pkg.my_module:make`` trains the one ``make(**overrides)``
returns (see the README's "Your own model and data").

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
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from jaxcoll import data
from jaxcoll.checks import positive_int as check_positive
from jaxcoll.train.trainer import takes_rng

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


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Workload:
  """A flax model, its (optional) synthetic data set and its loss.

  Fields are keyword-only; ``name``, ``init_params`` and ``loss_fn`` are
  required, the rest optional.

  Attributes:
    name: registry name (``"mlp"``, ``"resnet"``, ...) or your own.
    model: the flax linen module (None is allowed).
    dataset: the synthetic data set (:mod:`jaxcoll.data`), or None for a
      model trained only on files (``--config.data.train``).
    init_params: ``init_params(rng) -> params`` (a flax variables dict;
      ``rng`` is a ``jax.random`` key or an int seed).
    loss_fn: ``loss_fn(params, batch) -> (loss, aux)``; ``loss`` is the mean
      over the batch given (the local batch under a data-parallel trainer).
    eval_fn: ``eval_fn(params, batch) -> dict`` of scalar metrics (``loss``
      and more) in inference mode (BatchNorm uses its running statistics).
      Not given (None): filled in from ``loss_fn`` (:func:`loss_metrics`:
      ``{"loss": loss, **aux}``, no dropout rng), so ``workload.eval_fn`` is
      always a callable; ``dataclasses.replace(w, loss_fn=...)`` refills it.
    state_collections: variable collections that are model state, not
      trained by gradients (``("batch_stats",)`` for ResNet, else ``()``).
    config: the keyword arguments the workload was built with.
    label_classes: the integer columns the model indexes with, and how many
      values each takes (``{"labels": 10}``: class ids ``0..9``). File data is
      checked against it before training and in every batch read (a label
      equal to the class count gives a NaN loss, a label of -1 trains on the
      last class); ``{}``: no check.
    input_shapes: the per-row shapes of the batch columns the model was built
      for (``from_flax``: its ``sample_batch``'s inputs, e.g. ``{"features":
      (8,)}``); when the loss fails on files whose column has another per-row
      shape, the run names that column in one line. ``{}``: unknown.
  """

  name: str
  model: Any = None
  dataset: data.SyntheticDataset | None = None
  init_params: Callable[[Any], Params]
  loss_fn: Callable[[Params, Batch], tuple[jax.Array, dict[str, Any]]]
  eval_fn: Callable[[Params, Batch], dict[str, jax.Array]] | None = None
  state_collections: tuple[str, ...] = ()
  config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  label_classes: Mapping[str, int] = dataclasses.field(default_factory=dict)
  input_shapes: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

  def make_batch(
      self, step: int, batch_size: int, rows: slice | None = None, split: str = "train"
  ) -> dict[str, np.ndarray]:
    """The global batch of ``step`` (numpy), optionally only rows ``rows``.

    Deterministic: ``(config seed, step, batch_size)`` fixes the batch, so a
    resumed run sees the same data. See :meth:`SyntheticDataset.batch`.

    Raises:
      ValueError: if the workload has no synthetic data set.
    """
    if self.dataset is None:
      raise ValueError(
          f"workload {self.name!r} has no synthetic data set; train it on files "
          "(--config.data.train=GLOB) or pass `dataset=` when building it."
      )
    return self.dataset.batch(step, batch_size, rows=rows, split=split)

  def __post_init__(self):
    if self.eval_fn is None or isinstance(self.eval_fn, _LossMetrics):
      object.__setattr__(self, "eval_fn", _LossMetrics(self.loss_fn))

  @property
  def takes_rng(self) -> bool:
    """Whether ``loss_fn`` takes a third argument, the ``rng`` of
    ``jaxcoll.Trainer(..., rng=...)`` (dropout); the runner passes one then."""
    return takes_rng(self.loss_fn)

  @property
  def has_aux(self) -> bool:
    """Always True (``loss_fn`` returns ``(loss, aux)``): what ``Trainer(has_aux=)`` takes."""
    return True

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


def loss_metrics(loss_fn: Callable, params: Params, batch: Batch, *,
                 has_aux: bool = True) -> dict[str, Any]:
  """``{"loss": loss, **aux}`` of ``loss_fn`` on ``batch``: the metrics of a model
  without an ``eval_fn`` (a ``loss_fn`` that takes an rng gets None: no dropout)."""
  extra = (None,) if takes_rng(loss_fn) else ()
  out = loss_fn(params, batch, *extra)
  loss, aux = out if has_aux else (out, {})
  return {"loss": loss, **aux}


class _LossMetrics:
  """A workload's ``eval_fn`` when none was given: :func:`loss_metrics` of its loss."""

  def __init__(self, loss_fn: Callable):
    self.loss_fn = loss_fn

  def __call__(self, params: Params, batch: Batch) -> dict[str, Any]:
    return loss_metrics(self.loss_fn, params, batch)

  def __repr__(self) -> str:
    return f"loss_metrics({getattr(self.loss_fn, '__qualname__', self.loss_fn)!r})"


class _Training:
  """The default ``rng`` of a workload's ``loss_fn``: called as ``loss_fn(params, batch)``
  (by a trainer without ``rng=``) it trains; ``rng=None`` evaluates."""

  def __repr__(self) -> str:
    return "TRAINING"


#: ``loss_fn(params, batch)`` of a :func:`from_flax` / :func:`from_nnx` workload trains
#: (BatchNorm on the batch's statistics, updated in ``aux``); ``rng=None`` evaluates.
TRAINING = _Training()


def fixed_key(loss_fn: Callable, seed: int = 0) -> Callable:
  """``loss_fn`` with one fixed rng key if it takes one (else ``loss_fn`` itself): what
  the memory planner and the benchmarks compile, so a model that draws random numbers
  in training (dropout) runs in training mode there without ``Trainer(rng=...)``."""
  if not takes_rng(loss_fn):
    return loss_fn
  return functools.wraps(loss_fn)(
      lambda params, batch: loss_fn(params, batch, jax.random.key(seed)))


# The keywords that switch a module between training and evaluation, and their value in
# training: flax's examples (train, deterministic), haiku's and t5x's spellings, and
# MaxText's `enable_dropout` (an unknown one ran evaluation with dropout on).
_TRAIN_FLAGS = {"train": True, "training": True, "is_training": True, "is_train": True,
                "enable_dropout": True, "deterministic": False}


def _train_flag(module: Any) -> str | None:
  """The keyword of ``module.__call__`` that switches training mode, if any."""
  try:
    parameters = inspect.signature(module.__call__).parameters
  except (TypeError, ValueError):
    return None
  return next((name for name in _TRAIN_FLAGS if name in parameters), None)


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


def from_flax(
    module: Any,
    loss: Callable[[Any, Batch], Any],
    *,
    sample_batch: Mapping[str, Any] | None = None,
    inputs: tuple[str, ...] = ("inputs",),
    name: str | None = None,
    dataset: data.SyntheticDataset | None = None,
    config: Mapping[str, Any] | None = None,
    label_classes: Mapping[str, int] | None = None,
    rngs: tuple[str, ...] = ("dropout",),
) -> Workload:
  """A :class:`Workload` from a flax linen module and a loss on its outputs.

  The model is called as ``module.apply(params, *[batch[k] for k in inputs],
  rngs={"dropout": key})``: the workload's ``loss_fn(params, batch, rng=TRAINING)``
  takes the per-step, per-shard key of ``jaxcoll.Trainer(..., rng=...)``
  (the runner passes one); called with two arguments (a trainer without
  ``rng=``) it trains too, without ``rngs`` (a module that draws from one is
  one ``ValueError`` line asking for ``rng=``), and with ``rng=None``
  (evaluation: ``Trainer.eval``, ``eval_fn``) it evaluates. If ``module.__call__`` has a ``train`` / ``training`` /
  ``is_training`` keyword it gets ``True`` in training and ``False`` in
  evaluation (``deterministic``: the opposite), so ``nn.Dropout`` layers
  drop only while training.
  Model state (every variable collection but ``"params"``, e.g. BatchNorm's
  ``batch_stats``) is the workload's ``state_collections``: in training the
  module runs with those collections mutable and ``loss_fn`` returns their
  updated values in ``aux`` (``Trainer(..., merge_aux=workload.merge_aux)``
  writes them back; the runner does); in evaluation they are only read.
  Give BatchNorm ``axis_name=`` the trainer's data axis (``"data"``) for
  statistics over the global batch; on a multi-axis mesh, all its data
  axes (``("node", "local")``: the runner refuses, in one line, an axis
  name its mesh lacks).

  Args:
    module: the flax linen module.
    loss: ``loss(outputs, batch) -> loss`` or ``-> (loss, {metric: scalar})``;
      the loss is the mean over the batch given.
    sample_batch: a dict with at least the ``inputs`` columns (one row is
      enough) to initialise the parameters; default: ``dataset``'s first
      example.
    inputs: the batch keys passed to the module, in order.
    name: the workload's name (default: the module's class name).
    dataset: an optional synthetic data set (:mod:`jaxcoll.data`).
    config: what the workload was built with (kept for reference).
    label_classes: integer label columns and their class counts, e.g.
      ``{"label": 2}``; file data is checked against them (see
      :class:`Workload`).
    rngs: the names of the random streams the module draws from in
      training (each gets ``fold_in(rng, i)``); ``()`` for none.

  Returns:
    The workload; its ``eval_fn`` reports ``loss`` and the loss's metrics.

  Raises:
    ValueError: if neither ``sample_batch`` nor ``dataset`` is given, or an
      ``inputs`` key is missing from it.

  Example:
    >>> import flax.linen as nn, jax.numpy as jnp, numpy as np, optax
    >>> def loss(logits, batch):
    ...   ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    ...   return ce.mean(), {"accuracy": jnp.mean(logits.argmax(-1) == batch["labels"])}
    >>> w = from_flax(nn.Dense(3), loss, sample_batch={"inputs": np.zeros((1, 4))})
    >>> w.num_params
    15
  """
  if sample_batch is None:
    if dataset is None:
      raise ValueError("`sample_batch` is required without `dataset`: pass a dict with the "
                       f"{list(inputs)} columns (one row is enough).")
    sample_batch = dataset.examples(np.arange(1))
  missing = [k for k in inputs if k not in sample_batch]
  if missing:
    raise ValueError(f"`sample_batch` lacks the input column(s) {missing}; it has "
                     f"{sorted(sample_batch)}. Pass `inputs=` naming the model's columns.")
  sample = [np.asarray(sample_batch[k])[:1] for k in inputs]

  rngs = tuple(rngs)
  flag = _train_flag(module)

  def mode(training: bool) -> dict:
    return {} if flag is None else {flag: training == _TRAIN_FLAGS[flag]}

  def init_params(rng):
    return dict(module.init(as_key(rng), *sample, **mode(False)))

  def loss_fn(params, batch, rng=TRAINING):
    # Training: called with a key (Trainer(rng=...)) or with two arguments (a trainer
    # without rng); evaluation passes rng=None explicitly (Trainer.eval, eval_fn).
    training = rng is not None
    keyed = training and rng is not TRAINING
    streams = {n: jax.random.fold_in(rng, i) for i, n in enumerate(rngs)} if keyed else {}
    state = [k for k in params if k != "params"]  # model state: BatchNorm's batch_stats, ...
    try:
      outputs = module.apply(params, *[batch[k] for k in inputs], rngs=streams or None,
                             **({"mutable": state} if state else {}), **mode(training))
    except Exception as e:
      if type(e).__name__ != "InvalidRngError" or keyed:  # flax.errors.InvalidRngError
        raise
      if not training:  # evaluation: the module was not told to stop drawing
        told = (f"its `{flag}=` keyword was given {mode(False)[flag]}" if flag else
                f"its __call__ takes none of the keywords that switch it "
                f"({', '.join(_TRAIN_FLAGS)})")
        raise ValueError(
          f"model {type(module).__name__!r} draws random numbers in evaluation "
          f"({str(e).split(' (')[0]}), where from_flax passes no key: {told}. Give "
          "`__call__` one of those keywords (e.g. `train: bool = True`, with "
          "`nn.Dropout(rate, deterministic=not train)`)."
        ) from None
      raise ValueError(
        f"model {type(module).__name__!r} draws random numbers in training "
        f"({str(e).split(' (')[0]}), and the trainer has no key: pass "
        "`jaxcoll.Trainer(..., rng=SEED)` (experiments.train does), or "
        "`from_flax(..., rngs=(...))` naming the streams it draws from."
      ) from None
    outputs, updates = outputs if state else (outputs, {})
    out = loss(outputs, batch)
    value, metrics = out if isinstance(out, tuple) else (out, {})
    # In training the updated state goes back through aux (merge_aux); in evaluation
    # (rng=None) the state is only read (BatchNorm's running averages).
    return value, {**metrics, **(dict(updates) if training else {})}

  collections = tuple(jax.eval_shape(init_params, jax.random.key(0)))
  return Workload(
      name=name or type(module).__name__, model=module, dataset=dataset,
      init_params=init_params, loss_fn=loss_fn, config=dict(config or {}),
      label_classes=dict(label_classes or {}),
      input_shapes={k: tuple(np.shape(x)[1:]) for k, x in zip(inputs, sample)},
      state_collections=tuple(k for k in collections if k != "params"),
  )
