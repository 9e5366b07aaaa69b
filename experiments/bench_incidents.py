r"""The incident detectors' cost per step, against the step they watch.

    python -m experiments.bench_incidents --config=configs/default.py --steps=200 --repeats=3

Two measurements on the config's model, batch and mesh (``--config`` as
``experiments.train`` takes it):

1. Per step, in place: the trainer runs ``--steps`` steps; each one is timed
   (dispatch to ready, as ``step_time_s``), then the detectors are fed its
   metrics (:meth:`jaxcoll.run.incidents.Watch.after_step`: reading the loss
   and gradient norm off the device, the robust z-scores of both) and that
   call is timed, with the ``prefetch`` call the loop makes after dispatch
   (the copy to the host starts as the step runs). Prints the median of each and their ratio.
2. End to end: ``--repeats`` pairs of whole ``train_and_evaluate`` runs
   (checkpoints and TensorBoard off), alternating every signal ``off`` and
   the defaults, and the median wall time per step of each.

The loaded-machine noise of (2) is usually larger than the detectors' cost;
(1) is the figure the README quotes. With several processes (``python -m
jaxcoll.launch ... -- python -m experiments.bench_incidents``) it also times
one allgather of a float, what a separate collective per logged row would
cost (the throughput signal shares the timer's instead). Writes ``--json``
if given.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("JAXCOLL_CPU_DEVICES", "8")

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from experiments import _cli  # noqa: E402

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(_REPO, "configs", "default.py"), "Training config (as for train).")
_STEPS = flags.DEFINE_integer("steps", 200, "Steps per measurement.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Pairs of end-to-end runs (0: skip them).")
_JSON = flags.DEFINE_string("json", None, "Write the figures to this JSON file.")


def _per_step(config, steps: int) -> dict[str, float]:
  import jax  # noqa: PLC0415

  from jaxcoll.run import incidents, inputs, loop, optim  # noqa: PLC0415

  mesh, axis = loop.build_mesh(config)
  workload = inputs.make_workload(config)
  trainer = loop.build_trainer(config, workload, mesh, axis, optim.build_schedule(config))
  train_input = inputs.TrainInput(config, workload, mesh, axis)
  state = trainer.init(workload.init_params(int(config.seed)))
  with tempfile.TemporaryDirectory() as tmp:
    watch = incidents.Watch.from_config(config, tmp, is_chief=True)
    step_s, watch_s = [], []
    for step in range(steps + 5):
      batch = train_input.batch(step)
      t0 = time.perf_counter()
      state, m = trainer.step(state, batch)
      tp = time.perf_counter()
      watch.prefetch(m)  # as the loop does, right after dispatch
      prefetch = time.perf_counter() - tp
      jax.block_until_ready((state, m))
      t1 = time.perf_counter()
      watch.after_step(step + 1, m, batch=step + 1)
      t2 = time.perf_counter() + prefetch
      watch.pending = []
      if step >= 5:  # compile and caches first
        step_s.append(t1 - t0)
        watch_s.append(t2 - t1)
  step_med, watch_med = statistics.median(step_s), statistics.median(watch_s)
  return {"step_time_s_median": step_med, "detector_time_s_median": watch_med,
          "detector_time_s_mean": statistics.fmean(watch_s),
          "overhead_fraction": watch_med / step_med, "steps": steps}


def _end_to_end(config, steps: int, repeats: int) -> dict[str, list[float]]:
  from jaxcoll.run import incidents, loop  # noqa: PLC0415

  times: dict[str, list[float]] = {"off": [], "default": []}
  for _ in range(repeats):
    for mode in ("off", "default"):
      c = config.copy_and_resolve_references()
      with c.unlocked():
        c.steps, c.checkpoint_every, c.tensorboard, c.log_every = steps, 0, False, steps
        if mode == "off":
          for signal in incidents.SIGNALS:
            c.incidents[signal] = "off"
      with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        loop.train_and_evaluate(c, tmp)
        times[mode].append((time.perf_counter() - t0) / steps)
  return times


def _allgather_s(calls: int = 300) -> float:
  """Median time of the timer's allgather of a float (what a second one per row would cost)."""
  from jaxcoll.run import timing  # noqa: PLC0415

  for _ in range(20):
    timing.gather_process_times(0.1)
  times = []
  for _ in range(calls):
    t0 = time.perf_counter()
    timing.gather_process_times(0.1)
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main(argv):
  if len(argv) > 1:
    _cli.fail("bench_incidents", f"unexpected arguments {argv[1:]}; every option is a --flag.")
  logging.set_verbosity(logging.WARNING)  # orbax and JAX log every step's work at INFO
  import jax  # noqa: PLC0415

  import jaxcoll  # noqa: PLC0415

  jaxcoll.distributed.initialize()
  config = _CONFIG.value
  per = _per_step(config, _STEPS.value)
  print(f"per step ({per['steps']} steps): step {per['step_time_s_median'] * 1e3:.3f} ms, "
        f"detectors {per['detector_time_s_median'] * 1e6:.1f} us (median; mean "
        f"{per['detector_time_s_mean'] * 1e6:.1f} us): "
        f"{100 * per['overhead_fraction']:.2f}% of the step")
  result = {"config": config.model, "global_batch_size": int(config.global_batch_size),
            "per_step": per}
  if _REPEATS.value:
    e2e = _end_to_end(config, _STEPS.value, _REPEATS.value)
    off, on = statistics.median(e2e["off"]), statistics.median(e2e["default"])
    print(f"end to end ({_REPEATS.value} pairs of {_STEPS.value}-step runs): "
          f"signals off {off * 1e3:.3f} ms/step, defaults {on * 1e3:.3f} ms/step "
          f"({100 * (on / off - 1):+.1f}%; runs {[round(x * 1e3, 3) for x in e2e['off']]} vs "
          f"{[round(x * 1e3, 3) for x in e2e['default']]} ms)")
    result["end_to_end_s_per_step"] = e2e
  if jax.process_count() > 1:
    gather = _allgather_s()
    print(f"process {jax.process_index()}: one process_allgather of a float over "
          f"{jax.process_count()} processes: {gather * 1e6:.0f} us (median of 300)")
    result["allgather_s"] = gather
  if _JSON.value and jax.process_index() == 0:
    with open(_JSON.value, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  app.run(main, flags_parser=_cli.flags_parser("bench_incidents"))
