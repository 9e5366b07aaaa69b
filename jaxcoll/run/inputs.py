"""What the training loop trains and evaluates on: the workload and its data.

- :func:`make_workload`: ``config.model`` is a built-in name or a
  ``module:function`` path, called with ``config.model_overrides``.
- :class:`TrainInput`: the global batch of each step, from the workload's
  synthetic data set, or from files (``config.data.train``, read through
  grain by :class:`jaxcoll.data_files.FileData`, sharded per process as
  ``config.data.shard_by`` says). Its position goes into the checkpoint.
- :func:`make_evaluator`: the eval set (``config.data.eval`` files, else
  ``config.data.eval_examples`` held-out synthetic examples) for
  ``config.eval_every``.

Every bad value is a ``ValueError`` through the loop's config error,
raised before anything is written to the workdir. The files are checked
against the model where it is cheap, before training: the columns it needs
and their per-row shapes; a float column where it needs integers (class ids,
tokens); integer labels outside ``0 .. n - 1`` for the columns the workload
declares in ``Workload.label_classes`` (from the Parquet statistics, and in
every batch read); nulls (statistics, and every row group read); lists of
different lengths. A file that fails to read mid-run
(:class:`jaxcoll.data.sources.DataError`: damaged, a page checksum
mismatch, changed) is the same one-line error naming the file and row group.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from jaxcoll import checks, data, errors, models
from jaxcoll.data import files as data_files, sources as data_sources
from jaxcoll.run import config as run_config
from jaxcoll.run import data_skip, evaluate
from jaxcoll.run.config_error import ConfigError
from jaxcoll.run.config_error import fail as _fail
from jaxcoll.run.config_error import from_user_code
from jaxcoll.train import axes_bound


def make_workload(config) -> models.Workload:
  """The workload ``config.model`` with ``config.model_overrides``."""
  config = run_config.parse(config)
  overrides = dict(config.model_overrides)
  try:
    models.get(config.model)
  except ValueError as e:  # "'m:f': module 'm' does not import ...": the value said once
    raise _fail("model", config.model, str(e).removeprefix(f"{config.model!r}: ")) from None
  try:  # a typo'd key is the overrides' fault, not the model's
    models.check_overrides(config.model, overrides)
  except ValueError as e:
    hint = ""
    if str(e).startswith("Unknown override"):  # e.g. configs/minimal.py's mlp widths
      hint = (" The config file's model_overrides count too (a config made for another "
              "model passes its own): give them all, e.g. --config.model_overrides='{}' "
              "to clear them.")
    raise _fail("model_overrides", overrides, str(e) + hint) from None
  try:
    workload = models.build_checked(config.model, overrides)  # checked just above
  except ValueError as e:
    if from_user_code(e):  # raised by the user's own model function: show its traceback
      raise
    raise _fail("model", config.model, str(e)) from None
  _check_float_variables(config, workload)
  return workload


def _check_float_variables(config, workload) -> None:
  """Every leaf of the model's variables is floating point: the trainer keeps them all
  as parameters (model state such as BatchNorm statistics included), and an int or
  bool one failed at init with a traceback, after the workdir was made."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(workload.param_shapes)[0]:
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      where = jax.tree_util.keystr(path)
      state = (f" ({where[:where.index(']') + 1]} is model state: the trainer averages it "
               "over the devices after each step, as BatchNorm's statistics)"
               if path and getattr(path[0], "key", None) in workload.state_collections else "")
      raise _fail("model", config.model, f"its variable {where} is {leaf.dtype}{state}, but "
                  "every variable of a model jaxcoll trains must be floating point; declare "
                  "it float32, or keep it out of the model's variables.")


def check_columns(workload, sample: dict[str, np.ndarray], field: str, pattern: Any,
                  ignored: Sequence[str] = (), *, conflicts: dict[str, str] | None = None,
                  paths: Sequence[str] = (), axis_names: Sequence[str] = ()) -> None:
  """Raises unless rows with ``sample``'s columns fit the workload.

  With a synthetic data set, the columns and per-row shapes must include its
  batch's, and a column it holds as integers must not be float; otherwise the
  loss is traced (:func:`_loss_jaxpr`, with the mesh's ``axis_names`` bound) on the
  columns: a missing key is reported, and so is a float column with which the trace
  fails but succeeds when that column is int32 (float labels for a classifier). Any
  other trace error surfaces at the first step (the model's own code). A needed column in
  ``conflicts`` (the files disagree on it, so it is not read) is its reason; one that is
  a hive partition key of ``paths`` (``label=1/part-0.parquet``) is named as such.
  """
  conflicts = dict(conflicts or {})

  def lacking(key):
    if key in conflicts:
      return _fail(field, pattern, f"the model needs column {key!r}, but {conflicts[key]}")
    keyed = next((p for p in paths if f"{os.sep}{key}=" in f"{os.sep}{p}"), None)
    if keyed is not None:  # pyarrow.dataset(partitioning="hive") would make it a column
      part = next(d for d in keyed.split(os.sep) if d.startswith(f"{key}="))
      return _fail(field, pattern, f"the model needs column {key!r}, which the files lack: "
                   f"it is a partition key of their paths ({part!r} in {keyed}), and only "
                   "the columns inside the files are read; write it into the files (e.g. "
                   "pyarrow.dataset.dataset(DIR, partitioning='hive').to_table(), then "
                   "pyarrow.parquet.write_table), or partition by another column.")
    if key in ignored:  # in the files, but as text, bytes, timestamps, ...: never read
      return _fail(field, pattern, f"the model needs column {key!r}, which the files hold "
                   f"but not as numbers, so it is not read (their columns: {columns}); write "
                   "it as numbers or fixed-size lists of them (image bytes as uint8: "
                   "pyarrow.FixedSizeListArray.from_arrays(pyarrow.array(numpy.frombuffer("
                   "b''.join(blobs), numpy.uint8)), bytes_per_image)), or choose another model.")
    near = [c for c in columns if c.lower() == key.lower()] or difflib.get_close_matches(
        key, list(columns), n=1, cutoff=0.8)
    if near:  # 'Label' for 'label', 'labels' for 'label': a name, not missing data
      return _fail(field, pattern, f"the model needs column {key!r}, which the files lack; "
                   f"they have {near[0]!r} (column names are matched exactly: their columns: "
                   f"{columns}); rename it in the files (pyarrow: table.rename_columns) or "
                   f"have the model read {near[0]!r}.")
    return _fail(field, pattern, f"the model needs column {key!r}, which the files lack "
                 f"(their columns: {columns}); add it, or choose another model.")

  columns = {k: f"{np.asarray(v).dtype}{list(np.shape(v)[1:])}" for k, v in sample.items()}
  if ignored:  # the files' columns that are not numbers, never read
    columns = f"{columns}; not numbers, so not read: {list(ignored)}"
  if workload.dataset is not None:
    expected = workload.dataset.examples(np.arange(1))
    for key, value in expected.items():
      if key not in sample:
        raise lacking(key)
      if np.shape(value)[1:] != np.shape(sample[key])[1:]:
        raise _fail(field, pattern, f"column {key!r} has per-row shape "
                    f"{list(np.shape(sample[key])[1:])}, but the model needs "
                    f"{list(np.shape(value)[1:])}; write shards for this model's config.")
      want, got = np.asarray(value).dtype, np.asarray(sample[key]).dtype
      if want.kind in "iu" and got.kind not in "iub":
        raise _fail(field, pattern, f"column {key!r} holds {got} values, but the model takes "
                    f"integers there ({want}); write it as integers.")
    return
  structs = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for k, v in sample.items()}
  try:
    _loss_jaxpr(workload, structs, axis_names)
  except KeyError as e:
    raise lacking(e.args[0]) from None
  except Exception as e:  # noqa: BLE001  (other trace errors surface in the first step)
    for key, struct in structs.items():
      if not jnp.issubdtype(struct.dtype, jnp.floating):
        continue
      trial = {**structs, key: jax.ShapeDtypeStruct(struct.shape, np.int32)}
      try:
        _loss_jaxpr(workload, trial, axis_names)
      except Exception:  # noqa: BLE001, S112  (not this column)
        continue
      first = (str(e).strip().splitlines() or [""])[0][:160]
      raise _fail(field, pattern, f"column {key!r} holds {struct.dtype} values, but the "
                  f"model's loss needs integers there (with {struct.dtype} it fails: "
                  f"{type(e).__name__}: {first}; with int32 it traces); write the column as "
                  "integers.") from None
    _check_input_shapes(workload, structs, e, field, pattern, axis_names)


def _check_input_shapes(workload, structs, error, field, pattern, axis_names=()) -> None:
  """The loss failed (``error``) on the files' columns: raise naming the column whose
  per-row shape is not the one the model was built for (``Workload.input_shapes``),
  when with that shape the loss traces (so the data, not the model, is at fault)."""
  for key, want in dict(getattr(workload, "input_shapes", None) or {}).items():
    struct = structs.get(key)
    if struct is None or tuple(struct.shape[1:]) == tuple(want):
      continue
    trial = {**structs, key: jax.ShapeDtypeStruct((struct.shape[0], *want), struct.dtype)}
    try:
      _loss_jaxpr(workload, trial, axis_names)
    except Exception:  # noqa: BLE001, S112  (not this column)
      continue
    first = (str(error).strip().splitlines() or [""])[0].split(" (https://")[0][:200]
    raise _fail(field, pattern, f"column {key!r} has per-row shape {list(struct.shape[1:])}, "
                f"but the model was built for {list(want)} (its sample_batch) and its loss "
                f"fails on it ({type(error).__name__}: {first}); write the column with "
                f"per-row shape {list(want)}, or build the model on a sample of the files' "
                "shape.") from None


def label_classes(workload) -> dict[str, int]:
  """The workload's integer label columns and their class counts (may be empty)."""
  return {str(k): int(v) for k, v in dict(getattr(workload, "label_classes", None) or {}).items()}


def check_label_ranges(workload, source, sample, field: str, pattern: Any) -> None:
  """Before training: each declared label column is integer, and (from the
  Parquet statistics, no data read) within ``0 .. n - 1``."""
  for key, count in label_classes(workload).items():
    if key not in sample:
      continue
    dtype = np.asarray(sample[key]).dtype
    if dtype.kind not in "iu":
      raise _fail(field, pattern, f"column {key!r} holds {dtype} values, but the model takes "
                  f"integer class ids 0..{count - 1} there; write it as integers.")
    found = source.column_range(key) if hasattr(source, "column_range") else None
    if found is None:
      continue  # no statistics: every batch is checked as it is read
    lo, hi, lo_at, hi_at = found
    for value, (path, group) in ((lo, lo_at), (hi, hi_at)):
      if not 0 <= value < count:
        raise _fail(field, pattern, _label_fix(key, value, count,
                                               f"{path}, row group {group}"))


_last_trace: list = []  # [(what was traced), its jaxpr]: see _loss_jaxpr


def _loss_jaxpr(workload, structs: dict[str, jax.ShapeDtypeStruct], axis_names=()):
  """The jaxpr of the workload's loss on ``structs``, traced as the step runs it: with
  the mesh's ``axis_names`` bound (a loss with a collective over the data axis,
  ``nn.BatchNorm(axis_name="data")``, does not trace outside the trainer's shard_map
  otherwise) and a key when it takes one. Raises what the trace raises. The last one is
  kept: the column checks of the train files and of eval files with the same columns
  trace the model once."""
  loss, params = workload.loss_fn, workload.param_shapes
  shapes = (tuple(axis_names),
            sorted((k, tuple(s.shape), _narrowed(s.dtype)) for k, s in structs.items()))
  if _last_trace:
    (last_loss, last_params, last_shapes), jaxpr = _last_trace
    if last_loss is loss and last_params is params and last_shapes == shapes:
      return jaxpr
  key = (jax.random.key(0),) if workload.takes_rng else ()
  jaxpr = axes_bound.make_jaxpr_bound_if_needed(loss, axis_names, params, structs, *key)
  _last_trace[:] = [(loss, params, shapes), jaxpr]
  return jaxpr


def _columns_read(workload, structs: dict[str, jax.ShapeDtypeStruct],
                  axis_names=()) -> set[str] | None:
  """The batch columns the workload's loss reads: its jaxpr's inputs that survive dead-code
  elimination (a column it never reads, as an id or a timestamp kept for bookkeeping, may
  hold anything). None when the loss does not trace here (the first step says why)."""
  try:
    return _read_by(_loss_jaxpr(workload, structs, axis_names), workload, structs)
  except Exception:  # noqa: BLE001  (the model's own code: the first step shows the error)
    return None


def _read_by(closed, workload, structs: dict[str, Any]) -> set[str]:
  """The keys of ``structs`` whose values jaxpr ``closed`` reads (it takes the workload's
  parameters, then ``structs``' leaves in key order): its inputs that survive dead-code
  elimination."""
  from jax._src.interpreters import partial_eval as pe  # noqa: PLC0415  (no public equivalent)

  _, used = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
  first = len(jax.tree.leaves(workload.param_shapes))
  batch = used[first:first + len(structs)]
  return {key for key, read in zip(sorted(structs), batch, strict=True) if read}


def _needed(trace, workload, structs: dict[str, Any]) -> set[str] | None:
  """The keys of ``structs`` that function ``trace`` (structs -> its closed jaxpr) needs:
  those whose values it reads, when it traces on them alone; all when it needs more (a
  loss that takes only a column's shape, ``batch["x"].shape``, reads no value of it);
  None when it does not trace here."""
  try:
    read = _read_by(trace(structs), workload, structs)
  except Exception:  # noqa: BLE001  (the model's own code: the first step shows the error)
    return None
  if read == set(structs):
    return read
  try:
    trace({k: v for k, v in structs.items() if k in read})
  except Exception:  # noqa: BLE001  (it needs more than the values it reads)
    return set(structs)
  return read


def used_columns(workload, sample: dict[str, np.ndarray], axis_names=()) -> set[str] | None:
  """The columns of ``sample`` a training step needs: those of the workload's synthetic
  batch, else those its loss needs (:func:`_needed`). None when that is not known (the
  loss does not trace here)."""
  if workload.dataset is not None:
    return set(workload.dataset.examples(np.arange(1))) & set(sample)
  structs = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for k, v in sample.items()}
  return _needed(lambda s: _loss_jaxpr(workload, s, axis_names), workload, structs)


def eval_columns(workload, sample: dict[str, np.ndarray], axis_names=()) -> set[str] | None:
  """The columns of ``sample`` evaluation needs: as :func:`used_columns`, of the
  per-example metrics the evaluator runs (the workload's ``eval_fn``, which may read
  others than its loss)."""
  if workload.dataset is not None:
    return set(workload.dataset.examples(np.arange(1))) & set(sample)
  metrics = evaluate._per_example_metrics(workload)  # what the evaluator runs
  example = {k: jax.ShapeDtypeStruct(np.shape(v)[1:], np.asarray(v).dtype)
             for k, v in sample.items()}
  return _needed(lambda s: axes_bound.make_jaxpr_bound_if_needed(
      metrics, axis_names, workload.param_shapes, s), workload, example)


def _read_only(source, used: set[str] | None, unreadable: Mapping[str, str]) -> None:
  """``source`` reads only the columns ``used`` (:func:`used_columns` / :func:`eval_columns`);
  when those are not known (the function does not trace here), a column of row 0 that does
  not read (``unreadable``, from ``source.sample()``) is the run's one line."""
  if used is not None:
    source.select(used)
  elif unreadable:
    raise _data_error(data_sources.DataError(next(iter(unreadable.values()))))


def _narrowed(dtype: np.dtype) -> np.dtype:
  """The dtype JAX holds a column of numpy ``dtype`` in (int64 as int32 without
  ``jax_enable_x64``)."""
  return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def _narrowing_fix(key: str, value: Any, dtype: np.dtype, where: str) -> str:
  wide = np.array(value, dtype)
  return (f"column {key!r} holds {value} ({where}), outside {_narrowed(dtype)} "
          f"({np.iinfo(_narrowed(dtype)).min}..{np.iinfo(_narrowed(dtype)).max}): JAX "
          f"holds {dtype} as {_narrowed(dtype)} (jax_enable_x64 is off), so the model would "
          f"get {wide.astype(_narrowed(dtype))} instead, silently; write it as a float (e.g. "
          "seconds since a recent date), bring it into that range (an offset, or a hash "
          "modulo the model's vocabulary), or run with JAX_ENABLE_X64=1.")


def narrowed_columns(workload, source, sample, field: str, pattern: Any,
                     axis_names: Sequence[str] = ()) -> dict[str, Any]:
  """Before training: the 64-bit integer columns JAX would narrow. Without
  ``jax_enable_x64`` JAX holds int64 as int32 and uint64 as uint32, so a larger
  value (a timestamp in milliseconds, a database id) wraps around without a word
  (1733000000000 becomes 2128179712). Of such columns the loss reads (the declared
  label columns have their own check), one whose Parquet statistics show a value out
  of range raises (one line naming the value, where and the fix); those without
  statistics (ArrayRecord, files written without them) are returned,
  ``{column: its dtype}``, for :func:`check_narrowed_values` on every batch read. Which
  columns the loss reads comes from its jaxpr (traced with the mesh's ``axis_names``
  bound); where the loss does not trace here, none is refused up front: every such column
  past the range, or without statistics, is checked in every batch."""
  wide = {k: np.asarray(v).dtype for k, v in sample.items()
          if np.asarray(v).dtype.kind in "iu" and _narrowed(np.asarray(v).dtype) !=
          np.asarray(v).dtype and k not in label_classes(workload)}
  suspects: dict[str, tuple[Any, str] | None] = {}
  for key, dtype in wide.items():
    found = source.column_range(key) if hasattr(source, "column_range") else None
    if found is None:
      suspects[key] = None  # no statistics: checked in every batch
      continue
    info = np.iinfo(_narrowed(dtype))
    for value, (path, group) in zip(found[:2], found[2:], strict=True):
      if not info.min <= value <= info.max:
        suspects[key] = (value, f"{path}, row group {group}")
        break
  if not suspects:
    return {}
  structs = {k: jax.ShapeDtypeStruct(np.shape(v), _narrowed(np.asarray(v).dtype))
             for k, v in sample.items()}
  read = _columns_read(workload, structs, axis_names)
  if read is None:  # the loss does not trace here: which columns it reads is not known
    return {key: wide[key] for key in suspects}
  for key, found in suspects.items():
    if key in read and found is not None:
      raise _fail(field, pattern, _narrowing_fix(key, found[0], wide[key], found[1]))
  return {key: wide[key] for key, found in suspects.items() if key in read}


def check_narrowed_values(rows: dict[str, np.ndarray], narrowed: dict[str, Any], field: str,
                          where) -> None:
  """Every value of each column of ``narrowed`` (:func:`narrowed_columns`) fits the
  dtype JAX holds it in; ``where(row)`` names the file of a bad row."""
  for key, dtype in narrowed.items():
    values = rows.get(key)
    if values is None or not np.size(values):
      continue
    info = np.iinfo(_narrowed(dtype))
    bad = (values < info.min) | (values > info.max)
    if bad.any():
      at = tuple(np.argwhere(bad)[0])
      raise data_sources.DataError(
          f"`{field}`: {_narrowing_fix(key, values[at], dtype, where(int(at[0])))}")


def _label_fix(key: str, value: Any, count: int, where: str) -> str:
  more = " (or give the model more outputs)" if value >= count else ""
  return (f"column {key!r} holds {value} ({where}), but the model has {count} classes (ids "
          f"0..{count - 1}); fix those labels{more}. A label outside the range trains on a "
          "wrong class or gives a NaN loss.")


def _where(source, index: int) -> str:
  """Which file (and row group) holds record ``index`` of ``source``."""
  if hasattr(source, "row_group_of"):
    path, group = source.row_group_of(index)
    return f"{path}, row group {group}"
  for path, (a, b) in zip(source.paths, source.file_rows(), strict=True):
    if a <= index < b:
      return f"{path}, record {index - a}"
  return f"record {index}"


def check_label_values(rows: dict[str, np.ndarray], classes: dict[str, int], field: str,
                       pattern: Any, where) -> None:
  """Every value of each declared label column of ``rows`` is in range;
  ``where(row)`` names the file of a bad row."""
  for key, count in classes.items():
    values = rows.get(key)
    if values is None or not np.size(values):
      continue
    values = np.asarray(values)
    if values.dtype.kind not in "iu":
      raise _fail(field, pattern, f"column {key!r} holds {values.dtype} values, but the model "
                  f"takes integer class ids 0..{count - 1} there; write it as integers.")
    bad = (values < 0) | (values >= count)
    if bad.any():
      row = int(np.argwhere(bad)[0][0])
      value = values[tuple(np.argwhere(bad)[0])]
      raise data_sources.DataError(f"`{field}`: {_label_fix(key, value, count, where(row))}")


def _data_error(e: data_sources.DataError) -> ConfigError:
  """A data error as the loop's one-line bad-input error (exit 2, not restarted)."""
  return ConfigError(str(e))


def _data_error_mid_run(e: data_sources.DataError) -> ConfigError:
  """A data error met while training: in a multi-process job only this process
  met it (each reads its own rows), while the others wait for it in the step's
  collectives, and the loop's collective clean-up (the checkpoint's prune) would
  wait for them: the job hung until the watchdog (exit 86, restarted). So this
  process says it in one line and ends at once with the bad-input status; the
  launcher stops the others and does not restart the job. One process: the
  loop's one-line error, exit 2."""
  if jax.process_count() == 1:
    return _data_error(e)
  print(f"train: error: process {jax.process_index()} of {jax.process_count()}: "
        f"{' '.join(str(e).split())}", file=sys.stderr, flush=True)
  os._exit(errors.EXIT_USAGE)


class TrainInput:
  """The global batch of each training step, and its position for checkpoints.

  Args:
    config: the training config (``global_batch_size``, ``seed``, ``data``).
    workload: the workload (its synthetic data set without ``data.train``).
    mesh: the trainer's mesh.
    axis: the data axis the batch is split over.
  """

  def __init__(self, config, workload, mesh, axis):
    config = run_config.parse(config)
    self.mesh, self.axis = mesh, axis
    self.global_batch_size = int(config.global_batch_size)
    self.workload = workload
    self.pattern = config.data.train
    self.allow_changed_files = config.data.allow_changed_files
    self.classes = label_classes(workload)
    self.files = None
    self.narrowed: dict[str, Any] = {}  # 64-bit integer columns checked in every batch
    self._it = None
    self._next = None  # the iterator's next batch number (of FileData.iterator)
    self._base = 0  # global batch index - the iterator's batch number (a resume sets it)
    # data.skip: batches no step trains on (jaxcoll.run.data_skip); incidents add ranges.
    self.skip_setting = config.data.skip
    self.schedule = data_skip.BatchSchedule(data_skip.parse_skip(config.data.skip))
    self.skipped_by_incidents: list[tuple[int, int]] = []
    if self.pattern:
      try:
        self.files = data_files.FileData(
            self.pattern, self.global_batch_size, shard_by=config.data.shard_by,
            seed=config.seed, num_threads=config.data.num_threads,
            prefetch=config.data.prefetch, strict=False,
            cache_bytes=config.data.cache_mib << 20,
        )
        # Row 0's columns, and those that fail to read on their own (a list column of
        # several lengths, nulls without statistics): a model that needs one is told so.
        sample, unreadable = self.files.source.sample()
      except data_sources.DataError as e:
        raise _data_error(e) from None
      check_columns(workload, sample, "data.train", self.pattern,
                    self.files.source.ignored_columns,
                    conflicts={**self.files.source.conflicts, **unreadable},
                    paths=self.files.all_files, axis_names=mesh.axis_names)
      check_label_ranges(workload, self.files.source, sample, "data.train", self.pattern)
      self.narrowed = narrowed_columns(workload, self.files.source, sample, "data.train",
                                       self.pattern, mesh.axis_names)
      # Only the columns a step needs are read: one it never reads (a list of tags of any
      # length, a column of nulls) stopped the run at the row group that held it, mid-run.
      _read_only(self.files.source, used_columns(workload, sample, mesh.axis_names), unreadable)
      unbalanced = self.files.balance_warning()
      if unbalanced and jax.process_index() == 0:
        logging.warning("%s", unbalanced)
      # Under `file` each process reads files of its own and names theirs; under `record`
      # every process reads the same files: process 0 names them.
      if config.data.shard_by == "file" or jax.process_index() == 0:
        large = self.files.large_row_groups_warning()
        if large:
          logging.warning("%s", large)
    elif workload.dataset is None:
      raise _fail("data.train", "", f"model {config.model!r} has no synthetic data set; name "
                  "its training files, e.g. --config.data.train=/data/train-*.parquet.")

  def restore(self, start: int, extra: dict[str, Any] | None) -> None:
    """Continues after ``start`` steps (the checkpoint's ``extra`` has the state).

    Raises:
      ConfigError: the checkpoint's data position does not fit this run (other
        files, ``shard_by``, or process count under ``file``) and
        ``data.allow_changed_files`` is not set; nothing is changed.
    """
    for first, last in (extra or {}).get("data_skipped_by_incidents") or []:
      if (int(first), int(last)) not in self.skipped_by_incidents:
        self.skip(first, last)
    self._check_skip_fits(int(start), extra)
    if self.files is not None:
      # The iterator's saved position is the global batch after the last one trained on
      # (0-based: the batch number of step `start`), not the one up next: ranges skipped from
      # step start + 1 on (data.skip, a rollback's) are crossed by `batch`, which moves it.
      index = self.schedule.batch_number(int(start))
      try:
        state = self.files.resume(extra, index, allow_changed=self.allow_changed_files)
      except data_sources.DataError as e:
        raise _data_error(e) from None
      if self.files.resume_changes and jax.process_index() == 0:
        logging.warning(
            "the data position in the checkpoint at step %d does not fit this run: %s; "
            "data.allow_changed_files=True: going on from the same number of examples in the "
            "new order (this epoch may repeat or skip examples)", int(start),
            "; ".join(self.files.resume_changes))
      self._it = self.files.iterator(state)
      self._next = int(state["next_index"])
      self._base = index - self._next

  def _check_skip_fits(self, start: int, extra: dict[str, Any] | None) -> None:
    """Raises unless this run's skipped batches up to the last one checkpoint ``start``
    trained on are the checkpoint's: a ``data.skip`` changed there (at a resume) would
    renumber every later step, silently dropping (or training again) the batches the change
    shifts by. Ranges after that batch may change (the remedy replayed on purpose)."""
    saved = (extra or {}).get("config")
    if not start or not isinstance(saved, dict):  # a fresh start, or an older checkpoint
      return
    before = (saved.get("data") or {}).get("skip", "")
    try:
      old = data_skip.BatchSchedule([*data_skip.parse_skip(before),
                                     *((extra or {}).get("data_skipped_by_incidents") or [])])
    except ValueError:
      return
    trained = old.batch_number(start)  # the last batch the checkpoint's run trained on

    def upto(ranges):
      return [(a, min(b, trained)) for a, b in ranges if a <= trained]

    if upto(old.ranges) == upto(self.schedule.ranges):
      return
    mine = data_skip.parse_skip(self.skip_setting)
    keep = [(a, b) for a, b in data_skip.parse_skip(before) if a <= trained]
    later = [(max(a, trained + 1), b) for a, b in mine if b > trained]
    fix = data_skip.format_skip(data_skip.BatchSchedule([*keep, *later]).ranges)
    raise _fail("data.skip", self.skip_setting,
                f"the checkpoint at step {start} was trained on batches 1..{trained} with "
                f"data.skip={before!r}; a resume can change only the batches after "
                f"{trained} (a change before it renumbers every later step, dropping or "
                f"repeating batches): use --config.data.skip={fix!r}, or start afresh in a new "
                "--workdir to replay from batch 1.")

  def skip(self, first: int, last: int) -> None:
    """No step trains on batches ``first..last`` (1-based, inclusive) from now on."""
    self.schedule.add(first, last)
    self.skipped_by_incidents.append((int(first), int(last)))

  def batch_number(self, step: int) -> int:
    """The batch step ``step`` (1-based) trains on (past ``data.skip``)."""
    return self.schedule.batch_number(step)

  def batch(self, step: int) -> dict[str, jax.Array]:
    """The global batch of loop step ``step`` (0-based: what step ``step + 1``
    trains on; the steps are taken in order)."""
    index = self.schedule.batch_number(step + 1) - 1
    if self.files is None:
      return data.global_batch(self.workload.dataset, index, self.global_batch_size, self.mesh,
                               axis=self.axis)
    if self._it is None:
      self.restore(step, None)
    position = index - self._base  # the iterator's batch number of global batch `index`
    if self._next != position:  # past skipped batches (or back, after a rollback)
      self._it = self.files.iterator({"next_index": position})
    self._next = position + 1
    try:
      rows = next(self._it)  # a reader thread's error: grain re-raises it here

      def where(row):
        return _where(self.files.source, int(self.files.batch_indices(position)[row]))

      if self.classes:
        check_label_values(rows, self.classes, "data.train", self.pattern, where)
      check_narrowed_values(rows, self.narrowed, "data.train", where)
    except data_sources.DataError as e:
      raise _data_error_mid_run(e) from None
    return data.from_process_local(rows, self.mesh, axis=self.axis)

  def state(self) -> dict[str, Any]:
    """What the checkpoint's ``extra`` keeps of the data position."""
    skipped = ({"data_skipped_by_incidents": [list(r) for r in self.skipped_by_incidents]}
               if self.skipped_by_incidents else {})
    if self.files is None:
      return skipped
    return {**self.files.checkpoint_state(self._it), **skipped}

  def report(self) -> dict[str, Any]:
    """Which files this process read (for the run's output and summary)."""
    if self.files is None:
      return {}
    read = data_sources.display_names(self.files.source.files_read, among=self.files.all_files)
    print(f"data: {self.files.describe()}; read {read}", flush=True)
    return {"data_shard_by": self.files.shard_by, "data_files_read": read,
            "data_num_records": self.files.num_records}


def make_evaluator(config, workload, mesh, axis) -> evaluate.Evaluator | None:
  """The evaluator for ``config.eval_every`` (None when it is 0)."""
  config = run_config.parse(config)
  if not config.eval_every:
    if config.data.eval and jax.process_index() == 0:  # files the run would silently not read
      logging.warning("`config.data.eval`=%r is set but `config.eval_every`=0, so the run does "
                      "not evaluate; pass --config.eval_every=N to evaluate every N steps and "
                      "at the last one", config.data.eval)
    return None
  batch_size = config.data.eval_batch_size or config.global_batch_size
  shards = checks.axis_size(mesh, axis)
  if batch_size % shards:
    raise _fail("data.eval_batch_size", batch_size, f"must be a multiple of the {shards} "
                "devices of the data axis (0 = global_batch_size).")
  pattern = config.data.eval
  if pattern:
    try:
      source = data_sources.open_source(pattern, "data.eval", strict=False,
                                        cache_bytes=config.data.cache_mib << 20)
      sample, unreadable = source.sample() if len(source) else ({}, {})
    except data_sources.DataError as e:
      raise _data_error(e) from None
    if len(source) == 0:
      raise _fail("data.eval", pattern, "the files hold no records.")
    if (config.data.eval_examples != run_config.DataConfig().eval_examples
        and jax.process_index() == 0):  # a field with no effect here, silently
      logging.warning("`config.data.eval_examples`=%d counts the synthetic eval set only: "
                      "with `config.data.eval` every record of its files is evaluated (%d); "
                      "to evaluate fewer, give files of fewer records", config.data.eval_examples,
                      len(source))
    check_columns(workload, sample, "data.eval", pattern, source.ignored_columns,
                  conflicts={**source.conflicts, **unreadable}, paths=source.paths,
                  axis_names=mesh.axis_names)
    check_label_ranges(workload, source, sample, "data.eval", pattern)
    narrowed = narrowed_columns(workload, source, sample, "data.eval", pattern, mesh.axis_names)
    _read_only(source, eval_columns(workload, sample, mesh.axis_names), unreadable)
    classes, count = label_classes(workload), len(source)

    def read_rows(index):
      try:
        rows = source.read_rows(index)

        def where(row):
          return _where(source, int(np.asarray(index)[row]))

        check_label_values(rows, classes, "data.eval", pattern, where)
        check_narrowed_values(rows, narrowed, "data.eval", where)
      except data_sources.DataError as e:
        raise _data_error_mid_run(e) from None
      return rows
  elif workload.dataset is not None:
    count = config.data.eval_examples
    dataset = workload.dataset

    def read_rows(index):
      return dataset.examples(np.asarray(index), "eval")
  else:
    raise _fail("data.eval", "", f"model {config.model!r} has no synthetic eval set; name "
                "the eval files, e.g. --config.data.eval=/data/eval-*.parquet.")
  evaluator = evaluate.Evaluator(workload, mesh, axis, read_rows, num_examples=count,
                                 global_batch_size=batch_size)
  left_out = evaluator.left_out_metrics()
  if left_out and jax.process_index() == 0:  # they were left out of every eval, silently
    logging.warning(
        "model %r reports metric(s) the evaluation leaves out: %s; an eval metric is a "
        "scalar per batch (a mean) or a (sum, count) pair of scalars, e.g. one per class: "
        "{'acc_0': ..., 'acc_1': ...}", config.model,
        "; ".join(f"{k!r} ({v} per example)" for k, v in left_out.items()))
  return evaluator
