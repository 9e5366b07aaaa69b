"""The training loop behind ``python -m experiments.train``.

``train_and_evaluate(config, workdir)`` builds the mesh, the workload, the
strategy and the Trainer from a ``ConfigDict``; resumes from the newest
checkpoint in ``workdir``; trains ``config.steps`` steps; writes
``metrics.jsonl``, TensorBoard events, checkpoints and ``summary.json``.
Every process of a multi-host job runs it; process 0 writes the files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from jaxcoll import analysis, checkpoint, data, devices, metrics, models
from jaxcoll.train import inputs, optim, watchdog
from jaxcoll.train import state as state_lib
from jaxcoll.train.strategies import DataParallel, ZeRO
from jaxcoll.train.trainer import Trainer

STRATEGIES = ("dp", "zero1", "zero2", "zero3")
OPTIMIZERS = optim.OPTIMIZERS
ENV_RESTART = "JAXCOLL_RESTART"


def _fail(field: str, value: Any, fix: str) -> ValueError:
  return ValueError(f"`config.{field}`={value!r}: {fix}")


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
  if name in ("zero1", "zero2", "zero3"):
    if config.compression:
      raise _fail("compression", config.compression, "compression is for strategy 'dp' only.")
    return ZeRO(stage=int(name[-1]), **kwargs)
  raise _fail(
      "strategy", name,
      f"valid strategies: {', '.join(STRATEGIES)} (dp is ZeRO stage 0; ZeRO has stages 0-3).",
  )


def build_optimizer(config) -> optax.GradientTransformation:
  """``config.optimizer`` with ``config.schedule`` (see :mod:`jaxcoll.train.optim`)."""
  return optim.build_optimizer(config)


def _compute_dtype(config):
  name = config.get("compute_dtype", "float32") or "float32"
  if name not in ("float32", "bfloat16"):
    raise _fail("compute_dtype", name, "use 'float32' or 'bfloat16'.")
  return None if name == "float32" else jnp.bfloat16


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
  for field in ("steps", "global_batch_size", "log_every", "checkpoint_every"):
    value = config[field]
    minimum = 1 if field in ("steps", "global_batch_size", "log_every") else 0
    if not isinstance(value, int) or value < minimum:
      raise _fail(field, value, f"must be an integer >= {minimum}.")
  if ":" not in config.model and config.model not in models.names():
    raise _fail("model", config.model, f"valid models: {', '.join(models.names())}.")


EXIT_INJECTED_FAULT = 17


class ReplicaDesyncError(RuntimeError):
  """The fingerprint check found replicas that are no longer identical."""


def _maybe_fail(config, step: int) -> None:
  """Fault injection, process 0, first attempt only (``JAXCOLL_RESTART`` = 0):
  ``fail_at_step`` exits abruptly, ``hang_at_step`` stops making progress."""
  if jax.process_index() != 0 or int(os.environ.get(ENV_RESTART, "0")) != 0:
    return
  if config.get("fail_at_step", 0) and step == config.fail_at_step:
    logging.warning("fail_at_step=%d: process 0 exits abruptly (fault injection).", step)
    os._exit(EXIT_INJECTED_FAULT)
  if config.get("hang_at_step", 0) and step == config.hang_at_step:
    logging.warning("hang_at_step=%d: process 0 hangs (fault injection).", step)
    while True:
      time.sleep(3600)


@contextlib.contextmanager
def _paused(dog, step: int):
  """Host work between steps (checkpoint, desync check) is not a stall."""
  if dog is not None:
    dog.pause()
  try:
    yield
  finally:
    if dog is not None:
      dog.beat(step)


def _inject(config, step: int, batch, state):
  """Fault injection for the reliability tests (off by default):
  ``nan_at_step`` makes that step's batch non-finite (every attempt);
  ``desync_at_step`` moves one replica of the first parameter on process 0
  (first attempt only)."""
  if config.get("nan_at_step", 0) == step:
    batch = jax.tree.map(
        lambda x: x * jnp.nan if jnp.issubdtype(x.dtype, jnp.floating) else x, batch
    )
  if (
      config.get("desync_at_step", 0) == step
      and jax.process_index() == 0
      and int(os.environ.get(ENV_RESTART, "0")) == 0
  ):
    leaves, treedef = jax.tree.flatten(state.params)
    leaves[0] = state_lib.perturb_replica(leaves[0])
    state = state._replace(params=treedef.unflatten(leaves))
  return batch, state


def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  """Trains as ``config`` says; returns the summary (also in summary.json)."""
  t_start = time.time()
  _check_config(config)
  chief = jax.process_index() == 0
  if chief:
    checkpoint.check_writable(workdir, "--workdir")
  mesh, axis = build_mesh(config)
  workload = inputs.make_workload(config)
  schedule = optim.build_schedule(config)
  trainer = Trainer(
      workload.loss_fn,
      optim.build_optimizer(config, schedule),
      mesh,
      build_strategy(config, axis),
      has_aux=workload.has_aux,
      grad_accum_steps=int(config.grad_accum_steps),
      clip_global_norm=float(config.clip_global_norm) or None,
      compute_dtype=_compute_dtype(config),
      merge_aux=workload.merge_aux if workload.state_collections else None,
      nan_policy=config.get("nan_policy", "none"),
  )
  # Checked before anything is written to `workdir`.
  state_lib.check_batch_size(int(config.global_batch_size), trainer.dp_size,
                             int(config.grad_accum_steps))
  data.process_batch_slice(int(config.global_batch_size))
  train_input = inputs.TrainInput(config, workload, mesh, axis)
  evaluator = inputs.make_evaluator(config, workload, mesh, axis)
  state = trainer.init(workload.init_params(int(config.seed)))
  with contextlib.ExitStack() as cleanup:
    ckpt = checkpoint.Checkpointer(
        os.path.join(workdir, "checkpoints"), keep=int(config.keep_checkpoints)
    )
    cleanup.callback(ckpt.close)
    cleanup.callback(ckpt.wait)  # runs first: a pending save completes, even on errors
    start, loss = 0, float("nan")
    if ckpt.latest_step() is not None:
      try:
        state, start, extra = ckpt.restore(trainer)
      except FileNotFoundError as e:  # every checkpoint damaged: do not train over them
        raise ValueError(
            f"{e} Move {os.path.join(workdir, 'checkpoints')} away to start afresh."
        ) from None
      loss = float((extra or {}).get("loss", loss))
      train_input.restore(start, extra)
      logging.info("Resumed from step %d in %s", start, workdir)
    batch = train_input.batch(start)
    figures = _step_program_figures(trainer, state, batch)
    writer = metrics.MetricsWriter(
        workdir, is_chief=chief, tensorboard=config.get("tensorboard", True), start_step=start
    )
    cleanup.callback(writer.close)
    if config.get("watchdog_s", 0):
      dog = watchdog.StepWatchdog(config.watchdog_s)
      cleanup.callback(dog.stop)
      cleanup.callback(dog.pause)  # the final checkpoint may take a while
    else:
      dog = None
    state, loss, skipped = _train_steps(
        config, state, batch, start=start, loss=loss, trainer=trainer, workload=workload,
        mesh=mesh, axis=axis, ckpt=ckpt, writer=writer, dog=dog, figures=figures, chief=chief,
        train_input=train_input, evaluator=evaluator, schedule=schedule,
    )
  norm, sha = params_digest(trainer.params(state))
  summary = {
      "steps": max(int(config.steps), int(start)),  # a newer checkpoint is not undone
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
      "config": config.to_dict(),
  }
  if chief:
    _write_json_atomic(os.path.join(workdir, "summary.json"), summary)
  return summary


def _step_program_figures(trainer: Trainer, state, batch) -> dict[str, Any]:
  """Bytes each device sends per step (comm_report of the compiled step) and
  XLA's per-device memory for it. The compiled program is cached, so the
  first step does not compile again."""
  compiled = trainer.compile_step(state, batch)
  mem = compiled.memory_analysis()
  memory = None
  if mem is not None:
    memory = int(
        mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes
    )
  return {
      "comm_bytes_per_step": analysis.report_from_hlo(compiled.as_text())
      .total_bytes_sent_per_device,
      "memory_bytes_per_device": memory,
  }


def _train_steps(config, state, batch, *, start, loss, trainer, workload, mesh, axis,
                 ckpt, writer, dog, figures, chief, train_input, evaluator, schedule):
  """Steps ``start .. config.steps``: log, check, checkpoint. Returns
  ``(state, last loss, skipped steps)``."""
  gbs = int(config.global_batch_size)
  progress = metrics.Progress(config.steps, start=start, is_chief=chief)
  check_every = int(config.get("check_every", 0))
  last_logged, t_last, skipped = start, time.perf_counter(), 0
  for step in range(start, config.steps):
    _maybe_fail(config, step + 1)
    if step != start:
      batch = train_input.batch(step)
    batch, state = _inject(config, step + 1, batch, state)
    state, step_metrics = trainer.step(state, batch)
    done = step + 1
    if dog is not None:
      dog.beat(done)
    if "skipped" in step_metrics:
      skipped += int(step_metrics["skipped"])
    if check_every and done % check_every == 0:
      with _paused(dog, done):
        problems = trainer.check_fingerprints(state, raise_on_mismatch=False)
      if problems:
        raise ReplicaDesyncError(
            f"replicas diverged at step {done}: {'; '.join(problems)}. Stopping before "
            "anything else is saved; resume from the last checkpoint."
        )
    if done % config.log_every == 0 or done == config.steps:
      loss = float(step_metrics["loss"])  # waits for the step
      now = time.perf_counter()
      elapsed = (now - t_last) / (done - last_logged)  # per step since the last log
      last_logged, t_last = done, now
      row = {
          "loss": loss,
          "grad_norm": float(step_metrics["grad_norm"]),
          "step_time_s": elapsed,
          "examples_per_s": gbs / elapsed if elapsed > 0 else None,
          "learning_rate": float(schedule(done - 1)),  # the rate of this step's update
          **figures,
      }
      if trainer.nan_policy != "none":
        row["skipped_steps"] = skipped
      writer.write(done, row)
      progress.update(done, {"loss": loss, "step_time_s": elapsed})
    if evaluator is not None and (done % config.eval_every == 0 or done == config.steps):
      t_eval = time.perf_counter()
      with _paused(dog, done):
        writer.write(done, evaluator.run(trainer.params(state)))
      t_last += time.perf_counter() - t_eval  # eval time is not step time
    if config.checkpoint_every and (done % config.checkpoint_every == 0 or done == config.steps):
      loss = float(step_metrics["loss"])
      extra = {"config": config.to_dict(), "loss": loss, **train_input.state()}
      with _paused(dog, done):  # the save first waits for the previous one
        ckpt.save(done, trainer, state, data_position=done, extra=extra)
  return state, loss, skipped


def _write_json_atomic(path: str, value: Mapping[str, Any]) -> None:
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(value, f, indent=1, default=str)
  os.replace(tmp, path)
