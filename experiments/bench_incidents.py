r"""The incident detectors' cost per step, against the step they watch.

    python -m experiments.bench_incidents --config=configs/default.py --steps=200 --repeats=3

Two measurements on the config's model, batch and mesh (``--config`` as
``experiments.train`` takes it):

1. In one process, the loop's step as :mod:`jaxcoll.run.loop` runs it, in
   four modes, one log period (``log_every`` steps) of each per round in a
   random order (so that the machine's load and a period's place in the
   round fall on all alike), ``--steps`` steps each:

   - ``off``: no detector;
   - ``previous``: the build before the last (the copies to the host
     started after dispatch, the loss and gradient norm read and judged
     right after the step);
   - ``sync``: ``incidents.defer_reads=off``, read and judged right after
     every step;
   - ``batched``: ``defer_reads=on`` (what ``auto`` is), the steps wait and
     are read and judged together at the next step
     :func:`jaxcoll.run.incidents.judged_at_once` names, after the first
     read of that step's output, which its row pays anyway.

   Each step is timed from dispatch to the end of the detector work that
   follows it and, at the config's logged steps, of the row's read of the
   loss and gradient norm (every mode reads them there, as the loop does):
   what the loop spends on a step. ``batched`` puts its cost on the logged
   and saved steps, which a median does not see, so the figure a user
   feels is the mean. Printed, against ``off``:

   - paired: ``sum(mode - off) / sum(off)`` over a round's log periods
     (each holds one logged step), the median over the rounds (robust to a
     loaded host's outliers), and over all steps at once;
   - the ratio of the medians (what a non-logged step sees);
   - the host work after the step (ready to the end of the detectors and
     the row), paired the same way, over ``off``'s whole step: it leaves
     out the step itself, the same in every mode, and most of a loaded
     host's noise;
   - the detectors' own CPU time (``time.thread_time``, in which a loaded
     host's waits count) per step.

   Then the reads themselves: after ``log_every`` steps whose metrics are
   kept unread, the first read (the last step's loss) and each further one
   (an earlier step's loss or gradient norm, as a waiting step is read).
2. End to end: ``--repeats`` pairs of whole ``train_and_evaluate`` runs
   (checkpoints and TensorBoard off, the config's ``log_every``),
   every signal ``off`` and the defaults (which runs first alternates
   from pair to pair), and the median wall
   time per step of each (the machine's noise is usually larger than the
   detectors' cost).

With several processes (``python -m jaxcoll.launch ... -- python -m
experiments.bench_incidents``) it also times one allgather of a float, what
a separate collective per logged row would cost (the throughput signal
shares the timer's instead). Writes ``--json`` if given.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import time
from typing import Any

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


MODES = ("off", "previous", "sync", "batched")


def _per_step(config, steps: int) -> dict[str, Any]:
  import jax  # noqa: PLC0415

  from jaxcoll.run import incidents, inputs, loop, optim  # noqa: PLC0415

  mesh, axis = loop.build_mesh(config)
  workload = inputs.make_workload(config)
  trainer = loop.build_trainer(config, workload, mesh, axis, optim.build_schedule(config))
  train_input = inputs.TrainInput(config, workload, mesh, axis)
  state = trainer.init(workload.init_params(int(config.seed)))
  log_every, every = int(config.log_every), int(config.checkpoint_every)
  total = int(config.steps)
  with tempfile.TemporaryDirectory() as tmp:
    settings = incidents.settings_from_config(config)
    watches = {m: incidents.Watch({**settings, "defer_reads": "on" if m == "batched" else "off"},
                                  tmp, is_chief=True) for m in MODES[1:]}
    done = dict.fromkeys(MODES, 0)  # each mode's own step count (its watch's steps)
    loop_s: dict[str, list[float]] = {m: [] for m in MODES}
    step_s: dict[str, list[float]] = {m: [] for m in MODES}
    after_s: dict[str, list[float]] = {m: [] for m in MODES}  # ready to the end of the row
    cpu_s: dict[str, list[float]] = {m: [] for m in MODES}  # this thread's CPU time in them
    # Each round runs one log period (log_every steps, the last one logged) of each mode, the
    # modes in a random order: a mode's place in the round is no bias, and no other mode's
    # steps run between a period's (step by step, they made even batched's non-logged steps,
    # where it does ~1 us of work, +2% slower). The first round compiles and warms up.
    warm = log_every
    rounds = 1 + max(1, steps // log_every)
    rng = random.Random(0)
    order = [m for _ in range(rounds) for m in rng.sample(MODES, len(MODES))
             for _ in range(log_every)]
    for i, mode in enumerate(order):
      watch = watches.get(mode)
      done[mode] += 1
      n = (done[mode] - 1) % total + 1  # the step number the config's schedule sees
      batch = train_input.batch(i)
      t0 = time.perf_counter()
      state, m = trainer.step(state, batch)
      c0 = time.thread_time()
      if mode == "previous":  # the build before the last: the copies to the host started here
        m["loss"].copy_to_host_async()
        m["grad_norm"].copy_to_host_async()
      cpu = time.thread_time() - c0
      jax.block_until_ready((state, m))
      t1 = time.perf_counter()
      c0 = time.thread_time()
      logged = n % log_every == 0 or n == total
      if watch is not None:
        at_once = incidents.judged_at_once(n, steps=total, log_every=log_every,
                                           checkpoint_every=every)
        watch.after_step(done[mode], m, batch=done[mode], defer=not at_once)
        watch.pending = []
      cpu += time.thread_time() - c0
      if logged:  # the row reads both, detector or not
        float(m["loss"]), float(m["grad_norm"])
      t2 = time.perf_counter()
      if i >= warm * len(MODES):
        loop_s[mode].append(t2 - t0)
        step_s[mode].append(t1 - t0)
        after_s[mode].append(t2 - t1)
        cpu_s[mode].append(cpu)
    reads = _read_costs(trainer, train_input, state, log_every)
  med = {m: statistics.median(loop_s[m]) for m in MODES}
  off_sum = sum(loop_s["off"])
  periods = len(loop_s["off"]) // log_every

  def period_sums(mode, times=loop_s):
    return [sum(times[mode][k * log_every:(k + 1) * log_every]) for k in range(periods)]

  off_periods = period_sums("off")
  # Paired: each log period of a mode against the `off` steps of the same rounds.
  paired = {m: statistics.median(a - b for a, b in zip(period_sums(m), off_periods))
            / statistics.median(off_periods) for m in MODES[1:]}
  return {"steps": len(loop_s["off"]), "log_every": log_every, "periods": periods, **reads,
          "loop_s_median": med,
          "loop_s_mean": {m: statistics.fmean(loop_s[m]) for m in MODES},
          "step_time_s_median": {m: statistics.median(step_s[m]) for m in MODES},
          "paired_overhead_fraction": paired,  # per log period, median over the periods
          "mean_overhead_fraction": {m: sum(loop_s[m]) / off_sum - 1 for m in MODES[1:]},
          "median_overhead_fraction": {m: med[m] / med["off"] - 1 for m in MODES[1:]},
          "detector_cpu_s_mean": {m: statistics.fmean(cpu_s[m]) for m in MODES[1:]},
          # The host work after the step (detectors, the row's read): mode - off per log period,
          # median over the periods, over off's median period. Leaves out the step itself, the
          # same work in every mode and most of a loaded host's noise.
          "after_step_overhead_fraction": {
              m: statistics.median(a - b for a, b in zip(period_sums(m, after_s),
                                                         period_sums("off", after_s)))
              / statistics.median(off_periods) for m in MODES[1:]}}


def _read_costs(trainer, train_input, state, log_every: int, rounds: int = 20) -> dict:
  """After ``log_every`` steps (their metrics kept, unread): the first read of the last step's
  loss, then each earlier step's loss and gradient norm as a waiting step is read
  (:func:`jaxcoll.run.incidents._host`); medians over ``rounds``."""
  import jax  # noqa: PLC0415

  from jaxcoll.run import incidents  # noqa: PLC0415

  first, further = [], []
  for r in range(rounds + 1):
    kept = []
    for i in range(log_every):
      state, m = trainer.step(state, train_input.batch(i))
      jax.block_until_ready((state, m))
      kept.append(m)
    t0 = time.perf_counter()
    float(kept[-1]["loss"])
    t1 = time.perf_counter()
    for m in kept[:-1]:
      incidents._host(m["loss"]), incidents._host(m["grad_norm"])  # noqa: SLF001
    t2 = time.perf_counter()
    if r:  # the first round warms up
      first.append(t1 - t0)
      further.append((t2 - t1) / (2 * (log_every - 1)))
  return {"first_read_s": statistics.median(first), "further_read_s": statistics.median(further)}


def _end_to_end(config, steps: int, repeats: int) -> dict[str, list[float]]:
  from jaxcoll.run import incidents, loop  # noqa: PLC0415

  times: dict[str, list[float]] = {"off": [], "default": []}
  for r in range(repeats):
    for mode in ("off", "default")[::1 if r % 2 == 0 else -1]:  # which runs first alternates
      c = config.copy_and_resolve_references()
      with c.unlocked():
        c.steps, c.checkpoint_every, c.tensorboard = steps, 0, False
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
  _cli.no_positional("bench_incidents", argv)
  if _JSON.value is not None:  # before the runs: a --json that cannot be written lost the figures
    try:
      _cli.writable_file("json", _JSON.value, "bench_incidents.json")
    except ValueError as e:
      _cli.fail("bench_incidents", str(e))
  logging.set_verbosity(logging.WARNING)  # orbax and JAX log every step's work at INFO
  import jax  # noqa: PLC0415

  import jaxcoll  # noqa: PLC0415

  jaxcoll.distributed.initialize()
  config = _CONFIG.value
  per = _per_step(config, _STEPS.value)
  mean, steps_med = per["loop_s_mean"], per["step_time_s_median"]
  print(f"the loop's step ({per['steps']} steps a mode, in {per['periods']} rounds of one log "
        f"period ({per['log_every']} steps) of each in random order), dispatch to the end of the "
        "detectors and the row's read: mean (step_time_s median in brackets); overhead vs off:")
  for mode in MODES:
    ratio = "" if mode == "off" else (
        f": {100 * per['paired_overhead_fraction'][mode]:+.2f}% (paired per log period, median; "
        f"all steps: {100 * per['mean_overhead_fraction'][mode]:+.2f}%; ratio of medians: "
        f"{100 * per['median_overhead_fraction'][mode]:+.2f}%; the host work after the "
        f"step: {100 * per['after_step_overhead_fraction'][mode]:+.2f}%; the detectors' "
        "own CPU time "
        f"{per['detector_cpu_s_mean'][mode] * 1e6:.0f} us = "
        f"{100 * per['detector_cpu_s_mean'][mode] / steps_med['off']:.2f}% of off's step)")
    print(f"  {mode:8s} {mean[mode] * 1e3:.3f} ms ({steps_med[mode] * 1e3:.3f} ms){ratio}")
  print(f"reads after a step ({per['log_every']} steps kept unread): the last step's loss "
        f"{per['first_read_s'] * 1e6:.0f} us, then each earlier step's loss or gradient norm "
        f"{per['further_read_s'] * 1e6:.1f} us (medians)")
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
