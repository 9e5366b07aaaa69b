r"""ZeRO's exact update of a mixing optimizer against the per-row (elementwise) update.

    python -m experiments.zero_exact --devices=8 --width=1024 --layers=4 --steps=10

An MLP of ``--layers`` square ``--width`` layers on ``--devices`` emulated CPU devices,
under ZeRO-``--stage`` (1, 2 and 3 by default), with ``optax.adamw`` (elementwise: each
device updates its rows inside shard_map) and with optimizers that reduce across
elements (``clip_by_global_norm`` in the chain, LAMB, adafactor: the update runs on the
full-shaped leaves under GSPMD, ``plan.updates_globally``). Prints, per (stage,
optimizer): the median step time of ``--steps`` steps after 2 warm-up steps (waiting for
each), the train state's bytes per device and XLA's per-device peak of the compiled step
(``memory_analysis()``: args + outputs - alias + temp), against the model's float32 bytes.
"""

from __future__ import annotations

import os
import statistics
import time

from absl import app, flags

_DEVICES = flags.DEFINE_integer("devices", 8, "Emulated CPU devices.")
_WIDTH = flags.DEFINE_integer("width", 1024, "Width of each square layer.")
_LAYERS = flags.DEFINE_integer("layers", 4, "Number of layers.")
_BATCH = flags.DEFINE_integer("batch", 64, "Global batch (a multiple of --devices).")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per run.")
_STAGES = flags.DEFINE_list("stages", ["1", "2", "3"], "ZeRO stages to run.")


def main(argv):
  del argv
  os.environ["JAXCOLL_CPU_DEVICES"] = str(_DEVICES.value)
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  import optax  # noqa: PLC0415

  import jaxcoll  # noqa: PLC0415

  width, layers = _WIDTH.value, _LAYERS.value
  rng = np.random.default_rng(0)
  params = {f"layer{k}": {"w": (rng.normal(size=(width, width)) / np.sqrt(width)).astype(
    np.float32), "b": np.zeros(width, np.float32)} for k in range(layers)}
  model_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))

  def loss(p, batch):
    h = batch["x"]
    for k in range(layers):
      h = jnp.tanh(h @ p[f"layer{k}"]["w"] + p[f"layer{k}"]["b"])
    return jnp.mean((h - batch["y"]) ** 2)

  batch = {"x": rng.normal(size=(_BATCH.value, width)).astype(np.float32),
           "y": rng.normal(size=(_BATCH.value, width)).astype(np.float32)}
  optimizers = {
    "adamw (elementwise)": optax.adamw(1e-3),
    "clip+adamw (exact)": optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    "lamb (exact)": optax.lamb(1e-3),
    "adafactor (exact)": optax.adafactor(1e-3),
  }
  mesh = jaxcoll.devices.flat_mesh(_DEVICES.value)
  print(f"{_DEVICES.value} devices, {layers} x {width}^2 MLP ({model_bytes / 2**20:.1f} MiB "
        f"float32 params), global batch {_BATCH.value}, median of {_STEPS.value} steps")
  print(f"{'stage':<6} {'optimizer':<22} {'path':<7} {'ms/step':>9} {'state MiB/dev':>14} "
        f"{'peak MiB/dev':>13}")
  for stage in (int(s) for s in _STAGES.value):
    for name, optimizer in optimizers.items():
      trainer = jaxcoll.Trainer(loss, optimizer, mesh, jaxcoll.ZeRO(stage=stage))
      state = trainer.init(params)
      stats = trainer.compile_step(state, batch).memory_analysis()
      peak = (stats.argument_size_in_bytes + stats.output_size_in_bytes
              - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
      state_bytes = trainer.state_bytes_per_device(state)
      times = []
      for k in range(_STEPS.value + 2):
        start = time.perf_counter()
        state, metrics = trainer.step(state, batch)
        jax.block_until_ready(metrics["loss"])
        if k >= 2:
          times.append(time.perf_counter() - start)
      path = "global" if trainer._plan.updates_globally else "rows"  # noqa: SLF001
      print(f"{stage:<6} {name:<22} {path:<7} {1e3 * statistics.median(times):9.2f} "
            f"{state_bytes / 2**20:14.2f} {peak / 2**20:13.2f}")


if __name__ == "__main__":
  app.run(main)
