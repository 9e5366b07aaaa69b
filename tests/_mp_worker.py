"""Worker of tests/collectives/test_multiprocess.py: one process of a launched job.

Run as ``python -m jaxcoll.launch --num_processes=2 --devices_per_process=4
-- python tests/_mp_worker.py``. Each process joins the job, runs every
collective (several algorithms) inside one jitted shard_map over the
``("node", "local")`` mesh and one over the flat ``("data",)`` mesh, gathers
the outputs from all processes and compares every rank's output with
``jaxcoll.collectives.reference``. It prints one JSON line (prefixed
``RESULT ``) and exits 0, or names each mismatch and exits 1.
"""

from __future__ import annotations

import itertools
import json
import sys
import time

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll
from jaxcoll.runtime import distributed
from jaxcoll.collectives import reference

import jobs

_ALL_REDUCE = ("native", "ring", "recursive_doubling", "halving_doubling")
_BROADCAST = ("native", "binomial_tree", "scatter_allgather")
_BROADCAST_ROOT = 5  # a device of process 1: the data must cross processes


def _cases(mesh_axes: tuple[str, ...]) -> dict[str, tuple[str, tuple[str, ...], dict]]:
  everything = mesh_axes
  cases = {}
  for algo in _ALL_REDUCE:
    cases[f"all_reduce/{algo}"] = ("all_reduce", everything, dict(algorithm=algo))
  cases["all_reduce/ring/max/int32"] = ("all_reduce", everything, dict(algorithm="ring", op="max"))
  cases["all_gather/ring"] = ("all_gather", everything, dict(algorithm="ring"))
  cases["reduce_scatter/ring"] = ("reduce_scatter", everything, dict(algorithm="ring"))
  for algo in _BROADCAST:
    cases[f"broadcast/{algo}"] = (
      "broadcast",
      everything,
      dict(algorithm=algo, root=_BROADCAST_ROOT),
    )
  if len(mesh_axes) == 2:
    cases["all_reduce/hierarchical"] = ("all_reduce", everything, dict(algorithm="hierarchical"))
    cases["all_reduce/hierarchical(halving_doubling)"] = (
      "all_reduce",
      everything,
      dict(algorithm=jaxcoll.Hierarchical(inner="ring", outer="halving_doubling")),
    )
    cases["all_gather/hierarchical"] = ("all_gather", everything, dict(algorithm="hierarchical"))
    cases["reduce_scatter/hierarchical"] = (
      "reduce_scatter",
      everything,
      dict(algorithm="hierarchical"),
    )
    # One level only: "node" crosses the processes, "local" stays inside one.
    cases["all_reduce/ring@node"] = ("all_reduce", ("node",), dict(algorithm="ring"))
    cases["all_reduce/recursive_doubling@local"] = (
      "all_reduce",
      ("local",),
      dict(algorithm="recursive_doubling"),
    )
  return cases


def _input_name(name: str, collective: str) -> str:
  if name.endswith("int32"):
    return "int"
  return {"all_gather": "small", "reduce_scatter": "divisible", "broadcast": "small"}.get(
    collective, "odd"
  )


def _inputs(num_ranks: int) -> dict[str, np.ndarray]:
  """Per-rank rows (leading dim = rank); small integers, so sums are exact."""
  r = np.arange(num_ranks)[:, None]

  def rows(length, dtype):
    return ((np.arange(length)[None, :] * (r + 1) + 3 * r) % 11 - 5).astype(dtype)

  return {
    "odd": rows(12, np.float32),  # 12 does not divide by 8: all_reduce pads
    "int": rows(12, np.int32),
    "divisible": rows(16, np.float32),
    "small": rows(3, np.float32),
  }


def _groups(mesh_shape, mesh_axes, group_axes) -> list[list[int]]:
  """Flat ranks of each group over ``group_axes`` (row-major in the group)."""
  rank_grid = np.arange(int(np.prod(mesh_shape))).reshape(mesh_shape)
  order = [mesh_axes.index(a) for a in group_axes]
  rest = [i for i in range(len(mesh_axes)) if i not in order]
  moved = np.transpose(rank_grid, rest + order)
  return [list(g) for g in moved.reshape(-1, int(np.prod([mesh_shape[i] for i in order])))]


def _expected(collective, kwargs, rows, groups) -> list[np.ndarray]:
  kwargs = {k: v for k, v in kwargs.items() if k != "algorithm"}
  out = [None] * len(rows)
  for group in groups:
    xs = [rows[g] for g in group]
    ys = getattr(reference, collective)(xs, **kwargs)
    for g, y in zip(group, ys, strict=True):
      out[g] = y
  return out


def check_mesh(mesh, info) -> tuple[int, list[str]]:
  axes = tuple(mesh.axis_names)
  shape = tuple(mesh.devices.shape)
  n = mesh.devices.size
  spec = P(axes if len(axes) > 1 else axes[0])
  sharding = NamedSharding(mesh, spec)
  cases = _cases(axes)
  host = _inputs(n)

  def body(local):
    local = {k: v[0] for k, v in local.items()}
    out = {}
    for name, (collective, group_axes, kwargs) in cases.items():
      x = local[_input_name(name, collective)]
      fn = getattr(jaxcoll, collective)
      out[name] = fn(x, group_axes if len(group_axes) > 1 else group_axes[0], **kwargs)
    return {k: v[None] for k, v in out.items()}

  global_in = {
    k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
    for k, v in host.items()
  }
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
  out = f(global_in)

  problems = []
  # Each process holds the rows of its own devices (node = process).
  if len(axes) == 2:
    mine = sorted(s.index[0].start for s in out["all_reduce/native"].addressable_shards)
    local = shape[1]
    want = list(range(info.process_id * local, (info.process_id + 1) * local))
    if mine != want:
      problems.append(f"{axes}: process {info.process_id} holds ranks {mine}, want {want}")
  gathered = multihost_utils.process_allgather(out, tiled=True)
  checks = 0
  for name, (collective, group_axes, kwargs) in cases.items():
    rows = host[_input_name(name, collective)]
    want = _expected(collective, kwargs, list(rows), _groups(shape, axes, group_axes))
    got = np.asarray(gathered[name])
    for rank in range(n):
      checks += 1
      if got[rank].shape != want[rank].shape or not np.array_equal(got[rank], want[rank]):
        problems.append(
          f"{axes} {name}: rank {rank} got {got[rank].tolist()}, "
          f"want {np.asarray(want[rank]).tolist()}"
        )
  return checks, problems


def main() -> int:
  start = time.monotonic()
  info = distributed.initialize()
  again = distributed.initialize()
  problems = [] if again is info else ["initialize() twice returned a new ClusterInfo"]
  devices_per_process = jax.local_device_count()
  if jax.process_count() != info.num_processes:
    problems.append(f"jax.process_count()={jax.process_count()}, info={info}")
  meshes = [jaxcoll.devices.node_local_mesh(), jaxcoll.devices.flat_mesh()]
  if tuple(meshes[0].devices.shape) != (info.num_processes, devices_per_process):
    problems.append(f"node_local_mesh shape {meshes[0].devices.shape}")
  checks = 0
  for mesh in meshes:
    c, p = check_mesh(mesh, info)
    checks += c
    problems += p
  for p in itertools.islice(problems, 20):
    print(f"MISMATCH {p}", file=sys.stderr)
  jobs.say_result(json.dumps({
      "process_id": info.process_id,
      "num_processes": info.num_processes,
      "method": info.method,
      "devices_per_process": devices_per_process,
      "global_devices": jax.device_count(),
      "checks": checks,
      "mismatches": len(problems),
      "seconds": round(time.monotonic() - start, 2),
  }))
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main())
