"""Per-device memory of DP and ZeRO-1/2/3 before launch; the largest model a budget fits.

    python -m experiments.memory_plan --model=mlp --devices=8
    python -m experiments.memory_plan --budget_mb=64 --family=mlp --width=512 --devices=8
    python -m experiments.memory_plan --model=my_pkg.my_model:make --budget_mb=3000
    python -m experiments.memory_plan --model=my_pkg.my_model:make --budget_mb=64 \
        --model_overrides=width=256 --scale=model_overrides.depth

Nothing of any model's size is allocated: every figure comes from compiling the
step on abstract inputs (``Trainer.abstract_state``).

Without ``--budget_mb``: :func:`jaxcoll.memory.plan`'s table for ``--model``
(a jaxcoll model name or your own ``module:function``, as ``--config.model`` of
``experiments.train``; ``--model_overrides=FIELD=VALUE,...`` are its keyword
arguments): the ZeRO paper's model-state formula (float32 params and grads, K
from the optimizer), the state each device holds, XLA's memory analysis of the
compiled step and the predicted peak (:func:`jaxcoll.memory.predict_peak`).

With ``--budget_mb=B`` (MB = 1e6 bytes per device), one of:

* ``--model=...`` and ``--scale=model_overrides.FIELD``: for each strategy,
  the largest integer value of that keyword argument of the model function
  (from 1, up to ``--max_layers``) whose compiled step fits ``B``: doubling,
  then bisection (the peak must grow with it, as it does with depth or width);
* ``--model=...`` alone: whether the model as given fits ``B``, per strategy;
* neither (``--family``): the largest number of layers of ``--width`` in a
  scanned ``--family`` model, per strategy (DP, ZeRO-1/2/3, hybrid ZeRO-3 over
  a (2, N/2) mesh, GSPMD DP and FSDP), and the ratio ZeRO-3 / DP.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

from absl import app, flags

from experiments import _cli
from experiments import _workload_flags as wf

_PROG = "memory_plan"
FAMILIES = ("mlp", "transformer")

_BUDGET = flags.DEFINE_float("budget_mb", None, "Per-device budget in MB (1e6 bytes).")
_FAMILY = flags.DEFINE_string("family", "mlp", f"Model family for --budget_mb: {FAMILIES}.")
_WIDTH = flags.DEFINE_integer("width", 512, "Layer width (mlp) or d_model (transformer).")
_MAX_LAYERS = flags.DEFINE_integer("max_layers", 4096, "Stop the search at this many layers.")
_JSON = flags.DEFINE_string("json", None, "With --budget_mb: write the rows to this JSON file.")
_OVERRIDES = flags.DEFINE_list(
    "model_overrides", [], "FIELD=VALUE,... keyword arguments of --model's function "
    "(values read as Python literals, else strings).")
_SCALE = flags.DEFINE_string(
    "scale", None, "With --budget_mb and --model: model_overrides.FIELD, the integer size "
    "knob to search (e.g. model_overrides.num_layers).")


def _family_workload(family: str, width: int, layers: int):
  import jaxcoll  # noqa: PLC0415

  if family == "mlp":
    return jaxcoll.models.make_workload(
      "mlp", depth=layers + 1, width=width, scan_layers=layers >= 1
    ) if layers >= 1 else jaxcoll.models.make_workload("mlp", widths=(width,))
  heads = next(h for h in (8, 4, 2, 1) if width % h == 0)
  return jaxcoll.models.make_workload(
    "transformer", num_layers=layers, d_model=width, num_heads=heads, scan_layers=True
  )


def _check_budget_flags() -> None:
  if not _BUDGET.value > 0:
    raise ValueError(f"`--budget_mb`={_BUDGET.value!r} must be positive (MB per device).")
  if _FAMILY.value not in FAMILIES:
    raise ValueError(f"`--family`={_FAMILY.value!r}; valid families: {', '.join(FAMILIES)}.")
  if _WIDTH.value < 1 or _MAX_LAYERS.value < 1:
    raise ValueError(
      f"`--width`={_WIDTH.value} and `--max_layers`={_MAX_LAYERS.value} must be positive."
    )
  if wf.DEVICES.value < 1:
    raise ValueError(f"`--devices`={wf.DEVICES.value} must be positive.")
  _check_json()


def _check_json() -> None:
  """Before compiling anything: a --json that cannot be written lost the search's rows."""
  if _JSON.value is not None:
    _cli.writable_file("json", _JSON.value, "memory_plan.json")


def _strategies(mesh_of):
  """``name -> make(loss_fn, optimizer) -> trainer`` for every strategy this build has."""
  import functools  # noqa: PLC0415

  from jaxcoll.models import fixed_key  # noqa: PLC0415
  from jaxcoll.train import DataParallel, Trainer, ZeRO, baselines  # noqa: PLC0415

  flat = mesh_of(None)

  def native(mesh, strategy, loss_fn, optimizer):  # a dropout model in training mode
    return Trainer(fixed_key(loss_fn), optimizer, mesh, strategy, has_aux=True)

  def gspmd(fsdp, loss_fn, optimizer):
    return baselines.GspmdTrainer(fixed_key(loss_fn), optimizer, flat, fsdp=fsdp, has_aux=True)

  runs = {"DP": functools.partial(native, flat, DataParallel())}
  for stage in (1, 2, 3):
    runs[f"ZeRO-{stage}"] = functools.partial(native, flat, ZeRO(stage=stage))
  n = wf.DEVICES.value
  # Hybrid sharding exists once ZeRO has `replica_axis` (shard in a node, replicate across).
  if n % 2 == 0 and n >= 4 and "replica_axis" in {f.name for f in dataclasses.fields(ZeRO)}:
    hybrid = ZeRO(stage=3, axis="local", replica_axis="node")
    runs[f"hybrid ZeRO-3 (2x{n // 2})"] = functools.partial(native, mesh_of((2, n // 2)), hybrid)
  runs["GSPMD DP"] = functools.partial(gspmd, False)
  runs["GSPMD FSDP"] = functools.partial(gspmd, True)
  return runs


def _layout(make, workload) -> str:
  """The GSPMD FSDP baseline's layout line for ``workload`` (what it pads, what it replicates)."""
  import optax  # noqa: PLC0415

  return make(workload.loss_fn, optax.adam(1e-3)).layout(workload.param_shapes).summary()


def _print_layouts(rows) -> None:
  for r in rows:
    if "layout" in r:
      print(r["layout"])


def _budget_search() -> None:
  try:
    _check_budget_flags()
  except ValueError as e:
    _cli.fail(_PROG, str(e))
  os.environ.setdefault("JAXCOLL_CPU_DEVICES", str(wf.DEVICES.value))
  import optax  # noqa: PLC0415

  import jaxcoll  # noqa: PLC0415
  from jaxcoll.scale import memory  # noqa: PLC0415

  def mesh_of(shape):
    if shape is None:
      return jaxcoll.devices.flat_mesh(wf.DEVICES.value)
    return jaxcoll.devices.node_local_mesh(*shape)

  budget = _BUDGET.value * 1e6
  family, width, batch_size = _FAMILY.value, _WIDTH.value, wf.BATCH.value
  try:
    _check_batch_size()
  except ValueError as e:
    _cli.fail(_PROG, str(e))
  rows = []
  for name, make in _strategies(mesh_of).items():

    def peak_of(layers, make=make):
      w = _family_workload(family, width, layers)
      trainer = make(w.loss_fn, optax.adam(1e-3))
      return memory.compiled_peak_bytes(trainer, w.param_shapes, wf.batch_of(w, wf.BATCH.value))

    layers, peak = memory.largest_fitting(peak_of, budget, cap=_MAX_LAYERS.value)
    params = _family_workload(family, width, layers).num_params if layers else 0
    rows.append({"strategy": name, "layers": layers, "num_params": params,
                 "peak_mb": None if peak is None else peak / 1e6})
    if name == "GSPMD FSDP" and layers:
      rows[-1]["layout"] = _layout(make, _family_workload(family, width, layers))
  by_name = {r["strategy"]: r["layers"] for r in rows}
  print(
    f"Largest scanned {family} (width {width}, global batch {batch_size}) whose compiled step "
    f"fits {_BUDGET.value:g} MB per device on {wf.DEVICES.value} devices (XLA memory_analysis: "
    "args + outputs - alias + temp), found by compiling on abstract inputs:"
  )
  print(f"{'strategy':<24} {'layers':>7} {'params':>13} {'peak MB':>9}")
  for r in rows:
    peak = "-" if r["peak_mb"] is None else f"{r['peak_mb']:.2f}"
    print(f"{r['strategy']:<24} {r['layers']:>7} {r['num_params']:>13,} {peak:>9}")
  ratio = by_name["ZeRO-3"] / by_name["DP"] if by_name["DP"] else float("inf")
  print(f"ZeRO-3 / DP layers: {ratio:.2f}x")
  _print_layouts(rows)
  if _JSON.value is not None:
    os.makedirs(os.path.dirname(_JSON.value) or ".", exist_ok=True)
    config = {"budget_mb": _BUDGET.value, "family": family, "width": width,
              "devices": wf.DEVICES.value, "batch_size": batch_size}
    with open(_JSON.value, "w") as f:
      json.dump({"config": config, "rows": rows, "zero3_over_dp": ratio}, f, indent=2)


def _overrides() -> dict:
  """``--model_overrides`` as keyword arguments (ValueError naming the bad item)."""
  import ast  # noqa: PLC0415

  out = {}
  for item in _OVERRIDES.value:
    field, eq, text = item.partition("=")
    if not eq or not field.isidentifier():
      raise ValueError(f"`--model_overrides` item {item!r} is not FIELD=VALUE; write e.g. "
                       "--model_overrides=num_layers=4,d_model=256.")
    try:
      out[field] = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      out[field] = text
  return out


def _scale_field() -> str | None:
  if _SCALE.value is None:
    return None
  prefix, _, field = _SCALE.value.partition(".")
  if prefix != "model_overrides" or not field.isidentifier():
    raise ValueError(f"`--scale`={_SCALE.value!r} must be model_overrides.FIELD, naming an "
                     "integer keyword argument of --model's function (e.g. "
                     "model_overrides.num_layers).")
  return field


def _user_model() -> None:
  """``--budget_mb`` with ``--model``: search ``--scale``, or fit / no fit as given."""
  try:
    if not _BUDGET.value > 0:
      raise ValueError(f"`--budget_mb`={_BUDGET.value!r} must be positive (MB per device).")
    if wf.DEVICES.value < 1:
      raise ValueError(f"`--devices`={wf.DEVICES.value} must be positive.")
    if _MAX_LAYERS.value < 1:
      raise ValueError(f"`--max_layers`={_MAX_LAYERS.value} must be positive.")
    _check_json()
    field, overrides = _scale_field(), _overrides()
    if field is not None and field in overrides:
      raise ValueError(f"`--scale` searches {field!r}; do not also set it in --model_overrides.")
    os.environ.setdefault("JAXCOLL_CPU_DEVICES", str(wf.DEVICES.value))
    import jaxcoll  # noqa: PLC0415

    def workload_of(value):
      return wf.make_workload(wf.MODEL.value, overrides if field is None else
                              {**overrides, field: value})

    first = workload_of(1)
    _check_batch_size()
    wf.batch_of(first, wf.BATCH.value)  # one line now if the model needs --data
    mesh_of = (lambda shape: jaxcoll.devices.flat_mesh(wf.DEVICES.value) if shape is None
               else jaxcoll.devices.node_local_mesh(*shape))
    runs = _strategies(mesh_of)
  except ValueError as e:
    _cli.fail(_PROG, str(e))
  import optax  # noqa: PLC0415

  from jaxcoll.scale import memory  # noqa: PLC0415

  budget = _BUDGET.value * 1e6
  rows = []
  for name, make in runs.items():

    def peak_of(value, make=make):
      w = workload_of(value)
      trainer = make(w.loss_fn, optax.adam(1e-3))
      return memory.compiled_peak_bytes(trainer, w.param_shapes, wf.batch_of(w, wf.BATCH.value))

    try:
      if field is None:
        peak = peak_of(None)
        row = {"strategy": name, "fits": peak <= budget, "peak_mb": peak / 1e6,
               "num_params": first.num_params}
      else:
        value, peak = memory.largest_fitting(peak_of, budget, cap=_MAX_LAYERS.value)
        row = {"strategy": name, field: value,
               "num_params": workload_of(value).num_params if value else 0,
               "peak_mb": None if peak is None else peak / 1e6}
    except NameError as e:  # BatchNorm(axis_name="data") on hybrid's ("node", "local") mesh
      axis = re.search(r"unbound axis name: ([^\s.,]+)", str(e))
      if axis is None:
        raise
      rows.append({"strategy": name, "fits": None, "peak_mb": None, field or "value": "-",
                   "num_params": 0, "note": f"not compiled: the model reduces over mesh axis "
                   f"{axis[1]!r}, which this strategy's mesh lacks"})
      continue
    rows.append(row)
    if name == "GSPMD FSDP" and (field is None or value):
      rows[-1]["layout"] = _layout(make, workload_of(None if field is None else value))
  where = (f"on {wf.DEVICES.value} devices, global batch {wf.BATCH.value} (XLA memory_analysis "
           "of the step compiled on abstract inputs: args + outputs - alias + temp)")
  if field is None:
    print(f"Does {wf.MODEL.value} ({first.num_params:,} params) fit {_BUDGET.value:g} MB per "
          f"device {where}?")
    print(f"{'strategy':<24} {'peak MB':>11} {'fits':>5}")
    for r in rows:
      if r["peak_mb"] is None:
        print(f"{r['strategy']:<24} {'-':>11} {'-':>5}  {r['note']}")
        continue
      print(f"{r['strategy']:<24} {r['peak_mb']:>11.2f} {'yes' if r['fits'] else 'no':>5}")
  else:
    print(f"Largest {field} of {wf.MODEL.value} whose step fits {_BUDGET.value:g} MB per "
          f"device {where}:")
    print(f"{'strategy':<24} {field:>10} {'params':>13} {'peak MB':>9}")
    for r in rows:
      peak = "-" if r["peak_mb"] is None else f"{r['peak_mb']:.2f}"
      print(f"{r['strategy']:<24} {r[field]:>10} {r['num_params']:>13,} {peak:>9}"
            + (f"  {r['note']}" if "note" in r else ""))
  _print_layouts(rows)
  if _JSON.value is not None:
    os.makedirs(os.path.dirname(_JSON.value) or ".", exist_ok=True)
    config = {"budget_mb": _BUDGET.value, "model": wf.MODEL.value, "scale": _SCALE.value,
              "model_overrides": _overrides(), "devices": wf.DEVICES.value,
              "batch_size": wf.BATCH.value}
    with open(_JSON.value, "w") as f:
      json.dump({"config": config, "rows": rows}, f, indent=2, default=str)


def main(argv):
  _cli.no_positional(_PROG, argv)
  if _BUDGET.value is not None:
    if flags.FLAGS["model"].present or _SCALE.value is not None:
      _user_model()
    else:
      _budget_search()
    return
  try:
    if _SCALE.value is not None:
      raise ValueError("`--scale` searches a size knob against --budget_mb; pass --budget_mb.")
    if _OVERRIDES.value:
      os.environ.setdefault("JAXCOLL_CPU_DEVICES", str(wf.DEVICES.value))
      import jaxcoll  # noqa: PLC0415

      workload = wf.make_workload(wf.MODEL.value, _overrides())
      mesh = jaxcoll.devices.flat_mesh(wf.DEVICES.value)
    else:
      workload, mesh = wf.workload_and_mesh(_PROG)
    _check_batch_size()
    batch = wf.batch_of(workload, wf.BATCH.value)
  except ValueError as e:
    _cli.fail(_PROG, str(e))
  import optax  # noqa: PLC0415

  from jaxcoll.scale import memory  # noqa: PLC0415
  from jaxcoll.models import fixed_key  # noqa: PLC0415
  from jaxcoll.train import DataParallel, Trainer, ZeRO  # noqa: PLC0415

  strategies = [DataParallel(), ZeRO(stage=1), ZeRO(stage=2), ZeRO(stage=3)]
  trainers = [
    Trainer(fixed_key(workload.loss_fn), optax.adam(1e-3), mesh, s, has_aux=True)
    for s in strategies
  ]
  # Shapes only: the planner allocates nothing of the model's size.
  print(memory.plan(trainers, workload.param_shapes, batch))


def _check_batch_size() -> None:
  """``--batch_size`` splits over ``--devices`` (was the trainer's traceback, exit 1)."""
  batch, devices = wf.BATCH.value, wf.DEVICES.value
  if devices >= 1 and batch % devices:
    fit = max(devices, batch // devices * devices)
    raise ValueError(f"`--batch_size`={batch} is not divisible by `--devices`={devices}; use "
                     f"e.g. --batch_size={fit}.")


if __name__ == "__main__":
  app.run(main, flags_parser=_cli.flags_parser(_PROG))
