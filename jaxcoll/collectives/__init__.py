"""Collectives with an explicit algorithm, called inside shard_map / pmap.

Each function has the meaning of its ``lax`` twin (``psum``,
``psum_scatter(tiled=True)``, ``all_gather(tiled=True)``,
``all_to_all(tiled=True)``) and a keyword ``algorithm`` that says how the data
moves: ``"native"`` (one XLA collective: NCCL on GPU, ICI on TPU), a
composition of ``lax.ppermute`` steps (ring, tree, recursive doubling, ...),
or ``"auto"``. ``jaxcoll.algorithms(name)`` lists the choices. Every function
also accepts a pytree of arrays and applies itself to each leaf; with an
algorithm other than ``native``, the leaves of one dtype are packed into flat
buffers of at most ``bucket_bytes`` (25 MiB) and the algorithm runs once per
buffer (tensor fusion, :mod:`jaxcoll.collectives.packing`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp

from jaxcoll import checks
from jaxcoll.collectives import _dispatch, packing, reference
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
from jaxcoll.collectives.packing import DEFAULT_BUCKET_BYTES

AxisName = Hashable | Sequence[Hashable]

__all__ = [
    "COLLECTIVES",
    "DEFAULT_BUCKET_BYTES",
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


def _leaf_checks(x, *, keys: bool = False) -> jax.Array:
  """``x`` as an array of a dtype collectives take; PRNG key arrays (``jax.random.key``)
  only where ``keys`` (the collectives that move data: keys have no sum, max or min)."""
  x = jnp.asarray(x)
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    if not keys:  # numpy's "Cannot interpret 'key<fry>' as a data type", naming no leaf
      raise ValueError(
          f"a PRNG key array ({x.dtype}) has no sum, mean, max or min: move keys with "
          "broadcast, all_gather or all_to_all, or reduce their bits, "
          "jax.random.key_data(x).")
    return x
  _dispatch.check_dtype(x)
  return x


def _key_data(x: jax.Array):
  """(``x``'s numbers, the function that makes the result ``x``'s kind again): a PRNG key
  array moves as its ``jax.random.key_data`` (uint32, the key's words on trailing axes, as
  ``lax.all_gather`` moves it) and is wrapped back with its implementation."""
  if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return x, lambda out: out
  impl = jax.random.key_impl(x)
  return jax.random.key_data(x), lambda out: jax.random.wrap_key_data(out, impl=impl)


_map_leaves = packing.map_leaves


def _map_packed(collective, x, prepare, run, group, *, algorithm, bucket_bytes, lead=0):
  """``prepare`` and ``run(canonical, algorithm)`` on every leaf of ``x``; leaves of one
  dtype share a buffer, unless the algorithm is ``native`` (also as ``auto``'s choice for a
  buffer: XLA combines native collectives itself, without a copy) or nothing moves (a group
  of one)."""
  bucket_bytes = packing.check_bucket_bytes(bucket_bytes)
  if group.size == 1:
    bucket_bytes = 0
  return packing.map_packed(
      x, prepare, run, algorithm=algorithm, bucket_bytes=bucket_bytes, lead=lead,
      choose=lambda buffer: _dispatch.chosen(collective, algorithm, buffer, group))


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
    x,
    axis_name: AxisName,
    *,
    op: str = "sum",
    algorithm: Algorithm = "auto",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
):
  """Reduces ``x`` over the group; every device gets the result (``lax.psum``).

  HLO: ``all-reduce`` for ``native``, otherwise ``collective-permute`` steps.

  Args:
    x: an array (or pytree of arrays) on each device.
    axis_name: a mesh axis name or a tuple of names (flattened row-major).
    op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
    algorithm: one of ``jaxcoll.algorithms("all_reduce")``, or a
      ``jaxcoll.Hierarchical``.
    bucket_bytes: a pytree ``x`` with an algorithm other than ``native``: the
      leaves of one dtype are packed into flat buffers of at most this many
      bytes (a larger leaf is a buffer of its own), the algorithm runs once per
      buffer, and ``auto`` chooses on the buffer's size (as NCCL sees a fused
      buffer; where it chooses ``native``, the buffer's leaves run leaf by
      leaf, which XLA combines without a copy). 0 runs each leaf on its own.
      A float sum may then round differently than leaf by leaf (an element's
      summation order depends on where it sits in the buffer); it is still
      equal on every device.

  Returns:
    An array (pytree) of ``x``'s shape and dtype, equal on every device.

  Raises:
    ValueError: unknown op or algorithm, an axis not in the mesh, mean on an
      integer dtype, hierarchical on a single axis, ``bucket_bytes`` < 0.

  Example:
    >>> mesh = jaxcoll.devices.flat_mesh(8)  # doctest: +SKIP
    >>> f = jax.shard_map(lambda v: jaxcoll.all_reduce(v, "data", algorithm="ring"),
    ...                   mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    >>> f(jnp.arange(8.0))  # doctest: +SKIP
    Array([28., 28., 28., 28., 28., 28., 28., 28.], dtype=float32)
  """
  group = _dispatch.resolve_group(axis_name)

  def prepare(leaf):
    leaf = _leaf_checks(leaf)
    _dispatch.check_op(op, leaf.dtype)
    return leaf, lambda out: _finish(out, op, group.size, leaf.dtype)

  def run(v, algo):
    reducer = _dispatch.check_op(op, v.dtype)
    return _dispatch.run("all_reduce", algo, v, group, reducer=reducer)

  return _map_packed("all_reduce", x, prepare, run, group, algorithm=algorithm,
                     bucket_bytes=bucket_bytes)


def reduce_scatter(
    x,
    axis_name: AxisName,
    *,
    op: str = "sum",
    scatter_dimension: int = 0,
    algorithm: Algorithm = "auto",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
):
  """Reduces ``x`` and leaves block ``rank`` of ``scatter_dimension`` here.

  Same as ``lax.psum_scatter(x, axis_name, scatter_dimension=...,
  tiled=True)``: the output's ``scatter_dimension`` is ``1/n`` of the input's.
  A pytree's leaves of one dtype are packed as in :func:`all_reduce`: each
  leaf's ``n`` blocks become rows of ``(n, -1)`` and a buffer is the rows side
  by side, so one reduce-scatter leaves every leaf's block ``rank`` here.

  Raises:
    ValueError: as :func:`all_reduce`, and when ``x.shape[scatter_dimension]``
      is not divisible by the group size.
  """
  group = _dispatch.resolve_group(axis_name)
  n = group.size

  def prepare(leaf):
    leaf = _leaf_checks(leaf)
    _dispatch.check_op(op, leaf.dtype)
    if leaf.ndim == 0:
      raise ValueError("reduce_scatter needs an input of rank >= 1; got a scalar.")
    d = _normalize_axis(scatter_dimension, leaf.ndim, "scatter_dimension")
    _check_divisible(leaf, d, n, "scatter_dimension", "reduce_scatter")
    shape = leaf.shape
    split = shape[:d] + (n, shape[d] // n) + shape[d + 1 :]
    chunks = jnp.moveaxis(leaf.reshape(split), d, 0)
    return chunks, lambda out: _finish(out, op, n, leaf.dtype)

  def run(chunks, algo):
    reducer = _dispatch.check_op(op, chunks.dtype)
    return _dispatch.run("reduce_scatter", algo, chunks, group, reducer=reducer)

  return _map_packed("reduce_scatter", x, prepare, run, group, algorithm=algorithm,
                     bucket_bytes=bucket_bytes, lead=1)


def all_gather(
    x,
    axis_name: AxisName,
    *,
    axis: int = 0,
    algorithm: Algorithm = "auto",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
):
  """Concatenates every device's ``x`` along ``axis`` in rank order.

  Same as ``lax.all_gather(x, axis_name, axis=axis, tiled=True)``. A pytree's
  leaves of one dtype are packed as in :func:`all_reduce` (flattened side by
  side; the gathered ``(n, -1)`` rows are cut back into the leaves).
  """
  group = _dispatch.resolve_group(axis_name)

  def prepare(leaf):
    leaf = _leaf_checks(leaf, keys=True)
    if leaf.ndim == 0:
      raise ValueError(
          "all_gather (tiled) needs an input of rank >= 1; got a scalar. "
          "Use x[None] to gather scalars into a vector."
      )
    a = _normalize_axis(axis, leaf.ndim, "axis")
    data, wrap = _key_data(leaf)  # a key's words trail its axes: `a` is the same axis
    shape = data.shape

    def finish(gathered):
      moved = jnp.moveaxis(gathered, 0, a)
      return wrap(moved.reshape(shape[:a] + (group.size * shape[a],) + shape[a + 1 :]))

    return data, finish

  def run(v, algo):
    return _dispatch.run("all_gather", algo, v, group)

  return _map_packed("all_gather", x, prepare, run, group, algorithm=algorithm,
                     bucket_bytes=bucket_bytes)


def broadcast(
    x,
    axis_name: AxisName,
    *,
    root: int = 0,
    algorithm: Algorithm = "auto",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
):
  """Every device gets the ``root`` device's ``x`` (bit for bit).

  A pytree's leaves of one dtype are packed as in :func:`all_reduce`.
  """
  group = _dispatch.resolve_group(axis_name)
  root = _check_root(root, group.size)

  def prepare(leaf):
    return _key_data(_leaf_checks(leaf, keys=True))

  def run(v, algo):
    return _dispatch.run("broadcast", algo, v, group, root=root)

  return _map_packed("broadcast", x, prepare, run, group, algorithm=algorithm,
                     bucket_bytes=bucket_bytes)


def reduce(
    x,
    axis_name: AxisName,
    *,
    root: int = 0,
    op: str = "sum",
    algorithm: Algorithm = "auto",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
):
  """The ``root`` device gets the reduction; the others get their ``x`` back.

  A pytree's leaves of one dtype are packed as in :func:`all_reduce`.
  """
  group = _dispatch.resolve_group(axis_name)
  root = _check_root(root, group.size)

  def prepare(leaf):
    leaf = _leaf_checks(leaf)
    _dispatch.check_op(op, leaf.dtype)

    def finish(out):
      if op == "mean":
        out = jnp.where(group.rank() == root, out / group.size, leaf)
      return out.astype(leaf.dtype)

    return leaf, finish

  def run(v, algo):
    reducer = _dispatch.check_op(op, v.dtype)
    return _dispatch.run("reduce", algo, v, group, reducer=reducer, root=root)

  return _map_packed("reduce", x, prepare, run, group, algorithm=algorithm,
                     bucket_bytes=bucket_bytes)


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
    leaf = _leaf_checks(leaf, keys=True)
    if leaf.ndim == 0:
      raise ValueError("all_to_all needs an input of rank >= 1; got a scalar.")
    s = _normalize_axis(split_axis, leaf.ndim, "split_axis")
    c = _normalize_axis(concat_axis, leaf.ndim, "concat_axis")
    _check_divisible(leaf, s, n, "split_axis", "all_to_all")
    leaf, wrap = _key_data(leaf)  # a key's words trail its axes: `s`, `c` are the same axes
    shape = leaf.shape
    split = shape[:s] + (n, shape[s] // n) + shape[s + 1 :]
    chunks = jnp.moveaxis(leaf.reshape(split), s, 0)
    out = _dispatch.run("all_to_all", algorithm, chunks, group)
    moved = jnp.moveaxis(out, 0, c)
    chunk_shape = chunks.shape[1:]
    return wrap(moved.reshape(
        chunk_shape[:c] + (n * chunk_shape[c],) + chunk_shape[c + 1 :]
    ))

  return _map_leaves(one, x)
