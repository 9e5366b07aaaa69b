"""The training loop behind ``python -m experiments.train``.

``train_and_evaluate(config, workdir)`` builds the mesh, the workload, the
strategy and the Trainer from a ``ConfigDict``; resumes from the newest
checkpoint in ``workdir``; trains ``config.steps`` steps; writes
``metrics.jsonl``, TensorBoard events, checkpoints and ``summary.json``.
Every process of a multi-host job runs it; process 0 writes the files and
holds the workdir's lock (:mod:`jaxcoll.train.lock`).

It reads top to bottom as flax's ``examples/imagenet/train.py``: set-up, one
loop, the summary. Fault injection is not in it: the loop calls the hooks of
its hook list (:mod:`jaxcoll.train.hooks`), which the config's ``*_at_step``
fields and tests install. Bad configuration raises :class:`ConfigError`
(the command line's exit 2); anything else is a fault or a bug.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from jax.experimental import multihost_utils

from jaxcoll.observe import analysis, comm_share, metrics
from jaxcoll.train import checkpoint
from jaxcoll import checks, data, errors, models
from jaxcoll.runtime import devices
from jaxcoll.run import attempts as attempts_lib
from jaxcoll.run import hooks as hooks_lib
from jaxcoll.run import incidents as incidents_lib
from jaxcoll.run import inputs, optim, profiling, timing, watchdog
from jaxcoll.run import lock as lock_lib
from jaxcoll.train import state as state_lib
from jaxcoll.run.config_error import ConfigError
from jaxcoll.run.config_error import fail as _fail
from jaxcoll.train import strategies as strategies_lib
from jaxcoll.train.strategies import DataParallel, ZeRO
from jaxcoll.train.trainer import Trainer

STRATEGIES = tuple(strategies_lib.STAGES)  # dp, zero1, zero2, zero3
OPTIMIZERS = optim.OPTIMIZERS
ENV_RESTART = hooks_lib.ENV_RESTART
EXIT_INJECTED_FAULT = hooks_lib.EXIT_INJECTED_FAULT
EXIT_DISK_FULL = errors.EXIT_DISK_FULL  # no space left on the device (the CLI's status for ENOSPC)
ReplicaDesyncError = errors.ReplicaDesyncError  # its old name
# Config fields that decide the shape of the saved state: a checkpoint written
# under other values cannot be resumed.
_STATE_FIELDS = ("model", "model_overrides", "optimizer")


@contextlib.contextmanager
def _as_config_error():
  """The set-up from the config: a ValueError / TypeError it raises is bad
  configuration (a library check on a value the config gave)."""
  try:
    yield
  except ConfigError:
    raise
  except (ValueError, TypeError) as e:
    raise ConfigError(str(e)) from e


def build_mesh(config) -> tuple[jax.sharding.Mesh, str | tuple[str, ...]]:
  """The mesh and the data axis (a tuple for a multi-axis mesh)."""
  if not config.get("mesh_shape", ""):
    return devices.flat_mesh(), "data"
  mesh = devices.mesh_from_text(
      config.mesh_shape, config.get("mesh_axes", ""),
      shape_name="config.mesh_shape", axes_name="config.mesh_axes",
  )
  names = mesh.axis_names
  return mesh, names[0] if len(names) == 1 else names


def build_strategy(config, axis):
  name = config.strategy
  kwargs = dict(axis=axis, algorithm=config.algorithm, bucket_bytes=int(config.bucket_bytes))
  if name == "dp":
    return DataParallel(**kwargs, compression=config.compression or None)
  if name in STRATEGIES:
    if config.compression:
      raise _fail("compression", config.compression, "compression is for strategy 'dp' only.")
    replica = config.get("replica_axis", "") or None
    if replica is not None:  # hybrid: shard over the other axes, replicate over this one
      names = checks.axis_names(axis)
      rest = tuple(a for a in names if a != replica)
      if replica not in names or not rest:
        raise _fail("replica_axis", replica,
                    f"it must be one of the mesh axes {names}, leaving at least one to shard over.")
      kwargs["axis"] = rest[0] if len(rest) == 1 else rest
    return ZeRO(stage=strategies_lib.STAGES[name], replica_axis=replica, **kwargs)
  raise _fail(
      "strategy", name,
      f"valid strategies: {', '.join(STRATEGIES)} (dp is ZeRO stage 0; ZeRO has stages 0-3).",
  )


def build_optimizer(config, schedule: optax.Schedule | None = None) -> optax.GradientTransformation:
  """``config.optimizer`` with ``config.schedule`` (see :mod:`jaxcoll.train.optim`)."""
  return optim.build_optimizer(config, schedule)


def _compute_dtype(config):
  name = config.get("compute_dtype", "float32") or "float32"
  if name not in ("float32", "bfloat16"):
    raise _fail("compute_dtype", name, "use 'float32' or 'bfloat16'.")
  return None if name == "float32" else jnp.bfloat16




def build_trainer(config, workload, mesh, axis, schedule=None) -> Trainer:
  """The Trainer the config describes (learning rate from ``schedule``)."""
  return Trainer(
      workload.loss_fn,
      build_optimizer(config, schedule),
      mesh,
      build_strategy(config, axis),
      has_aux=workload.has_aux,
      grad_accum_steps=int(config.grad_accum_steps),
      clip_global_norm=float(config.clip_global_norm) or None,
      compute_dtype=_compute_dtype(config),
      merge_aux=workload.merge_aux if workload.state_collections else None,
      nan_policy=config.get("nan_policy", "none"),
  )


def params_digest(params) -> tuple[float, str]:
  """(global norm, sha256 of the leaves in tree order as float32 LE bytes)."""
  sha = hashlib.sha256()
  total = 0.0
  for leaf in jax.tree.leaves(params):
    host = np.asarray(jax.device_get(leaf), dtype="<f4")
    sha.update(host.tobytes())
    total += float(np.sum(np.square(host, dtype=np.float64)))
  return float(np.sqrt(total)), sha.hexdigest()


def _check_config(config) -> None:
  """The checks that need no devices, before anything is built or written."""
  for field in ("steps", "global_batch_size", "log_every", "checkpoint_every",
                "check_every", "keep_checkpoints"):
    value = config.get(field, 0)
    minimum = 0 if field in ("checkpoint_every", "check_every") else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
      raise _fail(field, value, f"must be an integer >= {minimum}.")
  for field, zero_ok in (("learning_rate", False), ("watchdog_s", True)):
    value = config.get(field, 0.0)
    try:
      number = float(value)
    except (TypeError, ValueError):
      number = math.nan
    if isinstance(value, bool) or not math.isfinite(number) or number < 0 or (
        number == 0 and not zero_ok):
      want = "a finite number >= 0 (0 turns it off)" if zero_ok else "a finite number > 0"
      raise _fail(field, value, f"must be {want}, e.g. --config.{field}="
                  + ("600" if zero_ok else "1e-3") + ".")
  if ":" not in config.model and config.model not in models.names():
    raise _fail("model", config.model, f"valid models: {', '.join(models.names())}.")


def _check_batch_fits_in_memory(config, workload) -> None:
  """A batch this process cannot hold is bad input, not a MemoryError later."""
  if workload.dataset is None:  # file data: read a batch at a time, never all of it
    return
  example = workload.dataset.examples(np.arange(1))
  per_process = int(config.global_batch_size) // jax.process_count()
  need = per_process * sum(np.asarray(v).nbytes for v in example.values())
  try:
    have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError):  # pragma: no cover - not POSIX
    return
  if need > have // 2:
    raise _fail(
        "global_batch_size", config.global_batch_size,
        f"one batch needs {need / 2**30:.1f} GiB per process but this host has "
        f"{have / 2**30:.1f} GiB of memory; use a smaller batch (or more processes).",
    )


def _check_checkpoints_fit(ckpt: checkpoint.Checkpointer, config) -> None:
  """Names the config fields that differ from the newest checkpoint's, if
  they decide the shape of the saved state (e.g. optimizer adam vs adamw)."""
  step = ckpt.latest_step()
  try:
    saved = ckpt.metadata(step).get("extra") or {}
  except ValueError:  # damaged: restore skips it and says so
    return
  saved = saved.get("config") if isinstance(saved, dict) else None
  if not isinstance(saved, dict):
    return
  now = json.loads(json.dumps(config.to_dict(), default=str))  # tuples as the JSON saved
  differ = [f for f in _STATE_FIELDS if f in saved and now.get(f) != saved[f]]
  if differ:
    have = ", ".join(f"{f}={saved[f]!r}" for f in differ)
    want = ", ".join(f"{f}={now.get(f)!r}" for f in differ)
    raise ConfigError(
        f"the checkpoints in {ckpt.directory} were written with {have}, this run has "
        f"{want}; pass --config.{differ[0]}={saved[differ[0]]!r} to resume them, or use another "
        "--workdir. The checkpoints are left as they are."
    )


def _save(ckpt, trainer, state, step: int, *, config, loss, dog, hooks,
          data_state: Mapping[str, Any]) -> None:
  """Verifies, then saves checkpoint ``step``: the replicas' fingerprints
  must agree (a diverged state is never written) and the state must be
  finite (:class:`jaxcoll.checkpoint.NonFiniteStateError`). The watchdog
  covers the save under its save limit."""
  with dog.saving(step) if dog is not None else contextlib.nullcontext():
    for hook in hooks:
      hook.before_save(step)
    problems = trainer.check_fingerprints(state, raise_on_mismatch=False)
    if problems:
      raise ReplicaDesyncError(
          f"replicas diverged at step {step}: {'; '.join(problems)}. Checkpoint {step} is not "
          "written; resume from the last checkpoint (every checkpoint was verified)."
      )
    extra = {"config": config.to_dict(), "loss": loss, **data_state}
    ckpt.save(step, trainer, state, data_position=step, extra=extra)


def train_and_evaluate(config, workdir: str, *,
                       hooks: Sequence[hooks_lib.Hook] = ()) -> dict[str, Any]:
  """Trains as ``config`` says; returns the summary (also in summary.json,
  with the history of attempts: :mod:`jaxcoll.train.attempts`).

  When the newest checkpoint is already at or past ``config.steps`` it logs
  "nothing to do" and returns summary.json's content with ``steps`` (that
  checkpoint's) and ``nothing_to_do=True``, having created, written and
  pruned nothing in ``workdir``.

  Args:
    config: an ``ml_collections.ConfigDict`` with the fields of
      ``configs/base.py``.
    workdir: where metrics, checkpoints and summary.json go.
    hooks: called before each step and each save, after the fault
      injectors the config's ``*_at_step`` fields install.

  Raises:
    ConfigError: bad configuration, a busy workdir or checkpoints that do not
      fit; nothing in ``workdir`` is changed.
    FloatingPointError: non-finite gradients (``nan_policy="raise"``) or a
      non-finite state (never saved; the run does not end as a success).
    ReplicaDesyncError: the replicas diverged.
    jaxcoll.train.watchdog.StopRequested: SIGTERM; stopped after a final
      checkpoint.
  """
  t_start = time.time()
  chief = jax.process_index() == 0
  with _as_config_error():
    _check_config(config)
    # The fault-injection, straggler and profiler fields are checked here too, before any write.
    hooks = [*hooks_lib.from_config(config), *hooks]
    straggler = timing.StragglerDetector.from_config(config)
    profile_steps = profiling.parse_profile_steps(config.get("profile_steps", ""), config.steps)
    mesh, axis = build_mesh(config)
    workload = inputs.make_workload(config)
    schedule = optim.build_schedule(config)
    trainer = build_trainer(config, workload, mesh, axis, schedule)
    gbs = int(config.global_batch_size)
    state_lib.check_batch_size(gbs, trainer.dp_size, int(config.grad_accum_steps))
    data.process_batch_slice(gbs)
    _check_batch_fits_in_memory(config, workload)
    train_input = inputs.TrainInput(config, workload, mesh, axis)
    evaluator = inputs.make_evaluator(config, workload, mesh, axis)
    hooks_lib.bind_input(hooks, train_input.batch_number)  # corrupt_batches counts batches
    watch = incidents_lib.Watch.from_config(  # README "Incidents and rollback"
        config, workdir, is_chief=chief, process_count=jax.process_count(),
        gather=timing.gather_process_times)
    if chief:
      checkpoint.check_writable(workdir, "--workdir")
  check_every, steps = int(config.get("check_every", 0)), int(config.steps)

  with contextlib.ExitStack() as stack:
    if chief:
      try:
        stack.enter_context(lock_lib.WorkdirLock(workdir))
      except lock_lib.WorkdirBusyError as e:
        raise ConfigError(str(e)) from None
    newest = _existing_checkpoints(os.path.join(workdir, "checkpoints"), config)
    if newest is not None and newest >= steps:  # nothing is created, written or pruned
      if chief:
        attempts_lib.announce_nothing_to_do(step=newest, steps=steps, workdir=workdir)
      return {**(attempts_lib.read_summary(workdir, set_aside=False) or {}),
              "steps": newest, "nothing_to_do": True}
    ckpt = stack.enter_context(checkpoint.Checkpointer(
        os.path.join(workdir, "checkpoints"), keep=int(config.keep_checkpoints)))

    start, loss, saved_by = 0, float("nan"), None
    state = trainer.init(workload.init_params(int(config.seed)))
    if ckpt.latest_step() is not None:
      try:
        with _as_config_error():
          state, start, extra = ckpt.restore(trainer)
      except FileNotFoundError as e:  # every checkpoint damaged: do not train over them
        raise ConfigError(
            f"{e} Move {os.path.join(workdir, 'checkpoints')} away to start afresh."
        ) from None
      loss = float((extra or {}).get("loss", loss))
      train_input.restore(start, extra)
      watch.restore(extra)
      with contextlib.suppress(ValueError):
        saved_by = ckpt.metadata(start).get("saved_by")
    attempt = attempts_lib.Attempt(workdir, start_step=start, is_chief=chief,
                                   started_at=t_start)
    attempt.begin()
    stack.push(attempt.on_exit)  # "stopped" / "failed" when the loop raises
    hooks = [attempt.hook, *hooks]  # the fault injectors are already in `hooks` (above)
    if chief:
      layout = dict(strategy=trainer.strategy.name, devices=jax.device_count(),
                    processes=jax.process_count(), workdir=workdir)
      if start:
        attempts_lib.announce_resume(start=start, steps=steps, saved_by=saved_by, **layout)
      else:
        attempts_lib.announce_start(steps=steps, **layout)

    batch = train_input.batch(start)
    figures, step_hlo = _step_program_figures(trainer, state, batch)
    writer = metrics.MetricsWriter(
        workdir, is_chief=chief, tensorboard=config.get("tensorboard", True), start_step=start
    )
    stack.callback(writer.close)
    writer.write_run_info(config.to_dict(), figures)
    dog = watchdog.StepWatchdog(config.watchdog_s) if config.get("watchdog_s", 0) else None
    if dog is not None:  # armed once the step is compiled
      stack.callback(dog.stop)
    # Runs first, on success and errors alike: the save in flight completes, watched.
    stack.callback(_wait_watched, ckpt, dog)
    stop = watchdog.StopSignal()
    stack.callback(stop.close)
    profiler = stack.enter_context(profiling.StepProfiler(profile_steps, workdir,
                                                          start_step=start))
    step_times = []  # the rows' step_time_s, for the communication share
    progress = metrics.Progress(steps, start=start, is_chief=chief)
    skipped = 0
    timer = timing.StepTimer(straggler=straggler,
                             warn=watch.straggler_warning(logging.warning if chief else None),
                             gather=watch.row_gather(lambda: timer) or timing.gather_process_times)
    watch.begin(start)
    step_range = incidents_lib.StepRange(start, steps)  # a rollback restarts it

    for step in step_range:
      timer.start_data()  # the step's own time, apart from its batch (jaxcoll.train.timing)
      if step != start or step_range.restarted:
        batch = train_input.batch(step)
      for hook in hooks:
        batch, state = hook.before_step(step + 1, batch, state)
      kept = watch.keep(state)  # a copy only when a response is `skip` (the step donates state)
      with profiler.step(step + 1):  # traced when in config.profile_steps
        timer.start_step()
        state, step_metrics = trainer.step(state, batch)
        timer.dispatched()
        watch.prefetch(step_metrics)  # the detectors read loss and grad norm after the step
        jax.block_until_ready((state, step_metrics))
        timer.end_step()
      done = step + 1
      if dog is not None:
        dog.beat(done)
      skipped += int(step_metrics.get("skipped", 0))
      watch.after_step(done, step_metrics, batch=train_input.batch_number(done))

      if check_every and done % check_every == 0:
        problems = trainer.check_fingerprints(state, raise_on_mismatch=False)
        if problems:
          raise ReplicaDesyncError(
              f"replicas diverged at step {done}: {'; '.join(problems)}. Stopping before "
              "anything else is saved; resume from the last checkpoint."
          )

      if done % config.log_every == 0 or done == steps:
        loss = float(step_metrics["loss"])
        row = {
            "loss": loss,
            "grad_norm": float(step_metrics["grad_norm"]),
            "learning_rate": float(schedule(done - 1)),  # the rate of this step's update
            **timer.row(gbs, done),  # every process: one small allgather
        }
        step_times.append(row["step_time_s"])
        watch.after_row(done, row)
        if trainer.nan_policy != "none":
          row["skipped_steps"] = skipped
        writer.write(done, row)
        progress.update(done, {"loss": loss, "step_time_s": row["step_time_s"]})

      if evaluator is not None and (done % config.eval_every == 0 or done == steps):
        t_eval = time.perf_counter()
        with dog.evaluating(done) if dog is not None else contextlib.nullcontext():
          evaluated = evaluator.run(trainer.params(state))
        writer.write(done, {**evaluated, "eval_time_s": time.perf_counter() - t_eval})
        watch.after_eval(done, evaluated)

      if watch.pending:  # incidents at this step: log them and respond
        state, restart = watch.respond(
            done, state, kept, ckpt=ckpt, trainer=trainer, train_input=train_input,
            init=lambda: trainer.init(workload.init_params(int(config.seed))))
        writer.write(done, {f"incident/{i['signal']}": 1 for i in watch.last})  # TB markers
        if restart is not None:
          step_range.restart(restart)
          continue
      stopping = stop.requested(done) or watch.stopping is not None
      every = config.checkpoint_every
      if every and (done % every == 0 or done == steps or stopping) and watch.may_save:
        loss = float(step_metrics["loss"])
        t_save = time.perf_counter()
        _save(ckpt, trainer, state, done, config=config, loss=loss, dog=dog, hooks=hooks,
              data_state={**train_input.state(), **watch.checkpoint_extra(done)})
        writer.write(done, {"checkpoint_time_s": time.perf_counter() - t_save})
      if stopping:
        if watch.stopping is not None:
          raise watch.stop_error(done, saved=bool(every) and watch.may_save)
        raise watchdog.StopRequested(done, saved=bool(every))

    shares = profiling.share_figures(figures["comm_time_estimate_s"], step_times, step_hlo,
                                     profiler)
    writer.write_figures(shares, step=max(steps, start))  # known once the attempt's rows are
    figures |= shares

  try:
    params = trainer.params(state)
    _check_finite(params, max(steps, start))
    norm, sha = params_digest(params)
  except BaseException as e:
    attempt.on_exit(type(e), e, e.__traceback__)
    raise
  summary = {
      "steps": max(steps, int(start)),  # a newer checkpoint is not undone
      "start_step": int(start),
      "final_loss": loss,
      "params_global_norm": norm,
      "params_sha256": sha,
      "wall_time_s": time.time() - t_start,
      "num_devices": len(jax.devices()),
      "num_processes": jax.process_count(),
      **figures,
      "skipped_steps": skipped,
      **(evaluator.last if evaluator is not None else {}),
      **train_input.report(),
      **watch.summary(),
      "config": config.to_dict(),
  }
  attempt.end(attempts_lib.COMPLETED, end_step=max(steps, start), summary=summary)
  return {**summary, "attempts": attempt.history}


def _existing_checkpoints(directory: str, config) -> int | None:
  """Checks that the checkpoints in ``directory`` fit ``config``
  (:func:`_check_checkpoints_fit`) and returns the newest committed step
  whose metadata reads back intact (the one a restore starts from, unless
  its arrays are damaged); None if there is none. Creates and changes
  nothing there."""
  found = os.path.isdir(directory)
  if jax.process_count() > 1:  # process 0's answer for all: orbax's calls are collective
    found = bool(multihost_utils.broadcast_one_to_all(np.int32(found)))
  if not found:
    return None
  with checkpoint.Checkpointer(directory, keep=None, read_only=True) as view:
    if view.latest_step() is not None:
      _check_checkpoints_fit(view, config)
    for step in reversed(view.all_steps()):
      try:
        view.metadata(step)
      except ValueError:
        continue
      return step
  return None


def _wait_watched(ckpt, dog) -> None:
  with dog.saving() if dog is not None else contextlib.nullcontext():
    ckpt.wait()


def _check_finite(params, step: int) -> None:
  """A run never ends as a success with NaN or infinite parameters."""
  bad = [jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
         if jnp.issubdtype(leaf.dtype, jnp.inexact) and not bool(jnp.all(jnp.isfinite(leaf)))]
  if bad:
    raise FloatingPointError(
        f"the parameters after step {step} are not finite (NaN or infinity in {bad[:4]}); "
        "no summary is written. Lower the learning rate, clip gradients, or set "
        "nan_policy='skip'."
    )


def _step_program_figures(trainer: Trainer, state, batch) -> tuple[dict[str, Any], str]:
  """The one-off figures of the compiled step, and its optimized HLO text.

  Bytes each device sends per step (comm_report of the compiled step), XLA's
  per-device memory for it, and the cost model's time of its collectives on
  the run's topology (:func:`jaxcoll.comm_share.estimate_comm_time`). The
  compiled program is cached, so the first step does not compile again.
  """
  compiled = trainer.compile_step(state, batch)
  memory = analysis.peak_bytes(compiled.memory_analysis())
  text = compiled.as_text()
  return {
      "comm_bytes_per_step": analysis.report_from_hlo(text).total_bytes_sent_per_device,
      "memory_bytes_per_device": memory,
      "comm_time_estimate_s": comm_share.estimate_comm_time(text).seconds,
  }, text
