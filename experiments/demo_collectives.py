"""Checks, times and analyses every all_reduce algorithm on emulated devices.

    python -m experiments.demo_collectives --bytes=1M

For each algorithm: whether the result equals the numpy reference on every
device, the median time per call, and the bytes each device sends according
to `jaxcoll.analysis.comm_report` next to the textbook volume.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("JAXCOLL_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcoll  # noqa: E402
from experiments import _cli  # noqa: E402
from jaxcoll.observe import bench  # noqa: E402
from jaxcoll.collectives import reference  # noqa: E402
from jaxcoll.sizes import parse_size  # noqa: E402

_BYTES = flags.DEFINE_string("bytes", "1M", "Message size per device (K/M suffix).")
_ITERS = flags.DEFINE_integer("iters", 10, "Timed calls per algorithm.")


def main(argv):
  del argv
  try:
    nbytes = parse_size(_BYTES.value, "--bytes")
  except ValueError as e:
    _cli.fail("demo_collectives", str(e))
  n = len(jax.devices())
  count = max(nbytes // 4, 1)
  two_level = n % 2 == 0 and n > 2
  flat = jaxcoll.devices.flat_mesh(n)
  hier = jaxcoll.devices.node_local_mesh() if two_level else None
  rng = np.random.default_rng(0)
  per_rank = [rng.integers(-8, 8, size=count).astype(np.float32) for _ in range(n)]
  want = reference.all_reduce(per_rank)[0]
  print(f"all_reduce of {count * 4} B per device on {n} devices ({jax.default_backend()})")
  print(f"{'algorithm':<20} {'check':<6} {'time (ms)':>10} {'sent/device':>12} {'textbook':>10}")
  for algo in jaxcoll.algorithms("all_reduce"):
    if algo == "hierarchical" and hier is None:
      continue
    mesh = hier if algo == "hierarchical" else flat
    axes = mesh.axis_names if algo == "hierarchical" else "data"
    fn = bench.program("all_reduce", algo, mesh, axes)
    x = jax.device_put(jnp.asarray(np.concatenate(per_rank)), NamedSharding(mesh, P(axes)))
    out = np.asarray(fn(x)).reshape(n, count)
    ok = all(np.array_equal(row, want) for row in out)
    times = []
    for _ in range(_ITERS.value):  # one call in flight at a time (see BUILD.md)
      t0 = time.perf_counter()
      fn(x).block_until_ready()
      times.append(time.perf_counter() - t0)
    sent = jaxcoll.analysis.comm_report(fn, x).total_bytes_sent_per_device
    book = _textbook(algo, n, count * 4, mesh)
    print(
        f"{algo:<20} {'OK' if ok else 'WRONG':<6} {np.median(times) * 1e3:>10.3f} "
        f"{sent:>12,.0f} {book:>10,.0f}"
    )


def _textbook(algo: str, n: int, s: int, mesh) -> float:
  """Bytes each device sends in the textbook form of the algorithm."""
  if algo == "recursive_doubling":
    p = 1 << (n.bit_length() - 1)
    return np.log2(p) * s + (2 * s if p != n else 0)
  if algo == "tree":
    return 2 * s  # busiest device: root of one tree (log n sends of S/2) + the other
  if algo == "hierarchical":
    m, l = mesh.devices.shape
    return 2 * (l - 1) / l * s + 2 * (m - 1) / m * s / l
  return 2 * (n - 1) / n * s


if __name__ == "__main__":
  app.run(main, flags_parser=_cli.flags_parser("demo_collectives"))
