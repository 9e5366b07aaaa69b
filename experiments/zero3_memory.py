r"""ZeRO-3 for a model only sharding fits: memory phase by phase, resume, step time.

    python -m experiments.zero3_memory --config=configs/big_zero3.py --json=/tmp/big.json
    python -m experiments.zero3_memory --config=configs/big_zero3.py:small
    python -m experiments.zero3_memory --config=configs/big_zero3.py:small --only=plan \
        --devices=6 --batch_size=24

Runs the config's model under its strategy (ZeRO-3) on the emulated devices,
each part in its own subprocess so each process's RSS is its own:

* ``plan``: the memory planner on abstract inputs for DP, ZeRO-3 and the
  GSPMD FSDP baseline, padded and with ``pad=False`` (XLA's per-device peak
  of the compiled step, args + outputs - alias + temp, against the machine's
  memory per device, MemTotal / devices; ZeRO-3's peak over each baseline's;
  the baseline's layout line: which leaves it pads to shard, which it keeps
  replicated); nothing of the model's size is allocated (the planner
  process's peak RSS is printed to show it);
* ``run``: ``init`` (``Trainer.init_from``: the parameters never exist in
  full), ``step`` (``steps`` steps), ``eval`` (the evaluator on the sharded
  state), ``save`` (a checkpoint at ``steps``, waited for), ``step`` again to
  ``2 * steps`` and the ``params_sha256`` of summary.json, leaf by leaf;
* ``restore``: a fresh process restores that checkpoint onto an abstract
  state, steps to ``2 * steps`` and must reach the same sha256 (bit-identical
  resume);
* ``timing``: the same model under ZeRO-3 and under the GSPMD FSDP baseline
  (``jax.jit`` with sharded parameters, gradients and Adam state; a leaf no
  dimension of divides by the devices padded to shard, as PyTorch FSDP pads,
  see :mod:`jaxcoll.train.baselines`), steps interleaved in one process,
  median step time of each.

``--devices=N`` emulates N CPU devices (default ``JAXCOLL_CPU_DEVICES`` or 8);
``--batch_size`` replaces the config's ``global_batch_size`` (it must divide
by the devices).

Each phase's peak RSS is ``VmHWM`` of ``/proc/self/status`` after writing 5 to
``/proc/self/clear_refs`` at the phase's start; beside it XLA's per-device
peak of that phase's program times the local devices. Prints a table, writes
``--json``; the bound checked is the issue's: the process's peak RSS
<= 2 x the full train state (float32 params + Adam's two moments).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

from absl import app, flags  # noqa: E402

from experiments import _cli  # noqa: E402

_PROG = "zero3_memory"
WORKERS = ("plan", "run", "restore", "timing")
_CONFIG = flags.DEFINE_string("config", os.path.join(_REPO, "configs", "big_zero3.py"),
                              "Config file[:variant] (experiments.train's).")
_STEPS = flags.DEFINE_integer("steps", 2, "Steps before the checkpoint (and after it).")
_TIMED = flags.DEFINE_integer("timed_steps", 3, "Timed steps per trainer (after one warm-up).")
_JSON = flags.DEFINE_string("json", None, "Write the figures to this JSON file.")
_DIR = flags.DEFINE_string("dir", None, "Checkpoint directory (default: a new temp dir).")
_WORKER = flags.DEFINE_enum("worker", None, WORKERS, "Internal: run one part in this process.")
_ONLY = flags.DEFINE_list("only", list(WORKERS), f"Parts to run, of {', '.join(WORKERS)}.")
_DEVICES = flags.DEFINE_integer("devices", None, "Emulated CPU devices (default: "
                                "JAXCOLL_CPU_DEVICES, else 8).")
_BATCH = flags.DEFINE_integer("batch_size", None, "Global batch (default: the config's "
                              "global_batch_size); must divide by the devices.")


def _load_config(spec: str):
  import runpy  # noqa: PLC0415

  path, _, variant = spec.partition(":")
  if not os.path.exists(path):
    raise ValueError(f"`--config`={spec!r}: no file {path!r}; e.g. configs/big_zero3.py.")
  config = runpy.run_path(path)["get_config"](variant or None)
  if _BATCH.value is not None:
    config.global_batch_size = _BATCH.value
  return config


def _check_devices(config) -> None:
  """``--devices`` and the batch (one line naming the flag, the value and the fix)."""
  if _BATCH.value is not None and _BATCH.value < 1:
    raise ValueError(f"`--batch_size`={_BATCH.value} must be >= 1.")
  env = os.environ.get("JAXCOLL_CPU_DEVICES", "").strip()
  if _DEVICES.value is not None:
    devices, where = _DEVICES.value, "`--devices`"
  elif env.isdigit():  # the emulated devices the workers get
    devices, where = int(env), "JAXCOLL_CPU_DEVICES"
  else:
    return
  if devices < 1:
    raise ValueError(f"{where}={devices} must be >= 1.")
  batch = int(config.global_batch_size)
  if not config.get("mesh_shape") and batch % devices:
    what = "`--batch_size`" if _BATCH.value is not None else "the config's global_batch_size"
    raise ValueError(f"{what}={batch} does not divide by {where}={devices}; pass "
                     f"--batch_size={devices * max(1, batch // devices)} or another multiple "
                     "of the devices.")


# -- inside a worker ---------------------------------------------------------------


class _Phases:
  """Peak RSS per phase (VmHWM reset at each start) and XLA's peak beside it."""

  def __init__(self):
    from jaxcoll.observe import rss  # noqa: PLC0415

    self.rss = rss
    self.rows: dict[str, dict] = {}
    self.baseline = rss.current_bytes()
    self._name = None

  def start(self, name: str) -> None:
    self.stop()
    if not self.rss.reset_peak():
      raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs): no phase peaks here")
    self._name, self._t = name, time.perf_counter()

  def stop(self) -> None:
    if self._name is not None:
      row = self.rows.setdefault(self._name, {"rss_peak_bytes": 0, "seconds": 0.0})
      row["rss_peak_bytes"] = max(row["rss_peak_bytes"], self.rss.peak_bytes())
      row["seconds"] += time.perf_counter() - self._t
      self._name = None

  def xla(self, name: str, compiled) -> None:
    from jaxcoll.observe import analysis  # noqa: PLC0415

    self.rows.setdefault(name, {"rss_peak_bytes": 0, "seconds": 0.0})["xla_peak_bytes"] = int(
        analysis.peak_bytes(compiled.memory_analysis()))


def _setup(config):
  import jax  # noqa: PLC0415

  from jaxcoll.run import inputs, loop, optim  # noqa: PLC0415

  mesh, axis = loop.build_mesh(config)
  workload = inputs.make_workload(config)
  trainer = loop.build_trainer(config, workload, mesh, axis, optim.build_schedule(config))
  return jax, loop, inputs, mesh, axis, workload, trainer


def _full_state_bytes(workload) -> int:
  import math  # noqa: PLC0415

  import jax  # noqa: PLC0415

  return 3 * sum(math.prod(x.shape) * x.dtype.itemsize
                 for x in jax.tree.leaves(workload.param_shapes))  # params + Adam mu, nu


def _worker_plan(config) -> dict:
  import jax  # noqa: PLC0415
  import optax  # noqa: PLC0415

  from jaxcoll.observe import rss  # noqa: PLC0415
  from jaxcoll.run import inputs, loop  # noqa: PLC0415
  from jaxcoll.scale import memory  # noqa: PLC0415
  from jaxcoll.train import DataParallel, Trainer, ZeRO, baselines  # noqa: PLC0415

  rss.reset_peak()
  mesh, axis = loop.build_mesh(config)
  workload = inputs.make_workload(config)
  batch = workload.make_batch(0, int(config.global_batch_size))
  with open("/proc/meminfo") as f:
    total = int(next(ln for ln in f if ln.startswith("MemTotal:")).split()[1]) * 1024
  budget = total // jax.local_device_count()
  rows = {}
  for name, strategy in (("DP", DataParallel()), ("ZeRO-3", ZeRO(stage=3))):
    trainer = Trainer(workload.loss_fn, optax.adam(1e-3), mesh, strategy, has_aux=True)
    peak = memory.compiled_peak_bytes(trainer, workload.param_shapes, batch)
    rows[name] = {"xla_peak_bytes_per_device": int(peak), "fits": bool(peak <= budget)}
  for name, pad in (("GSPMD FSDP", True), ("GSPMD FSDP (pad=False)", False)):
    gspmd = baselines.GspmdTrainer(workload.loss_fn, optax.adam(1e-3), mesh, axis, fsdp=True,
                                   has_aux=True, pad=pad)
    peak = memory.compiled_peak_bytes(gspmd, workload.param_shapes, batch)
    rows[name] = {"xla_peak_bytes_per_device": int(peak), "fits": bool(peak <= budget),
                  "layout": gspmd.layout(workload.param_shapes).summary()}
  return {"budget_bytes_per_device": int(budget), "machine_bytes": total, "strategies": rows,
          "planner_rss_peak_bytes": rss.peak_bytes()}


def _train_steps(trainer, train_input, state, start, stop):
  import jax  # noqa: PLC0415

  for step in range(start, stop):
    state, metrics = trainer.step(state, train_input.batch(step))
    jax.block_until_ready(state)
  return state, float(metrics["loss"])


def _worker_run(config, directory: str) -> dict:
  phases = _Phases()
  jax, loop, inputs, mesh, axis, workload, trainer = _setup(config)
  from jaxcoll.train import checkpoint  # noqa: PLC0415

  steps = _STEPS.value
  seed = int(config.seed)
  init_fn = lambda: workload.init_params(seed)  # noqa: E731
  phases.xla("init", trainer.lower_init_from(init_fn).compile())
  phases.start("init")
  state = trainer.init_from(init_fn)
  jax.block_until_ready(state)
  phases.stop()
  train_input = inputs.TrainInput(config, workload, mesh, axis)
  batch = train_input.batch(0)
  phases.xla("step", trainer.compile_step(state, batch))
  phases.start("step")
  state, loss = _train_steps(trainer, train_input, state, 0, steps)
  evaluator = inputs.make_evaluator(config, workload, mesh, axis)
  phases.xla("eval", evaluator.compile_on(trainer, state))
  phases.start("eval")
  evaluated = evaluator.run(trainer=trainer, state=state)
  phases.stop()
  phases.start("save")
  with checkpoint.Checkpointer(directory, keep=1) as ckpt:
    ckpt.save(steps, trainer, state, data_position=steps, extra=train_input.state())
    ckpt.wait()
  phases.start("step")
  state, loss = _train_steps(trainer, train_input, state, steps, 2 * steps)
  phases.start("digest")
  norm, sha = loop._state_digest(trainer, state, 2 * steps)  # noqa: SLF001 - summary.json's
  phases.stop()
  return {"phases": phases.rows, "baseline_rss_bytes": phases.baseline,
          "params_sha256": sha, "params_global_norm": norm, "final_loss": loss,
          "state_bytes_per_device": trainer.state_bytes_per_device(state),
          "eval": evaluated, "local_devices": jax.local_device_count(),
          "num_params": workload.num_params, "full_state_bytes": _full_state_bytes(workload)}


def _worker_restore(config, directory: str) -> dict:
  phases = _Phases()
  jax, loop, inputs, mesh, axis, workload, trainer = _setup(config)
  from jaxcoll.train import checkpoint  # noqa: PLC0415

  steps = _STEPS.value
  phases.start("restore")
  trainer.abstract_state(workload.param_shapes)  # the model; nothing allocated
  with checkpoint.Checkpointer(directory, keep=None, read_only=True) as ckpt:
    state, start, extra = ckpt.restore(trainer)
  jax.block_until_ready(state)
  phases.stop()
  train_input = inputs.TrainInput(config, workload, mesh, axis)
  train_input.restore(start, extra)
  phases.start("step")
  state, loss = _train_steps(trainer, train_input, state, start, 2 * steps)
  phases.start("digest")
  norm, sha = loop._state_digest(trainer, state, 2 * steps)  # noqa: SLF001
  phases.stop()
  return {"phases": phases.rows, "baseline_rss_bytes": phases.baseline, "start": start,
          "params_sha256": sha, "params_global_norm": norm, "final_loss": loss}


def _worker_timing(config) -> dict:
  import statistics  # noqa: PLC0415

  jax, loop, inputs, mesh, axis, workload, trainer = _setup(config)
  from jaxcoll.train import baselines  # noqa: PLC0415

  seed = int(config.seed)
  state = trainer.init_from(lambda: workload.init_params(seed))
  gspmd = baselines.GspmdTrainer(workload.loss_fn, trainer.optimizer, mesh, axis, fsdp=True,
                                 has_aux=True)
  gspmd.abstract_state(workload.param_shapes)  # builds its step; nothing allocated
  shardings, opt_shardings = gspmd.shardings(workload.param_shapes)
  params = jax.jit(lambda: gspmd.pad_params(workload.init_params(seed)), out_shardings=shardings)()
  other = (params, jax.jit(gspmd.optimizer.init, out_shardings=opt_shardings)(params))
  train_input = inputs.TrainInput(config, workload, mesh, axis)
  times = {"ZeRO-3": [], "GSPMD FSDP": []}
  for k in range(1 + _TIMED.value):  # the first of each compiles
    batch = train_input.batch(k)
    for name in times:
      t = time.perf_counter()
      if name == "ZeRO-3":
        state, metrics = trainer.step(state, batch)
        jax.block_until_ready((state, metrics))
      else:
        other, metrics = gspmd.step(other, batch)
        jax.block_until_ready((other, metrics))
      if k:
        times[name].append(time.perf_counter() - t)
  medians = {k: statistics.median(v) for k, v in times.items()}
  return {"step_s": medians, "all_step_s": times,
          "ratio": medians["ZeRO-3"] / medians["GSPMD FSDP"],
          "layout": gspmd.layout(workload.param_shapes).summary()}


def _worker(name: str) -> None:
  config = _load_config(_CONFIG.value)
  if name == "plan":
    out = _worker_plan(config)
  elif name == "run":
    out = _worker_run(config, _DIR.value)
  elif name == "restore":
    out = _worker_restore(config, _DIR.value)
  else:
    out = _worker_timing(config)
  from jaxcoll.observe import rss  # noqa: PLC0415

  out["process_rss_peak_bytes"] = rss.peak_bytes()  # since the last phase's reset
  print("RESULT " + json.dumps(out))


# -- the driver --------------------------------------------------------------------


def _spawn(name: str, directory: str) -> dict:
  cmd = [sys.executable, "-m", "experiments.zero3_memory", f"--worker={name}",
         f"--config={_CONFIG.value}", f"--steps={_STEPS.value}",
         f"--timed_steps={_TIMED.value}", f"--dir={directory}"]
  if _BATCH.value is not None:
    cmd.append(f"--batch_size={_BATCH.value}")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_REPO,
                                                                  os.environ.get("PYTHONPATH")])))
  if _DEVICES.value is not None:
    env["JAXCOLL_CPU_DEVICES"] = str(_DEVICES.value)
  env.setdefault("JAXCOLL_CPU_DEVICES", "8")
  t = time.perf_counter()
  proc = subprocess.run(cmd, cwd=_REPO, env=env, capture_output=True, text=True, check=False)
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
  if proc.returncode or not lines:
    raise RuntimeError(f"worker {name} failed (status {proc.returncode}):\n{proc.stderr[-3000:]}")
  out = json.loads(lines[-1][len("RESULT "):])
  out["wall_s"] = time.perf_counter() - t
  return out


def _gb(b) -> str:
  return "-" if b is None else f"{b / 1e9:.2f}"


def report(results: dict) -> tuple[str, dict]:
  """The printed table and the checks, from the workers' results."""
  lines, checks = [], {}
  run, restore = results.get("run"), results.get("restore")
  if run:
    full, local = run["full_state_bytes"], run["local_devices"]
    lines.append(f"{run['num_params']:,} params; full train state (float32 params + Adam mu, nu) "
                 f"{_gb(full)} GB; {local} local devices; process RSS before init "
                 f"{_gb(run['baseline_rss_bytes'])} GB")
    lines.append(f"{'phase':<16} {'peak RSS GB':>12} {'XLA peak/dev MB':>16} "
                 f"{'x devices GB':>13} {'seconds':>8}")
    rows = list(run["phases"].items()) + (
        [(f"{k} (resume)", v) for k, v in restore["phases"].items()] if restore else [])
    for name, row in rows:
      xla = row.get("xla_peak_bytes")
      lines.append(f"{name:<16} {_gb(row['rss_peak_bytes']):>12} "
                   f"{'-' if xla is None else f'{xla / 1e6:.1f}':>16} "
                   f"{'-' if xla is None else _gb(xla * local):>13} {row['seconds']:>8.2f}")
    peak = max(r["rss_peak_bytes"] for _, r in rows)
    checks["peak_rss_bytes"] = peak
    checks["peak_rss_over_full_state"] = peak / full
    checks["rss_within_2x_full_state"] = peak <= 2 * full
    lines.append(f"peak RSS {_gb(peak)} GB = {peak / full:.2f} x the full state "
                 f"(bound: <= 2 x = {_gb(2 * full)} GB): "
                 f"{'holds' if peak <= 2 * full else 'EXCEEDED'}")
  if run and restore:
    same = run["params_sha256"] == restore["params_sha256"]
    checks["resume_bit_identical"] = same
    lines.append(f"resume from step {restore['start']}: params_sha256 "
                 f"{restore['params_sha256'][:16]}... {'==' if same else '!='} straight run "
                 f"{run['params_sha256'][:16]}...")
  plan = results.get("plan")
  if plan:
    for name, row in plan["strategies"].items():
      lines.append(f"planner: {name} step peak {row['xla_peak_bytes_per_device'] / 1e6:.0f} "
                   f"MB/device vs {plan['budget_bytes_per_device'] / 1e6:.0f} MB/device "
                   f"(MemTotal / devices): {'fits' if row['fits'] else 'does not fit'}")
      if "layout" in row:
        lines.append(f"  {row['layout']}")
    lines.append(f"planner process peak RSS {_gb(plan['planner_rss_peak_bytes'])} GB "
                 "(nothing of the model's size allocated)")
    checks["dp_does_not_fit"] = not plan["strategies"]["DP"]["fits"]
    checks["zero3_fits"] = plan["strategies"]["ZeRO-3"]["fits"]
    peaks = {k: r["xla_peak_bytes_per_device"] for k, r in plan["strategies"].items()}
    if "GSPMD FSDP" in peaks:
      padded = peaks["ZeRO-3"] / peaks["GSPMD FSDP"]
      unpadded = peaks["ZeRO-3"] / peaks["GSPMD FSDP (pad=False)"]
      checks["zero3_over_gspmd_fsdp_peak"] = padded
      checks["zero3_over_gspmd_fsdp_unpadded_peak"] = unpadded
      lines.append(f"step peak per device, ZeRO-3 / GSPMD FSDP: {padded:.3f} (baseline pads "
                   f"odd-sized leaves to shard); {unpadded:.3f} (pad=False: they stay "
                   "replicated)")
  timing = results.get("timing")
  if timing:
    s = timing["step_s"]
    lines.append(f"step time: ZeRO-3 {s['ZeRO-3']:.3f} s, GSPMD FSDP {s['GSPMD FSDP']:.3f} s "
                 f"(medians, interleaved in one process): ratio {timing['ratio']:.2f}")
    checks["step_time_ratio"] = timing["ratio"]
    if "layout" in timing:
      lines.append(f"  timed baseline: {timing['layout']}")
  return "\n".join(lines), checks


def main(argv):
  _cli.no_positional(_PROG, argv)
  if _WORKER.value is not None:
    _worker(_WORKER.value)
    return
  try:
    _check_devices(_load_config(_CONFIG.value))
    unknown = sorted(set(_ONLY.value) - set(WORKERS))
    if unknown:
      raise ValueError(f"`--only` names {unknown}; valid parts: {', '.join(WORKERS)}.")
    if _STEPS.value < 1 or _TIMED.value < 1:
      raise ValueError(f"`--steps`={_STEPS.value} and `--timed_steps`={_TIMED.value} must be "
                       ">= 1.")
    if _JSON.value is not None:  # before the runs: a --json that cannot be written lost the figures
      _cli.writable_file("json", _JSON.value, "zero3_memory.json")
  except ValueError as e:
    _cli.fail(_PROG, str(e))
  import tempfile  # noqa: PLC0415

  directory = _DIR.value or tempfile.mkdtemp(prefix="zero3_memory_")
  results = {}
  for name in WORKERS:
    if name in _ONLY.value and not (name == "restore" and "run" not in results):
      results[name] = _spawn(name, directory)
  text, checks = report(results)
  print(f"{_CONFIG.value} ({' '.join(sys.argv[1:])})")
  print(text)
  if _JSON.value:
    os.makedirs(os.path.dirname(_JSON.value) or ".", exist_ok=True)
    with open(_JSON.value, "w") as f:
      json.dump({"config": _CONFIG.value, "steps": _STEPS.value, "results": results,
                 "checks": checks}, f, indent=2)
  if not _DIR.value:
    import shutil  # noqa: PLC0415

    shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
  app.run(main, flags_parser=_cli.flags_parser(_PROG))
