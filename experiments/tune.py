r"""Autotuner: measure every algorithm, write the tuning table `auto` reads.

    python -m experiments.tune --out=/tmp/table.json
    python -m experiments.tune --collectives=all_reduce --group_sizes=2,4,8 \
        --min_bytes=4K --max_bytes=64M --out=/tmp/table.json --json=/tmp/rows.json

For each collective and group size (one-axis sub-meshes of the devices), it
runs the benchmark harness (jaxcoll/observe/bench.py) over the size sweep for every
algorithm, keeps the fastest per size (native when within 3%), fits the
alpha/beta/gamma of this platform's topology preset
(:func:`jaxcoll.tuning.platform_topology`: `cpu-sim` on CPU, `dgx-h100` on
GPU, ...) to the ppermute algorithms' timings by non-negative least squares,
prints the table and the fit's median prediction error, and writes the table
to ``--out`` (required; use it with `jaxcoll.tuning.use(path)`). The shipped
table (`jaxcoll/comm_model/tuning_tables/<kind>.json`) changes only when ``--out`` names
it. Without accelerators it emulates ``JAXCOLL_CPU_DEVICES`` CPU devices
(default 8).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAXCOLL_CPU_DEVICES", "8")

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from experiments import _cli  # noqa: E402
from jaxcoll.observe import bench  # noqa: E402
from jaxcoll.runtime import devices, distributed  # noqa: E402
from jaxcoll.comm_model import tuning  # noqa: E402
from jaxcoll.collectives import COLLECTIVES  # noqa: E402
from jaxcoll.sizes import human_bytes  # noqa: E402
from jaxcoll.comm_model.topology import Topology  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("collectives", list(COLLECTIVES), "Collectives to tune.")
flags.DEFINE_list("group_sizes", None, "Group sizes to tune (default: all devices).")
flags.DEFINE_string("min_bytes", "4K", "Smallest size (K/M/G suffixes).")
flags.DEFINE_string("max_bytes", "64M", "Largest size.")
flags.DEFINE_integer("step_factor", 4, "Size step factor (>= 2).")
flags.DEFINE_string("dtype", "float32", "Element type measured.")
flags.DEFINE_integer("iters", 10, "Timed calls per (algorithm, size).")
flags.DEFINE_integer("warmup_iters", 2, "Untimed calls before them.")
flags.DEFINE_string("out", None, "Where to write the tuning table (required), e.g. /tmp/t.json.")
flags.mark_flag_as_required("out")
flags.DEFINE_string("json", None, "Also write the raw benchmark rows here.")


def _fail(message: str) -> None:
  _cli.fail("tune", message)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  distributed.initialize()
  n_all = len(jax.devices())
  try:
    sizes = bench.size_sweep(FLAGS.min_bytes, FLAGS.max_bytes, FLAGS.step_factor)
    groups = []
    for g in FLAGS.group_sizes or [str(n_all)]:
      size = _cli.whole_number(g)
      if size is None or not 1 < size <= n_all:
        raise ValueError(
            f"`--group_sizes` has {g!r}; each group size must be an integer in 2..{n_all} "
            "(the devices), e.g. --group_sizes=2,4")
      groups.append(size)
    for c in FLAGS.collectives:
      if c not in COLLECTIVES:
        raise ValueError(f"unknown collective {c!r}; valid: {', '.join(COLLECTIVES)}")
    # Before measuring: a path that cannot be written lost the table after every measurement.
    _cli.writable_file("out", FLAGS.out, "tuning.json")
    if FLAGS.json is not None:
      _cli.writable_file("json", FLAGS.json, "rows.json")
    for g in groups:  # every case checked before anything runs
      for collective in FLAGS.collectives:
        bench.cases(collective, "all", sizes, n=g, num_axes=1, dtype=FLAGS.dtype, op="sum",
                    root=0, iters=FLAGS.iters, warmup_iters=FLAGS.warmup_iters)
  except ValueError as e:
    _fail(str(e))
  rows = []
  for g in groups:
    mesh = devices.flat_mesh(g)
    for collective in FLAGS.collectives:
      measured = bench.run_benchmark(
          collective, "all", sizes, dtype=FLAGS.dtype, iters=FLAGS.iters,
          warmup_iters=FLAGS.warmup_iters, mesh=mesh,
          progress=bench.ProgressLine() if sys.stderr.isatty() else None,
      )
      if bench.total_wrong(measured):
        _fail(f"{collective} on {g} devices gave wrong values; not writing a table")
      for r in bench.to_dicts(measured):
        rows.append(dict(r, group_size=g))
  kind = tuning.device_kind()
  try:
    fitted, error = tuning.fit_topology(rows, tuning.platform_topology())
  except ValueError as e:  # too few ppermute rows: the table is still useful
    print(f"tune: no cost-model fit ({e})", file=sys.stderr)
    fitted, error = None, None
  table = tuning.TuningTable(kind, tuning.table_from_measurements(rows), fitted)
  if jax.process_index() == 0:
    tuning.save(table, FLAGS.out)
    if FLAGS.json is not None:
      with open(FLAGS.json, "w") as f:
        json.dump(rows, f, indent=1)
    _print(table, fitted, error)


def _print(table: tuning.TuningTable, fitted: Topology | None, error: float | None) -> None:
  print(f"# tuning table for device kind {table.device_kind!r} -> {FLAGS.out}")
  for collective, by_size in table.entries.items():
    for n, by_dtype in by_size.items():
      for dtype, ranges in by_dtype.items():
        low = 0
        for r in ranges:
          high = "inf" if r["max_bytes"] is None else human_bytes(r["max_bytes"])
          print(f"{collective:<15} n={n:<3} {dtype:<9} {human_bytes(low):>8} .. "
                f"{high:<8} {r['algorithm']}")
          low = r["max_bytes"] or 0
  if fitted is None:
    return
  level = fitted.levels[-1]
  print(f"# fitted {fitted.name}: alpha {level.latency_s * 1e6:.1f} us, "
        f"beta {level.bandwidth_Bps / 1e9:.3f} GB/s, gamma {level.reduce_Bps / 1e9:.3f} GB/s, "
        f"launch {fitted.launch_s * 1e6:.1f} us (fastest native call)")
  print(f"# median prediction error of the fitted model: {error:.1%}")


if __name__ == "__main__":
  app.run(main, flags_parser=_cli.flags_parser("tune"))
