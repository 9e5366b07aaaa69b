"""Ring algorithms: bandwidth-optimal, latency linear in the group size.

Ring all-reduce is a ring reduce-scatter followed by a ring all-gather
(Patarasuk & Yuan 2009; NCCL's ring): ``2(n-1)`` steps, each moving ``S/n``
bytes, so every device sends ``2(n-1)/n * S``. The bidirectional ring splits
every chunk in halves that travel in opposite directions, using both
directions of each link.

Chunk indices are kept static: each rank views its chunks so that position
``k`` holds chunk ``rank + k`` (see ``_group.rank_views``); every rank then
sends and receives the same positions at the same step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcoll.collectives._group import (
    Group,
    Reducer,
    rank_views,
    rotate,
    split_padded,
    unsplit,
)


def _reduce_scatter_positions(s: int, n: int, direction: int) -> tuple[int, int]:
  """(position sent, position received into) at reduce-scatter step ``s``."""
  if direction == 1:
    return (-1 - s) % n, (-2 - s) % n
  return (1 + s) % n, (2 + s) % n


def _all_gather_positions(s: int, n: int, direction: int) -> tuple[int, int]:
  """(position sent, position received into) at all-gather step ``s``."""
  if direction == 1:
    return (-s) % n, (-1 - s) % n
  return s % n, (s + 1) % n


def ring_reduce_scatter_lanes(
    lanes: list[list[jax.Array]], directions: list[int], group: Group, reducer: Reducer
) -> list[jax.Array]:
  """Ring reduce-scatter of rotated chunks, several lanes interleaved.

  ``lanes[i][k]`` holds chunk ``rank + k`` of lane ``i``; lane ``i`` flows to
  rank ``r + directions[i]`` (+1 or -1). Returns each lane's reduced
  position 0 (this rank's chunk). Steps of all lanes are interleaved so that
  XLA may overlap them.
  """
  n = group.size
  lanes = [list(v) for v in lanes]
  for s in range(n - 1):
    for views, direction in zip(lanes, directions):
      send, into = _reduce_scatter_positions(s, n, direction)
      received = group.shift(views[send], direction)
      views[into] = reducer.combine(views[into], received)
  return [views[0] for views in lanes]


def ring_all_gather_lanes(
    owns: list[jax.Array], directions: list[int], group: Group
) -> list[list[jax.Array]]:
  """Ring all-gather; lane ``i``'s ``views[k]`` = chunk of rank ``r + k``."""
  n = group.size
  lanes: list[list] = [[own] + [None] * (n - 1) for own in owns]
  for s in range(n - 1):
    for views, direction in zip(lanes, directions):
      send, into = _all_gather_positions(s, n, direction)
      views[into] = group.shift(views[send], direction)
  return lanes


def _unrotate(views: list[jax.Array], group: Group) -> jax.Array:
  """Stacks rank-relative views back into absolute rank order."""
  return rotate(jnp.stack(views), -group.rank())


def ring_reduce_scatter(chunks: jax.Array, group: Group, reducer: Reducer) -> jax.Array:
  if group.size == 1:
    return chunks[0]
  views = rank_views(chunks, group.rank())
  return ring_reduce_scatter_lanes([views], [1], group, reducer)[0]


def ring_all_gather(chunk: jax.Array, group: Group) -> jax.Array:
  if group.size == 1:
    return chunk[None]
  return _unrotate(ring_all_gather_lanes([chunk], [1], group)[0], group)


def ring_all_reduce(x: jax.Array, group: Group, reducer: Reducer) -> jax.Array:
  n = group.size
  if n == 1:
    return x
  chunks, size = split_padded(x, n)
  reduced = ring_reduce_scatter(chunks, group, reducer)
  return unsplit(ring_all_gather(reduced, group), size, x.shape)


def bidirectional_ring_all_reduce(
    x: jax.Array, group: Group, reducer: Reducer
) -> jax.Array:
  """Each chunk's first half goes clockwise, its second half anticlockwise."""
  n = group.size
  if n == 1:
    return x
  chunks, size = split_padded(x, 2 * n)  # (2n, c): chunk k = rows 2k, 2k+1
  halves = chunks.reshape(n, 2, -1)
  views = rank_views(halves, group.rank())
  forward = [v[0] for v in views]
  backward = [v[1] for v in views]
  owns = ring_reduce_scatter_lanes([forward, backward], [1, -1], group, reducer)
  views_f, views_b = ring_all_gather_lanes(owns, [1, -1], group)
  stacked = jnp.stack([jnp.stack([f, b]) for f, b in zip(views_f, views_b)])
  return unsplit(rotate(stacked, -group.rank()), size, x.shape)
