"""Collectives with an explicit algorithm, called inside shard_map / pmap.

Each function has the meaning of its ``lax`` twin (``psum``,
``psum_scatter(tiled=True)``, ``all_gather(tiled=True)``,
``all_to_all(tiled=True)``) and a keyword ``algorithm`` that says how the data
moves: ``"native"`` (one XLA collective: NCCL on GPU, ICI on TPU), a
composition of ``lax.ppermute`` steps (ring, tree, recursive doubling, ...),
or ``"auto"``. ``jaxcoll.algorithms(name)`` lists the choices. Every function
also accepts a pytree of arrays and applies itself to each leaf.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp

from jaxcoll import checks
from jaxcoll.collectives import _dispatch, reference
from jaxcoll.collectives._dispatch import (
    COLLECTIVES,
    OPS,
    Algorithm,
    algorithms,
    bound_axes,
    check_collective,
    register,
    reset_auto_chooser,
    set_auto_chooser,
)
from jaxcoll.collectives.hierarchical import Hierarchical

AxisName = Hashable | Sequence[Hashable]

__all__ = [
    "COLLECTIVES",
    "OPS",
    "Hierarchical",
    "algorithms",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "bound_axes",
    "broadcast",
    "check_collective",
    "reduce",
    "reduce_scatter",
    "reference",
    "register",
    "reset_auto_chooser",
    "set_auto_chooser",
]


def _leaf_checks(x) -> jax.Array:
  x = jnp.asarray(x)
  _dispatch.check_dtype(x)
  return x


def _map_leaves(one, x):
  """``jax.tree.map(one, x)``; a ValueError about one leaf of a pytree names that leaf.

  An optax state averaged with op='mean' said "needs a floating dtype, got int32" without
  saying that the int32 leaf is its step ``count``.
  """

  def named(path, leaf):
    try:
      return one(leaf)
    except ValueError as e:
      if not path:  # x is the array itself
        raise
      raise ValueError(f"leaf {jax.tree_util.keystr(path)} of `x`: {e}") from None

  return jax.tree_util.tree_map_with_path(named, x)


def _finish(value: jax.Array, op: str, n: int, dtype) -> jax.Array:
  if op == "mean":
    value = value / n
  return value.astype(dtype)


def _normalize_axis(axis: int, ndim: int, what: str) -> int:
  # A Python or numpy integer, as lax takes (x.ndim - 1 from a numpy shape is np.int64).
  if not checks.is_int(axis) or not -ndim <= axis < ndim:
    raise ValueError(
        f"`{what}` must be an axis of the input, in [-{ndim}, {ndim}); got {axis!r}."
    )
  return int(axis) % ndim


def _check_divisible(x: jax.Array, dim: int, n: int, what: str, collective: str) -> None:
  if x.shape[dim] % n:
    raise ValueError(
        f"{collective}: dimension `{what}`={dim} of the input has size "
        f"{x.shape[dim]}, which is not divisible by the group size {n}; pad it "
        f"to a multiple of {n} (as lax requires)."
    )


def _check_root(root: int, n: int) -> int:
  if isinstance(root, jax.Array):  # a traced rank, or a concrete one as a jax array
    raise ValueError(
        f"`root` must be a Python int, a rank in 0..{n - 1} fixed at trace time (each "
        f"algorithm's messages are laid out from it); got a jax array "
        f"({root.dtype}, shape {root.shape}): pass int(root) when it is known on the host; for "
        "a root chosen at run time, all_reduce(jnp.where(rank == root, x, 0)) broadcasts it.")
  if not checks.is_int(root) or not 0 <= root < n:
    raise ValueError(
        f"`root` must be a rank in 0..{n - 1} of the group of {n}; got {root!r}."
    )
  return int(root)


def all_reduce(
    x, axis_name: AxisName, *, op: str = "sum", algorithm: Algorithm = "auto"
):
  """Reduces ``x`` over the group; every device gets the result (``lax.psum``).

  HLO: ``all-reduce`` for ``native``, otherwise ``collective-permute`` steps.

  Args:
    x: an array (or pytree of arrays) on each device.
    axis_name: a mesh axis name or a tuple of names (flattened row-major).
    op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
    algorithm: one of ``jaxcoll.algorithms("all_reduce")``, or a
      ``jaxcoll.Hierarchical``.

  Returns:
    An array of ``x``'s shape and dtype, equal on every device.

  Raises:
    ValueError: unknown op or algorithm, an axis not in the mesh, mean on an
      integer dtype, hierarchical on a single axis.

  Example:
    >>> mesh = jaxcoll.devices.flat_mesh(8)  # doctest: +SKIP
    >>> f = jax.shard_map(lambda v: jaxcoll.all_reduce(v, "data", algorithm="ring"),
    ...                   mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    >>> f(jnp.arange(8.0))  # doctest: +SKIP
    Array([28., 28., 28., 28., 28., 28., 28., 28.], dtype=float32)
  """
  group = _dispatch.resolve_group(axis_name)

  def one(leaf):
    leaf = _leaf_checks(leaf)
    reducer = _dispatch.check_op(op, leaf.dtype)
    out = _dispatch.run("all_reduce", algorithm, leaf, group, reducer=reducer)
    return _finish(out, op, group.size, leaf.dtype)

  return _map_leaves(one, x)


def reduce_scatter(
    x,
    axis_name: AxisName,
    *,
    op: str = "sum",
    scatter_dimension: int = 0,
    algorithm: Algorithm = "auto",
):
  """Reduces ``x`` and leaves block ``rank`` of ``scatter_dimension`` here.

  Same as ``lax.psum_scatter(x, axis_name, scatter_dimension=...,
  tiled=True)``: the output's ``scatter_dimension`` is ``1/n`` of the input's.

  Raises:
    ValueError: as :func:`all_reduce`, and when ``x.shape[scatter_dimension]``
      is not divisible by the group size.
  """
  group = _dispatch.resolve_group(axis_name)
  n = group.size

  def one(leaf):
    leaf = _leaf_checks(leaf)
    reducer = _dispatch.check_op(op, leaf.dtype)
    if leaf.ndim == 0:
      raise ValueError("reduce_scatter needs an input of rank >= 1; got a scalar.")
    d = _normalize_axis(scatter_dimension, leaf.ndim, "scatter_dimension")
    _check_divisible(leaf, d, n, "scatter_dimension", "reduce_scatter")
    shape = leaf.shape
    split = shape[:d] + (n, shape[d] // n) + shape[d + 1 :]
    chunks = jnp.moveaxis(leaf.reshape(split), d, 0)
    out = _dispatch.run("reduce_scatter", algorithm, chunks, group, reducer=reducer)
    return _finish(out, op, n, leaf.dtype)

  return _map_leaves(one, x)


def all_gather(x, axis_name: AxisName, *, axis: int = 0, algorithm: Algorithm = "auto"):
  """Concatenates every device's ``x`` along ``axis`` in rank order.

  Same as ``lax.all_gather(x, axis_name, axis=axis, tiled=True)``.
  """
  group = _dispatch.resolve_group(axis_name)

  def one(leaf):
    leaf = _leaf_checks(leaf)
    if leaf.ndim == 0:
      raise ValueError(
          "all_gather (tiled) needs an input of rank >= 1; got a scalar. "
          "Use x[None] to gather scalars into a vector."
      )
    a = _normalize_axis(axis, leaf.ndim, "axis")
    gathered = _dispatch.run("all_gather", algorithm, leaf, group)
    moved = jnp.moveaxis(gathered, 0, a)
    shape = leaf.shape
    return moved.reshape(shape[:a] + (group.size * shape[a],) + shape[a + 1 :])

  return _map_leaves(one, x)


def broadcast(x, axis_name: AxisName, *, root: int = 0, algorithm: Algorithm = "auto"):
  """Every device gets the ``root`` device's ``x`` (bit for bit)."""
  group = _dispatch.resolve_group(axis_name)
  root = _check_root(root, group.size)

  def one(leaf):
    leaf = _leaf_checks(leaf)
    return _dispatch.run("broadcast", algorithm, leaf, group, root=root)

  return _map_leaves(one, x)


def reduce(
    x,
    axis_name: AxisName,
    *,
    root: int = 0,
    op: str = "sum",
    algorithm: Algorithm = "auto",
):
  """The ``root`` device gets the reduction; the others get their ``x`` back."""
  group = _dispatch.resolve_group(axis_name)
  root = _check_root(root, group.size)

  def one(leaf):
    leaf = _leaf_checks(leaf)
    reducer = _dispatch.check_op(op, leaf.dtype)
    out = _dispatch.run("reduce", algorithm, leaf, group, reducer=reducer, root=root)
    if op == "mean":
      out = jnp.where(group.rank() == root, out / group.size, leaf)
    return out.astype(leaf.dtype)

  return _map_leaves(one, x)


def all_to_all(
    x,
    axis_name: AxisName,
    split_axis: int,
    concat_axis: int,
    *,
    algorithm: Algorithm = "auto",
):
  """Block ``j`` of ``split_axis`` goes to rank ``j``; received blocks are
  concatenated along ``concat_axis`` in rank order.

  Same as ``lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=True)``.
  """
  group = _dispatch.resolve_group(axis_name)
  n = group.size

  def one(leaf):
    leaf = _leaf_checks(leaf)
    if leaf.ndim == 0:
      raise ValueError("all_to_all needs an input of rank >= 1; got a scalar.")
    s = _normalize_axis(split_axis, leaf.ndim, "split_axis")
    c = _normalize_axis(concat_axis, leaf.ndim, "concat_axis")
    _check_divisible(leaf, s, n, "split_axis", "all_to_all")
    shape = leaf.shape
    split = shape[:s] + (n, shape[s] // n) + shape[s + 1 :]
    chunks = jnp.moveaxis(leaf.reshape(split), s, 0)
    out = _dispatch.run("all_to_all", algorithm, chunks, group)
    moved = jnp.moveaxis(out, 0, c)
    chunk_shape = chunks.shape[1:]
    return moved.reshape(
        chunk_shape[:c] + (n * chunk_shape[c],) + chunk_shape[c + 1 :]
    )

  return _map_leaves(one, x)
