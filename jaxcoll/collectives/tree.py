"""Binomial-tree algorithms (latency logarithmic in the group size).

* ``binomial_tree`` reduce / broadcast: ``ceil(log2 n)`` steps, each moving
  the whole message (Thakur, Rabenseifner & Gropp 2005, section 4).
* ``tree`` all-reduce: a *double* binomial tree, NCCL's idea (Sanders,
  Speck & Traeff 2009): the message is cut in two halves; one half is
  reduced to rank 0 and broadcast back along a binomial tree, the other along
  the mirrored tree rooted at rank ``n-1``, so that every rank is an interior
  node of at most one of the two trees and both directions of the links work.
* ``scatter_allgather`` broadcast (van de Geijn): binomial scatter of ``n``
  chunks, then a ring all-gather; bandwidth ~``2S`` instead of ``S log n``.
* ``reduce_scatter_gather`` reduce (Rabenseifner): ring reduce-scatter, then a
  binomial gather of the chunks to the root.

Trees are described by ``order``: ``order[k]`` is the absolute rank that plays
tree position ``k`` (position 0 is the root), so a root other than 0, or the
mirrored tree, is only a relabelling of static ranks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcoll.collectives._group import (
    Group,
    Reducer,
    rank_in,
    rotate,
    split_padded,
    unsplit,
)
from jaxcoll.collectives.ring import ring_all_gather_lanes, ring_reduce_scatter


def _rooted_order(n: int, root: int) -> list[int]:
  return [(root + k) % n for k in range(n)]


def _reduce_steps(n: int) -> list[int]:
  steps, d = [], 1
  while d < n:
    steps.append(d)
    d *= 2
  return steps


def binomial_reduce_step(
    x: jax.Array, group: Group, reducer: Reducer, order: list[int], d: int
) -> jax.Array:
  """Positions ``s = d mod 2d`` send to ``s - d``, which combine."""
  n = len(order)
  pairs = [(order[s], order[s - d]) for s in range(d, n, 2 * d)]
  receivers = [dst for _, dst in pairs]
  received = group.permute(x, pairs)
  return jnp.where(rank_in(group.rank(), receivers), reducer.combine(x, received), x)


def binomial_broadcast_step(
    x: jax.Array, group: Group, order: list[int], d: int
) -> jax.Array:
  """Positions ``s = 0 mod 2d`` send to ``s + d``, which take the value."""
  n = len(order)
  pairs = [(order[s], order[s + d]) for s in range(0, n, 2 * d) if s + d < n]
  receivers = [dst for _, dst in pairs]
  received = group.permute(x, pairs)
  return jnp.where(rank_in(group.rank(), receivers), received, x)


def binomial_tree_reduce(
    x: jax.Array, group: Group, reducer: Reducer, root: int
) -> jax.Array:
  order = _rooted_order(group.size, root)
  acc = x
  for d in _reduce_steps(group.size):
    acc = binomial_reduce_step(acc, group, reducer, order, d)
  return jnp.where(group.rank() == root, acc, x)


def binomial_tree_broadcast(x: jax.Array, group: Group, root: int) -> jax.Array:
  order = _rooted_order(group.size, root)
  for d in reversed(_reduce_steps(group.size)):
    x = binomial_broadcast_step(x, group, order, d)
  return x


def double_tree_all_reduce(x: jax.Array, group: Group, reducer: Reducer) -> jax.Array:
  n = group.size
  if n == 1:
    return x
  halves, size = split_padded(x, 2)
  trees = [list(range(n)), list(range(n - 1, -1, -1))]
  parts = [halves[0], halves[1]]
  for d in _reduce_steps(n):
    parts = [binomial_reduce_step(p, group, reducer, t, d) for p, t in zip(parts, trees)]
  for d in reversed(_reduce_steps(n)):
    parts = [binomial_broadcast_step(p, group, t, d) for p, t in zip(parts, trees)]
  return unsplit(jnp.stack(parts), size, x.shape)


def _binomial_scatter(view: jax.Array, group: Group, order: list[int]) -> jax.Array:
  """Scatters the root's ``view`` (chunks in tree-position order).

  Every rank keeps ``view[k]`` = chunk of tree position ``own + k``; position
  ``s`` sends ``view[d:2d]`` to ``s + d``, which stores it at ``view[0:d]``.
  Returns ``view[0]``: this rank's chunk.
  """
  n = len(order)
  for d in reversed(_reduce_steps(n)):
    pairs = [(order[s], order[s + d]) for s in range(0, n, 2 * d) if s + d < n]
    received = group.permute(view[d : 2 * d], pairs)
    is_receiver = rank_in(group.rank(), [dst for _, dst in pairs])
    view = view.at[0:d].set(jnp.where(is_receiver, received, view[0:d]))
  return view[0]


def _binomial_gather(chunk: jax.Array, group: Group, order: list[int]) -> jax.Array:
  """Gathers one chunk per rank to ``order[0]``, in tree-position order."""
  n = len(order)
  steps = _reduce_steps(n)
  width = 2 ** len(steps)
  view = jnp.zeros((width,) + chunk.shape, chunk.dtype).at[0].set(chunk)
  for d in steps:
    pairs = [(order[s], order[s - d]) for s in range(d, n, 2 * d)]
    received = group.permute(view[0:d], pairs)
    is_receiver = rank_in(group.rank(), [dst for _, dst in pairs])
    view = view.at[d : 2 * d].set(jnp.where(is_receiver, received, view[d : 2 * d]))
  return view[:n]


def scatter_allgather_broadcast(x: jax.Array, group: Group, root: int) -> jax.Array:
  n = group.size
  if n == 1:
    return x
  chunks, size = split_padded(x, n)
  width = 2 ** len(_reduce_steps(n))
  # The root's chunk k goes to tree position k, i.e. rank root + k.
  view = jnp.zeros((width, chunks.shape[1]), chunks.dtype).at[:n].set(chunks)
  order = _rooted_order(n, root)
  mine = _binomial_scatter(view, group, order)
  views = ring_all_gather_lanes([mine], [1], group)[0]
  # views[k] = chunk held by rank r + k = chunk index (r + k - root).
  stacked = rotate(jnp.stack(views), root - group.rank())
  return unsplit(stacked, size, x.shape)


def reduce_scatter_gather_reduce(
    x: jax.Array, group: Group, reducer: Reducer, root: int
) -> jax.Array:
  n = group.size
  if n == 1:
    return x
  chunks, size = split_padded(x, n)
  mine = ring_reduce_scatter(chunks, group, reducer)  # chunk `rank`
  gathered = _binomial_gather(mine, group, _rooted_order(n, root))
  # gathered[k] = chunk of rank root + k = chunk index root + k.
  total = unsplit(rotate(gathered, -root), size, x.shape)
  return jnp.where(group.rank() == root, total, x)
