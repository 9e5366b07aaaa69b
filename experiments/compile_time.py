"""Trace + compile time of every all_reduce algorithm at several group sizes.

    python -m experiments.compile_time --devices=8,64 --json=out/compile_time.json

Each device count runs in a fresh subprocess (the CPU simulation mode is fixed
when JAX starts). Prints a table (seconds) and optionally writes JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from absl import app, flags

from experiments import _cli

_DEVICES = flags.DEFINE_list("devices", ["8", "64"], "Emulated device counts.")
_BYTES = flags.DEFINE_integer("bytes", 1 << 20, "Message size per device (bytes).")
_JSON = flags.DEFINE_string("json", None, "Write the rows to this JSON file.")
_CHILD = flags.DEFINE_integer("child", 0, "Internal: measure with this many devices.")


def _measure(n: int, nbytes: int) -> list[dict]:
  os.environ["JAXCOLL_CPU_DEVICES"] = str(n)
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  import jaxcoll  # noqa: PLC0415
  from jaxcoll.observe import bench  # noqa: PLC0415

  rows = []
  for two_level in (False, True):
    mesh = jaxcoll.devices.node_local_mesh() if two_level else jaxcoll.devices.flat_mesh(n)
    axes = mesh.axis_names if two_level else "data"
    for algo in jaxcoll.algorithms("all_reduce"):
      if algo == "auto" or (algo == "hierarchical") != two_level:
        continue
      fn = bench.program("all_reduce", algo, mesh, axes)
      x = jax.ShapeDtypeStruct((n * nbytes // 4,), jnp.float32)
      t0 = time.perf_counter()
      lowered = fn.lower(x)
      t1 = time.perf_counter()
      lowered.compile()
      t2 = time.perf_counter()
      rows.append(
          dict(devices=n, algorithm=algo, trace_s=t1 - t0, compile_s=t2 - t1)
      )
  return rows


def main(argv):
  del argv
  if _CHILD.value:
    print(json.dumps(_measure(_CHILD.value, _BYTES.value)))
    return
  counts = [_cli.whole_number(d) or 0 for d in _DEVICES.value]
  if not counts or min(counts) < 1:
    _cli.fail("compile_time", f"`--devices`={','.join(_DEVICES.value)!r}: give device counts "
              ">= 1, comma-separated, e.g. --devices=8,64.")
  if _JSON.value is not None:  # before measuring: a --json that cannot be written lost the rows
    try:
      _cli.writable_file("json", _JSON.value, "compile_time.json")
    except ValueError as e:
      _cli.fail("compile_time", str(e))
  rows = []
  for n in counts:
    out = subprocess.run(
        [sys.executable, "-m", "experiments.compile_time", f"--child={n}",
         f"--bytes={_BYTES.value}"],
        check=True, capture_output=True, text=True,
    )
    rows += json.loads(out.stdout.strip().splitlines()[-1])
  print(f"{'devices':>7}  {'algorithm':<20} {'trace (s)':>9} {'compile (s)':>11}")
  for r in rows:
    print(f"{r['devices']:>7}  {r['algorithm']:<20} {r['trace_s']:>9.3f} {r['compile_s']:>11.3f}")
  if _JSON.value:
    os.makedirs(os.path.dirname(_JSON.value) or ".", exist_ok=True)
    with open(_JSON.value, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  app.run(main, flags_parser=_cli.flags_parser("compile_time"))
