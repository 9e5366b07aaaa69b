"""Gradient buckets: many small leaves moved by a few large collectives.

A collective has a fixed cost per call (latency, launch), so reducing one
small gradient at a time wastes most of the link. As PyTorch DDP (Li et al.,
"PyTorch Distributed", VLDB 2020) and Horovod's tensor fusion do, leaves are
grouped into buckets of at most ``bucket_bytes`` in *reverse* leaf order (the
order backward produces them) and each bucket is one flat 1-D array.

Two layouts:

* data parallel: a bucket is the concatenation of whole flattened leaves,
  all-reduced as one vector (:func:`flatten_bucket` / :func:`unflatten_bucket`).
* ZeRO: each leaf is flattened, padded to a multiple of ``N`` and viewed as
  ``(N, c_i)``; device ``r`` owns row ``r``. A bucket concatenates the views
  along axis 1 into ``(N, C)``, so one reduce-scatter leaves this device its
  ``(C,)`` row, which splits into the per-leaf shards, and one all-gather
  rebuilds the views (:class:`ShardLayout`). A device's row of a leaf keeps
  the leaf's rank: shape ``(1, ..., 1, c_i)`` (``()`` for a scalar), or, when
  ``N`` divides the first dimension, the leaf's r-th block ``(d0 / N, ...)``
  (the same elements), so an optax mask that looks at ``ndim`` treats a row
  as it treats the leaf.

A bucket never mixes dtypes (:func:`plan_buckets` with ``groups``): a
bfloat16 leaf crosses the wire as bfloat16 next to float32 buckets.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxcoll import collectives
from jaxcoll.collectives.packing import plan_buckets
from jaxcoll.collectives.packing import split as _split

# checkpoint_name of ZeRO-3's gathered parameters (see make_gather).
ZERO3_GATHERED = "zero3_gathered"


# -- data parallel: buckets of whole leaves ----------------------------------


def pack(parts: Sequence[jax.Array], axis: int = 0) -> jax.Array:
  """Concatenates ``parts`` along ``axis`` by in-place slice updates.

  Same value as ``jnp.concatenate``; written as ``dynamic_update_slice``s of
  a zero buffer because XLA:CPU may fuse the gradients' producers (e.g. a
  bias gradient's reduction) into a concatenate and re-evaluate them for
  every element of the bucket (measured: 300 ms instead of 1 ms for a 1 MB
  bucket), while each slice update is its own in-place fusion. Parts of
  different dtypes are promoted to a common one, as ``jnp.concatenate`` does
  (the trainers' buckets never mix dtypes).
  """
  if len(parts) == 1:
    return parts[0]
  dtype = jnp.result_type(*parts)
  parts = [p.astype(dtype) for p in parts]
  shape = list(parts[0].shape)
  shape[axis] = sum(p.shape[axis] for p in parts)
  out = jnp.zeros(shape, dtype)
  offset = 0
  for p in parts:
    start = [0] * len(shape)
    start[axis] = offset
    out = jax.lax.dynamic_update_slice(out, p, start)
    offset += p.shape[axis]
  return out


def flatten_bucket(leaves: Sequence[jax.Array], bucket: Sequence[int], dtype=None) -> jax.Array:
  """The 1-D concatenation of ``leaves[i]`` for ``i`` in ``bucket``."""
  parts = [leaves[i].reshape(-1) for i in bucket]
  if dtype is not None:
    parts = [p.astype(dtype) for p in parts]
  return pack(parts)


def unflatten_bucket(
  flat: jax.Array, bucket: Sequence[int], like: Sequence[jax.Array]
) -> dict[int, jax.Array]:
  """Inverse of :func:`flatten_bucket`: ``{leaf index: array shaped like like[i]}``."""
  out, offset = {}, 0
  for i in bucket:
    size = math.prod(like[i].shape)
    out[i] = flat[offset : offset + size].reshape(like[i].shape).astype(like[i].dtype)
    offset += size
  return out


# -- ZeRO: (N, c_i) views, reduce-scatter and all-gather by bucket ----------


@dataclasses.dataclass(frozen=True)
class ShardLayout:
  """How a parameter tree is cut into per-device rows.

  Leaf ``i`` is flattened, zero-padded to ``N * c_i`` elements and cut into
  ``N`` rows of ``c_i``; device ``r`` owns row ``r``. A row keeps the leaf's
  rank (:meth:`row_shape`: ``(1, ..., 1, c_i)``, or ``()`` for a scalar), so
  code that looks at ``ndim`` (optax masks) sees a row as it sees the leaf.
  Stacked over devices, the rows of leaf ``i`` are ``(N,) + row_shape(i)``.

  A *scanned* leaf (``layers[i] = L``: parameters of ``L`` layers stacked on
  a leading axis by ``nn.scan``) is cut layer by layer: each of its ``L``
  layers is flattened, padded and cut into ``N`` rows of ``c_i``, so a
  device's row is ``(L, 1, ..., 1, c_i)`` and ``lax.scan`` hands one layer's
  row to each iteration, which gathers only that layer.

  Attributes:
    shapes: each leaf's shape, in tree order.
    sizes: each leaf's number of elements (of one layer, for a scanned leaf).
    chunks: ``c_i = max(ceil(size_i / N), 1)``: the number of elements of
      one device's row (of one layer); 1 for a scalar.
    n: the number of devices ``N`` in the data-parallel group.
    buckets: leaf indices grouped by :func:`plan_buckets` (one dtype each);
      leaves of FSDP units (``units``) are in none, their unit gathers them.
    layers: per leaf, the number of stacked layers ``L``, or None.
    units: indices of the leaves that belong to an FSDP unit.
  """

  shapes: tuple[tuple[int, ...], ...]
  sizes: tuple[int, ...]
  chunks: tuple[int, ...]
  n: int
  buckets: tuple[tuple[int, ...], ...]
  layers: tuple[int | None, ...] = ()
  units: frozenset = frozenset()

  @classmethod
  def build(
    cls,
    leaves: Sequence,
    n: int,
    bucket_bytes: int,
    itemsize: int = 4,
    units: dict[int, int | None] | None = None,
  ) -> ShardLayout:
    """The layout of ``leaves``; ``units`` maps unit leaves to their layer count (or None)."""
    units = units or {}
    shapes = tuple(tuple(np.shape(x)) for x in leaves)
    layers = tuple(units.get(i) for i in range(len(shapes)))
    sizes = tuple(
      math.prod(s[1:] if layer else s) for s, layer in zip(shapes, layers)
    )
    chunks = tuple(max(-(-s // n), 1) for s in sizes)
    dtypes = [np.dtype(x.dtype).name if hasattr(x, "dtype") else None for x in leaves]
    nbytes = [0 if i in units else n * c * itemsize for i, c in enumerate(chunks)]
    buckets = plan_buckets(nbytes, bucket_bytes, dtypes)
    return cls(shapes, sizes, chunks, n, buckets, layers, frozenset(units))

  def layer_count(self, i: int) -> int:
    """How many stacked layers leaf ``i`` has (1 when it is not scanned)."""
    return (self.layers[i] if self.layers else None) or 1

  _layers = layer_count

  def width(self, i: int) -> int:
    """Elements of one device's row of leaf ``i`` (all layers)."""
    return self._layers(i) * self.chunks[i]

  def aligned(self, i: int) -> bool:
    """Whether device r's row of leaf ``i`` is block r of its (layer's) first dimension."""
    inner = self.inner_shape(i)
    return bool(inner) and inner[0] % self.n == 0 and self.sizes[i] > 0

  def inner_row_shape(self, i: int) -> tuple[int, ...]:
    """One layer's row of leaf ``i`` (what a scan iteration sees).

    An aligned leaf's row is its block: ``(d0 / N, d1, ...)``, the same
    elements in the same order as ``(1, ..., 1, c_i)``, without the size-1
    axes (XLA:CPU copies a value to reshape between shapes that differ in
    size-1 axes, so blocks keep export, import and the update free of copies).
    """
    inner = self.inner_shape(i)
    if self.aligned(i):
      return (inner[0] // self.n,) + tuple(inner[1:])
    return (1,) * (len(inner) - 1) + (self.chunks[i],) if inner else ()

  def inner_shape(self, i: int) -> tuple[int, ...]:
    """One layer's full shape of leaf ``i`` (the leaf's shape when not scanned)."""
    return self.shapes[i][1:] if self.layers and self.layers[i] else self.shapes[i]

  def row_shape(self, i: int) -> tuple[int, ...]:
    """One device's row of leaf ``i``: ``(1,) * (ndim - 1) + (c_i,)``, or ``()``.

    A scanned leaf's row has the layer axis in front: ``(L, 1, ..., 1, c_i)``.
    """
    if self.layers and self.layers[i]:
      return (self.layers[i],) + self.inner_row_shape(i)
    return self.inner_row_shape(i)

  def table(self, leaf: jax.Array, i: int) -> jax.Array:
    """Leaf ``i`` flattened, zero-padded and viewed as ``(N, L * c_i)``."""
    layers, c = self._layers(i), self.chunks[i]
    flat = leaf.reshape(layers, self.sizes[i])
    flat = jnp.pad(flat, ((0, 0), (0, self.n * c - self.sizes[i])))
    if layers == 1:
      return flat.reshape(self.n, c)
    return flat.reshape(layers, self.n, c).transpose(1, 0, 2).reshape(self.n, layers * c)

  def rows(self, leaf: jax.Array, i: int) -> jax.Array:
    """Every device's row of leaf ``i``, stacked: ``(N,) + row_shape(i)``."""
    return self.table(leaf, i).reshape((self.n,) + self.row_shape(i))

  def unrows(self, rows: jax.Array, i: int) -> jax.Array:
    """Inverse of :meth:`rows` (or :meth:`table`): drops the padding, restores the shape."""
    layers, c = self._layers(i), self.chunks[i]
    if layers == 1:
      return rows.reshape(-1)[: self.sizes[i]].reshape(self.shapes[i])
    flat = rows.reshape(self.n, layers, c).transpose(1, 0, 2).reshape(layers, self.n * c)
    return flat[:, : self.sizes[i]].reshape(self.shapes[i])

  def own_shard(self, leaf: jax.Array, i: int, rank: jax.Array) -> jax.Array:
    """Row ``rank`` of leaf ``i`` (no communication), shaped ``row_shape(i)``."""
    row = jax.lax.dynamic_index_in_dim(self.table(leaf, i), rank, axis=0, keepdims=False)
    return row.reshape(self.row_shape(i))

  def own_shards(self, leaves: Sequence[jax.Array], rank: jax.Array) -> list[jax.Array]:
    """Row ``rank`` of every leaf (no communication)."""
    return [self.own_shard(x, i, rank) for i, x in enumerate(leaves)]

  def reduce_scatter(self, leaves, axis, algorithm) -> list[jax.Array]:
    """Mean over the group of every full leaf; returns this device's rows."""
    shards = [None] * len(leaves)
    for bucket in self.buckets:
      packed = pack([self.table(leaves[i], i) for i in bucket], axis=1)
      mine = collectives.reduce_scatter(packed.reshape(-1), axis, op="mean", algorithm=algorithm)
      for i, part in zip(bucket, _split(mine, [self.width(i) for i in bucket])):
        shards[i] = part.reshape(self.row_shape(i)).astype(leaves[i].dtype)
    return shards

  def all_gather(self, shards, axis, algorithm) -> list[jax.Array]:
    """Every device's rows of every leaf, reassembled into full leaves."""
    leaves = [None] * len(shards)
    for bucket in self.buckets:
      packed = pack([shards[i].reshape(-1) for i in bucket])
      everyone = collectives.all_gather(packed, axis, algorithm=algorithm)
      table = everyone.reshape(self.n, -1)
      widths = [self.width(i) for i in bucket]
      for i, view in zip(bucket, _split(table, widths, axis=1)):
        leaves[i] = self.unrows(view, i).astype(shards[i].dtype)
    return leaves


def make_gather(layout: ShardLayout, axis, algorithm, compute_dtype=None):
  """ZeRO-3's parameter gather: all-gather forward, reduce-scatter backward.

  Returns ``gather(shards) -> full leaves`` (lists in tree order). Its VJP is
  the bucketed mean reduce-scatter of the full-parameter cotangent, so the
  gradient arrives already sharded (FSDP, Zhao et al. VLDB 2023). Each
  gathered leaf is named :data:`ZERO3_GATHERED` so that a
  ``jax.checkpoint`` policy can refuse to save it: the parameters are then
  gathered again in the backward pass instead of being kept alive from the
  forward pass (maxtext does the same).

  Args:
    layout: the shard layout of the parameters.
    axis: the data-parallel axis (or tuple of axes).
    algorithm: the all-gather / reduce-scatter algorithm.
    compute_dtype: if set, shards are cast to it before the all-gather (so
      bf16 halves the gather's bytes); cotangents are reduce-scattered in the
      shards' own dtype (float32 master precision).
  """

  bucketed = frozenset(i for bucket in layout.buckets for i in bucket)

  @jax.custom_vjp
  def gather(shards):
    if compute_dtype is not None:
      shards = [s.astype(compute_dtype) if i in bucketed else s for i, s in enumerate(shards)]
    full = layout.all_gather(shards, axis, algorithm)
    # Leaves of FSDP units are in no bucket: their unit gathers them.
    return [s if f is None else f for f, s in zip(full, shards)]

  def forward(shards):
    # Empty arrays carry the shards' dtypes to the backward pass.
    return gather(shards), [jnp.zeros((0,), s.dtype) for s in shards]

  def backward(dtype_tags, cotangents):
    cotangents = [c.astype(t.dtype) for c, t in zip(cotangents, dtype_tags)]
    rows = layout.reduce_scatter(cotangents, axis, algorithm)
    return ([c if r is None else r for r, c in zip(rows, cotangents)],)

  def named_gather(shards):
    full = gather(list(shards))
    return [checkpoint_name(x, ZERO3_GATHERED) if i in bucketed else x for i, x in enumerate(full)]

  gather.defvjp(forward, backward)
  return named_gather


# Cheap data movement: recomputed in backward rather than saved, so that no
# cast / transpose / reshape of a gathered parameter is kept alive instead.
_RECOMPUTED_PRIMITIVES = frozenset(
  {
    "broadcast_in_dim",
    "convert_element_type",
    "copy",
    "copy_p",
    "expand_dims",
    "reshape",
    "rev",
    "slice",
    "squeeze",
    "transpose",
  }
)


def zero3_remat_policy(prim, *_, **params) -> bool:
  """``jax.checkpoint`` policy of ZeRO-3: save everything but the parameters.

  Not saved (so recomputed in the backward pass from the parameter rows,
  i.e. gathered again): values named :data:`ZERO3_GATHERED`, the outputs of
  ``custom_vjp`` calls (the gather is one; a model's own custom_vjp
  functions are recomputed too) and cheap data movement (casts, transposes,
  reshapes, broadcasts) that could otherwise keep a copy of a gathered
  parameter alive. Everything else (activations) is saved as without remat.

  ``jax.checkpoint_policies.save_anything_except_these_names`` is not enough:
  it would save the value the name was applied to.
  """
  if prim.name == "name":
    return params.get("name") != ZERO3_GATHERED
  if prim.name == "custom_vjp_call":
    return False
  return prim.name not in _RECOMPUTED_PRIMITIVES
