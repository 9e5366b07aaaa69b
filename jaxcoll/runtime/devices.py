"""CPU simulation mode and mesh helpers.

The CPU simulation mode makes one process expose ``n`` XLA CPU devices, so
that collective and data-parallel code can be run and tested on a laptop.
It must be switched on before JAX starts its backend: importing :mod:`jaxcoll`
with ``JAXCOLL_CPU_DEVICES=n`` in the environment does it, or call
:func:`simulate_cpu_devices` right after ``import jax``.

Mesh vocabulary (as maxtext): a flat ``("data",)`` mesh, and a two-level
``("node", "local")`` mesh whose outer axis crosses hosts (one process is one
node in a multi-process job) and whose inner axis stays inside a host.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxcoll import checks

ENV_CPU_DEVICES = "JAXCOLL_CPU_DEVICES"


def simulate_cpu_devices(n: int) -> None:
  """Makes JAX expose ``n`` CPU devices in this process.

  Args:
    n: number of emulated CPU devices, >= 1.

  Raises:
    ValueError: if ``n`` is not a positive integer.
    RuntimeError: if JAX's backend already started with a different number of
      CPU devices (the count cannot change once JAX has started).

  Example:
    >>> import jax, jaxcoll
    >>> jaxcoll.devices.simulate_cpu_devices(8)  # doctest: +SKIP
    >>> len(jax.devices("cpu"))  # doctest: +SKIP
    8
  """
  n = checks.positive_int(n, "n")
  try:
    jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:
    # The backend has started: fine if it already has n CPU devices.
    current = len(jax.devices("cpu"))
    if current != n:
      raise RuntimeError(
          f"JAX's backend has already started with {current} CPU device(s); "
          f"cannot switch to {n}. Call jaxcoll.devices.simulate_cpu_devices({n}) "
          f"(or set {ENV_CPU_DEVICES}={n}) before any JAX computation runs, "
          "e.g. right after `import jax`, or start a new process."
      ) from None


def simulate_from_environment() -> int | None:
  """Applies ``JAXCOLL_CPU_DEVICES`` if set; returns the count or None."""
  value = os.environ.get(ENV_CPU_DEVICES)
  if value is None or value == "":
    return None
  try:
    n = int(value)
  except ValueError:
    n = 0
  if n < 1:
    raise ValueError(
        f"`{ENV_CPU_DEVICES}` must be a positive integer (CPU devices to emulate), got "
        f"{value!r}; e.g. {ENV_CPU_DEVICES}=8, or unset it."
    )
  simulate_cpu_devices(n)
  return n


def emulation_hint(wanted: int, processes: int = 1) -> str:
  """How to get ``wanted`` devices on a CPU-only machine, for error messages.

  ``processes``: the job's process count. ``JAXCOLL_CPU_DEVICES`` is per
  process, so a job of several needs ``wanted / processes`` on each (a 3-process
  job told to set ``JAXCOLL_CPU_DEVICES=8`` would have 24 devices).
  """
  if processes > 1:
    if wanted % processes:
      return (f"{wanted} devices do not split evenly over the job's {processes} processes "
              f"(each process has the same number); choose a multiple of {processes}, or "
              "another process count")
    each = wanted // processes
    return (f"to emulate {wanted} CPU devices over {processes} processes, give each "
            f"{ENV_CPU_DEVICES}={each} (python -m jaxcoll.launch --devices_per_process={each})")
  return (
      f"to emulate {wanted} CPU devices, set {ENV_CPU_DEVICES}={wanted} in the environment "
      f"before starting Python, or call jaxcoll.devices.simulate_cpu_devices({wanted}) "
      "right after `import jax`, before JAX starts"
  )


def _process_count(devices: Sequence[jax.Device]) -> int:
  return len({d.process_index for d in devices})


def refilled_shape(shape: Sequence[int], devices: int) -> list[int] | None:
  """``shape`` fitted to ``devices`` by refilling its last axis, the others kept (a hybrid
  run's node axis: ``(2, 4)`` on 6 devices is ``[2, 3]``); None for a shape of one axis or
  where the other axes do not divide ``devices``."""
  rest = math.prod(shape[:-1])
  return [*shape[:-1], devices // rest] if len(shape) > 1 and devices % rest == 0 else None


def _check_shape(shape: Sequence[int], devices: Sequence[jax.Device], what: str) -> None:
  if any(not checks.is_int(s) or s < 1 for s in shape):
    raise ValueError(f"`{what}` must be positive integers, got {tuple(shape)}.")
  wanted = math.prod(shape)
  if wanted != len(devices):
    hint = f"; {emulation_hint(wanted, _process_count(devices))}" if wanted > len(devices) else ""
    fitted = refilled_shape(shape, len(devices))
    example = f" (e.g. {','.join(map(str, fitted))})" if fitted else ""
    raise ValueError(
        f"`{what}` {tuple(shape)} has {wanted} devices but "
        f"{len(devices)} are available; choose a shape whose product is "
        f"{len(devices)}{example}{hint}."
    )


def make_mesh(
    shape: Sequence[int],
    axis_names: Sequence[str],
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
  """A mesh of ``devices`` (default: all) with Auto axis types.

  Devices are laid out process by process (process 0's devices first), so
  the last axes stay inside a host when their size divides the per-process
  device count. One size may be ``-1`` to fill the remaining devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = list(shape)
  if len(shape) != len(axis_names):
    raise ValueError(
        f"`mesh_shape` {tuple(shape)} and `axis_names` {tuple(axis_names)} "
        "must have the same length."
    )
  if shape.count(-1) > 1:
    raise ValueError(f"`mesh_shape` {tuple(shape)} may contain at most one -1.")
  if -1 in shape:
    rest = math.prod(s for s in shape if s != -1)
    if rest < 1 or len(devices) % rest:
      fits = [d for d in range(1, len(devices) + 1) if len(devices) % d == 0]
      raise ValueError(
          f"`mesh_shape` {tuple(shape)}: {len(devices)} devices do not divide "
          f"by {rest}; the other axes' sizes must multiply to one of {fits}."
      )
    shape[shape.index(-1)] = len(devices) // rest
  _check_shape(shape, devices, "mesh_shape")
  ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
  grid = np.array(ordered, dtype=object).reshape(shape)
  return Mesh(grid, tuple(axis_names), axis_types=(AxisType.Auto,) * len(shape))


_DEFAULT_AXES = {1: ("data",), 2: ("node", "local")}


def mesh_from_text(
    shape_text: str | None,
    axes_text: str | None,
    *,
    shape_name: str = "mesh_shape",
    axes_name: str = "mesh_axes",
) -> Mesh:
  """A mesh from command-line text such as ``"2,4"`` and ``"node,local"``.

  No shape means one axis over all devices; no axis names mean ``data`` for
  one axis and ``node, local`` for two. ``shape_name`` / ``axes_name`` are
  the flag or config names the errors mention.

  Raises:
    ValueError: a shape that is not integers, names that do not match it,
      or a shape whose product is not the device count.
  """
  axes = tuple(axes_text.split(",")) if axes_text else None
  if not shape_text:
    if axes is not None and len(axes) != 1:
      raise ValueError(f"`{axes_name}`={axes_text!r} needs a `{shape_name}`, e.g. 2,4.")
    shape = (len(jax.devices()),)
  else:
    try:
      shape = tuple(int(s) for s in shape_text.split(","))
    except ValueError:
      raise ValueError(
          f"`{shape_name}`={shape_text!r} is not a comma-separated list of integers, e.g. 2,4."
      ) from None
  if axes is None:
    if len(shape) not in _DEFAULT_AXES:
      raise ValueError(f"`{shape_name}`={shape_text!r} needs `{axes_name}` names.")
    axes = _DEFAULT_AXES[len(shape)]
  if len(axes) != len(shape) or len(set(axes)) != len(axes) or not all(axes):
    raise ValueError(
        f"`{axes_name}`={axes_text!r} must be {len(shape)} distinct names, one per "
        f"`{shape_name}` entry ({shape_text})."
    )
  if -1 not in shape:  # named as the caller's flag / config field (-1: make_mesh fills it)
    _check_shape(shape, jax.devices(), shape_name)
  return make_mesh(shape, axes)


def flat_mesh(
    num_devices: int | None = None,
    axis_name: str = "data",
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
  """A one-axis mesh over the first ``num_devices`` devices (default all)."""
  devices = list(jax.devices() if devices is None else devices)
  if num_devices is None:
    num_devices = len(devices)
  if not checks.is_int(num_devices) or not 1 <= num_devices <= len(devices):
    hint = ""
    if checks.is_int(num_devices) and num_devices > len(devices):
      hint = f"; {emulation_hint(num_devices, _process_count(devices))}"
    raise ValueError(
        f"`num_devices` must be in 1..{len(devices)} (the available devices), "
        f"got {num_devices!r}{hint}."
    )
  ordered = sorted(devices, key=lambda d: (d.process_index, d.id))[:num_devices]
  return make_mesh((num_devices,), (axis_name,), ordered)


def node_local_mesh(
    nodes: int | None = None,
    local: int | None = None,
    devices: Sequence[jax.Device] | None = None,
    axis_names: tuple[str, str] = ("node", "local"),
) -> Mesh:
  """A two-level ``("node", "local")`` mesh.

  With several processes, the default is one node per process and ``local``
  = devices per process, so the ``node`` axis crosses process boundaries.
  In a single process, ``nodes`` defaults to 2 (emulating two hosts). Both
  given in a single process without ``devices``, it is over the first ``nodes x
  local`` devices, as :func:`flat_mesh` is over the first ``num_devices``
  (``node_local_mesh(2, 3)`` on 8). With several processes a part of the devices
  would make a node straddle two hosts (the hierarchical algorithms and the cost
  model take a node to be a host), and ``devices`` given are the mesh's, every one
  of them: there a shape of another size is refused.
  """
  given = devices
  devices = list(jax.devices() if devices is None else devices)
  if (given is None and _process_count(devices) == 1 and checks.is_int(nodes)
      and checks.is_int(local) and 0 < nodes * local < len(devices)):
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))[:nodes * local]
  total = len(devices)
  if nodes is None and local is None:
    nodes = max(jax.process_count(), 1)
    if nodes == 1 and total % 2 == 0 and total > 1:
      nodes = 2
  if nodes is None:
    nodes = -1
  if local is None:
    local = -1
  return make_mesh((nodes, local), axis_names, devices)
