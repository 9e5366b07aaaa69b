"""The device group of a collective, and helpers shared by the algorithms.

Every algorithm sees its group as ranks ``0 .. size-1`` in row-major order of
the axis names (as ``lax.axis_index`` of a tuple), and communicates only with
``lax.ppermute`` over static permutations. Rank-dependent choices are made
with ``jnp.where`` on ``lax.axis_index`` so that every device runs the same
program (SPMD) and every choice is visible in the HLO.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass(frozen=True)
class Group:
  """A communication group: one or more mesh axes, flattened row-major.

  Ranks follow the order of ``axes`` as given (as ``lax.axis_index`` and
  ``lax.all_gather`` do). ``lax.ppermute`` numbers the devices of a tuple of
  axes in *mesh* order instead; ``mesh_axes`` records that order so that
  :meth:`permute` can translate.
  """

  axes: tuple[str, ...]
  sizes: tuple[int, ...]
  mesh_axes: tuple[str, ...] | None = None  # ``axes`` in mesh order, if different
  # The group's one axis is a ``jax.vmap(axis_name=...)`` axis, not a mesh axis: vmap's
  # ppermute takes only whole permutations, and vmap has no varying types.
  vmapped: bool = False

  @property
  def size(self) -> int:
    return math.prod(self.sizes)

  @property
  def axis_name(self) -> str | tuple[str, ...]:
    return self.axes[0] if len(self.axes) == 1 else self.axes

  def rank(self) -> jax.Array:
    """This device's rank in the group (a traced int32 scalar)."""
    return lax.axis_index(self.axis_name)

  def sub(self, axes: Sequence[str]) -> Group:
    axes = tuple(axes)
    mesh_axes = None
    if self.mesh_axes is not None:
      mesh_axes = tuple(a for a in self.mesh_axes if a in axes)
      mesh_axes = None if mesh_axes == axes else mesh_axes
    return Group(axes, tuple(self.sizes[self.axes.index(a)] for a in axes), mesh_axes,
                 vmapped=self.vmapped)

  def _ppermute_index(self, rank: int) -> int:
    """The index ``lax.ppermute`` uses for the device of ``rank``."""
    if self.mesh_axes is None:
      return rank
    coords = dict(zip(self.axes, np.unravel_index(rank, self.sizes)))
    sizes = dict(zip(self.axes, self.sizes))
    index = 0
    for a in self.mesh_axes:
      index = index * sizes[a] + int(coords[a])
    return index

  def permute(self, x: jax.Array, pairs: Sequence[tuple[int, int]]) -> jax.Array:
    """``lax.ppermute`` over (source, destination) ranks; others receive 0."""
    pairs = [(self._ppermute_index(s), self._ppermute_index(d)) for s, d in pairs]
    if not pairs:
      return jnp.zeros_like(x)
    if self.vmapped and len(pairs) < self.size:
      # jax.vmap's ppermute moves whole permutations only (its batching rule asserts it):
      # send the idle ranks' data to the ranks that receive nothing, then zero it there.
      receivers = {d for _, d in pairs}
      idle = [r for r in range(self.size) if r not in {s for s, _ in pairs}]
      empty = [r for r in range(self.size) if r not in receivers]
      out = lax.ppermute(x, self.axis_name, pairs + list(zip(idle, empty, strict=True)))
      return jnp.where(rank_in(self.rank(), receivers), out, jnp.zeros_like(out))
    return lax.ppermute(x, self.axis_name, pairs)

  def varying(self, x: jax.Array) -> jax.Array:
    """Types ``x`` as varying over the group axes (shard_map's vma types).

    Every jaxcoll collective returns values typed varying over the group,
    whatever the algorithm, so that switching algorithms never changes the
    types a caller sees (ppermute results are always varying).
    """
    manual = getattr(jax.typeof(x), "mat", None)  # None outside shard_map
    varying = getattr(manual, "varying", None)
    if varying is None or self.vmapped:  # a vmap axis has no varying type
      return x
    missing = tuple(a for a in self.axes if a not in varying)
    return lax.pcast(x, missing, to="varying") if missing else x

  def shift(self, x: jax.Array, offset: int) -> jax.Array:
    """Sends to rank ``r + offset`` and receives from ``r - offset`` (mod n)."""
    n = self.size
    return self.permute(x, [(r, (r + offset) % n) for r in range(n)])


@dataclasses.dataclass(frozen=True)
class Reducer:
  """A reduction op: its name and the elementwise combine function."""

  name: str  # "sum", "max" or "min" (mean is sum, divided afterwards)
  combine: Callable[[jax.Array, jax.Array], jax.Array]


REDUCERS = {
    "sum": Reducer("sum", jnp.add),
    "max": Reducer("max", jnp.maximum),
    "min": Reducer("min", jnp.minimum),
}


def rank_in(rank: jax.Array, ranks: Sequence[int]) -> jax.Array:
  """A boolean scalar: whether ``rank`` is one of the static ``ranks``."""
  ranks = sorted(set(int(r) for r in ranks))
  if not ranks:
    return jnp.zeros((), bool)
  return jnp.any(rank == jnp.asarray(ranks, jnp.int32))


def split_padded(x: jax.Array, n: int) -> tuple[jax.Array, int]:
  """Flattens ``x`` and pads it to ``(n, c)``; returns it and the true size."""
  flat = x.reshape(-1)
  size = flat.shape[0]
  chunk = max(-(-size // n), 1)
  pad = n * chunk - size
  if pad:  # jnp.pad, not concatenate: XLA:CPU can fuse a producer's reduction
    flat = jnp.pad(flat, (0, pad))  # into a concatenate and run it ~80x slower
  return flat.reshape(n, chunk), size


def unsplit(chunks: jax.Array, size: int, shape: tuple[int, ...]) -> jax.Array:
  """Inverse of :func:`split_padded`."""
  return chunks.reshape(-1)[:size].reshape(shape)


def rotate(stacked: jax.Array, shift: jax.Array) -> jax.Array:
  """``out[k] = stacked[(k + shift) mod n]`` along axis 0, for a traced shift.

  Algorithms use it to turn rank-dependent chunk indices into static ones:
  after ``rotate(chunks, rank)``, position ``k`` holds chunk ``rank + k``.
  """
  n = stacked.shape[0]
  if n == 1:
    return stacked
  # A gather of whole chunks: measured ~10x faster on XLA:CPU than slicing a
  # doubled buffer (concatenate + dynamic_slice) at 16 MiB per device.
  index = (jnp.arange(n, dtype=jnp.int32) + shift) % n
  return jnp.take(stacked, index, axis=0, unique_indices=True, indices_are_sorted=False)


def rank_views(stacked: jax.Array, rank: jax.Array) -> list[jax.Array]:
  """``views[k] = stacked[(rank + k) mod n]``, one dynamic slice per chunk.

  Cheaper than ``rotate`` when each chunk is used once: every slice fuses
  into its consumer (the add or the send), so no rotated copy is written.
  """
  n = stacked.shape[0]
  return [
      lax.dynamic_index_in_dim(stacked, (rank + k) % n, axis=0, keepdims=False)
      for k in range(n)
  ]
