"""Eval-only: a checkpoint of a run evaluated without training (``python -m experiments.eval``).

:func:`evaluate_checkpoint` restores the newest trusted checkpoint of a
workdir (or a given step) onto this job's devices and strategy (the
checkpoint reshards: any device count, process count or ZeRO stage), runs the
in-training evaluation on it (:func:`jaxcoll.run.inputs.make_evaluator` and
``Evaluator.run(trainer=..., state=...)``, the very code ``eval_every`` runs,
so the figures equal that step's eval row by value), and returns one row.
It only reads the workdir: the checkpoints are opened read-only (nothing is
created, probed, pruned or written there), and neither ``metrics.jsonl`` nor
``summary.json``, which a later resume reads, is touched. The row goes to
``evals.jsonl`` (:func:`jaxcoll.observe.metrics.append_eval_row`), next to
them or in another directory;
``experiments.report`` shows it.

*Trusted*: a committed checkpoint whose metadata and arrays match the
fingerprints of its save (a damaged one is skipped with a warning, as a
resume does) and that no recorded rollback abandoned
(``incident_state.json``; README "Incidents and rollback").

The config is the one the checkpoint was saved with (``extra["config"]``),
with the command line's ``--config.FIELD=VALUE`` overrides on top (e.g.
``data.eval``, ``strategy``, ``data.eval_batch_size``), or a ``--config``
file given in full. Bad input is one :class:`ConfigError` line: a workdir
without checkpoints, a step that is not one (the ones that are, named),
eval data that is missing or matches nothing, a model that does not match
the checkpoint's parameters.

Example:
  >>> row = evaluate_checkpoint("/tmp/run", step=6)  # doctest: +SKIP
  >>> metrics.append_eval_row(row, "/tmp/run")  # doctest: +SKIP
  '/tmp/run/evals.jsonl'
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import time
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxcoll import checks
from jaxcoll.errors import CorruptCheckpointWarning
from jaxcoll.observe import metrics
from jaxcoll.comm_model import tuning
from jaxcoll.run import config as run_config
from jaxcoll.run import incidents as incidents_lib
from jaxcoll.run import inputs, optim
from jaxcoll.run.config_error import ConfigError
from jaxcoll.runtime import devices as devices_lib
from jaxcoll.train import canonical as canonical_lib
from jaxcoll.train import checkpoint

EVALS_NAME = metrics.EVALS_NAME  # the eval-only rows of a workdir (one JSON object a line)


def _log(message: str) -> None:
  if jax.process_index() == 0:
    from absl import logging  # noqa: PLC0415

    logging.warning("%s", message)


def _no_checkpoint(workdir: str, why: str) -> ConfigError:
  return ConfigError(
      f"`--workdir` {workdir!r} {why}; pass the --workdir of a run that saved checkpoints "
      f"(config.checkpoint_every > 0, or its last step), e.g. after python -m experiments.train "
      f"--workdir={shlex.quote(workdir)}.")


def _apply_overrides(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict:
  """``config`` (nested dicts) with each dotted ``overrides`` field set."""
  out = json.loads(json.dumps(dict(config), default=str))
  for name, value in overrides.items():
    *parents, leaf = name.split(".")
    node = out
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = value.to_dict() if hasattr(value, "to_dict") else value
  return out


def _trusted_steps(view: checkpoint.Checkpointer, workdir: str) -> tuple[list[int], dict, dict]:
  """(committed steps, their metadata by step (readable ones), the abandoned ones: why)."""
  watch = incidents_lib.Watch(incidents_lib.DEFAULTS, workdir, is_chief=jax.process_index() == 0,
                              process_count=jax.process_count())
  watch.load_state()  # only reads incident_state.json
  steps, metas, abandoned = view.all_steps(), {}, {}
  for s in steps:
    try:
      metas[s] = view.metadata(s)
    except ValueError as e:  # damaged metadata: never trusted
      abandoned[s] = str(e)
      continue
    if watch.abandoned(s, metas[s].get("extra")):
      abandoned[s] = ("a recorded rollback abandoned it (incident_state.json): it is never "
                      "resumed from")
  return steps, metas, abandoned


def _pick_step(step: int | None, steps, metas, abandoned, directory: str) -> list[int]:
  """The steps to try, newest first (one, when ``step`` is given)."""
  if step is not None:
    if step not in steps:
      raise ConfigError(
          f"`--step`={step}: there is no checkpoint of that step in {directory}; its "
          f"checkpoints are steps {steps} (pass one of them, or omit --step for the newest).")
    if step in abandoned:
      trusted = [s for s in steps if s not in abandoned]
      raise ConfigError(f"`--step`={step}: checkpoint {directory}/{step} is not trusted: "
                        f"{abandoned[step]}; trusted checkpoints: steps {trusted}.")
    return [step]
  trusted = [s for s in reversed(steps) if s not in abandoned]
  if not trusted:
    raise ConfigError(f"no trusted checkpoint in {directory}: steps {steps} are each damaged "
                      "or abandoned by a rollback; nothing to evaluate.")
  for s in (s for s in steps if s in abandoned and s > trusted[0]):
    _log(f"checkpoint {directory}/{s} is not trusted ({abandoned[s]}); evaluating the newest "
         f"trusted one, step {trusted[0]}")
  return trusted


def _config_for(meta: Mapping[str, Any], step: int, directory: str, given, overrides):
  """The run config to evaluate checkpoint ``step`` with (``eval_every`` set)."""
  if given is not None:
    base = given.to_dict() if hasattr(given, "to_dict") else dict(given)
  else:
    base = (meta.get("extra") or {}).get("config") if isinstance(meta.get("extra"), dict) else None
    if not isinstance(base, dict):
      raise ConfigError(
          f"checkpoint {directory}/{step} holds no run config (it was not written by "
          "experiments.train); pass the config it was trained with, --config=FILE.")
    if "tuning_table" not in (overrides or {}):
      # The run's table chose its all-reduce; an evaluation has its own (--config.algorithm=
      # native on a run trained with one was refused: "only algorithm=auto reads a table").
      base = {**base, "tuning_table": ""}
  try:
    config = run_config.parse(_apply_overrides(base, overrides or {}))
  except ConfigError as e:
    if given is not None or not overrides:
      raise
    raise ConfigError(f"{e} (the config saved in checkpoint {step}, with the overrides "
                      f"{sorted(overrides)})") from None
  if config.data.eval and "data.eval_examples" not in (overrides or {}):
    # the saved run's synthetic eval size, not this command's: no warning about it
    config = dataclasses.replace(config, data=dataclasses.replace(
        config.data, eval_examples=run_config.DataConfig().eval_examples))
  return dataclasses.replace(config, eval_every=max(1, config.eval_every))


def _fit_saved_mesh(config, overrides, devices: int):
  """The run's saved ``mesh_shape`` where it fits this job's ``devices``; else a mesh that
  does (said in one line): its last axis refilled where the others divide ``devices``
  (``2,4`` on 6 devices: ``2,3``, the hybrid ``replica_axis`` kept), or one flat axis
  (the replica axis and the hierarchical algorithm, which need two, dropped). An
  evaluation's figures do not depend on the layout (but for float reduction order); a
  hybrid run of 8 evaluated on 6 devices was refused: "`config.mesh_shape` (2, 4) has 8
  devices but 6 are available"."""
  if not config.mesh_shape or "mesh_shape" in (overrides or {}):
    return config
  try:
    shape = [int(s) for s in config.mesh_shape.split(",")]
  except ValueError:
    return config  # build_mesh says what is wrong with it
  fixed = [s for s in shape if s != -1]
  if any(s < 1 for s in fixed) or shape.count(-1) > 1:
    return config  # build_mesh says what is wrong with it
  if devices % math.prod(fixed) == 0 if -1 in shape else math.prod(shape) == devices:
    return config  # it fits
  refilled = None if -1 in shape[:-1] else devices_lib.refilled_shape(shape, devices)
  if refilled is not None:
    fitted = dataclasses.replace(config, mesh_shape=",".join(map(str, refilled)))
  else:
    fitted = dataclasses.replace(config, mesh_shape="", mesh_axes="", replica_axis="")
    if config.algorithm == "hierarchical":
      fitted = dataclasses.replace(fitted, algorithm="auto")
  kept = fitted.mesh_shape or f"one axis of {devices}"
  _log(f"mesh: the run's mesh_shape={config.mesh_shape} does not fit this job's {devices} "
       f"devices; evaluating on {kept} (--config.mesh_shape sets it)")
  return fitted


def _fit_eval_batch(config, shards: int):
  """An eval batch that defaults to ``global_batch_size`` (``data.eval_batch_size`` = 0) and
  does not divide by this job's ``shards`` (a run of batch 32 evaluated on 6 devices) is
  rounded up to a multiple: the masked sums are the same but for float reduction order."""
  size = int(config.global_batch_size)
  if config.data.eval_batch_size or size % shards == 0:
    return config
  fitted = -(-size // shards) * shards
  _log(f"eval batch: global_batch_size={size} does not divide by the {shards} devices of the "
       f"data axis; evaluating in batches of {fitted} (--config.data.eval_batch_size sets it)")
  return dataclasses.replace(config, data=dataclasses.replace(config.data,
                                                              eval_batch_size=fitted))


def _check_model_fits(meta: Mapping[str, Any], step: int, directory: str, trainer,
                      config) -> None:
  """The checkpoint's leaves are the ones this config's model and optimizer have."""
  saved = canonical_lib.saved_specs(meta.get("leaves", []))
  problems = canonical_lib.spec_mismatches(
      saved, canonical_lib.leaf_specs(trainer.export_shapes()), ignore_dtype=True)
  if not problems:
    return
  first = next((p for p in problems if not p.startswith("['opt_state']")), problems[0])
  run = (meta.get("extra") or {}).get("config") or {}
  theirs = ", ".join(f"{k}={run[k]!r}" for k in ("model", "model_overrides", "optimizer")
                     if k in run)
  ours = ", ".join(f"{k}={getattr(config, k)!r}" for k in ("model", "model_overrides",
                                                          "optimizer"))
  raise ConfigError(
      f"checkpoint {directory}/{step} does not match this config's model and optimizer: "
      f"{len(problems)} leaves differ, e.g. {first}; this config has {ours}"
      + (f", the checkpoint's run had {theirs}" if theirs else "")
      + " (omit --config and the model overrides to evaluate with the run's own config).")


def evaluate_checkpoint(workdir: str, *, step: int | None = None, config=None,
                        overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """Evaluates checkpoint ``step`` (default: the newest trusted one) of ``workdir``.

  Every process of a job calls it (the restore and the eval are collective).

  Args:
    workdir: a training run's ``--workdir`` (it holds ``checkpoints/``).
    step: the checkpoint to evaluate; None: the newest trusted one.
    config: the run config to evaluate with (a ``RunConfig``, ``ConfigDict``
      or mapping); None: the one saved in the checkpoint.
    overrides: ``{"data.eval": GLOB, "strategy": "zero3", ...}``, dotted
      fields set on that config.

  Returns:
    The row: ``step``, ``eval_loss``, ``eval_<metric>``, ``eval_examples``
    (exactly those of the in-training eval of that step), ``eval_time_s``,
    ``eval_data`` (the glob, or ``"synthetic"``), ``params_sha256``
    and ``params_global_norm`` of the restored parameters (summary.json's
    digest), ``strategy``, ``num_devices``, ``num_processes``, ``checkpoint``
    (its directory) and ``evaluated_at`` (unix time).

  Raises:
    ConfigError: bad input (one line): see the module docstring. Nothing
      in ``workdir`` is changed.
  """
  with tuning.kept():  # --config.tuning_table's table for this evaluation only
    return _evaluate_checkpoint(workdir, step=step, config=config, overrides=overrides)


def _evaluate_checkpoint(workdir: str, *, step: int | None = None, config=None,
                         overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
  from jaxcoll.run import loop  # noqa: PLC0415  (the loop's builders: one way to build a run)

  with loop._decided_together(None), loop._as_config_error():
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, np.integer))
                             or step < 0):
      raise ConfigError(f"`--step`={step!r}: pass a checkpoint's step, an int >= 0.")
    if not os.path.isdir(workdir):
      raise _no_checkpoint(workdir, "is not a directory")
    directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    if not os.path.isdir(directory):
      run = metrics.inside_run(workdir)
      if run is not None:  # RUN/checkpoints or RUN/checkpoints/N: its run is one level up
        run_dir, in_run = run
        what = ("the checkpoints/ directory" if in_run is None else f"checkpoint {in_run}")
        pick = "" if in_run is None else f" --step={in_run}"
        raise ConfigError(
            f"`--workdir` {workdir!r} is {what} of the run {run_dir}, not a run's workdir; "
            f"pass --workdir={shlex.quote(run_dir)}{pick}.")
      raise _no_checkpoint(workdir, "has no checkpoints/ directory")
    view = checkpoint.Checkpointer(directory, keep=None, read_only=True)
  try:
    with loop._decided_together(None), loop._as_config_error():
      steps, metas, abandoned = _trusted_steps(view, workdir)
      if not steps:
        unfinished = checkpoint.unfinished_saves(directory)
        if unfinished:  # it did save: none finished (the job ended during its saves)
          raise ConfigError(
              f"`--workdir` {workdir!r} has no committed checkpoint in {directory}: the "
              f"save of step {', '.join(map(str, unfinished))} never finished (cut short by "
              "the job's end; never read); a run that goes on there (python -m "
              f"experiments.train --workdir={shlex.quote(workdir)}) starts again from step 0, "
              "or pass the --workdir of a run with a finished save.")
        raise _no_checkpoint(workdir, f"has no committed checkpoint in {directory}")
      candidates = _pick_step(step, steps, metas, abandoned, directory)
      chosen = candidates[0]
      config_given = config is not None
      config = _config_for(metas[chosen], chosen, directory, config, overrides)
      loop._use_tuning_table(config.tuning_table)  # noqa: SLF001 - the runner's, same rules
      if not config_given:  # the run's own layout, unless it cannot be this job's
        config = _fit_saved_mesh(config, overrides, jax.device_count())
      mesh, axis = loop.build_mesh(config)
      config = _fit_eval_batch(config, checks.axis_size(mesh, axis))
      workload = inputs.make_workload(config)
      trainer = loop.build_trainer(config, workload, mesh, axis, optim.build_schedule(config))
      try:
        evaluator = inputs.make_evaluator(config, workload, mesh, axis)
      except ValueError as e:  # the data's errors are ValueErrors, made ConfigErrors above
        if not str(e).startswith("`data.eval`=") or config_given or "data.eval" in (
            overrides or {}):
          raise
        # The files the run evaluated on moved (scratch purged, data copied elsewhere): the
        # glob is the saved config's, not one this command was given.
        raise ConfigError(
            f"{str(e).rstrip('.')}; it is the glob of checkpoint {chosen}'s saved config: pass "
            "--config.data.eval=GLOB where the files are now.") from None
      trainer.abstract_state(workload.param_shapes)  # the model restore fits onto; no memory
      _check_model_fits(metas[chosen], chosen, directory, trainer, config)
    with loop._decided_together(None):
      state, chosen = _restore(view, trainer, candidates, directory, explicit=step is not None)
  finally:
    view.close()

  t_eval = time.perf_counter()
  with loop._decided_together(None):  # a data error of the eval set: bad input, one line
    try:
      evaluated = evaluator.run(trainer=trainer, state=state)  # the in-training eval's call
    except ConfigError:
      raise
    except Exception as e:
      if type(e).__module__.startswith("jaxcoll.data"):
        raise ConfigError(f"the evaluation of checkpoint {chosen} failed: {e}") from None
      raise
  eval_time = time.perf_counter() - t_eval
  norm, sha, _ = trainer.params_digest(state)
  return {
      "step": int(chosen),
      **evaluated,
      "eval_time_s": eval_time,
      "eval_data": config.data.eval or "synthetic",
      "params_sha256": sha,
      "params_global_norm": norm,
      "strategy": trainer.strategy.name,
      "num_devices": jax.device_count(),
      "num_processes": jax.process_count(),
      "checkpoint": os.path.join(directory, str(chosen)),
      "evaluated_at": time.time(),
  }


def _restore(view, trainer, candidates, directory: str, *, explicit: bool):
  """(state, step) of the newest of ``candidates`` that restores intact."""
  for s in candidates:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", CorruptCheckpointWarning)  # said below, in one line
      try:
        state, _, _ = view.restore(trainer, step=s, residual_notice=lambda message: None)
        return state, s
      except ValueError as e:
        if "damaged" not in str(e):  # a checkpoint of another model (checked before, too)
          raise ConfigError(" ".join(str(e).split())) from None
        if not os.path.isdir(os.path.join(directory, str(s))):  # not damage: gone
          why = (f"checkpoint {directory}/{s} was removed while it was read (a training job "
                 "in this workdir pruned it: config.keep_checkpoints)")
          if explicit:
            raise ConfigError(f"`--step`={s}: {why}; pass a newer --step.") from None
          _log(f"{why}; evaluating an older one")
          continue
        # "`step` N: the checkpoint D/N is damaged: WHY." said once, after this line's own
        # name of the step (it read "`--step`=N: `step` N: ..." and "checkpoint D/N is damaged
        # (`step` N: the checkpoint D/N is damaged: ...)").
        said = " ".join(str(e).split()).removeprefix(f"`step` {s}: ")
        if explicit:
          raise ConfigError(f"`--step`={s}: {said} Omit --step to evaluate the newest intact "
                            "checkpoint.") from None
        _log(f"{said.removesuffix('.')}; evaluating an older one")
  raise ConfigError(f"no intact checkpoint in {directory} (steps {candidates} are damaged); "
                    "nothing to evaluate.")


def describe(row: Mapping[str, Any]) -> str:
  """``step 6: eval_loss=2.44306 eval_accuracy=0.12207 (37 examples: GLOB; ...)``, one line."""
  names = sorted((k for k, v in row.items() if k.startswith("eval_") and isinstance(v, float)
                  and k not in ("eval_examples", "eval_time_s")), key=lambda k: k != "eval_loss")
  shown = " ".join(f"{k}={row[k]:.6g}" for k in names)
  return (f"step {row['step']}: {shown} ({row.get('eval_examples')} examples: "
          f"{row.get('eval_data')}; {row.get('strategy')} on {row.get('num_devices')} devices, "
          f"{row.get('eval_time_s', 0):.2f} s)")
