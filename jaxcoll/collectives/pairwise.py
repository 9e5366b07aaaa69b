"""Pairwise-exchange all-to-all (MPICH's algorithm for long messages).

``n - 1`` steps; at step ``s`` rank ``r`` sends its chunk for rank ``r + s``
directly to it and receives the chunk of rank ``r - s``. Every device sends
``(n-1)/n * S`` bytes, the minimum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcoll.collectives._group import Group, rank_views, rotate


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
