"""Evaluation over a whole eval set: every example exactly once, across processes.

The eval set of ``N`` examples is cut into ``ceil(N / B)`` global batches of
``B`` rows, each process reading its own contiguous rows
(:func:`jaxcoll.data_files.eval_batches`); rows past the last example carry
mask 0. The workload's ``eval_fn`` runs on each example (``jax.vmap`` over
batches of one, so a batch mean becomes that example's value; BatchNorm uses
its running statistics), and the masked sums over all batches and devices,
divided by ``N``, are the metrics: ``eval_loss`` and ``eval_<metric>`` for
every other scalar the workload reports (accuracy, masked-token accuracy;
the recommender's loss is the log-loss), plus ``eval_examples`` = ``N``.

So a plain scalar is a mean over *examples*: a loss that is a mean over an
example's tokens evaluates as the mean of the examples' means. A metric
given as a pair ``(sum, count)`` (from ``eval_fn``, or in the ``aux`` of a
``loss_fn`` without one: ``{"loss": (jnp.sum(ce * mask), jnp.sum(mask))}``
replaces the scalar loss there) is the weighted mean instead: the masked sums
of both over the whole set, ``eval_<metric>`` = sum of sums / sum of counts
(a token-weighted loss or accuracy, as one pass over every token would give;
NaN when the counts sum to 0).

Example:
  >>> ev = Evaluator(workload, mesh, "data", read_rows, num_examples=1000,  # doctest: +SKIP
  ...                global_batch_size=256)
  >>> ev(trainer=trainer, state=state)  # doctest: +SKIP
  {'eval_loss': 0.41, 'eval_accuracy': 0.86, 'eval_examples': 1000}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll import data
from jaxcoll.data import files as data_files
from jaxcoll.models import workload as workload_lib


def _reported_metrics(workload) -> Callable[[Any, Any], dict[str, Any]]:
  """``fn(params, example) -> {name: value}``: every metric the workload's eval or loss
  fn reports for one example (its state collections left out), as it reports it."""
  skip = set(getattr(workload, "state_collections", ()) or ())

  def reported(params, example):
    batch = jax.tree.map(lambda x: x[None], example)
    if workload.eval_fn is not None:  # a Workload always has one (from its loss_fn)
      out = dict(workload.eval_fn(params, batch))
    else:
      out = workload_lib.loss_metrics(workload.loss_fn, params, batch, has_aux=workload.has_aux)
    return {k: v for k, v in out.items() if k not in skip}

  return reported


def _per_example_metrics(workload) -> Callable[[Any, Any], dict[str, jax.Array]]:
  """``fn(params, example) -> {name: scalar}`` from the workload's eval or loss fn: the
  scalars and ``(sum, count)`` pairs; anything else is left out (:func:`_left_out`)."""
  reported = _reported_metrics(workload)

  def one(params, example):
    kept = {}
    for k, v in reported(params, example).items():
      if _is_pair(v):  # (sum, count): a weighted mean (module docstring)
        kept[k] = (jnp.asarray(v[0], jnp.float32), jnp.asarray(v[1], jnp.float32))
      elif _is_scalar(v):
        kept[k] = jnp.asarray(v, jnp.float32)
    return kept

  return one


def _is_scalar(value) -> bool:
  return not isinstance(value, (tuple, list, dict)) and jnp.ndim(value) == 0


def _left_out(reported: dict[str, Any]) -> dict[str, str]:
  """The metrics of ``reported`` (shapes of one example's) that are neither a scalar nor
  a ``(sum, count)`` pair of scalars, by name, each with what it is (``shape (3,)``)."""
  def what(value):
    if isinstance(value, (tuple, list)):
      return f"a {type(value).__name__} of {len(value)}: " + ", ".join(
          f"shape {tuple(np.shape(x))}" for x in value)
    if isinstance(value, dict):
      return f"a dict of {sorted(value)}"
    return f"shape {tuple(np.shape(value))}"

  return {k: what(v) for k, v in reported.items() if not (_is_pair(v) or _is_scalar(v))}


def _is_pair(value) -> bool:
  """Whether a metric is ``(sum, count)``: a tuple or list of two scalars."""
  return (isinstance(value, (tuple, list)) and len(value) == 2
          and all(jnp.ndim(x) == 0 for x in value))


class Evaluator:
  """Runs a workload's metrics over an eval set on ``mesh``.

  Args:
    workload: a :class:`jaxcoll.models.Workload` (its ``eval_fn``, else its
      ``loss_fn`` and scalar ``aux``).
    mesh: the device mesh.
    axis: the data axis (name or tuple) the eval batch is split over.
    read_rows: ``read_rows(example numbers) -> dict of numpy rows``.
    num_examples: ``N``, the size of the eval set.
    global_batch_size: ``B``, eval examples per batch over all processes.
  """

  def __init__(self, workload, mesh, axis, read_rows: Callable[[np.ndarray], dict], *,
               num_examples: int, global_batch_size: int):
    self.mesh, self.axis = mesh, axis
    self.read_rows = read_rows
    self.num_examples = int(num_examples)
    self.global_batch_size = int(global_batch_size)
    per_example = _per_example_metrics(workload)
    self._per_example, self._param_shapes = per_example, workload.param_shapes
    self._reported = _reported_metrics(workload)

    def sums(params, batch, mask):
      values = jax.vmap(per_example, in_axes=(None, 0))(params, batch)
      return jax.tree.map(lambda v: jnp.sum(v * mask), values) | {"count": jnp.sum(mask)}

    replicated = NamedSharding(mesh, P())
    self._sums = jax.jit(sums, out_shardings=replicated)
    # The same sums on each device's rows, for Trainer.eval_sums (one function: one program).
    self._local_sums = lambda params, b: sums(params, b["batch"], b["mask"])
    self.last: dict[str, float] = {}

  def run(self, params=None, *, trainer=None, state=None,
          cut_short: Callable[[], bool] | None = None) -> dict[str, float] | None:
    """Evaluates and keeps the result in :attr:`last` (``None``, and :attr:`last` kept,
    where ``cut_short`` stopped it: :meth:`__call__`).

    Either full ``params``, or ``trainer`` and its (sharded) ``state``: then the
    metrics run inside the trainer's program on the state as it is laid out
    (:meth:`jaxcoll.train.Trainer.eval_sums`; under ZeRO-3 FSDP units are
    gathered where they run), and no device holds a replicated copy of the model.
    """
    evaluated = self(params, trainer=trainer, state=state, cut_short=cut_short)
    if evaluated is not None:
      self.last = evaluated
    return evaluated

  def metric_names(self) -> tuple[str, ...]:
    """The metrics :meth:`run` reports (``eval_loss``, ``eval_accuracy``, ...; not
    ``eval_examples``), from the shapes of one eval example: nothing is computed."""
    return tuple(f"eval_{k}" for k in jax.eval_shape(self._per_example, self._param_shapes,
                                                     self._example_shapes()))

  def left_out_metrics(self) -> dict[str, str]:
    """The metrics the workload reports that :meth:`run` leaves out, by name, each with
    what it is (``"shape (3,)"``): not a scalar nor a ``(sum, count)`` pair of scalars (a
    per-class accuracy vector). Traced on the shapes of one eval example: nothing computed."""
    return _left_out(jax.eval_shape(self._reported, self._param_shapes,
                                    self._example_shapes()))

  def _example_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
    row = self.read_rows(np.arange(1))
    return {k: jax.ShapeDtypeStruct(np.shape(v)[1:], np.asarray(v).dtype)
            for k, v in row.items()}

  def compile_on(self, trainer, state) -> jax.stages.Compiled:
    """The compiled program :meth:`run` with ``trainer`` and ``state`` runs per batch
    (for ``memory_analysis()``), lowered on the first eval batch."""
    local, mask = next(iter(data_files.eval_batches(self.read_rows, self.num_examples,
                                                    self.global_batch_size)))
    batch = data.from_process_local({**local, "__mask__": mask}, self.mesh, axis=self.axis)
    mask_array = batch.pop("__mask__")
    return trainer.lower_eval_sums(
        self._local_sums, state, {"batch": batch, "mask": mask_array}).compile()

  def __call__(self, params=None, *, trainer=None, state=None,
               cut_short: Callable[[], bool] | None = None) -> dict[str, float] | None:
    """``{"eval_loss": ..., "eval_<metric>": ..., "eval_examples": N}``.

    ``cut_short``: asked before each batch after the first; when it says True the
    evaluation stops there and returns ``None`` (a stop signal: the runner saves and exits
    instead of finishing a long evaluation past a preemption's grace period).
    """
    if (params is None) == (trainer is None or state is None):
      raise ValueError("Evaluator: pass either `params` or both `trainer` and `state`.")
    totals: dict[str, float] = {}
    for i, (local, mask) in enumerate(data_files.eval_batches(
        self.read_rows, self.num_examples, self.global_batch_size)):
      if i and cut_short is not None and cut_short():
        return None
      batch = data.from_process_local({**local, "__mask__": mask}, self.mesh, axis=self.axis)
      mask_array = batch.pop("__mask__")
      if trainer is not None:
        out = trainer.eval_sums(self._local_sums, state, {"batch": batch, "mask": mask_array})
      else:
        out = self._sums(params, batch, mask_array)
      out = jax.device_get(out)  # one batch in flight
      for k, v in out.items():
        parts = [float(np.asarray(x, np.float64)) for x in (v if isinstance(v, tuple) else (v,))]
        totals[k] = [a + b for a, b in zip(totals.get(k, [0.0] * len(parts)), parts)]
    count = totals.pop("count")[0]
    if round(count) != self.num_examples:  # the invariant the mask guarantees
      raise RuntimeError(f"eval counted {count} examples, expected {self.num_examples}")
    return {f"eval_{k}": _ratio(*v) if len(v) == 2 else v[0] / count
            for k, v in totals.items()} | {"eval_examples": int(round(count))}


def _ratio(total: float, weight: float) -> float:
  """A weighted metric's mean over the set (NaN when nothing was counted)."""
  return total / weight if weight else float("nan")
