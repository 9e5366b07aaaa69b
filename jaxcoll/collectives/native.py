"""`native`: the collective as one XLA op (NCCL on GPU, ICI on TPU).

Canonical forms (shared by every algorithm module): ``reduce_scatter`` takes
the input stacked as ``(n, ...)`` chunks and returns this rank's reduced
chunk; ``all_gather`` takes one chunk and returns ``(n, ...)``; ``all_to_all``
takes ``(n, ...)`` chunks (chunk ``j`` goes to rank ``j``) and returns
``(n, ...)`` (position ``j`` came from rank ``j``). The public functions in
:mod:`jaxcoll.collectives` move the user's axes into these forms.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxcoll.collectives._group import Group, Reducer


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _extremum(x: jax.Array, axis_name, name: str) -> jax.Array:
  """``lax.pmax`` / ``lax.pmin``, with the derivative JAX leaves undefined.

  Every ppermute algorithm differentiates (``jnp.maximum`` steps), so without a rule
  ``jax.grad`` through ``op="max"`` failed for ``native`` alone, and for ``auto`` only at
  the sizes where it picks ``native``. The rule is ``jnp.max``'s over the stacked inputs:
  the tangent of the device(s) holding the extremum, averaged over ties.
  """
  return (lax.pmax if name == "max" else lax.pmin)(x, axis_name)


@_extremum.defjvp
def _extremum_jvp(axis_name, name, primals, tangents):
  (x,), (t,) = primals, tangents
  out = _extremum(x, axis_name, name)
  if t.dtype == jax.dtypes.float0:  # integer input: no tangent
    return out, t
  here = x == out
  count = lax.psum(here.astype(t.dtype), axis_name)
  return out, lax.psum(jnp.where(here, t, jnp.zeros_like(t)), axis_name) / count


_LAX_REDUCE = {
    "sum": lax.psum,
    "max": lambda x, axis_name: _extremum(x, axis_name, "max"),
    "min": lambda x, axis_name: _extremum(x, axis_name, "min"),
}


def native_all_reduce(x: jax.Array, group: Group, reducer: Reducer) -> jax.Array:
  return group.varying(_LAX_REDUCE[reducer.name](x, group.axis_name))


def native_reduce_scatter(
    chunks: jax.Array, group: Group, reducer: Reducer
) -> jax.Array:
  if reducer.name == "sum":
    return lax.psum_scatter(chunks, group.axis_name, scatter_dimension=0, tiled=False)
  # XLA's reduce-scatter only sums: max/min reduce everything, keep our chunk.
  full = _LAX_REDUCE[reducer.name](chunks, group.axis_name)
  mine = lax.dynamic_index_in_dim(full, group.rank(), axis=0, keepdims=False)
  return group.varying(mine)


def native_all_gather(chunk: jax.Array, group: Group) -> jax.Array:
  return group.varying(lax.all_gather(chunk, group.axis_name, axis=0, tiled=False))


def _masked_bits_psum(x: jax.Array, group: Group, root: int) -> jax.Array:
  """All-reduce of the root's bit pattern and zeros elsewhere.

  Summing the integer bit patterns (one non-zero term) is exact for every
  dtype, -0.0 and NaN payloads included.
  """
  bits = jnp.dtype(f"uint{8 * jnp.dtype(x.dtype).itemsize}")
  raw = lax.bitcast_convert_type(x, bits)
  raw = jnp.where(group.rank() == root, raw, jnp.zeros_like(raw))
  out = lax.bitcast_convert_type(lax.psum(raw, group.axis_name), x.dtype)
  return group.varying(out)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def native_broadcast(x: jax.Array, group: Group, root: int) -> jax.Array:
  """One XLA all-reduce of the root's bits (see ``_masked_bits_psum``).

  Not XLA's collective-broadcast (``lax.pbroadcast``): it has no CPU lowering
  and no transpose rule in this JAX, and it moves the same data as this
  all-reduce on a ring. The bit casts have no derivative, so the tangent is
  the same broadcast written as a float sum, ``psum(where(rank == root, t,
  0))``: linear, so reverse mode is its transpose (the root receives the sum
  of every device's cotangent, the others zero), and every order is defined.
  """
  return _masked_bits_psum(x, group, root)


@native_broadcast.defjvp
def _broadcast_jvp(group, root, primals, tangents):
  (x,), (t,) = primals, tangents
  out = native_broadcast(x, group, root)
  if t.dtype == jax.dtypes.float0:  # integer input: no tangent
    return out, t
  masked = jnp.where(group.rank() == root, t, jnp.zeros_like(t))
  return out, group.varying(lax.psum(masked, group.axis_name))


def native_reduce(x: jax.Array, group: Group, reducer: Reducer, root: int) -> jax.Array:
  total = _LAX_REDUCE[reducer.name](x, group.axis_name)
  return jnp.where(group.rank() == root, total, x)


def native_all_to_all(chunks: jax.Array, group: Group) -> jax.Array:
  return lax.all_to_all(chunks, group.axis_name, 0, 0, tiled=False)
