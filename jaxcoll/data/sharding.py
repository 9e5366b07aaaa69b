"""Per-process sharding of the global batch: which rows each process feeds.

A global batch of ``B`` rows is split over processes in contiguous blocks
(the rows each process's devices hold on a process-ordered mesh), and each
process builds or reads only its own block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll import checks

if TYPE_CHECKING:
  from jaxcoll.data.synthetic import Batch, SyntheticDataset

def process_batch_slice(
    global_batch_size: int,
    process_index: int | None = None,
    process_count: int | None = None,
) -> slice:
  """The rows of the global batch that process ``process_index`` feeds.

  Process ``p`` of ``P`` gets the contiguous rows ``[p * B / P, (p + 1) * B /
  P)``, which are the rows its devices hold on a process-ordered mesh (such
  as :func:`jaxcoll.devices.make_mesh` builds) sharded over its data axis.

  Args:
    global_batch_size: ``B``, examples per step over all processes.
    process_index: this process (default ``jax.process_index()``).
    process_count: number of processes (default ``jax.process_count()``).

  Returns:
    ``slice(start, stop)`` into ``range(global_batch_size)``.

  Raises:
    ValueError: if ``B`` does not divide by the process count, or the index
      is out of range.
  """
  global_batch_size = checks.positive_int(global_batch_size, "global_batch_size")
  process_index = jax.process_index() if process_index is None else process_index
  process_count = jax.process_count() if process_count is None else process_count
  process_count = checks.positive_int(process_count, "process_count")
  if not 0 <= process_index < process_count:
    raise ValueError(
        f"`process_index` must be in 0..{process_count - 1}, got {process_index!r}."
    )
  if global_batch_size % process_count:
    raise ValueError(
        f"`global_batch_size` ({global_batch_size}) must be divisible by the number of "
        f"processes ({process_count}); use a multiple of {process_count}."
    )
  per_process = global_batch_size // process_count
  return slice(process_index * per_process, (process_index + 1) * per_process)


def _process_rows(sharding: NamedSharding, global_batch_size: int) -> slice:
  """The contiguous batch rows the devices of this process hold."""
  index_map = sharding.addressable_devices_indices_map((global_batch_size,))
  spans = {idx[0].indices(global_batch_size)[:2] for idx in index_map.values()}
  start, stop = min(s for s, _ in spans), max(e for _, e in spans)
  covered = sum(e - s for s, e in spans)
  if covered != stop - start:
    raise ValueError(
        "This process's devices hold non-contiguous rows of the batch under "
        f"{sharding.spec}; build the mesh process by process, e.g. with "
        "jaxcoll.devices.make_mesh, so each process feeds one contiguous block."
    )
  return slice(start, stop)


def global_batch(
    dataset: SyntheticDataset,
    step: int,
    global_batch_size: int,
    mesh: Mesh,
    *,
    axis: str | tuple[str, ...] = "data",
    split: str = "train",
) -> dict[str, jax.Array]:
  """The global batch of ``step`` as jax.Arrays sharded over ``axis``.

  Each process computes only the rows its own devices hold and hands them to
  ``jax.make_array_from_process_local_data``, so no process ever builds the
  whole batch (as a multi-host input pipeline, where each process reads only
  its own shard of the data). In a single process this is the whole batch.

  Args:
    dataset: the data set.
    step: data position (training step).
    global_batch_size: examples per step over all processes.
    mesh: the device mesh.
    axis: mesh axis name (or tuple of names) the batch dimension is split
      over.
    split: ``"train"`` or ``"eval"``.

  Returns:
    A dict of jax.Arrays with leading dimension ``global_batch_size`` and
    sharding ``NamedSharding(mesh, P(axis))``.

  Raises:
    ValueError: if the global batch does not divide by the process count or
      by the size of ``axis``, or ``axis`` is not a mesh axis.
  """
  axes = checks.axis_names(axis)
  unknown = [a for a in axes if a not in mesh.shape]
  if unknown:
    raise ValueError(
        f"`axis` {axis!r} is not an axis of the mesh; valid axes: {tuple(mesh.axis_names)}."
    )
  global_batch_size = checks.positive_int(global_batch_size, "global_batch_size")
  process_batch_slice(global_batch_size)  # the process-count check, with its message
  shards = checks.axis_size(mesh, axes)
  if global_batch_size % shards:
    raise ValueError(
        f"`global_batch_size` ({global_batch_size}) must be divisible by the size of "
        f"mesh axis {axis!r} ({shards}); use a multiple of {shards}."
    )
  sharding = NamedSharding(mesh, P(axis))
  rows = _process_rows(sharding, global_batch_size)
  local = dataset.batch(step, global_batch_size, rows=rows, split=split)
  return {
      name: jax.make_array_from_process_local_data(
          sharding, value, (global_batch_size, *value.shape[1:])
      )
      for name, value in local.items()
  }


def from_process_local(
    local_batch: Batch,
    mesh: Mesh,
    *,
    axis: str | tuple[str, ...] = "data",
) -> dict[str, jax.Array]:
  """The global batch made of every process's own rows, for ``Trainer.step``.

  Each process passes only its ``b`` local rows (as DDP, Horovod and grain
  loaders give them); the result is the global batch of ``b x
  jax.process_count()`` rows sharded over ``axis``, process ``p``'s rows at
  ``p*b .. (p+1)*b - 1`` (``jax.make_array_from_process_local_data``). In a
  single process it is the batch itself, placed.

  Args:
    local_batch: dict of numpy arrays with the same leading dimension ``b``.
    mesh: the trainer's mesh (``trainer.mesh``).
    axis: the data axis (``trainer.axis``).

  Returns:
    A dict of jax.Arrays with leading dimension ``b * process_count``.

  Raises:
    ValueError: if the leaves' leading dimensions differ, or ``b`` is not
      what this process's devices hold of a global batch of ``b x P`` rows;
      the message shows the local and global sizes and the fix.

  Example:
    >>> mesh = jaxcoll.devices.flat_mesh(8)  # doctest: +SKIP
    >>> local = {"x": np.ones((16, 4))}  # this process's 16 rows  # doctest: +SKIP
    >>> batch = jaxcoll.data.from_process_local(local, mesh)  # doctest: +SKIP
    >>> state, metrics = trainer.step(state, batch)  # 16 x P rows  # doctest: +SKIP
  """
  sizes = {k: int(np.shape(v)[0]) if np.ndim(v) else None for k, v in local_batch.items()}
  if not sizes or None in sizes.values() or len(set(sizes.values())) != 1:
    raise ValueError(
        f"`local_batch` leaves must share one leading (batch) dimension, got {sizes}; pass a "
        "dict of arrays with this process's rows first."
    )
  local = next(iter(sizes.values()))
  procs = jax.process_count()
  sharding = NamedSharding(mesh, P(axis))
  global_size = local * procs
  shards = checks.axis_size(mesh, axis)
  rows = None
  if global_size % shards == 0:
    rows = _process_rows(sharding, global_size)
  if rows is None or rows.stop - rows.start != local:
    raise ValueError(
        f"`local_batch` has {local} rows on this process, so the global batch is {local} x "
        f"{procs} processes = {global_size} rows, which does not split over the {shards} "
        f"devices of axis {axis!r} with {shards // procs} per process; give each process a "
        f"multiple of {max(1, shards // procs)} rows."
    )
  return {
      name: jax.make_array_from_process_local_data(
          sharding, np.asarray(value), (global_size, *np.shape(value)[1:])
      )
      for name, value in local_batch.items()
  }
