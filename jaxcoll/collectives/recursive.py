"""Recursive doubling / halving algorithms (logarithmic step count).

From Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication
Operations in MPICH" (IJHPCA 2005):

* ``recursive_doubling`` all-reduce: ``log2 n`` exchanges of the whole
  message with the partner ``rank xor 2^k``; every device sends
  ``log2(n) * S``. Latency-optimal for small messages.
* ``halving_doubling`` all-reduce (Rabenseifner): recursive-halving
  reduce-scatter then recursive-doubling all-gather; ``2 log2 n`` steps and
  ``2(n-1)/n * S`` bytes, bandwidth-optimal like the ring.
* Group sizes that are not powers of two use the standard fold: with
  ``p = 2^floor(log2 n)`` and ``rem = n - p``, the even ranks below ``2 rem``
  first hand their data to the next odd rank, the remaining ``p`` ranks run the
  power-of-two algorithm, and the result is handed back.
* ``recursive_halving`` reduce-scatter: ``log2 n`` halving exchanges on
  powers of two. A named fallback otherwise: it runs ``pairwise`` (``n-1``
  steps, see pairwise.py), since a fold would leave ``rem`` ranks without
  their block.
* ``recursive_doubling`` all-gather: the exchange-and-concatenate doubling on
  powers of two. A named fallback otherwise: it runs ``bruck``.
* ``bruck`` all-gather (Bruck et al., "Efficient algorithms for all-to-all
  communications in multiport message-passing systems", IEEE TPDS 1997):
  ``ceil(log2 n)`` steps for any ``n``, rank ``r`` receiving ``min(d, n-d)``
  blocks from rank ``r + d`` at distance ``d = 1, 2, 4, ...``, then a local
  rotation.
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
from jaxcoll.collectives.pairwise import pairwise_reduce_scatter


def _is_power_of_two(n: int) -> bool:
  return n & (n - 1) == 0


class _Core:
  """The power-of-two core of a group and the fold-in / fold-out steps."""

  def __init__(self, group: Group):
    n = group.size
    self.group = group
    self.p = 1 << (n.bit_length() - 1)
    self.rem = n - self.p
    # core rank j is played by absolute rank members[j].
    self.members = [2 * i + 1 for i in range(self.rem)] + list(range(2 * self.rem, n))

  def core_rank(self) -> jax.Array:
    r = self.group.rank()
    return jnp.where(r < 2 * self.rem, r // 2, r - self.rem)

  def exchange(self, x: jax.Array, distance: int) -> jax.Array:
    """Swaps ``x`` with core partner ``core_rank xor distance``."""
    m = self.members
    return self.group.permute(x, [(m[j], m[j ^ distance]) for j in range(self.p)])

  def fold_in(self, x: jax.Array, reducer: Reducer) -> jax.Array:
    """Even rank ``2i < 2 rem`` hands its data to ``2i + 1``, which reduces it in."""
    return self._hand_over(x, [(2 * i, 2 * i + 1) for i in range(self.rem)], reducer.combine)

  def fold_out(self, x: jax.Array) -> jax.Array:
    """Odd rank ``2i + 1 < 2 rem`` hands the result back to ``2i``."""
    return self._hand_over(x, [(2 * i + 1, 2 * i) for i in range(self.rem)],
                           lambda _, received: received)

  def _hand_over(self, x, pairs, combine) -> jax.Array:
    if not pairs:
      return x
    received = self.group.permute(x, pairs)
    is_receiver = rank_in(self.group.rank(), [d for _, d in pairs])
    return jnp.where(is_receiver, combine(x, received), x)


def _distances(p: int) -> list[int]:
  return [1 << k for k in range(p.bit_length() - 1)]


def recursive_doubling_all_reduce(
    x: jax.Array, group: Group, reducer: Reducer
) -> jax.Array:
  if group.size == 1:
    return x
  core = _Core(group)
  x = core.fold_in(x, reducer)
  for d in _distances(core.p):
    x = reducer.combine(x, core.exchange(x, d))
  return core.fold_out(x)


def _halving_reduce_scatter(
    seg: jax.Array, core: _Core, reducer: Reducer
) -> jax.Array:
  """Recursive halving over ``(p, c)`` chunks; returns chunk ``core_rank``."""
  rank = core.core_rank()
  for d in reversed(_distances(core.p)):
    lower, upper = seg[:d], seg[d:]
    upper_half = (rank & d) != 0
    send = jnp.where(upper_half, lower, upper)
    keep = jnp.where(upper_half, upper, lower)
    seg = reducer.combine(keep, core.exchange(send, d))
  return seg[0]


def _doubling_all_gather(chunk: jax.Array, core: _Core) -> jax.Array:
  """Recursive doubling over the core; returns ``(p, ...)`` in core order."""
  rank = core.core_rank()
  seg = chunk[None]
  for d in _distances(core.p):
    received = core.exchange(seg, d)
    upper_half = (rank & d) != 0
    seg = jnp.where(
        upper_half,
        jnp.concatenate([received, seg]),
        jnp.concatenate([seg, received]),
    )
  return seg


def halving_doubling_all_reduce(
    x: jax.Array, group: Group, reducer: Reducer
) -> jax.Array:
  if group.size == 1:
    return x
  core = _Core(group)
  x = core.fold_in(x, reducer)
  chunks, size = split_padded(x, core.p)
  mine = _halving_reduce_scatter(chunks, core, reducer)
  full = unsplit(_doubling_all_gather(mine, core), size, x.shape)
  return core.fold_out(full)


def recursive_halving_reduce_scatter(
    chunks: jax.Array, group: Group, reducer: Reducer
) -> jax.Array:
  n = group.size
  if n == 1:
    return chunks[0]
  if not _is_power_of_two(n):  # the documented fallback: pairwise
    return pairwise_reduce_scatter(chunks, group, reducer)
  flat = chunks.reshape(n, -1)
  return _halving_reduce_scatter(flat, _Core(group), reducer).reshape(chunks.shape[1:])


def bruck_all_gather(chunk: jax.Array, group: Group) -> jax.Array:
  """Bruck et al. 1997: receive ``view[d:...]`` from rank ``r + d``."""
  n = group.size
  if n == 1:
    return chunk[None]
  view = chunk[None]
  d = 1
  while d < n:
    count = min(d, n - d)
    received = group.shift(view[:count], -d)  # rank r+d sends to r
    view = jnp.concatenate([view, received])
    d *= 2
  return rotate(view, -group.rank())


def recursive_doubling_all_gather(chunk: jax.Array, group: Group) -> jax.Array:
  n = group.size
  if n == 1:
    return chunk[None]
  if not _is_power_of_two(n):  # the documented fallback: bruck
    return bruck_all_gather(chunk, group)
  return _doubling_all_gather(chunk, _Core(group))
