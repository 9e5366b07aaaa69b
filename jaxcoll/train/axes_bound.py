"""A loss traced outside the trainer's ``shard_map`` with the mesh's axes bound (size 1).

A user's loss may reduce over a mesh axis (``nn.BatchNorm(axis_name="data")``
calls ``lax.pmean(x, "data")``). Inside the trainer's ``shard_map`` that axis is
bound; traced anywhere else (the planner's one-device activation compile, the
GSPMD baseline's plain ``jit`` of the global batch) JAX raises "unbound axis
name". Binding each axis as a ``vmap`` axis of size 1 over unbatched inputs
makes every reduction over it the identity (``pmean``/``psum`` of one copy),
which is the right value where the batch traced is the whole batch of that
axis: one device's batch on one device, or the global batch under GSPMD. A
``vmap`` (not a one-device ``shard_map``) works inside any ``jit``, whatever
the devices of its inputs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Sequence

import jax


def with_axes_bound(fn: Callable, axis_names: Sequence[Hashable]) -> Callable:
  """``fn`` with each of ``axis_names`` bound as an axis of size 1 while it runs.

  Same arguments and outputs as ``fn`` (no axis added to either); a reduction over
  a bound axis inside ``fn`` returns its operand, ``lax.axis_size`` gives 1.

  Args:
    fn: any function of arrays (its positional arguments are not mapped).
    axis_names: the axes to bind, e.g. ``trainer.mesh.axis_names``; ``()``
      returns ``fn`` itself.

  Returns:
    The wrapped function.

  Example:
    >>> import jax.numpy as jnp
    >>> from jax import lax
    >>> mean = with_axes_bound(lambda x: lax.pmean(x.mean(), "data"), ("data",))
    >>> float(mean(jnp.arange(4.0)))
    1.5
  """
  names = tuple(axis_names)
  if not names:
    return fn
  mapped = fn
  for name in names:
    mapped = jax.vmap(mapped, in_axes=None, out_axes=0, axis_size=1, axis_name=name)
  index = (0,) * len(names)

  def bound(*args):
    return jax.tree.map(lambda x: x[index], mapped(*args))

  return bound


def _unbound_axis(err: NameError) -> bool:
  return "unbound axis name" in str(err)


def unbound_axis_name(err: NameError) -> str | None:
  """The axis JAX's ``NameError`` "unbound axis name: data. ..." names, else None."""
  match = re.search(r"unbound axis name: ([^\s.,]+)", str(err))
  return match.group(1) if match else None


def bound_if_needed(fn: Callable, axis_names: Sequence[Hashable], *args) -> Callable:
  """``fn`` itself, or :func:`with_axes_bound` of it where ``fn(*args)`` needs that.

  Decides by one abstract trace (``jax.eval_shape``) of ``fn`` on ``args``
  (arrays, tracers or ``jax.ShapeDtypeStruct``s): the axes are bound only if it
  raises "unbound axis name" (a loss with ``nn.BatchNorm(axis_name="data")``). A
  function that needs no binding, or one that runs its own ``jax.shard_map`` over
  the mesh (which a ``vmap`` named after the mesh's axes would break), is
  returned unchanged.

  Example:
    >>> import jax.numpy as jnp
    >>> from jax import lax
    >>> plain = lambda x: x.mean()
    >>> bound_if_needed(plain, ("data",), jnp.ones(4)) is plain
    True
    >>> mean = bound_if_needed(lambda x: lax.pmean(x.mean(), "data"), ("data",), jnp.ones(4))
    >>> float(mean(jnp.arange(4.0)))
    1.5
  """
  names = tuple(axis_names)
  if not names:
    return fn
  structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), x.dtype), args)
  try:
    jax.eval_shape(fn, *structs)
  except NameError as err:
    if not _unbound_axis(err):
      raise
    return with_axes_bound(fn, names)
  return fn


def make_jaxpr_bound_if_needed(fn: Callable, axis_names: Sequence[Hashable], *args):
  """``jax.make_jaxpr`` of :func:`bound_if_needed`'s function on ``args``.

  The same decision (the axes are bound only where tracing ``fn`` raises "unbound
  axis name"), taken on the trace that makes the jaxpr: one trace where ``fn`` needs
  no binding, not an ``eval_shape`` and then another. Any other trace error is
  raised as it is.

  Returns:
    The ``jax.core.ClosedJaxpr``; its inputs are ``args``' leaves in order.
  """
  names = tuple(axis_names)
  try:
    return jax.make_jaxpr(fn)(*args)
  except NameError as err:
    if not names or not _unbound_axis(err):
      raise
  return jax.make_jaxpr(with_axes_bound(fn, names))(*args)
