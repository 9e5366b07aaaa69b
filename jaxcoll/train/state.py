"""The train state, batch placement and the replica check.

Where each part of :class:`TrainState` lives (``N`` = data-parallel size):

=================  =========================  ===================================
field              DataParallel / ZeRO-1, 2   ZeRO-3
=================  =========================  ===================================
``params``         full, replicated           rows, concatenated: row r on device r
``opt_state``      DP: replicated;            per-device, concatenated
                   ZeRO: concatenated
``residual``       error feedback, stacked    ``()``
``step``           int32 scalar, replicated   same
=================  =========================  ===================================

"Stacked" leaves hold one value per device on a new leading dimension ``N``
sharded over the data axis. ZeRO's per-device values (each device's rows and
their optimizer state) are *concatenated* instead (:func:`concat_shape`): a
value of shape ``(a, b, ...)`` becomes a global ``(N * a, b, ...)`` whose
shard on device r is exactly its value, with no extra axis to squeeze in the
step (on XLA:CPU, squeezing and re-adding that axis around the optimizer
update cost three leaf-sized copies); a scalar's become ``(N,)``. A ZeRO row
keeps its leaf's rank (``ShardLayout.row_shape``).
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


class TrainState(NamedTuple):
  """What a :class:`jaxcoll.train.Trainer` carries from step to step."""

  step: jax.Array
  params: Any
  opt_state: Any
  residual: Any


def stack(tree):
  """Adds the per-device leading axis (inside shard_map: shape ``(1, ...)``)."""
  return jax.tree.map(lambda x: x[None], tree)


def unstack(tree):
  """Drops the per-device leading axis added by :func:`stack`."""
  return jax.tree.map(lambda x: x[0], tree)


def concat_shape(shape, n: int) -> tuple[int, ...]:
  """Global shape of ``n`` devices' values of ``shape``, concatenated (scalars stacked)."""
  shape = tuple(shape)
  return (n * shape[0],) + shape[1:] if shape else (n,)


def to_block(tree):
  """Inside shard_map: per-device values as blocks of their :func:`concat_shape`."""
  return jax.tree.map(lambda x: x if x.ndim else x[None], tree)


def from_block(tree, like):
  """Inverse of :func:`to_block`: each block reshaped to ``like``'s (per-device) shape."""
  return jax.tree.map(lambda x, t: x.reshape(t.shape), tree, like)


def global_batch_size(batch) -> int:
  """The common leading dimension of every batch leaf.

  Raises:
    ValueError: a leaf of text (ids kept beside the features) or of Python objects, which
      JAX cannot hold (it was JAX's ``TypeError: Dtype <U3 is not a valid JAX array type``,
      naming no leaf); leaves of different leading dimensions, or a Python list where an
      array goes (a pytree of one leaf per item to JAX), each named by its path.
  """
  flat = jax.tree_util.tree_flatten_with_path(batch)[0]
  if not flat:
    raise ValueError("`batch` has no arrays; pass a pytree of arrays.")
  for path, x in flat:
    kind = getattr(x, "dtype", None) if isinstance(x, (np.ndarray, np.generic)) else None
    if kind is None and isinstance(x, (str, bytes)):
      kind = np.asarray(x).dtype
    if kind is not None and (kind.kind in "USO" or (  # text, bytes, objects, records
        kind.kind == "V" and not jnp.issubdtype(kind, jnp.number))):  # not bfloat16, int4
      key = getattr(path[0], "key", "id") if path else "id"
      raise ValueError(
        f"`batch` leaf {leaf_name(path)} holds {kind} values (text or objects), which JAX "
        "cannot hold: a batch holds numbers only. Drop it before the step (e.g. "
        f"`{{k: v for k, v in batch.items() if k != {key!r}}}`), or encode it as integers.")
  sizes = {int(np.shape(x)[0]) if np.ndim(x) else None for _, x in flat}
  if None in sizes or len(sizes) != 1:
    shown = ", ".join(f"{leaf_name(path)}: {tuple(np.shape(x))}" for path, x in flat[:4])
    more = f", ... ({len(flat)} leaves)" if len(flat) > 4 else ""
    lists = sorted({leaf_name(path[:_first_index(path)]) for path, _ in flat
                    if _first_index(path)})  # the outermost list of each leaf's path
    hint = (f"; {', '.join(lists[:3])} {'is a list' if len(lists) == 1 else 'are lists'} "
            "(a pytree of one leaf per item to JAX): pass numpy arrays, np.asarray(...)"
            if lists else "")
    raise ValueError(
      f"Every `batch` leaf must have the same leading (batch) dimension; got {shown}{more}"
      f"{hint}.")
  return sizes.pop()


def _first_index(path) -> int:
  """Where the first list (or tuple) index of a leaf's path is (0: none, or at the root)."""
  return next((i for i, key in enumerate(path) if isinstance(key, jax.tree_util.SequenceKey)),
              0)


def check_batch(batch, dp_size: int, grad_accum_steps: int) -> int:
  """Raises unless the global batch splits evenly over devices and microbatches."""
  size = global_batch_size(batch)
  check_batch_size(size, dp_size, grad_accum_steps)
  return size


def check_batch_size(size: int, dp_size: int, grad_accum_steps: int) -> None:
  """Raises unless ``size`` examples split evenly over devices and microbatches."""
  unit = dp_size * grad_accum_steps
  if size <= 0:  # a mean over no rows: a NaN loss, and the optimizer stepped on it
    raise ValueError(
      f"Global batch size {size}: `batch` has no rows; pass at least {unit} ({dp_size} "
      f"data-parallel devices x grad_accum_steps {grad_accum_steps}), e.g. skip an empty "
      "last batch.")
  if size % unit:
    good = max(unit, size // unit * unit)
    raise ValueError(
      f"Global batch size {size} is not divisible by data-parallel size "
      f"{dp_size} x grad_accum_steps {grad_accum_steps} = {unit}; use a "
      f"global batch that is a multiple of {unit} (e.g. {good}), or change "
      "the number of devices or grad_accum_steps."
    )


def check_same_on_every_process(batch) -> None:
  """Raises unless a host (numpy) batch is the same on every process.

  ``Trainer.step`` takes the *global* batch; a process then reads only the
  rows its devices own. If each process passed its own local rows instead, it
  would silently train on part of them, so with several processes a SHA-256
  of the host leaves is compared across processes (one small all-gather; jax
  arrays, e.g. from :func:`jaxcoll.data.from_process_local`, skip it).

  Raises:
    ValueError: showing the local and global sizes and the fix.
  """
  procs = jax.process_count()
  host = [x for x in jax.tree.leaves(batch) if not isinstance(x, jax.Array)]
  if procs == 1 or not host:
    return
  from jax.experimental import multihost_utils  # noqa: PLC0415

  sha = hashlib.sha256()
  for x in host:
    a = np.ascontiguousarray(x)
    sha.update(f"{a.shape}{a.dtype}".encode() + a.tobytes())
  everyone = np.asarray(multihost_utils.process_allgather(
      np.frombuffer(sha.digest(), np.uint32)))
  if not (everyone == everyone[0:1]).all():
    size = global_batch_size(batch)
    raise ValueError(
      f"`batch` differs across the {procs} processes ({size} rows here): Trainer.step takes "
      f"one global batch, of which each process would use only its devices' rows and "
      f"drop the rest. If each process holds its own {size} rows (a global batch of "
      f"{size} x {procs} = {size * procs}), pass jaxcoll.data.from_process_local(batch, "
      "trainer.mesh, axis=trainer.axis); otherwise pass the same global batch everywhere."
    )


def same_on_every_process(leaves) -> bool:
  """Whether every process holds the same values of the process-local ``leaves``
  (numpy, or jax arrays on this process's devices only; global arrays are one
  array and skipped): one SHA-256 per process, all-gathered (every process must
  call it, and all get the same answer). True with one process."""
  if jax.process_count() == 1:
    return True
  from jax.experimental import multihost_utils  # noqa: PLC0415

  sha = hashlib.sha256()
  for x in leaves:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      continue
    a = np.ascontiguousarray(x)  # one leaf on the host at a time (a view on XLA:CPU)
    sha.update(f"{a.shape}{a.dtype}".encode())
    sha.update(memoryview(a.reshape(-1).view(np.uint8)))
    del a
  everyone = np.asarray(multihost_utils.process_allgather(
      np.frombuffer(sha.digest(), np.uint32)))
  return bool((everyone == everyone[0:1]).all())


def place(tree, mesh: Mesh, spec: P):
  """Puts host or device arrays on ``mesh`` with ``spec``.

  Numpy arrays go through ``jax.make_array_from_callback``, which only reads
  the slices this process's devices own, so it also works when every process
  holds the global array. Jax arrays already placed this way are kept. With
  several processes, a jax array on this process's devices only is treated
  like numpy (read to the host): ``jax.device_put`` would require every
  process to pass the same values, while this takes each process's own
  (for replicated ``spec``, the caller then picks device 0's).
  """
  sharding = NamedSharding(mesh, spec)
  multi_process = jax.process_count() > 1

  def one(x):
    if isinstance(x, jax.ShapeDtypeStruct):  # abstract (lower / compile only)
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    if isinstance(x, jax.Array):
      if x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
      if not (multi_process and x.is_fully_addressable):
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

  return jax.tree.map(one, tree)


def check_not_donated(leaf) -> None:
  """One line for a state a donating ``step`` was given before: ``leaf``, one array of it
  (all are donated together), is deleted. Run again on the deleted buffers, the step
  killed the process with a segmentation fault on a multi-device mesh (XLA:CPU)."""
  if isinstance(leaf, jax.Array) and leaf.is_deleted():
    raise ValueError(
        "`state` was already given to `trainer.step`, which donates it (its buffers hold "
        "the new state now): use the state that step returned, `state, metrics = "
        "trainer.step(state, batch)`; to keep a copy, save it first (export_state, "
        "Checkpointer.save).")


def leaf_name(path) -> str:
  return jax.tree_util.keystr(path) or "<root>"


def check_float_params(params) -> None:
  """Raises unless every parameter leaf is floating point (``jax.grad`` needs it)."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    dtype = jax.numpy.result_type(leaf)
    if not jax.numpy.issubdtype(dtype, jax.numpy.inexact):
      kind = _nnx_variable_type(params, path)
      fix = (
        f" It is an nnx {kind}: train only the model's nnx.Param state (`graphdef, params, "
        "rest = nnx.split(model, nnx.Param, ...)`, passing `rest` to `loss_fn` unchanged), or "
        "build the workload with jaxcoll.models.from_nnx(model, loss), which carries "
        "BatchStat-like state and reseeds the rng streams from Trainer(rng=...)."
        if kind else "")
      raise ValueError(
        f"`params` leaf {leaf_name(path)} has dtype {dtype}; every parameter "
        "must be floating point, since jax.grad cannot differentiate integer or bool "
        "leaves. Move it out of the trained parameters (e.g. into the batch or a "
        "closure of `loss_fn`), or cast it to a float dtype." + fix
      )


def _nnx_variable_type(params, path) -> str | None:
  """The name of the ``flax.nnx`` Variable type holding the leaf at ``path``, if any."""
  import sys  # noqa: PLC0415

  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return None
  is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
  for var_path, var in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_var)[0]:
    if is_var(var) and tuple(path[:len(var_path)]) == tuple(var_path):
      return type(var).__name__
  return None


def replica_mismatches(tree) -> list[str]:
  """Leaves of ``tree`` whose replicas are not bit-identical.

  Every copy of a block is checked: of fully replicated leaves, and of leaves
  sharded over some mesh axes and replicated over others (hybrid ZeRO's
  ``replica_axis``: each group's rows), the devices holding the same block.
  Each process compares the bytes of its addressable copies; with several
  processes, a SHA-256 fingerprint of every process's copy of each block is
  also compared across the processes that hold it.

  Returns:
    One line per mismatching leaf (and block): its path and where it differs.
  """
  problems, digests, names = [], [], []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not isinstance(leaf, jax.Array):
      continue
    blocks = _replicated_blocks(leaf)
    if blocks is None:  # every block on one device only: nothing to compare
      continue
    copies: dict = {}
    for shard in leaf.addressable_shards:
      copies.setdefault(_block_key(shard.index, leaf.shape), []).append(shard)
    for block in blocks:
      where = "" if len(blocks) == 1 else f" {_block_name(block)}"
      held = copies.get(block, [])
      reference = np.asarray(held[0].data).tobytes() if held else b""
      bad = [x.device for x in held[1:] if np.asarray(x.data).tobytes() != reference]
      if bad:
        problems.append(f"{leaf_name(path)}{where}: devices {[d.id for d in bad]} differ from "
                        f"device {held[0].device.id}")
      digest = np.frombuffer(hashlib.sha256(reference).digest(), np.uint32)
      digests.append(np.concatenate([digest, np.array([bool(held)], np.uint32)]))
      names.append(f"{leaf_name(path)}{where}")
  if jax.process_count() > 1 and digests:
    from jax.experimental import multihost_utils

    everyone = np.asarray(multihost_utils.process_allgather(np.stack(digests)))
    for k, name in enumerate(names):
      holders = [p for p in range(everyone.shape[0]) if everyone[p, k, -1]]
      if not holders:
        continue
      first = everyone[holders[0], k]
      differ = [p for p in holders if (everyone[p, k] != first).any()]
      if differ:
        problems.append(f"{name}: processes {differ} differ from process {holders[0]}")
  return problems


def _replicated_blocks(leaf) -> list | None:
  """The distinct blocks of ``leaf`` (sorted), or None when no block has two copies."""
  owners = leaf.sharding.devices_indices_map(leaf.shape)
  keys = [_block_key(index, leaf.shape) for index in owners.values()]
  distinct = sorted(set(keys))
  return None if len(distinct) == len(keys) else distinct


def _block_key(index, shape) -> tuple:
  return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape))


def _block_name(key) -> str:
  return "[" + ", ".join(f"{a}:{b}" for a, b in key) + "]"


def bytes_per_device(tree) -> int:
  """Bytes of ``tree`` held by the first addressable device (``jax.ShapeDtypeStruct``
  leaves, e.g. ``Trainer.abstract_state``'s: by their sharding's shard shape)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      total += leaf.addressable_shards[0].data.nbytes
    elif isinstance(leaf, jax.ShapeDtypeStruct):
      shape = leaf.shape if leaf.sharding is None else leaf.sharding.shard_shape(leaf.shape)
      total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    else:
      total += np.asarray(leaf).nbytes
  return total


def perturb_replica(leaf: jax.Array, copy: int = -1, delta: float = 1e-3) -> jax.Array:
  """Fault injection: ``leaf`` with one addressable copy's first element moved.

  Builds a new global array from this process's device buffers in which
  copy number ``copy`` (of ``leaf.addressable_shards``) differs by
  ``delta`` in its first element: what a silent replica desync looks like.
  """
  shards = leaf.addressable_shards
  copies = [np.array(s.data) for s in shards]
  flat = copies[copy].reshape(-1)
  flat[0] = flat[0] + np.asarray(delta, flat.dtype)
  return jax.make_array_from_single_device_arrays(
      leaf.shape,
      leaf.sharding,
      [jax.device_put(c, s.device) for c, s in zip(copies, shards)],
  )

