"""Idiomatic JAX baselines of the trainers, and a step timer.

What a JAX user writes without jaxcoll: ``jax.jit`` with ``NamedSharding``
and XLA's GSPMD partitioner inserting the collectives.

* ``GspmdTrainer(..., fsdp=False)``: data parallelism: parameters and
  optimizer state replicated, batch sharded over the data axis.
* ``GspmdTrainer(..., fsdp=True)``: GSPMD's FSDP: every parameter (and its
  optimizer state) sharded over the data axis along its largest dimension
  that divides, as in the JAX "distributed arrays" and maxtext FSDP recipes.

They share :class:`jaxcoll.train.Trainer`'s ``init`` / ``step`` interface,
so :func:`time_steps` times either.
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
from jaxcoll.train.strategies import axis_spec, axis_tuple, check_axis


class GspmdTrainer:
  """``jax.jit`` + ``NamedSharding`` training step (the baseline).

  Args:
    loss_fn: as for :class:`jaxcoll.train.Trainer`.
    optimizer: an optax optimizer.
    mesh: the device mesh.
    axis: the data axis (or tuple of axes).
    fsdp: shard parameters and optimizer state over ``axis`` (GSPMD FSDP).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
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
  ):
    self.loss_fn, self.optimizer, self.mesh = loss_fn, optimizer, mesh
    self.dp_size = check_axis(axis, mesh)
    self.axis = axis_spec(axis)
    self.fsdp, self.has_aux = fsdp, has_aux
    self.name = "GSPMD FSDP" if fsdp else "GSPMD DP"

  def _param_spec(self, shape: Sequence[int]) -> P:
    if not self.fsdp:
      return P()
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
      if shape[dim] % self.dp_size == 0:
        spec = [None] * len(shape)
        spec[dim] = self.axis
        return P(*spec)
    return P()  # small or odd-sized leaves stay replicated

  def init(self, params):
    shardings = jax.tree.map(
      lambda x: NamedSharding(self.mesh, self._param_spec(np.shape(x))), params
    )
    # Via host copies: device_put could alias the caller's buffers, which
    # the donating step would then delete.
    params = jax.device_put(jax.tree.map(np.asarray, params), shardings)
    replicated = NamedSharding(self.mesh, P())
    opt_state = jax.tree.map(  # scalars (Adam's count) land on one device
      lambda x: x if isinstance(x.sharding, NamedSharding) else jax.device_put(x, replicated),
      jax.jit(self.optimizer.init)(params),
    )
    opt_shardings = jax.tree.map(lambda x: x.sharding, opt_state)
    batch_sharding = NamedSharding(self.mesh, P(self.axis))

    def step(params, opt_state, batch):
      def loss(p):
        out = self.loss_fn(p, batch)
        return out if self.has_aux else (out, ())

      (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(params)
      updates, opt_state = self.optimizer.update(grads, opt_state, params)
      metrics = {"loss": value, "grad_norm": optax.global_norm(grads)}
      if self.has_aux:
        metrics["aux"] = aux
      return optax.apply_updates(params, updates), opt_state, metrics

    self._step = jax.jit(
      step,
      in_shardings=(shardings, opt_shardings, batch_sharding),
      out_shardings=(shardings, opt_shardings, NamedSharding(self.mesh, P())),
      donate_argnums=(0, 1),
    )
    return params, opt_state

  def step(self, state, batch):
    params, opt_state = state
    batch = state_lib.place(batch, self.mesh, P(self.axis))
    params, opt_state, metrics = self._step(params, opt_state, batch)
    return (params, opt_state), metrics


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
  spec = P(axis_tuple(axis)[0] if len(axis_tuple(axis)) == 1 else axis_tuple(axis))
  return [state_lib.place(b, mesh, spec) for b in batches]
