"""Per-device memory of DP and ZeRO-1/2/3 before launch: formula vs XLA.

    python -m experiments.memory_plan --model=mlp --devices=8

Prints :func:`jaxcoll.memory.plan`'s table: the ZeRO paper's model-state
formula (float32 params and grads, K from the optimizer), the state each
device holds, and XLA's memory analysis of the compiled step.
"""

from __future__ import annotations

from absl import app

from experiments import _cli
from experiments import _workload_flags as wf

_PROG = "memory_plan"


def main(argv):
  del argv
  workload, mesh = wf.workload_and_mesh(_PROG)
  import optax  # noqa: PLC0415

  from jaxcoll import memory  # noqa: PLC0415
  from jaxcoll.train import DataParallel, Trainer, ZeRO  # noqa: PLC0415

  strategies = [DataParallel(), ZeRO(stage=1), ZeRO(stage=2), ZeRO(stage=3)]
  trainers = [
    Trainer(workload.loss_fn, optax.adam(1e-3), mesh, s, has_aux=True) for s in strategies
  ]
  params = workload.init_params(0)
  print(memory.plan(trainers, params, workload.make_batch(0, wf.BATCH.value)))


if __name__ == "__main__":
  app.run(main, flags_parser=_cli.flags_parser(_PROG))
