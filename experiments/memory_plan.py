"""Per-device memory of DP and ZeRO-1/2/3 before launch: formula vs XLA.

    python -m experiments.memory_plan --model=mlp --devices=8

Prints :func:`jaxcoll.memory.plan`'s table: the ZeRO paper's model-state
formula (float32 params and grads, K from the optimizer), the state each
device holds, and XLA's memory analysis of the compiled step.
"""

from __future__ import annotations

import os

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "mlp", "A jaxcoll.models workload name.")
_WIDTHS = flags.DEFINE_list("widths", ["512", "512"], "MLP hidden widths (model=mlp).")
_DEVICES = flags.DEFINE_integer("devices", 8, "Data-parallel devices (emulated on CPU).")
_BATCH = flags.DEFINE_integer("batch_size", 256, "Global batch size.")


def main(argv):
  del argv
  os.environ.setdefault("JAXCOLL_CPU_DEVICES", str(_DEVICES.value))
  import optax  # noqa: PLC0415

  import jaxcoll  # noqa: PLC0415
  from jaxcoll import memory, models  # noqa: PLC0415
  from jaxcoll.train import DataParallel, Trainer, ZeRO  # noqa: PLC0415

  overrides = {"widths": tuple(int(w) for w in _WIDTHS.value)} if _MODEL.value == "mlp" else {}
  workload = models.make_workload(_MODEL.value, **overrides)
  mesh = jaxcoll.devices.flat_mesh(_DEVICES.value)
  strategies = [DataParallel(), ZeRO(stage=1), ZeRO(stage=2), ZeRO(stage=3)]
  trainers = [
    Trainer(workload.loss_fn, optax.adam(1e-3), mesh, s, has_aux=True) for s in strategies
  ]
  params = workload.init_params(0)
  print(memory.plan(trainers, params, workload.make_batch(0, _BATCH.value)))


if __name__ == "__main__":
  app.run(main)
