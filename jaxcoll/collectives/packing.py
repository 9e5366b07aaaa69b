"""Pytree inputs packed into a few flat buffers (tensor fusion).

A ppermute algorithm is ``O(n)`` or ``O(log n)`` collective-permute steps per
call, each with a fixed latency, and XLA does not combine ppermutes the way it
combines native all-reduces. Run leaf by leaf on a parameter tree, a ring
all-reduce of 100 leaves was 100 rings: 8.6 s to compile on 8 CPU devices
(0.2 s for ``native``) and 100 latency-bound collectives per call. As Horovod's
tensor fusion and PyTorch DDP's buckets do, the leaves of one dtype are packed
into flat buffers of at most ``bucket_bytes`` (a leaf larger than that is a
buffer of its own), the algorithm runs once per buffer and the result is split
back into the leaves' shapes and dtypes.

Each collective views its leaves in its canonical form (native.py) with
``lead`` leading axes kept (1 for reduce_scatter's ``(n, ...)`` chunks, else
0): every leaf becomes ``shape[:lead] + (-1,)`` and the buffer is their
concatenation along the last axis, so that the rows of reduce_scatter's chunks
and all_gather's gathered rows line up leaf by leaf.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# PyTorch DDP's default bucket_cap_mb=25 (Horovod's HOROVOD_FUSION_THRESHOLD is 64 MiB); the
# trainers' gradient buckets default to the same (DataParallel(bucket_bytes=...), ZeRO's).
DEFAULT_BUCKET_BYTES = 25 * 2**20


def plan_buckets(
  leaf_bytes: Sequence[int], bucket_bytes: int, groups: Sequence[Hashable] | None = None
) -> tuple[tuple[int, ...], ...]:
  """Groups leaf indices into buckets of at most ``bucket_bytes``.

  Leaves are visited in reverse order; a leaf larger than ``bucket_bytes``
  gets a bucket of its own (as DDP). Zero-size leaves are skipped. With
  ``groups``, only leaves of the same group share a bucket (each group fills
  its own open bucket), so e.g. float32 and bfloat16 leaves are never packed
  into one buffer.

  Args:
    leaf_bytes: bytes of each leaf, in tree order.
    bucket_bytes: the cap of one bucket.
    groups: optionally, one key per leaf (e.g. its dtype).

  Returns:
    A tuple of buckets, each a tuple of leaf indices in bucket order.

  Example:
    >>> plan_buckets([40, 40, 40, 100], bucket_bytes=80)
    ((3,), (2, 1), (0,))
    >>> plan_buckets([40, 40, 40, 40], bucket_bytes=80, groups="abab")
    ((3, 1), (2, 0))
  """
  groups = [None] * len(leaf_bytes) if groups is None else list(groups)
  # Open bucket of each group: {group: (leaf indices, bytes)}, in opening order.
  closed, open_ = [], {}
  for i in reversed(range(len(leaf_bytes))):
    nbytes = int(leaf_bytes[i])
    if nbytes == 0:
      continue
    current, current_bytes = open_.get(groups[i], ([], 0))
    if current and current_bytes + nbytes > bucket_bytes:
      closed.append(tuple(current))
      del open_[groups[i]]
      current, current_bytes = [], 0
    open_[groups[i]] = (current + [i], current_bytes + nbytes)
  closed += [tuple(current) for current, _ in open_.values()]
  return tuple(closed)


def concatenate(parts: Sequence[jax.Array], axis: int = 0) -> jax.Array:
  """``jnp.concatenate(parts, axis)``, each part computed before the copy.

  The optimization barrier keeps XLA from fusing the parts' producers into the
  concatenation, where XLA:CPU may re-evaluate a producer (a gradient's
  reduction) for every element of the buffer (jaxcoll.train.buckets.pack: 300 ms
  instead of 1 ms for a 1 MB bucket). One concatenation, rather than that pack's
  one in-place update per part: each update is a kernel of its own, and 100 of
  them compiled in about twice the time of the rest of a packed ring all-reduce.
  """
  if len(parts) == 1:
    return parts[0]
  return jnp.concatenate(jax.lax.optimization_barrier(list(parts)), axis=axis)


def split(x: jax.Array, widths: Sequence[int], axis: int = 0) -> list[jax.Array]:
  """``x`` cut along ``axis`` into parts of ``widths`` (inverse of :func:`concatenate`)."""
  offsets = np.cumsum(widths)[:-1].tolist()
  return jnp.split(x, offsets, axis=axis) if offsets else [x]


def check_bucket_bytes(bucket_bytes) -> int:
  """Returns ``bucket_bytes`` if it is an int >= 0, else a one-line ValueError."""
  if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int | np.integer) or (
      bucket_bytes < 0):
    raise ValueError(
        f"`bucket_bytes` must be an int >= 0: the largest buffer a pytree's leaves are packed "
        f"into (default {DEFAULT_BUCKET_BYTES}, 25 MiB; 0 runs each leaf on its own); got "
        f"{bucket_bytes!r}.")
  return int(bucket_bytes)


def _named(path, fn: Callable, leaf):
  """``fn(leaf)``; a ValueError about one leaf of a pytree names that leaf.

  An optax state averaged with op='mean' said "needs a floating dtype, got int32" without
  saying that the int32 leaf is its step ``count``.
  """
  try:
    return fn(leaf)
  except ValueError as e:
    if not path:  # x is the array itself
      raise
    raise ValueError(f"leaf {jax.tree_util.keystr(path)} of `x`: {e}") from None


def map_leaves(one: Callable, x):
  """``jax.tree.map(one, x)``, naming the leaf in a ValueError about it."""
  return jax.tree_util.tree_map_with_path(lambda path, leaf: _named(path, one, leaf), x)


def map_packed(
    x,
    prepare: Callable,
    run: Callable[[jax.Array, object], jax.Array],
    *,
    algorithm,
    choose: Callable[[jax.ShapeDtypeStruct], object],
    bucket_bytes: int,
    lead: int = 0,
):
  """A collective applied to every leaf of ``x``, leaves of one dtype packed together.

  Args:
    x: an array or a pytree of arrays.
    prepare: ``leaf -> (canonical, finish)``: checks the leaf (a ValueError is named after
      it) and returns its canonical form and ``finish(canonical_result) -> result leaf``.
    run: ``run(canonical, algorithm)``, the collective on one leaf's canonical array or on
      a packed buffer.
    algorithm: the caller's algorithm; ``"native"`` runs leaf by leaf (XLA combines native
      collectives itself, without copying the leaves into a buffer).
    choose: the algorithm for a buffer of this shape and dtype (``auto``'s choice on the
      buffer's size; else ``algorithm``). A buffer ``auto`` runs natively is not made:
      its leaves run leaf by leaf with ``native``.
    bucket_bytes: the cap of one buffer; 0 runs leaf by leaf.
    lead: leading axes of the canonical form kept apart (1 for reduce_scatter's chunks).

  Returns:
    ``x``'s structure of the results.
  """
  paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(x)
  if _is_native(algorithm) or bucket_bytes == 0 or len(paths_leaves) < 2:
    return map_leaves(lambda leaf: _finish_one(prepare(leaf), run, algorithm), x)
  # Every leaf is checked (in tree order, named) before anything runs, as leaf by leaf.
  prepared = [_named(path, prepare, leaf) for path, leaf in paths_leaves]
  canonical = [c for c, _ in prepared]
  buckets = plan_buckets([c.size * c.dtype.itemsize for c in canonical], bucket_bytes,
                         [c.dtype for c in canonical])
  out = [None] * len(canonical)
  for bucket in buckets:
    flats = [canonical[i].reshape(canonical[i].shape[:lead] + (-1,)) for i in bucket]
    widths = [f.shape[-1] for f in flats]
    chosen = choose(jax.ShapeDtypeStruct(flats[0].shape[:-1] + (sum(widths),), flats[0].dtype))
    if _is_native(chosen):
      for i in bucket:
        out[i] = _finish_one(prepared[i], run, chosen)
      continue
    result = run(concatenate(flats, axis=lead), chosen)
    for i, part in zip(bucket, split(result, widths, axis=-1)):
      out[i] = prepared[i][1](part.reshape(part.shape[:-1] + canonical[i].shape[lead:]))
  for i, one in enumerate(prepared):
    if out[i] is None:  # a zero-size leaf, in no bucket: run alone, as before
      out[i] = _finish_one(one, run, algorithm)
  return jax.tree_util.tree_unflatten(treedef, out)


def _is_native(algorithm) -> bool:
  return isinstance(algorithm, str) and algorithm == "native"


def _finish_one(prepared, run, algorithm):
  canonical, finish = prepared
  return finish(run(canonical, algorithm))
