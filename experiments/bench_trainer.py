"""Step time of jaxcoll's trainers against the idiomatic JAX baselines.

    python -m experiments.bench_trainer --steps=30 --warmup=5 --json=out/bench_trainer.json

Runs DP (native), DP (ring), ZeRO-1/2/3 and the GSPMD baselines
(``jax.jit`` + ``NamedSharding``: replicated params for DP, params sharded over
the data axis for FSDP) on the same model, mesh and batches, waiting for every
step (bounded work in flight). Prints median ms/step and the ratio to the
matching baseline (DP -> GSPMD DP, ZeRO -> GSPMD FSDP); writes JSON.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from experiments import _cli
from experiments import _workload_flags as wf

_PROG = "bench_trainer"

_STEPS = flags.DEFINE_integer("steps", 30, "Timed steps per trainer.")
_WARMUP = flags.DEFINE_integer("warmup", 5, "Untimed steps first (compile, caches).")
_JSON = flags.DEFINE_string("json", None, "Write the rows to this JSON file.")


def main(argv):
  del argv
  workload, mesh = wf.workload_and_mesh(_PROG)
  import optax  # noqa: PLC0415

  from jaxcoll.train import DataParallel, Trainer, ZeRO, baselines  # noqa: PLC0415

  params = workload.init_params(0)
  batches = baselines.data_sharded(
    [workload.make_batch(i, wf.BATCH.value) for i in range(4)], mesh, "data"
  )
  optimizer = optax.adam(1e-3)
  runs = {
    "GSPMD DP": baselines.GspmdTrainer(workload.loss_fn, optimizer, mesh, has_aux=True),
    "GSPMD FSDP": baselines.GspmdTrainer(
      workload.loss_fn, optimizer, mesh, fsdp=True, has_aux=True
    ),
  }
  for name, strategy in {
    "DP (native)": DataParallel(algorithm="native"),
    "DP (ring)": DataParallel(algorithm="ring"),
    "ZeRO-1": ZeRO(stage=1, algorithm="native"),
    "ZeRO-2": ZeRO(stage=2, algorithm="native"),
    "ZeRO-3": ZeRO(stage=3, algorithm="native"),
  }.items():
    runs[name] = Trainer(workload.loss_fn, optimizer, mesh, strategy, has_aux=True)

  rows = []
  for name, trainer in runs.items():
    _, times = baselines.time_steps(
      trainer, trainer.init(params), batches, warmup=_WARMUP.value, steps=_STEPS.value
    )
    rows.append({"trainer": name, "median_ms": baselines.median_ms(times)})
  by_name = {r["trainer"]: r["median_ms"] for r in rows}
  for r in rows:
    sharded = r["trainer"].startswith(("ZeRO", "GSPMD FSDP"))
    base = "GSPMD FSDP" if sharded else "GSPMD DP"
    r["baseline"] = base
    r["ratio"] = r["median_ms"] / by_name[base]

  print(
    f"{workload.name} ({workload.num_params:,} params), {wf.DEVICES.value} devices, global "
    f"batch {wf.BATCH.value}, median of {_STEPS.value} steps after {_WARMUP.value} warm-up"
  )
  print(f"{'trainer':<12} {'ms/step':>9}  {'vs':<11} {'ratio':>6}")
  for r in rows:
    print(f"{r['trainer']:<12} {r['median_ms']:9.2f}  {r['baseline']:<11} {r['ratio']:6.3f}")
  if _JSON.value:
    os.makedirs(os.path.dirname(_JSON.value) or ".", exist_ok=True)
    config = {
      "model": wf.MODEL.value,
      "devices": wf.DEVICES.value,
      "batch_size": wf.BATCH.value,
      "steps": _STEPS.value,
      "warmup": _WARMUP.value,
      "num_params": workload.num_params,
    }
    with open(_JSON.value, "w") as f:
      json.dump({"config": config, "rows": rows}, f, indent=2)


if __name__ == "__main__":
  app.run(main, flags_parser=_cli.flags_parser(_PROG))
