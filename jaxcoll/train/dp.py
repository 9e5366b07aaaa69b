"""Data parallelism as a :class:`~jaxcoll.train.plan.Plan`.

Parameters and optimizer state are replicated; each device differentiates
its slice of the batch and the gradients are averaged by a bucketed
all-reduce (PyTorch DDP, Horovod tensor fusion), optionally compressed with
error feedback (:mod:`jaxcoll.train.compression`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll import collectives
from jaxcoll.train import compression as compression_lib
from jaxcoll.train import grads as grads_lib
from jaxcoll.train.buckets import flatten_bucket, plan_buckets, unflatten_bucket
from jaxcoll.train import kinds
from jaxcoll.train.plan import ReplicatedParams, TrainSetup
from jaxcoll.train.state import TrainState, stack, unstack


def fill_empty(out, leaves):
  """Zero-size leaves are in no bucket: give them their (empty) gradient."""
  return [o if o is not None else jnp.zeros_like(x) for o, x in zip(out, leaves)]


def all_reduce_buckets(leaves, buckets, axis, algorithm):
  """Mean over ``axis`` of every leaf, one all-reduce per bucket."""
  out = [None] * len(leaves)
  for bucket in buckets:
    flat = flatten_bucket(leaves, bucket)
    mean = collectives.all_reduce(flat, axis, op="mean", algorithm=algorithm)
    for i, g in unflatten_bucket(mean, bucket, leaves).items():
      out[i] = g
  return fill_empty(out, leaves)


class DataParallelPlan(ReplicatedParams):
  """:class:`jaxcoll.DataParallel` bound to a model."""

  kind = kinds.DP

  def __init__(self, strategy, model: TrainSetup, axis, dp_size: int):
    self.strategy, self.model = strategy, model
    self.data_axes, self.dp_size = axis, dp_size
    complex_leaves = [("/".join(p), x.dtype) for p, x in zip(model.paths, model.like)
                      if jnp.issubdtype(x.dtype, jnp.complexfloating)]
    if strategy.compression and complex_leaves:  # the float32 bucket dropped .imag, silently
      name, dtype = complex_leaves[0]
      raise ValueError(
        f"DataParallel: `compression` {strategy.compression!r} sends real numbers, but "
        f"`params` leaf {name} is {dtype}: the imaginary part of its gradient would be "
        "lost. Use compression=None for a model with complex parameters.")
    self.buckets = plan_buckets(
      [x.size * 4 for x in model.like], strategy.bucket_bytes, [x.dtype.name for x in model.like]
    )
    self.feedback = bool(strategy.compression and strategy.error_feedback)
    rep = P()
    self.state_spec = TrainState(step=rep, params=rep, opt_state=rep, residual=P(axis))
    self._init_replicated = jax.jit(self.smap(self._init_body, rep, self.state_spec))

  # -- state ---------------------------------------------------------------------

  def _init_body(self, params) -> TrainState:
    # Leaf by leaf, as before tensor fusion: packing would add a copy of the
    # model at init, where memory is tightest.
    params = collectives.broadcast(params, self.data_axes, root=0, bucket_bytes=0)
    step = jnp.zeros((), jnp.int32)
    residual = stack(self._residuals()) if self.feedback else ()
    return TrainState(step, params, self.model.optimizer.init(params), residual)

  def _residuals(self, lead: tuple[int, ...] = ()):
    residual = []
    for bucket in self.buckets:
      size = sum(self.model.like[i].size for i in bucket)
      shapes = compression_lib.residual_shapes(size, self.dp_size, self.strategy.compression)
      residual.append({k: jnp.zeros(lead + v, jnp.float32) for k, v in shapes.items()})
    return tuple(residual)

  def zero_residuals(self):
    if not self.feedback:
      return ()
    sharding = NamedSharding(self.model.mesh, P(self.data_axes))
    return jax.device_put(self._residuals((self.dp_size,)), sharding)

  def residual_layout(self):
    if not self.feedback:
      return None
    return {
      "strategy": "DataParallel",
      "compression": self.strategy.compression,
      "data_parallel_size": int(self.dp_size),
      "buckets": [[int(i) for i in bucket] for bucket in self.buckets],
    }

  # -- one step ----------------------------------------------------------------------

  def grads(self, state, batch, loss, accumulate):
    grad_fn = jax.value_and_grad(lambda p, b: loss(self.model.cast(p), b), has_aux=True)
    value, aux, local = accumulate(grad_fn, state.params, batch)
    leaves = jax.tree.leaves(local)
    s = self.strategy
    if not s.compression:
      grads = all_reduce_buckets(leaves, self.buckets, self.data_axes, s.algorithm)
      return value, aux, self.model.unflatten(grads), state.residual
    out, new_residual = [None] * len(leaves), []
    residual = unstack(state.residual) if state.residual else [{}] * len(self.buckets)
    for bucket, old in zip(self.buckets, residual):
      flat = flatten_bucket(leaves, bucket, jnp.float32)
      mean, new = compression_lib.compressed_mean(
        flat, old, self.data_axes, compression=s.compression, algorithm=s.algorithm,
        error_feedback=s.error_feedback,
      )
      for i, g in unflatten_bucket(mean, bucket, leaves).items():
        out[i] = g
      new_residual.append(new)
    new_residual = stack(tuple(new_residual)) if s.error_feedback else ()
    return value, aux, self.model.unflatten(fill_empty(out, leaves)), new_residual

  def grad_norm(self, grads):
    return jnp.sqrt(sum(jnp.sum(grads_lib.abs_squared(g))
                        for g in jax.tree.leaves(grads)))

  def apply(self, state, grads):
    updates, opt_state = self.model.optimizer.update(grads, state.opt_state, state.params)
    return optax.apply_updates(state.params, updates), opt_state

  def replicated(self, state):
    return {"params": state.params, "opt_state": state.opt_state}

  # -- leaving the device ------------------------------------------------------------

  def opt_mirrors(self):
    full = self.model.unflatten(self.model.like)
    return [None] * len(jax.tree.leaves(jax.eval_shape(self.model.optimizer.init, full)))

  def export_leaves(self, state, mirrors):
    return jax.tree.leaves(state.params), jax.tree.leaves(state.opt_state)

  def import_leaves(self, params, opt, mirrors):
    return params, opt
