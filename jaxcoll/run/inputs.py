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
raised before anything is written to the workdir.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from jaxcoll import checks, data, models
from jaxcoll.data import files as data_files, sources as data_sources
from jaxcoll.run import data_skip, evaluate
from jaxcoll.run.config_error import fail as _fail


def _data(config, name: str, default: Any) -> Any:
  section = config.get("data", None)
  return default if section is None else section.get(name, default)


def make_workload(config) -> models.Workload:
  """The workload ``config.model`` with ``config.model_overrides``."""
  try:
    return models.make_workload(config.model, **dict(config.get("model_overrides", {})))
  except ValueError as e:
    raise _fail("model", config.model, str(e)) from None


def check_columns(workload, sample: dict[str, np.ndarray], field: str, pattern: str) -> None:
  """Raises unless rows with ``sample``'s columns fit the workload.

  With a synthetic data set, the columns and per-row shapes must include its
  batch's; otherwise the loss is traced (``jax.eval_shape``) on the columns
  and a missing key is reported.
  """
  columns = {k: f"{np.asarray(v).dtype}{list(np.shape(v)[1:])}" for k, v in sample.items()}
  if workload.dataset is not None:
    expected = workload.dataset.examples(np.arange(1))
    for key, value in expected.items():
      if key not in sample:
        raise _fail(field, pattern, f"the model needs column {key!r}, which the files lack "
                    f"(their columns: {columns}); add it, or choose another model.")
      if np.shape(value)[1:] != np.shape(sample[key])[1:]:
        raise _fail(field, pattern, f"column {key!r} has per-row shape "
                    f"{list(np.shape(sample[key])[1:])}, but the model needs "
                    f"{list(np.shape(value)[1:])}; write shards for this model's config.")
    return
  structs = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for k, v in sample.items()}
  try:
    jax.eval_shape(workload.loss_fn, workload.param_shapes, structs)
  except KeyError as e:
    raise _fail(field, pattern, f"the model needs column {e.args[0]!r}, which the files lack "
                f"(their columns: {columns}); add it, or choose another model.") from None
  except Exception:  # noqa: BLE001, S110  (other trace errors surface in the first step)
    pass


class TrainInput:
  """The global batch of each training step, and its position for checkpoints.

  Args:
    config: the training config (``global_batch_size``, ``seed``, ``data``).
    workload: the workload (its synthetic data set without ``data.train``).
    mesh: the trainer's mesh.
    axis: the data axis the batch is split over.
  """

  def __init__(self, config, workload, mesh, axis):
    self.mesh, self.axis = mesh, axis
    self.global_batch_size = int(config.global_batch_size)
    self.workload = workload
    self.pattern = _data(config, "train", "") or ""
    self.files = None
    self._it = None
    self._next = None  # the 0-based batch index the file iterator yields next
    # data.skip: batches no step trains on (jaxcoll.run.data_skip); incidents add ranges.
    self.schedule = data_skip.BatchSchedule(data_skip.parse_skip(_data(config, "skip", "")))
    self.skipped_by_incidents: list[tuple[int, int]] = []
    if self.pattern:
      self.files = data_files.FileData(
          self.pattern, self.global_batch_size, shard_by=_data(config, "shard_by", "record"),
          seed=int(config.seed), num_threads=int(_data(config, "num_threads", 2)),
          prefetch=int(_data(config, "prefetch", 2)),
      )
      check_columns(workload, self.files.source.read_rows([0]), "data.train", self.pattern)
    elif workload.dataset is None:
      raise _fail("data.train", "", f"model {config.model!r} has no synthetic data set; name "
                  "its training files, e.g. --config.data.train=/data/train-*.parquet.")

  def restore(self, start: int, extra: dict[str, Any] | None) -> None:
    """Continues after ``start`` steps (the checkpoint's ``extra`` has the state)."""
    for first, last in (extra or {}).get("data_skipped_by_incidents") or []:
      if (int(first), int(last)) not in self.skipped_by_incidents:
        self.skip(first, last)
    if self.files is not None:
      index = self.schedule.batch_number(int(start) + 1) - 1
      state = (extra or {}).get("data_iterator") or {"next_index": index}
      self._it = self.files.iterator(state)
      self._next = int(state.get("next_index", index))

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
    if self._next != index:  # past skipped batches (or back, after a rollback)
      self._it = self.files.iterator({"next_index": index})
    self._next = index + 1
    return data.from_process_local(next(self._it), self.mesh, axis=self.axis)

  def state(self) -> dict[str, Any]:
    """What the checkpoint's ``extra`` keeps of the data position."""
    skipped = ({"data_skipped_by_incidents": [list(r) for r in self.skipped_by_incidents]}
               if self.skipped_by_incidents else {})
    if self.files is None:
      return skipped
    return {"data_iterator": self._it.get_state(), "data_shard_by": self.files.shard_by,
            **skipped}

  def report(self) -> dict[str, Any]:
    """Which files this process read (for the run's output and summary)."""
    if self.files is None:
      return {}
    read = [os.path.basename(f) for f in self.files.source.files_read]
    print(f"data: {self.files.describe()}; read {read}", flush=True)
    return {"data_shard_by": self.files.shard_by, "data_files_read": read,
            "data_num_records": self.files.num_records}


def make_evaluator(config, workload, mesh, axis) -> evaluate.Evaluator | None:
  """The evaluator for ``config.eval_every`` (None when it is 0)."""
  every = config.get("eval_every", 0)
  if isinstance(every, bool) or not isinstance(every, int) or every < 0:
    raise _fail("eval_every", every, "must be an integer >= 0 (0 = no evaluation).")
  if not every:
    return None
  batch_size = int(_data(config, "eval_batch_size", 0) or config.global_batch_size)
  axes = checks.axis_names(axis)
  shards = int(np.prod([mesh.shape[a] for a in axes]))
  if batch_size % shards:
    raise _fail("data.eval_batch_size", batch_size, f"must be a multiple of the {shards} "
                "devices of the data axis (0 = global_batch_size).")
  pattern = _data(config, "eval", "") or ""
  if pattern:
    source = data_sources.open_source(pattern, "data.eval")
    if len(source) == 0:
      raise _fail("data.eval", pattern, "the files hold no records.")
    check_columns(workload, source.read_rows([0]), "data.eval", pattern)
    read_rows, count = source.read_rows, len(source)
  elif workload.dataset is not None:
    count = _data(config, "eval_examples", 1024)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
      raise _fail("data.eval_examples", count, "must be a positive integer.")
    dataset = workload.dataset

    def read_rows(index):
      return dataset.examples(np.asarray(index), "eval")
  else:
    raise _fail("data.eval", "", f"model {config.model!r} has no synthetic eval set; name "
                "the eval files, e.g. --config.data.eval=/data/eval-*.parquet.")
  return evaluate.Evaluator(workload, mesh, axis, read_rows, num_examples=count,
                            global_batch_size=batch_size)
