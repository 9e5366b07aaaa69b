"""Hierarchical (two-level) algorithms for a tuple of axes.

The last axis is the *inner* level (devices inside a node, e.g. NVLink); the
leading axes form the *outer* level (across nodes, e.g. InfiniBand). As in
Horovod's hierarchical all-reduce and NCCL's tree/ring across nodes:

* all-reduce = reduce-scatter over the inner axis, all-reduce of the ``1/l``
  shard over the outer axes, all-gather over the inner axis. Each device sends
  ``(l-1)/l*S + 2(m-1)/m*S/l + (l-1)/l*S`` bytes, and only ``S/l`` of them
  cross the slow outer links.
* reduce-scatter / all-gather over the flattened group (rank ``i*l + j``) are
  composed the same way, inner level first (reduce-scatter) or last
  (all-gather).

:class:`Hierarchical` chooses the flat algorithm used at each level.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxcoll.collectives._group import Group, Reducer, split_padded, unsplit


@dataclasses.dataclass(frozen=True)
class Hierarchical:
  """A hierarchical algorithm with a choice of flat algorithm per level.

  Pass an instance as ``algorithm=`` to ``all_reduce``, ``reduce_scatter``
  or ``all_gather``; the string ``"hierarchical"`` means ``Hierarchical()``.

  Attributes:
    inner: algorithm of the reduce-scatter and all-gather over the inner
      (last) axis: any flat reduce_scatter/all_gather algorithm name.
    outer: algorithm over the outer axes: an all_reduce algorithm name for
      all_reduce, a reduce_scatter/all_gather name for those.

  Example:
    >>> algo = jaxcoll.Hierarchical(inner="ring", outer="halving_doubling")
    >>> jaxcoll.all_reduce(g, ("node", "local"), algorithm=algo)  # doctest: +SKIP
  """

  inner: str = "ring"
  outer: str = "ring"


def _levels(group: Group) -> tuple[Group, Group]:
  return group.sub(group.axes[:-1]), group.sub(group.axes[-1:])


def hierarchical_all_reduce(
    x: jax.Array, group: Group, reducer: Reducer, *, spec: Hierarchical, run
) -> jax.Array:
  """``run(collective, algorithm, x, group, **kw)`` calls a flat algorithm."""
  outer, inner = _levels(group)
  l = inner.size
  chunks, size = split_padded(x, l)
  mine = run("reduce_scatter", spec.inner, chunks, inner, reducer=reducer)
  mine = run("all_reduce", spec.outer, mine, outer, reducer=reducer)
  full = run("all_gather", spec.inner, mine, inner)
  return unsplit(full, size, x.shape)


def hierarchical_reduce_scatter(
    chunks: jax.Array, group: Group, reducer: Reducer, *, spec: Hierarchical, run
) -> jax.Array:
  outer, inner = _levels(group)
  m, l = outer.size, inner.size
  # chunk i*l + j ends at (node i, local j): first reduce over the node.
  by_local = jnp.swapaxes(chunks.reshape((m, l) + chunks.shape[1:]), 0, 1)
  mine = run("reduce_scatter", spec.inner, by_local, inner, reducer=reducer)
  return run("reduce_scatter", spec.outer, mine, outer, reducer=reducer)


def hierarchical_all_gather(
    chunk: jax.Array, group: Group, *, spec: Hierarchical, run
) -> jax.Array:
  outer, inner = _levels(group)
  across = run("all_gather", spec.outer, chunk, outer)  # (m, ...)
  full = run("all_gather", spec.inner, across, inner)  # (l, m, ...)
  # (m * l, ...), not (-1, ...): a chunk with no elements leaves -1 undetermined.
  return jnp.swapaxes(full, 0, 1).reshape((outer.size * inner.size,) + chunk.shape)
