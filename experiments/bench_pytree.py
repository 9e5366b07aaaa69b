"""Compile and step time of a pytree all_reduce: packed buffers vs leaf by leaf.

    python -m experiments.bench_pytree --leaves=10,100,300 --mbytes=8 --json=out/bench_pytree.json

A tree of ``--leaves`` float32 leaves of mixed sizes (log-uniform, from a bias of
16 numbers to matrices, ``--mbytes`` MB in all per device, as a model's
gradients) is all-reduced over 8 emulated CPU devices with each of
``--algorithms``: packed (the default: one buffer per dtype of at most
``jaxcoll.collectives.DEFAULT_BUCKET_BYTES``) and leaf by leaf
(``bucket_bytes=0``, the behaviour before packing); ``native`` is one XLA
all-reduce per leaf that XLA combines itself (mode ``xla``). Prints a table (seconds, and each
as a ratio to native's) and optionally writes JSON.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time

from absl import app, flags

from experiments import _cli

os.environ.setdefault("JAXCOLL_CPU_DEVICES", "8")

_LEAVES = flags.DEFINE_list("leaves", ["10", "100", "300"], "Leaf counts of the tree.")
_MBYTES = flags.DEFINE_float("mbytes", 8.0, "Total size of the tree per device (MB).")
_ALGORITHMS = flags.DEFINE_list("algorithms", ["ring", "tree", "native"],
                                "all_reduce algorithms (jaxcoll.algorithms('all_reduce')).")
_ITERS = flags.DEFINE_integer("iters", 5, "Timed steps (after one warm-up); the median is shown.")
_JSON = flags.DEFINE_string("json", None, "Write the rows to this JSON file.")


def leaf_sizes(leaves: int, total_bytes: int, seed: int = 0) -> list[int]:
  """``leaves`` float32 element counts, log-uniform in [16, 2**18], scaled to ``total_bytes``."""
  import numpy as np  # noqa: PLC0415

  rng = np.random.default_rng(seed)
  raw = np.exp(rng.uniform(np.log(16), np.log(2**18), size=leaves))
  sizes = np.maximum(1, np.round(raw / raw.sum() * total_bytes / 4)).astype(int)
  return [int(s) for s in sizes]


def _tree(sizes):
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  # Larger leaves are matrices (rows of 16), small ones vectors, as in a model.
  return {f"leaf{i:03d}": jax.ShapeDtypeStruct((s // 16, 16) if s % 16 == 0 and s >= 256
                                               else (s,), jnp.float32)
          for i, s in enumerate(sizes)}


def _measure(leaves: int, total_bytes: int, algorithm: str, bucket_bytes: int, iters: int):
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  import jaxcoll  # noqa: PLC0415

  mesh = jaxcoll.devices.flat_mesh(len(jax.devices()))
  shapes = _tree(leaf_sizes(leaves, total_bytes))
  fn = jax.jit(jax.shard_map(
      lambda t: jaxcoll.all_reduce(t, "data", algorithm=algorithm, bucket_bytes=bucket_bytes),
      mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
  t0 = time.perf_counter()
  lowered = fn.lower(shapes)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  tree = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), shapes)
  jax.block_until_ready(compiled(tree))
  steps = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(compiled(tree))
    steps.append(time.perf_counter() - start)
  permutes = lowered.as_text().count("collective_permute")
  return dict(leaves=leaves, algorithm=algorithm, bucket_bytes=bucket_bytes,
              mode="xla" if algorithm == "native" else "packed" if bucket_bytes else "per_leaf",
              collective_permutes=permutes,
              trace_s=t1 - t0, compile_s=t2 - t1, step_s=statistics.median(steps))


def _ratio(row: dict, key: str) -> str:
  return f"{row[key]:>8.1f}" if key in row else f"{'-':>8}"


def main(argv):
  del argv
  counts = [_cli.whole_number(v) or 0 for v in _LEAVES.value]
  if not counts or min(counts) < 1:
    _cli.fail("bench_pytree", f"`--leaves`={','.join(_LEAVES.value)!r}: give leaf counts "
              ">= 1, comma-separated, e.g. --leaves=10,100,300.")
  if not (math.isfinite(_MBYTES.value) and _MBYTES.value > 0):  # inf was an OverflowError
    _cli.fail("bench_pytree", f"`--mbytes`={_MBYTES.value!r}: give the tree's size in MB, > 0.")
  if _ITERS.value < 1:
    _cli.fail("bench_pytree", f"`--iters`={_ITERS.value!r}: give 1 or more timed steps.")
  import jax  # noqa: PLC0415

  import jaxcoll  # noqa: PLC0415
  from jaxcoll.observe import bench  # noqa: PLC0415

  valid = [a for a in jaxcoll.algorithms("all_reduce") if a not in ("hierarchical", "auto")]
  bad = [a for a in _ALGORITHMS.value if a not in valid]
  if bad or not _ALGORITHMS.value:
    _cli.fail("bench_pytree", f"`--algorithms`={','.join(_ALGORITHMS.value)!r}: "
              f"valid choices: {', '.join(valid)}.")
  if _JSON.value is not None:  # before measuring: a --json that cannot be written lost the rows
    try:
      _cli.writable_file("json", _JSON.value, "bench_pytree.json")
    except ValueError as e:
      _cli.fail("bench_pytree", str(e))
  total = int(_MBYTES.value * 2**20)
  try:
    bench.check_tree_memory(total, len(jax.devices()))
  except ValueError as e:
    _cli.fail("bench_pytree", str(e))
  packed = jaxcoll.collectives.DEFAULT_BUCKET_BYTES
  rows = []
  for leaves in counts:
    native = None
    for algorithm in sorted(_ALGORITHMS.value, key=lambda a: a != "native"):
      for bucket_bytes in ((0,) if algorithm == "native" else (0, packed)):
        row = _measure(leaves, total, algorithm, bucket_bytes, _ITERS.value)
        native = native or (row if algorithm == "native" else None)
        if native:
          row["compile_vs_native"] = row["compile_s"] / native["compile_s"]
          row["step_vs_native"] = row["step_s"] / native["step_s"]
        rows.append(row)
  platform = jax.devices()[0].platform.upper()  # "8 CPU devices" was printed on GPUs too
  print(f"{len(jax.devices())} {platform} devices; a tree of {_MBYTES.value:g} MB of float32 per "
        f"device; packed = buffers of <= {packed >> 20} MiB")
  # As wide as the longest name: bidirectional_ring and halving_doubling pushed their rows'
  # columns out of line with the header's (10 wide).
  width = max(10, *(len(r["algorithm"]) for r in rows))
  print(f"{'leaves':>6}  {'algorithm':<{width}} {'mode':<8} {'permutes':>8} {'compile (s)':>11} "
        f"{'x native':>8} {'step (ms)':>9} {'x native':>8}")
  for r in rows:
    print(f"{r['leaves']:>6}  {r['algorithm']:<{width}} {r['mode']:<8} "
          f"{r['collective_permutes']:>8} "
          f"{r['compile_s']:>11.2f} {_ratio(r, 'compile_vs_native')} {r['step_s'] * 1e3:>9.2f} "
          f"{_ratio(r, 'step_vs_native')}")
  if _JSON.value:
    os.makedirs(os.path.dirname(_JSON.value) or ".", exist_ok=True)
    with open(_JSON.value, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  app.run(main, flags_parser=_cli.flags_parser("bench_pytree"))
