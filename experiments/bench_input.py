r"""Input pipeline throughput vs the training step: is the loader ever the bottleneck?

    python -m experiments.bench_input
    python -m experiments.bench_input --config=configs/recommender_2x4.py --shard_by=record \
        --examples=16384 --batches=50

Writes the config's synthetic rows as Parquet shards (or reads `--shards`), then
measures (1) the examples/s one process's grain loader delivers (process 0 of
`--processes`, its B/P rows per batch, the same reads a real run makes) and
(2) the examples/s of the config's training step on this machine's devices, per
process (B / step time / P). Prints both and their ratio; the loader should be
>= 3x the step. Bad input: one line on stderr, exit 2.
"""

from __future__ import annotations

import os
import tempfile
import time

os.environ.setdefault("JAXCOLL_CPU_DEVICES", "8")

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from experiments import _cli  # noqa: E402

_REPO = _cli.use_shipped_configs("bench_input")  # --config=NAME: a shipped one
try:
  _CONFIG = config_flags.DEFINE_config_file(
      "config", os.path.join(_REPO, "configs", "recommender_2x4.py"),
      "Training config (its model, batch size and generator).", lock_config=True)
except (KeyError, AttributeError, ValueError, TypeError, OSError) as e:
  _cli.fail("bench_input", _cli.explain_config_error(e))
_SHARDS = flags.DEFINE_string("shards", "", "Glob of existing shards (default: write them).")
_EXAMPLES = flags.DEFINE_integer("examples", 16384, "Rows to write when --shards is empty.")
_NUM_SHARDS = flags.DEFINE_integer("num_shards", 4, "Shards to write.")
_ROW_GROUP = flags.DEFINE_integer("row_group_size", 1024, "Parquet rows per row group written.")
_FORMAT = flags.DEFINE_enum("format", "parquet", ["parquet", "array_record"], "Shard format.")
_SHARD_BY = flags.DEFINE_enum("shard_by", "file", ["record", "file"], "How processes shard.")
_PROCESSES = flags.DEFINE_integer("processes", 2, "Process count the loader shards for.")
_BATCHES = flags.DEFINE_integer("batches", 50, "Batches to time the loader on.")
_STEPS = flags.DEFINE_integer("steps", 20, "Training steps to time.")


def loader_rate(pattern: str, config) -> tuple[float, int]:
  """(examples/s, local batch) of process 0's loader over ``--batches`` batches."""
  from jaxcoll.data import files as data_files  # noqa: PLC0415

  loader = data_files.FileData(
      pattern, int(config.global_batch_size), shard_by=_SHARD_BY.value, seed=0,
      process_index=0, process_count=_PROCESSES.value,
      num_threads=int(config.data.num_threads), prefetch=int(config.data.prefetch),
  )
  it = loader.iterator()
  next(it)  # start-up (threads, first row groups) is not throughput
  t0 = time.perf_counter()
  for _ in range(_BATCHES.value):
    next(it)
  elapsed = time.perf_counter() - t0
  return _BATCHES.value * loader.local_batch_size / elapsed, loader.local_batch_size


def step_rate(config) -> float:
  """Examples/s of the config's training step on this machine's devices."""
  import jax  # noqa: PLC0415

  from jaxcoll import data, models  # noqa: PLC0415
  from jaxcoll.runtime import devices  # noqa: PLC0415
  from jaxcoll.run import inputs, loop  # noqa: PLC0415

  mesh = devices.flat_mesh()
  workload = inputs.make_workload(config)
  trainer = loop.Trainer(models.fixed_key(workload.loss_fn), loop.build_optimizer(config), mesh,
                         loop.build_strategy(config, "data"), has_aux=True)
  state = trainer.init(workload.init_params(0))
  gbs = int(config.global_batch_size)
  batches = [data.global_batch(workload.dataset, s, gbs, mesh) for s in range(_STEPS.value + 2)]
  for b in batches[:2]:  # compile and warm up
    state, m = trainer.step(state, b)
  jax.block_until_ready(m["loss"])
  t0 = time.perf_counter()
  for b in batches[2:]:
    state, m = trainer.step(state, b)
  jax.block_until_ready(m["loss"])
  return _STEPS.value * gbs / (time.perf_counter() - t0)


def main(argv):
  _cli.no_positional("bench_input", argv)
  import numpy as np  # noqa: PLC0415

  from jaxcoll.data import sources as data_sources  # noqa: PLC0415
  from jaxcoll import models  # noqa: PLC0415

  config = _CONFIG.value
  try:
    config.mesh_shape, config.mesh_axes = "", ""  # the step on one process's devices
    if config.strategy == "dp" and config.algorithm == "hierarchical":
      config.algorithm = "auto"  # one process: no node axis
    pattern = _SHARDS.value
    with tempfile.TemporaryDirectory() as tmp:
      if not pattern:
        w = models.make_workload(config.model, **dict(config.model_overrides))
        rows = w.dataset.examples(np.arange(_EXAMPLES.value))
        paths = data_sources.write_shards(rows, tmp, num_shards=_NUM_SHARDS.value,
                                          fmt=_FORMAT.value, prefix="train",
                                          row_group_size=_ROW_GROUP.value)
        pattern = paths
      loader, local = loader_rate(pattern, config)
    step = step_rate(config)
  except ValueError as e:
    _cli.fail("bench_input", str(e))
  procs = _PROCESSES.value
  print(f"model {config.model}, global batch {config.global_batch_size}, {procs} processes "
        f"x {local} rows, shard_by={_SHARD_BY.value}, {_FORMAT.value}")
  print(f"loader, one process:        {loader:12,.0f} examples/s")
  print(f"training step, per process: {step / procs:12,.0f} examples/s "
        f"({step:,.0f} on this machine's devices)")
  print(f"loader / step:              {loader / (step / procs):12.1f}x")


if __name__ == "__main__":
  app.run(main, flags_parser=_cli.flags_parser("bench_input"))
