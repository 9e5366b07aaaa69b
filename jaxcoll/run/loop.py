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
import shutil
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

from jaxcoll.observe import analysis, comm_share, metrics, rss
from jaxcoll.train import axes_bound
from jaxcoll.train import canonical as canonical_lib
from jaxcoll.train import checkpoint
from jaxcoll import checks, data, errors
from jaxcoll.comm_model import tuning
from jaxcoll.runtime import devices, distributed, liveness
from jaxcoll.run import attempts as attempts_lib
from jaxcoll.run import config as run_config
from jaxcoll.run import hooks as hooks_lib
from jaxcoll.run import incidents as incidents_lib
from jaxcoll.run import inputs, optim, profiling, timing, watchdog
from jaxcoll.run import lock as lock_lib
from jaxcoll.train import state as state_lib
from jaxcoll.run.config_error import ConfigError
from jaxcoll.run.config_error import fail as _fail
from jaxcoll.run.config_error import from_user_code
from jaxcoll.train import strategies as strategies_lib
from jaxcoll.train.strategies import DataParallel, ZeRO
from jaxcoll.train.trainer import Trainer

STRATEGIES = run_config.STRATEGIES  # dp, zero1, zero2, zero3
OPTIMIZERS = optim.OPTIMIZERS
ENV_RESTART = hooks_lib.ENV_RESTART
EXIT_INJECTED_FAULT = hooks_lib.EXIT_INJECTED_FAULT
EXIT_DISK_FULL = errors.EXIT_DISK_FULL  # no space left on the device (the CLI's status for ENOSPC)
ReplicaDesyncError = errors.ReplicaDesyncError  # its old name
EvalError = errors.EvalError
# Config fields that decide the shape of the saved state: a checkpoint written
# under other values cannot be resumed.
_STATE_FIELDS = ("model", "model_overrides", "optimizer")


@contextlib.contextmanager
def _as_config_error():
  """The set-up from the config: a ValueError / TypeError it raises is bad
  configuration (a library check on a value the config gave), unless it
  came from the user's own code (:func:`config_error.from_user_code`)."""
  try:
    yield
  except ConfigError:
    raise
  except (ValueError, TypeError) as e:
    if from_user_code(e):  # the user's model or data code: its traceback, not a config line
      raise
    raise ConfigError(_config_names(str(e))) from e


# Config fields passed unchanged to a library constructor, whose check names its own argument:
# the command line's line names the config field ("DataParallel: `compression` ..." read as
# if there were a `compression` flag).
_PASSED_THROUGH = ("algorithm", "bucket_bytes", "compression", "nan_policy")


def _config_names(message: str) -> str:
  """``message`` with a library argument that is a config field named as ``config.FIELD``.

  >>> _config_names("DataParallel: `compression` must be one of ...; got 'fp8'.")
  "`config.compression` must be one of ...; got 'fp8'."
  """
  for field in _PASSED_THROUGH:
    if message.startswith((f"`{field}`", f"DataParallel: `{field}`", f"ZeRO: `{field}`")):
      return f"`config.{field}`" + message.split(f"`{field}`", 1)[1]
  return message


_PROBLEM_BYTES = 4096  # the longest bad-input line shared between processes


@contextlib.contextmanager
def _decided_together(held: lock_lib.WorkdirLock | None):
  """The set-up's bad-input checks decide for every process of the job.

  Some checks are made by process 0 alone (the workdir, its lock); the rest
  by all. After them, every process learns whether any found bad input
  (one small allgather), and each then raises :class:`ConfigError` with
  the first such process's line, named ``process P of N: ...`` (its own, if
  it has one: a path only one host lacks is then said as that host sees it): so every process
  of the job ends with exit 2 at once, instead of the others waiting in the
  next collective until a timeout. ``held`` (process 0's workdir lock) is
  released when the job stops here.
  """
  problem: ConfigError | None = None
  try:
    yield
  except ConfigError as e:
    problem = e
  if jax.process_count() > 1:
    row = np.zeros(_PROBLEM_BYTES, np.uint8)
    if problem is not None:
      text = str(problem).encode()[: _PROBLEM_BYTES - 1]
      row[0], row[1 : 1 + len(text)] = 1, np.frombuffer(text, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(row))
    first = next((p for p, r in enumerate(rows) if r[0]), None)
    if problem is None and first is not None:  # another's: say whose (its config, its files)
      text = bytes(rows[first][1:]).rstrip(b"\0").decode(errors="replace")
      problem = ConfigError(f"process {first} of {len(rows)}: {text}")
  if problem is not None:
    if held is not None:
      held.release()
    raise problem


def build_mesh(config) -> tuple[jax.sharding.Mesh, str | tuple[str, ...]]:
  """The mesh and the data axis (a tuple for a multi-axis mesh)."""
  config = run_config.parse(config)
  if not config.mesh_shape:
    return devices.flat_mesh(), "data"
  mesh = devices.mesh_from_text(
      config.mesh_shape, config.mesh_axes,
      shape_name="config.mesh_shape", axes_name="config.mesh_axes",
  )
  names = mesh.axis_names
  return mesh, names[0] if len(names) == 1 else names


def build_strategy(config, axis):
  config = run_config.parse(config)  # the strategy's name and compression are checked there
  name = config.strategy
  kwargs = dict(axis=axis, algorithm=config.algorithm, bucket_bytes=config.bucket_bytes)
  replica = config.replica_axis or None
  names = checks.axis_names(axis)
  if name == "dp":
    # DP replicates over every axis: a mesh axis given here (kept from a hybrid command
    # line) changes nothing; a name the mesh lacks is a typo, refused as under zero*.
    if replica is not None and replica not in names:
      raise _fail("replica_axis", replica,
                  f"it must be one of the mesh axes {names} (strategy dp replicates over all "
                  "of them; omit it).")
    return DataParallel(**kwargs, compression=config.compression or None)
  if replica is not None:  # hybrid: shard over the other axes, replicate over this one
    rest = tuple(a for a in names if a != replica)
    if replica not in names or not rest:
      raise _fail("replica_axis", replica,
                  f"it must be one of the mesh axes {names}, leaving at least one to shard over.")
    kwargs["axis"] = rest[0] if len(rest) == 1 else rest
  return ZeRO(stage=strategies_lib.STAGES[name], replica_axis=replica, **kwargs)


def build_optimizer(config, schedule: optax.Schedule | None = None) -> optax.GradientTransformation:
  """``config.optimizer`` with ``config.schedule`` (see :mod:`jaxcoll.train.optim`)."""
  return optim.build_optimizer(config, schedule)


def _compute_dtype(config):
  return None if (config.compute_dtype or "float32") == "float32" else jnp.bfloat16




def build_trainer(config, workload, mesh, axis, schedule=None) -> Trainer:
  """The Trainer the config describes (learning rate from ``schedule``)."""
  config = run_config.parse(config)
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
      nan_policy=config.nan_policy,
      # Dropout & co.: a key of its own, apart from the parameters' init key.
      rng=jax.random.fold_in(jax.random.key(int(config.seed)), 1) if workload.takes_rng else None,
  )


def params_digest(params) -> tuple[float, str]:
  """(global norm, sha256 of the leaves in tree order as float32 LE bytes)."""
  return leaves_digest(jax.device_get(leaf) for leaf in jax.tree.leaves(params))


def leaves_digest(leaves) -> tuple[float, str]:
  """:func:`params_digest` of an iterable of leaves (e.g. ``Trainer.host_params``), one at a time."""
  sha = hashlib.sha256()
  total = 0.0
  for leaf in leaves:
    host = np.asarray(leaf, dtype="<f4")
    sha.update(host.tobytes())
    total += float(np.sum(np.square(host, dtype=np.float64)))
  return float(np.sqrt(total)), sha.hexdigest()


def _state_digest(trainer: Trainer, state, step: int) -> tuple[float, str]:
  """:func:`params_digest` of the state's parameters, shard by shard
  (``Trainer.params_digest``: no replicated copy of the model), refusing
  non-finite ones: a run never ends as a success with NaN or infinite parameters."""
  norm, sha, bad = trainer.params_digest(state)
  if bad:
    raise FloatingPointError(
        f"the parameters after step {step} are not finite (NaN or infinity in {bad[:4]}); "
        "no summary is written. Lower the learning rate, clip gradients, or set "
        "nan_policy='skip'."
    )
  return norm, sha


def _with_digest(error: watchdog.StopRequested, trainer: Trainer, state):
  """``error`` (a stop after a step) carrying the digest of the parameters it stops with, for
  its attempt's entry in summary.json (``attempt_detail``: ``params_sha256``,
  ``params_global_norm``): a stopped attempt named no parameters at all, so nothing told
  which params its final checkpoint holds (summary.json's top level stays the last completed
  attempt's). Every process stops at the same step, so each takes part in the digest's
  collectives. Non-finite parameters: none named (the stop is not made an error). The stop
  comes first: a state over ``STOP_DIGEST_MAX_BYTES`` is not digested (hashing it on the
  host could outlast a preemption's grace period, and the attempt would go unrecorded), and a
  digest that fails leaves the stop as it was (its exit status is what a requeue reads)."""
  try:
    size = sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(state))
    if size > STOP_DIGEST_MAX_BYTES:
      return error
    norm, sha, bad = trainer.params_digest(state)
  except Exception:  # noqa: BLE001  (the stop's own status wins)
    return error
  if not bad:
    error.attempt_detail = {"params_sha256": sha, "params_global_norm": norm}
  return error


STOP_DIGEST_MAX_BYTES = 4 << 30  # a stopped attempt's state digested, at most (global bytes)


def _check_watch_limits(config) -> None:
  """In a multi-process job the watchdog's limits fit inside JAX's heartbeat
  timeout (a hung peer must end in the watchdog's exit 86 and its message,
  not JAX's abort, exit 134)."""
  config = run_config.parse(config)  # save_timeout_s: a finite number >= 0
  heartbeat, need = distributed.heartbeat_timeout_s(), watchdog.heartbeat_needed_s(config)
  if heartbeat is not None and need is not None and heartbeat < need:
    step_s, save_s = watchdog.limits(config)
    raise ConfigError(
        f"`config.watchdog_s`={step_s:g} / `config.save_timeout_s`={save_s:g} (the save limit) "
        f"do not fit JAX's heartbeat timeout of {heartbeat} s (JAXCOLL_HEARTBEAT_TIMEOUT_S): a "
        "hung peer would make JAX abort the job (exit 134) before the watchdog reports it "
        f"(exit 86). Set JAXCOLL_HEARTBEAT_TIMEOUT_S={need} or more (twice the longer limit + "
        f"{watchdog.HEARTBEAT_MARGIN_S} s), or lower the limits."
    )


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


def _check_loss_is_scalar(config, workload, train_input, rows: int, mesh=None) -> None:
  """A loss that returns a vector (a loss per example, not their mean) is
  bad input, named before training (it would fail in the step's compile);
  so is a model that reduces over a mesh axis this run's mesh does not have
  (``nn.BatchNorm(axis_name="data")`` on a ``node, local`` mesh: JAX's
  "unbound axis name" at the first step's compile, after the workdir was
  written). The loss is only traced (``jax.eval_shape``), on ``rows`` rows,
  as the step runs it: in training mode (with a key when it takes one) and,
  given ``mesh``, inside a ``shard_map`` over every axis of it."""
  if train_input.files is not None:
    sample = train_input.files.source.read_rows([0])
  elif workload.dataset is not None:
    sample = workload.dataset.examples(np.arange(1))
  else:  # pragma: no cover - TrainInput refuses this
    return
  structs = {k: jax.ShapeDtypeStruct((max(rows, 1), *np.shape(v)[1:]), np.asarray(v).dtype)
             for k, v in sample.items()}
  key = (jax.random.key(0),) if workload.takes_rng else ()
  traced = workload.loss_fn
  if mesh is not None:  # every input whole on each device: only the names and shapes matter
    traced = jax.shard_map(workload.loss_fn, mesh=mesh, in_specs=P(), out_specs=P(),
                           check_vma=False)
  try:
    out = jax.eval_shape(traced, workload.param_shapes, structs, *key)
  except NameError as e:  # a collective over an axis name no mesh axis has
    name = axes_bound.unbound_axis_name(e)
    if mesh is None or name is None:
      return
    axes = tuple(mesh.axis_names)
    every = axes[0] if len(axes) == 1 else axes
    raise _fail("model", config.model,
                f"it reduces over mesh axis {name!r} (e.g. nn.BatchNorm(axis_name="
                f"{name!r})), which this run's mesh does not have: its axes are "
                f"{axes} (config.mesh_axes). Name them, axis_name={every!r}, for statistics "
                "over the whole global batch.") from None
  except ValueError as e:  # a shipped model's own check of its axis names (resnet's
    # bn_axis_name='data' on a `node, local` mesh): it was a traceback at the first step
    if mesh is None or from_user_code(e) or "is not bound here" not in str(e):
      return
    raise ConfigError(f"`config.model_overrides` of model {config.model!r}: {e} (at the "
                      "command line: --config.model_overrides.bn_axis_name='*')") from None
  except Exception:  # noqa: BLE001  (any other trace error shows at the first step, in full)
    return
  loss = out[0] if isinstance(out, (tuple, list)) else out
  shape = tuple(getattr(loss, "shape", ()))
  if shape != ():
    raise _fail("model", config.model,
                f"its loss_fn returns shape {shape}, not a scalar; return the mean over the "
                "batch (e.g. jnp.mean(per_example_loss)) as the loss.")


def _check_state_exports(config, trainer: Trainer, workload) -> None:
  """Checkpoints hold the layout-free state (the optimizer state one device would have):
  an optimizer whose state structure ZeRO's rows change (a mask on exact sizes) cannot be
  saved (adafactor's factored moments can: ZeRO updates them on the full leaves). Found
  from shapes before anything is written; it was the first save's ValueError traceback,
  after the steps before it were trained and lost."""
  if not config.checkpoint_every:
    return
  trainer.abstract_state(workload.param_shapes)  # shapes only; the run builds the same
  try:
    trainer.export_shapes()
  except ValueError as e:
    why = str(e).removeprefix("`optimizer`: ").split(" Use jaxcoll.DataParallel")[0]
    raise _fail("optimizer", config.optimizer,
                f"under `config.strategy`={config.strategy!r} its state cannot be "
                f"checkpointed ({why.rstrip('.')}): use --config.strategy=dp, an elementwise "
                "optimizer (adam, adamw, lion, sgd, momentum), or --config.checkpoint_every=0 "
                "(no checkpoints, no resume).") from None


def _check_checkpoints_fit(ckpt: checkpoint.Checkpointer, config,
                           leaf_specs: Mapping[str, tuple[tuple[int, ...], str]] | None = None
                           ) -> None:
  """Names the config fields that differ from the newest checkpoint's, if
  they decide the shape of the saved state (e.g. optimizer adam vs adamw).

  ``leaf_specs``: this run's state leaves (``{path: (shape, dtype name)}``, as the
  checkpoint's metadata names them). Given, ``model_overrides`` that differ but leave every
  leaf as saved (a BatchNorm's axis names for another mesh, a mask rate, remat) are no
  refusal: the resume goes on and :func:`config_changes` names them."""
  step = ckpt.latest_step()
  try:
    meta = ckpt.metadata(step)
  except ValueError:  # damaged: restore skips it and says so
    return
  saved = meta.get("extra") or {}
  saved = saved.get("config") if isinstance(saved, dict) else None
  if not isinstance(saved, dict):
    return
  now = json.loads(json.dumps(config.to_dict(), default=str))  # tuples as the JSON saved
  differ = [f for f in _STATE_FIELDS if f in saved and now.get(f) != saved[f]]
  if differ == ["model_overrides"] and leaf_specs is not None and now.get("model") == saved.get(
      "model"):
    leaves = meta.get("leaves")
    # dtypes too: a restore casts each leaf to this run's dtype (param_dtype='bfloat16')
    if leaves and not canonical_lib.spec_mismatches(canonical_lib.saved_specs(leaves),
                                                    leaf_specs):
      return
  if differ:
    have = ", ".join(f"{f}={saved[f]!r}" for f in differ)
    want = ", ".join(f"{f}={now.get(f)!r}" for f in differ)
    value = repr(saved[differ[0]])
    if not isinstance(saved[differ[0]], str):  # a dict or list: quoted for the shell, as pasted
      value = f'"{value}"'
    raise ConfigError(
        f"the checkpoints in {ckpt.directory} were written with {have}, this run has "
        f"{want}; pass --config.{differ[0]}={value} to resume them, or use another "
        "--workdir. The checkpoints are left as they are."
    )


# Config fields a resume may change without changing what the run trains: how long it runs
# (`steps`, unless a decaying schedule ends there), how often it logs, saves, evaluates and
# checks, how it is watched, and the layout (a checkpoint reshards; the resume line names the
# layout), gradient accumulation included (the same global batch in more micro-batches: the
# same update, what a user changes to fit a device with less memory). Any other field that
# differs from the restored checkpoint's is named in one line.
_BOOKKEEPING = ("steps", "eval_every", "log_every", "checkpoint_every", "keep_checkpoints",
                "tensorboard", "profile_steps", "straggler_factor", "straggler_steps",
                "check_every", "watchdog_s", "save_timeout_s", "fail_at_step", "hang_at_step",
                "fail_process", "desync_at_step", "slow_process", "slow_seconds", "strategy",
                "algorithm", "tuning_table", "bucket_bytes", "mesh_shape", "mesh_axes",
                "replica_axis", "grad_accum_steps",
                "data.eval", "data.eval_examples", "data.eval_batch_size", "data.num_threads",
                "data.allow_changed_files",  # a permission: what it lets change is logged
                "data.prefetch", "data.cache_mib",
                # which eval the watch compares: its own line says the best starts afresh
                "incidents.eval_metric", "incidents.eval_mode")


def config_changes(saved: Mapping[str, Any] | None, config) -> list[str]:
  """The fields of ``config`` that differ from ``saved`` (a checkpoint's ``extra["config"]``)
  and change what a resumed run trains, as ``name old -> new``: every field but the
  bookkeeping ones (``_BOOKKEEPING``; ``steps`` counts under a decaying schedule, whose
  length it is) and those :func:`_check_checkpoints_fit` refuses. Fields the checkpoint's
  version did not have are not compared.

  >>> config_changes({"learning_rate": 0.001, "steps": 10, "data": {"skip": ""}},
  ...                {"learning_rate": 0.5, "steps": 20, "data": {"skip": "3:4"}})
  ['learning_rate 0.001 -> 0.5', "data.skip '' -> '3:4'"]
  """
  if not isinstance(saved, Mapping):
    return []
  now = json.loads(json.dumps(dict(config.to_dict() if hasattr(config, "to_dict") else config),
                              default=str))
  old, new = metrics.flatten_config(saved), metrics.flatten_config(now)
  free = set(_BOOKKEEPING) | set(_STATE_FIELDS)
  if (new.get("schedule") or "constant") != "constant":
    free.discard("steps")
  # `model_overrides` that reach a resume left every leaf as saved: named (the others are
  # refused first).
  return [f"{name} {old[name]!r} -> {new[name]!r}" for name in new
          if name in old and name.split(".")[0] not in ("model", "optimizer")
          and name not in free and json.dumps(old[name]) != json.dumps(new[name])]


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
  # SIGTERM / SIGINT from the very start (a Ctrl-C while compiling stops
  # after the first step, with a checkpoint), and the handlers put back after.
  stop = watchdog.StopSignal()
  try:
    with tuning.kept():  # config.tuning_table's, for this run only (_use_tuning_table)
      return _train_and_evaluate(config, workdir, hooks=hooks, stop=stop)
  finally:
    stop.close()


def _use_tuning_table(path: str) -> None:
  """Makes the table at ``path`` the one ``algorithm=auto`` consults, checked to be the same on
  every process (:func:`jaxcoll.tuning.load_agreed`; ``""``: the shipped one, or the one a
  program called :func:`jaxcoll.tuning.use` with). Every process joins its allgather, one
  that cannot read the file too (else the others would wait there while it is in
  :func:`_decided_together`'s: a collective mismatch that aborts the job)."""
  if path:
    try:
      tuning.use(tuning.load_agreed(path, "config.tuning_table"))
    except ValueError as e:
      raise ConfigError(str(e)) from None


def _train_and_evaluate(config, workdir: str, *, hooks: Sequence[hooks_lib.Hook],
                        stop: watchdog.StopSignal) -> dict[str, Any]:
  """Trains as ``config`` says; returns the summary (also in summary.json,
  with the history of attempts: :mod:`jaxcoll.train.attempts`).

  When the newest checkpoint is already at or past ``config.steps`` it logs
  "nothing to do" and returns summary.json's content with ``steps`` (that
  checkpoint's) and ``nothing_to_do=True``, having created, written and
  pruned nothing in ``workdir``.

  Args:
    config: a :class:`jaxcoll.run.config.RunConfig`, or an
      ``ml_collections.ConfigDict`` (or mapping) of its fields
      (``configs/base.py``), parsed by :func:`jaxcoll.run.config.parse`.
    workdir: where metrics, checkpoints and summary.json go.
    hooks: called before each step and each save, after the fault
      injectors the config's ``*_at_step`` fields install.

  Raises:
    ConfigError: bad configuration, a busy workdir or checkpoints that do not
      fit; nothing in ``workdir`` is changed.
    FloatingPointError: non-finite gradients (``nan_policy="raise"``) or a
      non-finite state (never saved; the run does not end as a success).
    ReplicaDesyncError: the replicas diverged.
    jaxcoll.train.watchdog.StopRequested: SIGTERM or SIGINT (Ctrl-C);
      stopped after a final checkpoint.
  """
  t_start = time.time()
  memory_phases = rss.PhasePeaks()  # peak RSS phase by phase (summary.json's memory_note)
  chief = jax.process_index() == 0
  held = lock_lib.WorkdirLock(workdir) if chief else None
  with _decided_together(held), _as_config_error():
    config = run_config.parse(config)  # every field checked, before anything is written
    # The fault-injection, straggler and profiler fields are checked here too, before any write.
    hooks = [*hooks_lib.from_config(config), *hooks]
    straggler = timing.StragglerDetector.from_config(config)
    _check_watch_limits(config)
    profile_steps = profiling.parse_profile_steps(config.profile_steps, config.steps)
    mesh, axis = build_mesh(config)
    _use_tuning_table(config.tuning_table)
    workload = inputs.make_workload(config)
    schedule = optim.build_schedule(config)
    trainer = build_trainer(config, workload, mesh, axis, schedule)
    gbs = int(config.global_batch_size)
    state_lib.check_batch_size(gbs, trainer.dp_size, int(config.grad_accum_steps))
    data.process_batch_slice(gbs)
    _check_batch_fits_in_memory(config, workload)
    train_input = inputs.TrainInput(config, workload, mesh, axis)
    _check_loss_is_scalar(config, workload, train_input, gbs // trainer.dp_size, mesh)
    _check_state_exports(config, trainer, workload)
    evaluator = inputs.make_evaluator(config, workload, mesh, axis)
    hooks_lib.bind_input(hooks, train_input.batch_number)  # corrupt_batches counts batches
    watch = incidents_lib.Watch.from_config(  # README "Incidents and rollback"
        config, workdir, is_chief=chief, process_count=jax.process_count(),
        gather=timing.gather_process_times,
        eval_metrics=evaluator.metric_names() if evaluator is not None else None)
    try:  # before the workdir is made: a refusal leaves no directory behind
      checkpoint.check_glob_free(os.path.join(workdir, "checkpoints"))
    except ValueError as e:
      raise ConfigError(f"checkpoints/ of --workdir: {e}") from None
    if chief:
      # also: the paths written below it fit PATH_MAX
      checkpoint.check_writable(workdir, "--workdir", room=checkpoint.ROOM_UNDER_WORKDIR)
      try:
        held.acquire()
      except lock_lib.WorkdirLockError as e:  # busy, or not a usable lock file
        raise ConfigError(str(e)) from None
  check_every, steps = config.check_every, config.steps

  with contextlib.ExitStack() as stack:
    if held is not None:
      stack.callback(held.release)
    watch.load_state()  # the decisions a hard kill must not lose (incidents.STATE_NAME)
    trainer.abstract_state(workload.param_shapes)  # the model's leaves: nothing allocated
    leaf_specs = canonical_lib.leaf_specs(trainer.export_shapes())
    newest = _existing_checkpoints(os.path.join(workdir, "checkpoints"), config,
                                   unsettled=watch.unsettled, leaf_specs=leaf_specs)
    if (newest is not None and newest >= steps  # nothing is created, written or pruned
        and _restores_intact(os.path.join(workdir, "checkpoints"), newest, trainer, workload,
                             config)):
      if chief:
        attempts_lib.announce_nothing_to_do(step=newest, steps=steps, workdir=workdir)
      return {**(attempts_lib.read_summary(workdir, set_aside=False) or {}),
              "steps": newest, "nothing_to_do": True}
    try:  # before anything is written: e.g. a read-only checkpoints/ in a writable workdir
      ckpt = stack.enter_context(checkpoint.Checkpointer(
          os.path.join(workdir, "checkpoints"), keep=int(config.keep_checkpoints)))
    except ValueError as e:
      raise ConfigError(f"checkpoints/ of --workdir: {e}") from None

    start, loss, saved_by, extra = 0, float("nan"), None, None
    watch.settle(ckpt)  # a rollback a hard kill cut short: its abandoned checkpoints go aside
    if ckpt.latest_step() is None:
      if chief:  # a workdir whose run got further, e.g. checkpoints/ deleted: said, and kept
        _note_restart_from_zero(workdir, watch)
      memory_phases.start("init")
      seed = int(config.seed)  # the same on every process: so are the rows it makes
      state = trainer.init_from(lambda: workload.init_params(seed))  # never held in full
    else:  # the restored state replaces it: build the model, allocate nothing
      memory_phases.start("restore")
      trainer.abstract_state(workload.param_shapes)
      try:
        with _as_config_error():
          state, start, extra = ckpt.restore(trainer, residual_notice=incidents_lib.log_line)
      except FileNotFoundError as e:  # every checkpoint damaged: do not train over them
        raise ConfigError(
            f"{e} Move {os.path.join(workdir, 'checkpoints')} away to start afresh."
        ) from None
      loss = float((extra or {}).get("loss", loss))
      train_input.restore(start, extra)
      watch.restore(extra)
      with contextlib.suppress(ValueError):
        saved_by = ckpt.metadata(start).get("saved_by")
    watch.oldest_checkpoint = lambda: next(iter(ckpt.all_steps()), None)  # process 0's listing
    watch.resume(start, extra, train_input)  # recorded rollbacks the checkpoint does not carry
    memory_phases.start("step")
    attempt = attempts_lib.Attempt(workdir, start_step=start, is_chief=chief,
                                   started_at=t_start)
    attempt.begin()
    stack.push(attempt.on_exit)  # "stopped" / "failed" when the loop raises
    # ... and when another thread ends the process at once: a peer's end (exit 76), the
    # step watchdog's (exit 86)
    stack.callback(liveness.on_end(attempt.end_abruptly))
    hooks = [attempt.hook, *hooks]  # the fault injectors are already in `hooks` (above)
    if chief:
      layout = dict(strategy=trainer.strategy.name, devices=jax.device_count(),
                    processes=jax.process_count(), workdir=workdir)
      if start:
        attempts_lib.announce_resume(start=start, steps=steps, saved_by=saved_by, **layout)
        changed = config_changes((extra or {}).get("config"), config)
        if changed:
          logging.warning(
              "config changed since checkpoint %d was saved: %s; the resumed run trains as this "
              "config says, not as the run that wrote it (pass the old values to continue that "
              "run unchanged)", start, ", ".join(changed))
        if not config.checkpoint_every and start < steps:
          # The jaxcoll logger, as the resume line: absl's INFO is hidden at the CLI's default.
          attempts_lib.log.info(
              "checkpoint_every is 0, but this run resumes from checkpoint %d: its last step is "
              "saved too, so the next run resumes from where this one ends", start)
      else:
        attempts_lib.announce_start(steps=steps, **layout)

    batch = train_input.batch(start)
    figures, step_hlo = _step_program_figures(trainer, state, batch)
    writer = metrics.MetricsWriter(
        workdir, is_chief=chief, tensorboard=config.tensorboard, start_step=start
    )
    stack.callback(writer.close)
    writer.write_run_info(config.to_dict(), figures)
    dog = watchdog.StepWatchdog(  # its exit 86 is this attempt's end (liveness.on_end above)
        config.watchdog_s, save_timeout_s=config.save_timeout_s or None,
    ) if config.watchdog_s else None
    if dog is not None:  # armed once the step is compiled
      stack.callback(dog.stop)
    # Runs first, on success and errors alike: the save in flight completes, watched
    # (on an error without the prune's collective: Checkpointer.close).
    stack.push(lambda kind, *_: _wait_watched(
        ckpt, dog, prune=kind is None or issubclass(kind, watchdog.StopRequested)))
    profiler = stack.enter_context(profiling.StepProfiler(profile_steps, workdir,
                                                          start_step=start))
    step_times = []  # the rows' step_time_s, for the communication share
    progress = metrics.Progress(steps, start=start, is_chief=chief)
    stack.callback(progress.close)  # a step that raises: the bar's line ends before its error
    skipped, applied = 0, None  # applied: the metrics of the last step not skipped
    # nan_policy="skip": the steps skipped so far in the run (a resumed run's include those
    # before its checkpoint; a rollback's abandoned stretch is not counted); `skipped`: this
    # attempt's (_check_result).
    skipped_before = _skipped_in(extra)
    saved_step = start if ckpt.latest_step() is not None else None
    every = config.checkpoint_every
    saves_last = bool(every or start)  # every=0 but resumed from a checkpoint: keep it current
    timer = timing.StepTimer(straggler=straggler,
                             warn=watch.straggler_warning(logging.warning if chief else None),
                             gather=watch.row_gather(lambda: timer) or timing.gather_process_times)
    watch.begin(start)
    step_range = incidents_lib.StepRange(start, steps)  # a rollback restarts it

    def respond(done, state, kept):
      """Logs this step's incidents and responds: (state, the step to restart from or None)."""
      nonlocal skipped_before
      state, restart = watch.respond(
          done, state, kept, ckpt=ckpt, trainer=trainer, train_input=train_input,
          init=lambda: trainer.init_from(lambda: workload.init_params(int(config.seed))))
      if restart is not None:  # the rows after the checkpoint: marked abandoned
        writer.rewind(restart, rollback=watch.rollbacks)
        profiler.restart(restart, rollback=watch.rollbacks)  # a trace per stretch
        progress.rewind(restart)  # the abandoned stretch's eval is no longer shown
        # nan_policy's count as at the target (the steps after it are trained again)
        skipped_before = _skipped_in(watch.restored_extra) - skipped
      for at in sorted({i["step"] for i in watch.last}):  # TensorBoard markers, at their steps
        writer.write(at, {f"incident/{i['signal']}": 1 for i in watch.last if i["step"] == at})
      return state, restart

    def save(done, loss):
      t_save = time.perf_counter()
      memory_phases.start("save")
      _save(ckpt, trainer, state, done, config=config, loss=loss, dog=dog, hooks=hooks,
            data_state={**train_input.state(), **watch.checkpoint_extra(done),
                        "skipped_steps": skipped_before + skipped})
      watch.prune_skips()  # the recorded skips no retained checkpoint replays
      memory_phases.start("step")
      writer.write(done, {"checkpoint_time_s": time.perf_counter() - t_save})

    if watch.pending:  # an eval incident of step `start` a hard kill left unanswered
      state, restart = respond(start, state, None)
      if restart is not None:
        step_range.restart(restart)
      elif watch.stopping is not None:
        # checkpoint `start`, saved before its eval
        raise _with_digest(watch.stop_error(start, saved=True), trainer, state)
    for step in step_range:
      timer.start_data()  # the step's own time, apart from its batch (jaxcoll.train.timing)
      if step != start or step_range.restarted:
        batch = train_input.batch(step)
      for hook in hooks:
        batch, state = hook.before_step(step + 1, batch, state)
      kept = watch.keep(state, step + 1)  # a copy only when a response may be `skip` (donated)
      with profiler.step(step + 1):  # traced when in config.profile_steps
        timer.start_step()
        state, step_metrics = trainer.step(state, batch)
        timer.dispatched()
        jax.block_until_ready((state, step_metrics))
        timer.end_step()
      done = step + 1
      if dog is not None:
        dog.beat(done)
      if trainer.nan_policy == "skip":  # a skip recorded (a kill replays it) or skipped again
        state, step_metrics = watch.trainer_skip(done, state, kept, step_metrics,
                                                 train_input.batch_number(done))
      step_skipped = int(step_metrics.get("skipped", 0))
      skipped += step_skipped
      applied = applied if step_skipped else step_metrics
      watch.after_step(done, step_metrics, batch=train_input.batch_number(done),
                       defer=not incidents_lib.judged_at_once(  # else with the next such
                           done, steps=steps, log_every=config.log_every,
                           checkpoint_every=config.checkpoint_every,
                           eval_every=config.eval_every if evaluator is not None else 0))

      if check_every and done % check_every == 0:
        problems = trainer.check_fingerprints(state, raise_on_mismatch=False)
        if problems:
          raise ReplicaDesyncError(
              f"replicas diverged at step {done}: {'; '.join(problems)}. Stopping before "
              "anything else is saved; resume from the last checkpoint."
          )

      if done % config.log_every == 0 or done == steps:
        loss = _kept_loss(applied, loss)
        row = {
            "loss": float(step_metrics["loss"]),
            "grad_norm": float(step_metrics["grad_norm"]),
            "learning_rate": float(schedule(done - 1)),  # the rate of this step's update
            **timer.row(gbs, done),  # every process: one small allgather
        }
        step_times.append(row["step_time_s"])
        watch.after_row(done, row)
        if trainer.nan_policy != "none":
          row["skipped_steps"] = skipped_before + skipped
        writer.write(done, row)
        progress.update(done, {"loss": row["loss"], "step_time_s": row["step_time_s"]})

      if stop.requested(done):  # a signal: the waiting steps are judged before the final save
        watch.flush()
      if watch.pending:  # incidents at this step (or waiting ones): log them and respond
        state, restart = respond(done, state, kept)
        if restart is not None:
          step_range.restart(restart)
          continue
      stopping = stop.requested(done) or watch.stopping is not None
      saved_now = False
      if (every and done % every == 0 or saves_last and (done == steps or stopping)) \
          and watch.may_save:
        loss = _kept_loss(applied, loss)
        save(done, loss)
        saved_step, saved_now = done, True
      # After the save: an eval that fails never costs this step's checkpoint.
      if evaluator is not None and (done % config.eval_every == 0 or done == steps):
        memory_phases.start("eval")
        evaluated = _evaluate(evaluator, trainer, state, done, writer=writer, dog=dog,
                              saved_step=saved_step, progress=progress,
                              cut_short=stop.arrived)
        memory_phases.start("step")
        if evaluated is None:  # a signal during the eval: save this step now and stop
          if saves_last and not saved_now and watch.may_save:
            save(done, _kept_loss(applied, loss))
            saved_step, saved_now = done, True
          logging.warning(
              "a stop signal arrived during the evaluation after step %d: the evaluation is "
              "left unfinished (no eval row for step %d)%s.", done, done,
              f"; evaluate checkpoint {done} later with python -m experiments.eval "
              f"--workdir=... --step={done}" if saved_now else "")
          raise _with_digest(stop.stopped(done, saved=saved_now), trainer, state)
        watch.after_eval(done, evaluated)
        if watch.pending:  # an eval regression: respond after this step's save
          state, restart = respond(done, state, kept)
          if restart is not None:
            step_range.restart(restart)
            continue
          if watch.stopping is not None and not stopping:
            stopping = True
            if saves_last and not saved_now and watch.may_save:
              save(done, _kept_loss(applied, loss))
              saved_step = done
      if stopping:
        if watch.stopping is not None:
          raise _with_digest(watch.stop_error(done, saved=saves_last and watch.may_save),
                             trainer, state)
        raise _with_digest(stop.stopped(done, saved=saves_last), trainer, state)

    shares = profiling.share_figures(figures["comm_time_estimate_s"], step_times, step_hlo,
                                     profiler)
    writer.write_figures(shares, step=max(steps, start))  # known once the attempt's rows are
    figures |= shares

  try:
    memory_phases.start("digest")
    norm, sha = _state_digest(trainer, state, max(steps, start))
    _check_result(loss, skipped, start=start, steps=steps, nan_policy=trainer.nan_policy)
    memory = memory_phases.figures(figures.get("memory_bytes_per_device"),
                                   jax.local_device_count(), trainer.state_bytes_per_device(state))
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
      **memory,
      "skipped_steps": skipped_before + skipped,
      **(evaluator.last if evaluator is not None else {}),
      **train_input.report(),
      **watch.summary(),
      "config": config.to_dict(),
  }
  summary |= _measured_share(workdir, figures, attempt, profiler)
  attempt.end(attempts_lib.COMPLETED, end_step=max(steps, start), summary=summary)
  return {**summary, "attempts": attempt.history}


train_and_evaluate.__doc__ = _train_and_evaluate.__doc__


def _measured_share(workdir: str, figures, attempt, profiler) -> dict[str, Any]:
  """summary.json's ``comm_share_measured`` and ``comm_share_measured_from`` (``{"attempt":
  N, "steps": [A, B]}``: the attempt and the traced steps it was measured on). An attempt
  that traced nothing keeps the previous measurement (a resume without
  ``profile_steps`` used to drop it: the one measured figure of the run, lost); a new
  measurement replaces it."""
  if "comm_share_measured" in figures:
    traced = profiler.traced
    return {"comm_share_measured_from": {"attempt": attempt.number,
                                         "steps": list(traced) if traced else None}}
  before = attempts_lib.read_summary(workdir, set_aside=False) or {}
  if not isinstance(before.get("comm_share_measured"), (int, float)):
    return {}
  source = before.get("comm_share_measured_from")
  if not isinstance(source, dict):  # written before the source was recorded: the attempt
    # whose summary is the top level, the last one that completed before this one
    done = [i + 1 for i, a in enumerate(before.get("attempts") or [])
            if isinstance(a, dict) and a.get("status") == attempts_lib.COMPLETED]
    source = {"attempt": done[-1] if done else None, "steps": None}
  return {"comm_share_measured": before["comm_share_measured"],
          "comm_share_measured_from": source}


def _existing_checkpoints(directory: str, config, unsettled=None,
                          leaf_specs=None) -> int | None:
  """Checks that the checkpoints in ``directory`` fit ``config``
  (:func:`_check_checkpoints_fit`) and returns the newest committed step
  whose metadata reads back intact (the one a restore starts from, unless
  its arrays are damaged); None if there is none, or if ``unsettled(step,
  extra)`` says that step still has an incident decision to carry out
  (:meth:`jaxcoll.run.incidents.Watch.unsettled`: not "nothing to do").
  Creates and changes nothing there."""
  found = os.path.isdir(directory)
  if jax.process_count() > 1:  # process 0's answer for all: orbax's calls are collective
    found = bool(multihost_utils.broadcast_one_to_all(np.int32(found)))
  if not found:
    return None
  with checkpoint.Checkpointer(directory, keep=None, read_only=True) as view:
    if view.latest_step() is not None:
      _check_checkpoints_fit(view, config, leaf_specs)
    for step in reversed(view.all_steps()):
      try:
        meta = view.metadata(step)
      except ValueError:
        continue
      if unsettled is not None and unsettled(step, meta.get("extra")):
        return None
      return step
  return None


def _evaluate(evaluator, trainer, state, step: int, *, writer, dog, saved_step,
              progress, cut_short=None) -> dict[str, float] | None:
  """Runs the eval after ``step`` and writes its row; a failure names the
  eval, the step and the newest checkpoint (:class:`EvalError`, or the
  same jaxcoll error with that context for bad input or a data error).
  ``None``, and no row, where ``cut_short`` (a stop signal) ended it early."""
  t_eval = time.perf_counter()
  try:
    with dog.evaluating(step) if dog is not None else contextlib.nullcontext():
      evaluated = evaluator.run(trainer=trainer, state=state,  # on the sharded state
                                cut_short=cut_short)
  except Exception as e:  # noqa: BLE001  (named, then raised again)
    kept = (f"checkpoint {step} is saved" if saved_step == step else
            "no checkpoint is saved yet" if saved_step is None else
            f"the newest checkpoint is step {saved_step}")
    where = f"the evaluation after step {step} failed ({kept})"
    if isinstance(e, ConfigError) or type(e).__module__.startswith("jaxcoll.data"):
      try:  # bad input or a named data error: the same kind of error, with where it happened
        named = type(e)(f"{where}: {e}")
      except Exception:  # noqa: BLE001  (an error class with other arguments)
        named = None
      if named is None:
        raise
      raise named from e
    raise EvalError(f"{where}: {type(e).__name__}: {e}") from e
  if evaluated is None:
    return None
  writer.write(step, {**evaluated, "eval_time_s": time.perf_counter() - t_eval})
  shown = {k: v for k, v in evaluated.items() if k not in ("eval_loss", "eval_examples")}
  progress.show_eval(step, {"eval_loss": evaluated.get("eval_loss"), **shown})
  return evaluated


def _restores_intact(directory: str, step: int, trainer, workload, config) -> bool:
  """Whether checkpoint ``step`` restores intact (its arrays read back and
  match the fingerprints of the save), as the restore of a resumed run would
  check; read only. A damaged one is not "nothing to do": the run then goes
  on as any resume does (skips it with a warning, falls back to the newest
  intact step and trains up to ``config.steps`` again)."""
  trainer.abstract_state(workload.param_shapes)  # the model restore fits onto; nothing allocated
  with checkpoint.Checkpointer(directory, keep=None, read_only=True) as view:
    try:
      view.restore(trainer, step=step, residual_notice=lambda message: None)  # intact or not
    except ValueError as e:
      if "damaged" not in str(e):  # a checkpoint of another model
        raise ConfigError(str(e)) from None
      if jax.process_index() == 0:
        logging.warning("checkpoint %d is at config.steps=%d but does not restore intact "
                        "(%s); training from the newest intact checkpoint instead of "
                        "reporting nothing to do.", step, int(config.steps), e)
      return False
  return True


def _wait_watched(ckpt, dog, *, prune: bool = True) -> None:
  with dog.saving() if dog is not None else contextlib.nullcontext():
    ckpt.wait(prune=prune)


def _previous_reach(workdir: str) -> tuple[int, int]:
  """How far the runs of ``workdir`` got: ``(step, checkpoint)``, the last step that summary.json
  (its result, its attempts) or a row of metrics.jsonl names and the last checkpoint a row says
  was saved (rows a rollback abandoned aside); 0 for none."""
  summary = attempts_lib.read_summary(workdir, set_aside=False) or {}
  steps = [summary.get("steps")] + [a.get("end_step") for a in summary.get("attempts") or []
                                    if isinstance(a, dict)]
  saved = [0]
  path = os.path.join(workdir, "metrics.jsonl")
  if os.path.exists(path):
    with warnings.catch_warnings():  # a torn last line: the writer says so when it opens
      warnings.simplefilter("ignore")
      rows = [r for r in metrics.read_metrics(workdir) if not r.get("abandoned")]
    steps += [r.get("step") for r in rows]
    saved += [r.get("step") for r in rows if "checkpoint_time_s" in r]
  ints = lambda xs: [int(x) for x in xs if isinstance(x, int) and not isinstance(x, bool)]  # noqa: E731
  return max(ints(steps), default=0), max(ints(saved), default=0)


def _note_restart_from_zero(workdir: str, watch: incidents_lib.Watch) -> None:
  """Process 0, at a start from step 0 (no checkpoint to restore): when the workdir shows that
  a run there got further (summary.json, metrics.jsonl), one warning line says so, names that
  step, and how to start fresh on purpose; the rows the restart would replace are kept aside
  first (``metrics.jsonl.before-restart-<unix time>``). incidents.jsonl, incident_state.json
  (its decisions are taken again from the start) and summary.json's attempts stay. Not said
  when the newest recorded rollback restored the initial state and no checkpoint was saved
  after it (that is where the run is: the resume line says so)."""
  reached, saved = _previous_reach(workdir)
  if reached <= 0 or not saved and watch.last_rollback_target() == 0:
    return
  path = os.path.join(workdir, "metrics.jsonl")
  kept = ""
  if os.path.exists(path) and os.path.getsize(path):
    aside = f"{path}.before-restart-{time.time():.0f}"
    while os.path.exists(aside):
      aside += "+"
    shutil.copyfile(path, aside)
    kept = f"; its metrics rows are kept in {os.path.basename(aside)}"
  why = (f"its checkpoints (up to step {saved}) are gone from checkpoints/" if saved else
         "it saved no checkpoint (checkpoint_every=0, or it ended before the first)")
  logging.warning(
      "--workdir %s: a previous run there reached step %d but %s; starting again from step "
      "0%s. To start fresh on purpose, pass a new --workdir (or move this one away).",
      workdir, reached, why, kept)


def _skipped_in(extra: Mapping[str, Any] | None) -> int:
  """The steps ``nan_policy="skip"`` had skipped in the run when a checkpoint was saved (its
  ``extra``; 0 for the initial state or a checkpoint written before it was kept)."""
  try:
    return int((extra or {}).get("skipped_steps", 0) or 0)
  except (TypeError, ValueError):
    return 0


def _kept_loss(applied, previous: float) -> float:
  """The run's loss: that of the last step applied (``applied``, its
  metrics; a step ``nan_policy="skip"`` skipped has the NaN batch's loss),
  else ``previous`` (the restored checkpoint's)."""
  return previous if applied is None else float(applied["loss"])


def _check_result(loss: float, skipped: int, *, start: int, steps: int, nan_policy: str) -> None:
  """A run never ends as a success with a non-finite loss, or with every
  step skipped (``nan_policy="skip"``: nothing was trained)."""
  if steps > start and skipped >= steps - start:
    raise FloatingPointError(
        f"every one of the {steps - start} steps from step {start + 1} to {steps} was skipped "
        f"(non-finite gradients, nan_policy={nan_policy!r}): nothing was trained; the inputs "
        "are NaN or infinite, or the learning rate is far too high. No summary is written."
    )
  if not math.isfinite(loss):
    raise FloatingPointError(
        f"the loss after step {max(steps, start)} is {loss} (not finite); no summary is "
        "written. Check the labels against the model's outputs (a label outside the classes "
        "gives NaN), lower the learning rate, or set nan_policy='raise' to find the step."
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
