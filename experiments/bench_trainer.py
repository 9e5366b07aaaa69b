"""Step time and peak memory of jaxcoll's trainers against the idiomatic JAX baselines.

    python -m experiments.bench_trainer --steps=30 --warmup=5 --json=out/bench_trainer.json

Runs DP (native), DP (ring), ZeRO-1/2/3 and the GSPMD baselines
(``jax.jit`` + ``NamedSharding``: replicated params for DP; for FSDP params,
gradients and Adam state sharded over the data axis, see
:mod:`jaxcoll.train.baselines`) on the ``--model`` workload, then DP
(native), ZeRO-3, GSPMD DP and GSPMD FSDP on a scanned transformer
(``--scanned_layers`` layers of ``--scanned_d_model``; 0 layers skips it),
on the same mesh and batches, waiting for every step (bounded work in
flight). Prints median ms/step, the ratio to the matching baseline (DP ->
GSPMD DP, ZeRO -> GSPMD FSDP) and XLA's peak memory per device of each
compiled step (``memory_analysis()``: args + outputs - alias + temp);
writes JSON.
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
_SCANNED_LAYERS = flags.DEFINE_integer(
  "scanned_layers", 8, "Layers of the scanned transformer run (0: skip it)."
)
_SCANNED_D_MODEL = flags.DEFINE_integer("scanned_d_model", 64, "d_model of the scanned run.")


def _peak_bytes(trainer, state, batch) -> int:
  stats = trainer.compile_step(state, batch).memory_analysis()
  return int(
    stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
    + stats.temp_size_in_bytes
  )


def _bench(workload, mesh, names, files=True) -> list[dict]:
  import optax  # noqa: PLC0415

  from jaxcoll.models import fixed_key  # noqa: PLC0415
  from jaxcoll.train import DataParallel, Trainer, ZeRO, baselines  # noqa: PLC0415

  params = workload.init_params(0)
  loss_fn = fixed_key(workload.loss_fn)  # a dropout model in training mode
  batches = baselines.data_sharded(wf.batches_of(workload, wf.BATCH.value, 4, files=files), mesh, "data")
  optimizer = optax.adam(1e-3)
  make = {
    "GSPMD DP": lambda: baselines.GspmdTrainer(loss_fn, optimizer, mesh, has_aux=True),
    "GSPMD FSDP": lambda: baselines.GspmdTrainer(
      loss_fn, optimizer, mesh, fsdp=True, has_aux=True
    ),
  }
  strategies = {
    "DP (native)": DataParallel(algorithm="native"),
    "DP (ring)": DataParallel(algorithm="ring"),
    "ZeRO-1": ZeRO(stage=1, algorithm="native"),
    "ZeRO-2": ZeRO(stage=2, algorithm="native"),
    "ZeRO-3": ZeRO(stage=3, algorithm="native"),
  }
  for name, strategy in strategies.items():
    make[name] = lambda s=strategy: Trainer(loss_fn, optimizer, mesh, s, has_aux=True)

  rows = []
  for name in names:
    trainer = make[name]()
    state = trainer.init(params)
    peak = _peak_bytes(trainer, state, batches[0])
    _, times = baselines.time_steps(
      trainer, state, batches, warmup=_WARMUP.value, steps=_STEPS.value
    )
    rows.append({
      "workload": f"{workload.name}{' (scanned)' if workload.config.get('scan_layers') else ''}",
      "num_params": workload.num_params,
      "trainer": name,
      "median_ms": baselines.median_ms(times),
      "peak_mb": peak / 1e6,
    })
    if hasattr(trainer, "layout") and trainer.fsdp:  # what the baseline padded or replicated
      rows[-1]["layout"] = trainer.layout(params).summary()
  by_name = {r["trainer"]: r for r in rows}
  for r in rows:
    sharded = r["trainer"].startswith(("ZeRO", "GSPMD FSDP"))
    base = by_name["GSPMD FSDP" if sharded else "GSPMD DP"]
    r["baseline"] = base["trainer"]
    r["ratio"] = r["median_ms"] / base["median_ms"]
    r["peak_ratio"] = r["peak_mb"] / base["peak_mb"]
  return rows


def main(argv):
  del argv
  workload, mesh = wf.workload_and_mesh(_PROG)
  try:
    if _JSON.value is not None:  # before timing: a --json that cannot be written lost the rows
      _cli.writable_file("json", _JSON.value, "bench_trainer.json")
    wf.batch_of(workload, wf.BATCH.value)  # a model trained only on files needs --data
  except ValueError as e:
    _cli.fail(_PROG, str(e))
  import jaxcoll  # noqa: PLC0415

  all_names = ("GSPMD DP", "GSPMD FSDP", "DP (native)", "DP (ring)", "ZeRO-1", "ZeRO-2", "ZeRO-3")
  runs = [(workload, all_names)]
  if _SCANNED_LAYERS.value > 0:
    d_model = _SCANNED_D_MODEL.value
    scanned = jaxcoll.models.make_workload(
      "transformer", num_layers=_SCANNED_LAYERS.value, d_model=d_model, scan_layers=True,
      num_heads=next(h for h in (8, 4, 2, 1) if d_model % h == 0),
    )
    runs.append((scanned, ("GSPMD DP", "GSPMD FSDP", "DP (native)", "ZeRO-3")))
  # The scanned transformer reads its own synthetic set, not --model's --data files.
  rows = [row for w, names in runs for row in _bench(w, mesh, names, files=w is workload)]

  print(
    f"{wf.DEVICES.value} devices, global batch {wf.BATCH.value}, median of {_STEPS.value} steps "
    f"after {_WARMUP.value} warm-up; peak = XLA memory_analysis per device "
    "(args + outputs - alias + temp)"
  )
  header = f"{'workload':<28} {'trainer':<12} {'ms/step':>9}  {'vs':<11} {'ratio':>6}"
  print(f"{header} {'peak MB':>9} {'peak ratio':>10}")
  for r in rows:
    label = f"{r['workload']} {r['num_params'] / 1e6:.2f}M"
    print(
      f"{label:<28} {r['trainer']:<12} {r['median_ms']:9.2f}  {r['baseline']:<11} "
      f"{r['ratio']:6.3f} {r['peak_mb']:9.2f} {r['peak_ratio']:10.3f}"
    )
  for r in rows:
    if "layout" in r:
      print(f"{r['workload']}: {r['layout']}")
  if _JSON.value:
    os.makedirs(os.path.dirname(_JSON.value) or ".", exist_ok=True)
    config = {
      "model": wf.MODEL.value,
      "devices": wf.DEVICES.value,
      "batch_size": wf.BATCH.value,
      "steps": _STEPS.value,
      "warmup": _WARMUP.value,
      "num_params": workload.num_params,
      "scanned_layers": _SCANNED_LAYERS.value,
      "scanned_d_model": _SCANNED_D_MODEL.value,
    }
    with open(_JSON.value, "w") as f:
      json.dump({"config": config, "rows": rows}, f, indent=2)


if __name__ == "__main__":
  app.run(main, flags_parser=_cli.flags_parser(_PROG))
