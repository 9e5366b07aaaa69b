"""Gradient accumulation over microbatches and clipping by a given global norm."""

from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp


def accumulate(grad_fn, params, batch, steps: int):
  """Mean loss, aux and gradient of ``grad_fn`` over ``steps`` microbatches.

  Args:
    grad_fn: ``(params, microbatch) -> ((loss, aux), grads)``.
    params: what ``grad_fn`` differentiates (full parameters or rows).
    batch: this device's batch; its leading dimension divides by ``steps``.
    steps: the number of microbatches (``lax.scan`` over them when > 1).

  Returns:
    ``(loss, aux, grads)``: floating aux leaves averaged, integer ones summed.
  """
  if steps == 1:
    (loss, aux), grads = grad_fn(params, batch)
    return loss, aux, grads
  micro = jax.tree.map(lambda x: x.reshape((steps, x.shape[0] // steps) + x.shape[1:]), batch)

  def one(total, microbatch):
    (loss, aux), grads = grad_fn(params, microbatch)
    return jax.tree.map(jnp.add, total, grads), (loss, aux)

  zeros = jax.tree.map(jnp.zeros_like, params)
  total, (losses, auxes) = jax.lax.scan(one, zeros, micro)
  grads = jax.tree.map(lambda g: g / steps, total)
  aux = jax.tree.map(lambda a: a.mean(0) if is_float(a) else a.sum(0), auxes)
  return losses.mean(), aux, grads


def is_float(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def abs_squared(x) -> jax.Array:
  """``|x|**2`` elementwise in float32, the squares of optax's global norm: a complex
  entry counts its real and imaginary parts (a cast to float32 kept the real part only,
  so the gradient norm and clipping of complex parameters were those of their real parts)."""
  if jnp.iscomplexobj(x):
    return jnp.square(x.real.astype(jnp.float32)) + jnp.square(x.imag.astype(jnp.float32))
  return jnp.square(x.astype(jnp.float32))


def clip(grads, norm, max_norm):
  """Exactly ``optax.clip_by_global_norm(max_norm)`` given the global ``norm``."""
  trigger = norm < max_norm
  return jax.tree.map(
    lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm), grads
  )


try:  # JAX's dead-code elimination of a jaxpr (no public name yet)
  from jax._src.interpreters.partial_eval import dce_jaxpr as _dce_jaxpr
except ImportError:  # pragma: no cover  (then the whole jaxpr is searched)
  _dce_jaxpr = None

# Collectives through which one device's examples change another's outputs: a loss
# that runs one over the data axes (nn.BatchNorm(axis_name="data")) couples the rows.
_COUPLING = ("psum", "pmax", "pmin", "all_gather", "all_to_all", "ppermute", "reduce_scatter")


def reduces_over(fn, args, axes) -> str | None:
  """The first collective primitive over any of ``axes`` that ``fn(*args)``'s outputs
  depend on, or None.

  Traced only (``jax.make_jaxpr``), inside the caller's ``shard_map`` (where
  ``axes`` are bound); dead code is dropped first (``dce_jaxpr``), so a collective
  whose result ``fn`` does not return (an aux metric the caller left out) is not
  counted; sub-programs (scan, remat, pjit, custom_vjp) are searched too.
  """
  names = {axes} if isinstance(axes, str) else set(axes)
  try:
    closed = jax.make_jaxpr(fn)(*args)
  except Exception:  # noqa: BLE001  (the step traces it again and shows any error in full)
    return None
  jaxpr = closed.jaxpr
  if _dce_jaxpr is not None:
    jaxpr, _ = _dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name.startswith(_COUPLING):
        named = eqn.params.get("axes", eqn.params.get("axis_name", ()))
        named = {named} if isinstance(named, str) else set(named)
        if named & names:
          return eqn.primitive.name
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        found = visit(sub)
        if found:
          return found
    return None

  return visit(jaxpr)
