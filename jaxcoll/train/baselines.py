"""Idiomatic JAX baselines of the trainers, and a step timer.

What a JAX user writes without jaxcoll: ``jax.jit`` with ``NamedSharding``
and XLA's GSPMD partitioner inserting the collectives.

* ``GspmdTrainer(..., fsdp=False)``: data parallelism: parameters and
  optimizer state replicated, batch sharded over the data axis.
* ``GspmdTrainer(..., fsdp=True)``: GSPMD's FSDP, set up as the JAX
  "distributed arrays" guide and MaxText's FSDP (``ici_fsdp_parallelism``)
  set it up: every parameter sharded over the data axis along its largest
  dimension that divides; the optimizer state (Adam's ``mu`` / ``nu``)
  sharded exactly like the parameter it belongs to
  (``optax.tree_map_params``); gradients constrained to the parameters'
  shardings; one ``jax.jit`` with ``in_shardings`` / ``out_shardings`` and
  the state donated. Leaves of a scanned stack (under a ``"layers"`` key,
  leading layer axis) are never cut along the layer axis, as MaxText's
  ``layers`` logical axis is unsharded: each scan iteration then gathers one
  layer, not the stack.

They share :class:`jaxcoll.train.Trainer`'s ``init`` / ``step`` /
``compile_step`` interface, so :func:`time_steps` and
:func:`jaxcoll.memory.compare`'s helpers take either.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll.train import state as state_lib
from jaxcoll.train.strategies import axis_spec, check_axis

LAYER_KEY = "layers"  # jaxcoll.models' scanned stacks: leading axis = layer


def _is_stacked(path, layer_key: str | None) -> bool:
  if layer_key is None:
    return False
  return any(getattr(k, "key", getattr(k, "name", None)) == layer_key for k in path)


class GspmdTrainer:
  """``jax.jit`` + ``NamedSharding`` training step (the baseline).

  Args:
    loss_fn: as for :class:`jaxcoll.train.Trainer`.
    optimizer: an optax optimizer.
    mesh: the device mesh.
    axis: the data axis (or tuple of axes).
    fsdp: shard parameters, gradients and optimizer state over ``axis``
      (GSPMD FSDP).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    layer_key: leaves with this dict key in their path are scanned stacks
      whose leading axis is the layer: FSDP shards one of their other
      dimensions. None: every dimension may be sharded.

  Example:
    >>> trainer = GspmdTrainer(loss_fn, optax.adam(1e-3), mesh, fsdp=True)  # doctest: +SKIP
    >>> state = trainer.init(params)  # doctest: +SKIP
    >>> state, metrics = trainer.step(state, batch)  # doctest: +SKIP
  """

  def __init__(
    self,
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    axis="data",
    *,
    fsdp: bool = False,
    has_aux: bool = False,
    layer_key: str | None = LAYER_KEY,
  ):
    self.loss_fn, self.optimizer, self.mesh = loss_fn, optimizer, mesh
    self.dp_size = check_axis(axis, mesh)
    self.axis = axis_spec(axis)
    self.fsdp, self.has_aux, self.layer_key = fsdp, has_aux, layer_key
    self.name = "GSPMD FSDP" if fsdp else "GSPMD DP"
    self._built = None

  def param_spec(self, shape: Sequence[int], stacked: bool = False) -> P:
    """The ``PartitionSpec`` of a parameter of ``shape`` (a stacked leaf keeps axis 0 whole)."""
    if not self.fsdp:
      return P()
    dims = range(1 if stacked else 0, len(shape))
    for dim in sorted(dims, key=lambda d: -shape[d]):
      if shape[dim] % self.dp_size == 0:
        spec = [None] * len(shape)
        spec[dim] = self.axis
        return P(*spec)
    return P()  # small or odd-sized leaves stay replicated

  def shardings(self, params) -> tuple[Any, Any]:
    """``(param_shardings, opt_state_shardings)`` for ``params`` (arrays or shape structs).

    Optimizer-state leaves that mirror a parameter (``mu``, ``nu``, ...) get
    that parameter's sharding; the rest (Adam's ``count``) are replicated.
    """
    param_shardings = jax.tree_util.tree_map_with_path(
      lambda path, x: NamedSharding(
        self.mesh, self.param_spec(np.shape(x), _is_stacked(path, self.layer_key))
      ),
      params,
    )
    replicated = NamedSharding(self.mesh, P())
    abstract_opt = jax.eval_shape(self.optimizer.init, params)
    opt_shardings = optax.tree_map_params(
      self.optimizer,
      lambda _, sharding: sharding,
      abstract_opt,
      param_shardings,
      transform_non_params=lambda _: replicated,
    )
    return param_shardings, opt_shardings

  def _build(self, params) -> None:
    leaves, treedef = jax.tree.flatten(params)
    key = (treedef, tuple((np.shape(x), np.dtype(x.dtype)) for x in leaves))
    if self._built == key:
      return
    self._built = key
    self._shardings = shardings, opt_shardings = self.shardings(params)
    self._batch_sharding = NamedSharding(self.mesh, P(self.axis))

    def step(params, opt_state, batch):
      def loss(p):
        out = self.loss_fn(p, batch)
        return out if self.has_aux else (out, ())

      (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(params)
      grads = jax.lax.with_sharding_constraint(grads, shardings)
      updates, opt_state = self.optimizer.update(grads, opt_state, params)
      metrics = {"loss": value, "grad_norm": optax.tree.norm(grads)}
      if self.has_aux:
        metrics["aux"] = aux
      return optax.apply_updates(params, updates), opt_state, metrics

    self._step = jax.jit(
      step,
      in_shardings=(shardings, opt_shardings, self._batch_sharding),
      out_shardings=(shardings, opt_shardings, NamedSharding(self.mesh, P())),
      donate_argnums=(0, 1),
    )
    self._opt_init = jax.jit(self.optimizer.init, out_shardings=opt_shardings)

  def init(self, params):
    """``(params, opt_state)`` placed with their shardings."""
    self._build(params)
    # Via host copies: device_put could alias the caller's buffers, which
    # the donating step would then delete.
    params = jax.device_put(jax.tree.map(np.asarray, params), self._shardings[0])
    return params, self._opt_init(params)

  def abstract_state(self, param_shapes):
    """The state ``init`` would return, as ``jax.ShapeDtypeStruct``s with
    shardings (nothing allocated): for :meth:`lower_step` of large models."""
    self._build(param_shapes)
    shardings, opt_shardings = self._shardings
    like = lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s)  # noqa: E731
    opt = jax.eval_shape(self.optimizer.init, param_shapes)
    return jax.tree.map(like, param_shapes, shardings), jax.tree.map(like, opt, opt_shardings)

  def step(self, state, batch):
    params, opt_state = state
    batch = state_lib.place(batch, self.mesh, P(self.axis))
    params, opt_state, metrics = self._step(params, opt_state, batch)
    return (params, opt_state), metrics

  def lower_step(self, state, batch) -> jax.stages.Lowered:
    """The lowered step; ``state`` may be :meth:`abstract_state`, ``batch`` shape structs."""
    params, opt_state = state
    self._build(params)
    if not all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(batch)):
      batch = state_lib.place(batch, self.mesh, P(self.axis))
    return self._step.lower(params, opt_state, batch)

  def compile_step(self, state, batch) -> jax.stages.Compiled:
    """The compiled step (for ``memory_analysis()``)."""
    return self.lower_step(state, batch).compile()

  def params(self, state):
    """The parameters (global jax arrays, sharded as trained)."""
    return state[0]


def time_steps(
  trainer, state, batches: Sequence, *, warmup: int, steps: int
) -> tuple[Any, list[float]]:
  """Seconds per step, waiting for each step to finish before the next.

  Waiting every step bounds the executions in flight (the XLA CPU backend
  aborts with many queued collective programs, see BUILD.md) and makes each
  sample one step's latency. Batches are reused round-robin.

  Returns:
    ``(state, times)``: the final state and ``steps`` durations (warm-up not
    included).
  """
  times = []
  for i in range(warmup + steps):
    start = time.perf_counter()
    state, metrics = trainer.step(state, batches[i % len(batches)])
    jax.block_until_ready(metrics)
    if i >= warmup:
      times.append(time.perf_counter() - start)
  return state, times


def median_ms(times: Sequence[float]) -> float:
  return 1e3 * statistics.median(times)


def data_sharded(batches, mesh: Mesh, axis) -> list:
  """Batches placed on ``mesh``, sharded over ``axis`` (outside the timing)."""
  spec = P(axis_spec(axis))
  return [state_lib.place(b, mesh, spec) for b in batches]
