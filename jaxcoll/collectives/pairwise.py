"""Pairwise-exchange algorithms: all-to-all and reduce-scatter.

From Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication
Operations in MPICH" (IJHPCA 2005). Both run ``n - 1`` steps for any group
size; at step ``s`` rank ``r`` sends to rank ``r + s`` and receives from rank
``r - s``. Every device sends ``(n-1)/n * S`` bytes, the minimum.

* ``pairwise`` all-to-all (MPICH's algorithm for long messages): the chunk
  for rank ``r + s`` goes straight to it.
* ``pairwise`` reduce-scatter: the chunk for rank ``r + s`` goes straight to
  it, and each rank adds what it receives into its own chunk. It is what
  ``recursive_halving`` runs on groups that are not a power of two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcoll.collectives._group import Group, Reducer, rank_views, rotate


def pairwise_all_to_all(chunks: jax.Array, group: Group) -> jax.Array:
  n = group.size
  if n == 1:
    return chunks
  rank = group.rank()
  views = rank_views(chunks, rank)  # views[s] is for rank r + s
  received = [views[0]] + [None] * (n - 1)
  for s in range(1, n):
    # The chunk from rank r - s lands at position -s (relative to r).
    received[(-s) % n] = group.shift(views[s], s)
  return rotate(jnp.stack(received), -rank)


def pairwise_reduce_scatter(
    chunks: jax.Array, group: Group, reducer: Reducer
) -> jax.Array:
  """Step ``s`` sends chunk ``rank + s`` to rank ``rank + s``."""
  n = group.size
  views = rank_views(chunks, group.rank())
  acc = views[0]
  for s in range(1, n):
    acc = reducer.combine(acc, group.shift(views[s], s))
  return acc
