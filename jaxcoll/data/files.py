"""Training and eval batches from record files, sharded per process, via grain.

Two ways to shard the global batch of ``B`` examples over ``P`` processes
(``shard_by``):

- ``"record"`` (default): the sequence of global batches is a seeded
  permutation of all ``N`` records (a new one each epoch, drawn from
  ``(seed, epoch)``), the same whatever ``P``. Global
  batch ``b`` is positions ``b*B .. b*B + B - 1`` of that sequence; process
  ``p`` reads only positions ``b*B + p*B/P ..`` (its own rows, which its
  devices hold on a process-ordered mesh), by random access. So 1 process x 8
  devices and 2 x 4 train on identical batches, and after a change of process
  count a resumed run continues the same sequence.
- ``"file"``: process ``p`` of ``P`` opens only files ``p*F/P .. (p+1)*F/P``
  (``F`` must divide by ``P``) and draws its ``B/P`` rows of each step from a
  seeded permutation of its own records; the union over processes is the
  step's global batch. Each process streams its own shard of the data set.

Epoch ``e``'s permutation is ``numpy.random.default_rng([seed, stream, e])
.permutation(N)`` (``stream`` 0 for ``record``, 1 + p for process ``p``'s own
records under ``file``; 4 bytes a record, the two latest epochs cached): vectorized,
where grain's per-index ``shuffle`` costs ~60 us a record in Python and
would make the loader slower than the step. Reading is grain's: a
``MapDataset`` of batch numbers mapped to random-access reads of the
source, iterated with reader threads and prefetch.

The iterator is a grain ``DatasetIterator`` over batch numbers; its state
(``{"next_index": b}``: the number of batches consumed) goes into the
checkpoint with what it means (:meth:`FileData.checkpoint_state`: the batch
size, process count, ``shard_by``, the example position the batches count
from, and a fingerprint of the files: names, sizes, record counts), so a
resumed run sees the examples an uninterrupted one would. :meth:`FileData.resume`
continues exactly after another ``global_batch_size`` (the same sequence of
examples, cut into the new batches) and, under ``record``, another process
count; it refuses (:class:`jaxcoll.data.sources.DataError`, one line) other
files or file contents, another ``shard_by``, or another process count under
``file``, unless told to go on (``allow_changed=True``).

Example:
  >>> import numpy as np, tempfile, os
  >>> from jaxcoll import data_sources
  >>> d = tempfile.mkdtemp()
  >>> _ = data_sources.write_shards({"x": np.arange(12.0)}, d, num_shards=4)
  >>> one = FileData(os.path.join(d, "*.parquet"), 8, process_index=0, process_count=1)
  >>> two = [FileData(os.path.join(d, "*.parquet"), 8, process_index=p, process_count=2)
  ...        for p in (0, 1)]
  >>> whole = next(one.iterator())["x"]
  >>> halves = np.concatenate([next(t.iterator())["x"] for t in two])
  >>> bool((whole == halves).all())
  True
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grain
import jax
import numpy as np

from jaxcoll.data import sources as data_sources

SHARD_BY = ("record", "file")
Batch = dict[str, np.ndarray]


def _permutation(seed: int, stream: int, epoch: int, n: int) -> np.ndarray:
  """Epoch ``epoch``'s permutation of ``range(n)`` for ``(seed, stream)``."""
  order = np.random.default_rng([int(seed), int(stream), int(epoch)]).permutation(n)
  return order.astype(np.int32 if n < 2**31 else np.int64)


class FileData:
  """This process's training batches from files matching ``pattern``.

  Args:
    pattern: glob (or comma-separated globs) of Parquet or ArrayRecord files.
    global_batch_size: examples per step over all processes.
    shard_by: ``"record"`` or ``"file"`` (see the module docstring).
    seed: shuffle seed; each epoch uses a new permutation derived from it.
    process_index: this process (default ``jax.process_index()``).
    process_count: number of processes (default ``jax.process_count()``).
    num_threads: grain reader threads.
    prefetch: batches grain reads ahead.
    field: the config field named in error messages.
    strict: ``False``: columns the files disagree on are not read
      (:func:`jaxcoll.data.sources.open_source`).
    cache_bytes: Parquet row groups this process keeps decoded
      (:class:`jaxcoll.data.sources.ParquetSource`).

  Raises:
    ValueError: for a glob that matches nothing, mixed schemas, an unknown
      ``shard_by``, a batch that does not divide by the process count, or
      (``file``) a file count that does not divide by the process count.
  """

  def __init__(
      self,
      pattern: str,
      global_batch_size: int,
      *,
      shard_by: str = "record",
      seed: int = 0,
      process_index: int | None = None,
      process_count: int | None = None,
      num_threads: int = 2,
      prefetch: int = 2,
      field: str = "data.train",
      strict: bool = True,
      cache_bytes: int = 256 << 20,
  ):
    if shard_by not in SHARD_BY:
      raise ValueError(
          f"`data.shard_by`={shard_by!r}: valid choices are {', '.join(SHARD_BY)} "
          "(record: the same batches for any process count; file: each process its own files)."
      )
    self.process_index = jax.process_index() if process_index is None else int(process_index)
    self.process_count = jax.process_count() if process_count is None else int(process_count)
    if global_batch_size % self.process_count:
      raise ValueError(
          f"`global_batch_size` ({global_batch_size}) must be divisible by the number of "
          f"processes ({self.process_count}); use a multiple of {self.process_count}."
      )
    self.shard_by = shard_by
    self.global_batch_size = int(global_batch_size)
    self.local_batch_size = self.global_batch_size // self.process_count
    self.seed = int(seed)
    self.all_files = data_sources.expand(pattern, field)
    data_sources.file_format(self.all_files, field, pattern)
    if shard_by == "file":
      count, procs = len(self.all_files), self.process_count
      if count % procs:
        raise ValueError(
            f"`{field}` matches {count} files, which do not divide among {procs} processes "
            f"(`data.shard_by`='file' gives each process the same number of files); write a "
            f"multiple of {procs} shards (make_shards --num_shards) or use shard_by=record."
        )
      per = count // procs
      self.files = self.all_files[self.process_index * per:(self.process_index + 1) * per]
      # Every process checks every file (footers only): each process's batches must have
      # the others' keys, types and shapes, and each must have records of its own.
      whole = data_sources.open_source(self.all_files, field, strict=strict,
                                       cache_bytes=cache_bytes)
      rows = [b - a for a, b in whole.file_rows()]
      self.process_records = [sum(rows[p * per:(p + 1) * per]) for p in range(procs)]
      empty = [p for p, n in enumerate(self.process_records) if n == 0]
      if empty and sum(rows):
        names = data_sources.display_names(
            self.all_files[empty[0] * per:(empty[0] + 1) * per], among=self.all_files)
        raise ValueError(
            f"`{field}`={pattern!r}: under `data.shard_by`='file' process {empty[0]} of "
            f"{procs} gets the files {names[:4]}{' ...' if len(names) > 4 else ''}, which hold "
            f"no records (the {sum(rows)} records are in the other processes' files); use "
            "--config.data.shard_by=record (every process reads its rows from every file), or "
            "write shards of about equal size (python -m experiments.make_shards --num_shards)."
        )
      if procs == 1:
        self.source = whole
      elif isinstance(whole, data_sources.ParquetSource):  # the columns and dtypes of all
        self.source = data_sources.ParquetSource(self.files, field=field, columns=whole.dtypes,
                                                 cache_bytes=cache_bytes)
        self.source.conflicts = dict(whole.conflicts)
        self.source.null_columns = list(whole.null_columns)
      else:
        self.source = data_sources.open_source(self.files, field)
    else:
      self.files = self.all_files
      self.source = data_sources.open_source(self.files, field, strict=strict,
                                             cache_bytes=cache_bytes)
      rows = [b - a for a, b in self.source.file_rows()]
      self.process_records = None
    self.num_records = len(self.source)
    if self.num_records == 0:
      raise ValueError(f"`{field}`={pattern!r}: the files hold no records.")
    self.field = field
    self.fingerprint = data_sources.fingerprint(self.all_files, rows)
    self._rows = rows
    # The example position batch 0 of the iterator starts at (global under record,
    # this process's own under file); not 0 only after a resume with another batch size.
    self.origin = 0
    self.resume_changes: list[str] = []  # what resume() let change (allow_changed=True)
    self._threads, self._prefetch = int(num_threads), int(prefetch)
    # record: one stream for every process; file: one per process (its own records).
    self._stream = 0 if shard_by == "record" else 1 + self.process_index
    self._epochs: dict[int, np.ndarray] = {}
    self._lock = threading.Lock()

  def _epoch(self, epoch: int) -> np.ndarray:
    with self._lock:
      order = self._epochs.get(epoch)
      if order is None:
        order = self._epochs[epoch] = _permutation(self.seed, self._stream, epoch,
                                                   self.num_records)
        # Reader threads use at most two at once: keep this one and the newest other
        # (evicting by age alone dropped an older epoch read again: a KeyError).
        for old in sorted(e for e in self._epochs if e != epoch)[:-1]:
          del self._epochs[old]
      return order

  @property
  def schema(self) -> dict[str, str]:
    return self.source.schema

  def batch_indices(self, batch: int) -> np.ndarray:
    """The record numbers (in this process's source) of its rows of ``batch``."""
    if self.shard_by == "record":
      first = (self.origin + batch * self.global_batch_size
               + self.process_index * self.local_batch_size)
    else:
      first = self.origin + batch * self.local_batch_size
    positions = first + np.arange(self.local_batch_size, dtype=np.int64)
    epochs, within = np.divmod(positions, self.num_records)
    out = np.empty(len(positions), np.int64)
    for epoch in np.unique(epochs):
      where = epochs == epoch
      out[where] = self._epoch(int(epoch))[within[where]]
    return out

  def dataset(self):
    """A grain ``MapDataset``: element ``b`` is this process's rows of batch ``b``."""
    return grain.MapDataset.range(sys.maxsize).map(
        lambda b: self.source.read_rows(self.batch_indices(int(b)))
    )

  def iterator(self, state: dict[str, Any] | None = None) -> Iterator[Batch]:
    """A grain ``DatasetIterator`` of local batches, at ``state`` (``get_state()``)."""
    options = grain.ReadOptions(num_threads=self._threads, prefetch_buffer_size=self._prefetch)
    it = iter(self.dataset().to_iter_dataset(options))
    if state:
      it.set_state(dict(state))
    return it

  def checkpoint_state(self, it) -> dict[str, Any]:
    """What a checkpoint keeps of iterator ``it``'s position, and what it means."""
    return {
        "data_iterator": it.get_state(),
        "data_shard_by": self.shard_by,
        "data_origin": int(self.origin),
        "data_global_batch_size": self.global_batch_size,
        "data_process_count": self.process_count,
        "data_seed": self.seed,
        "data_files": self.fingerprint,
    }

  def resume(self, saved: dict[str, Any] | None, step: int, *,
             allow_changed: bool = False) -> dict[str, Any]:
    """The iterator state that continues after ``saved`` (a checkpoint's
    :meth:`checkpoint_state`, or an older checkpoint's ``extra`` with only
    ``data_iterator``; None: ``step`` batches of this run's size consumed).

    Another ``global_batch_size`` continues the same sequence of examples (it
    counts examples, not batches); so does another process count under
    ``record``. Sets :attr:`origin`.

    Raises:
      DataError: the files (names, sizes, record counts), ``shard_by``, the
        ``seed`` (of the records' order) or, under ``file``, the process count
        differ from the checkpoint's, unless
        ``allow_changed`` (then the run goes on from the same number of
        examples consumed, in the new files' order).
    """
    saved = dict(saved or {})
    it_state = saved.get("data_iterator") or {"next_index": int(step)}
    batches = int(it_state.get("next_index", step))
    old_config = saved.get("config") if isinstance(saved.get("config"), dict) else {}
    old_batch = int(saved.get("data_global_batch_size")
                    or old_config.get("global_batch_size") or self.global_batch_size)
    old_procs = int(saved.get("data_process_count") or self.process_count)
    old_shard_by = saved.get("data_shard_by") or self.shard_by
    old_origin = int(saved.get("data_origin", 0))
    problems = []
    old_files = saved.get("data_files")
    if isinstance(old_files, dict) and old_files.get("sha256") not in (
        self.fingerprint["sha256"],  # or as a checkpoint written before paths in it named
        data_sources.fingerprint(self.all_files, self._rows, basenames=True)["sha256"]):
      problems.append(f"the files of `{self.field}` changed: "
                      + data_sources.describe_change(old_files, self.fingerprint))
    old_seed = saved.get("data_seed", old_config.get("seed"))
    if isinstance(old_seed, int) and old_seed != self.seed:
      problems.append(f"`seed` was {old_seed}, now {self.seed}, and each epoch's order of the "
                      "records is a permutation drawn from it")
    if old_shard_by != self.shard_by:
      problems.append(f"`data.shard_by` was {old_shard_by!r}, now {self.shard_by!r}")
    elif self.shard_by == "file" and old_procs != self.process_count:
      problems.append(
          f"it was written by {old_procs} process(es), this run has {self.process_count}, and "
          "under `data.shard_by`='file' each process's files and order depend on the count")
    if problems and not allow_changed:
      raise data_sources.DataError(
          f"the data position in the checkpoint at step {step} does not fit this run: "
          f"{'; '.join(problems)}. Restore what changed to continue with the examples an "
          "uninterrupted run would see (shard_by=record continues across process counts), or "
          "pass --config.data.allow_changed_files=True to go on from the same number of "
          "examples in the new order (this epoch may then repeat or skip examples)."
      )
    # Allowed (allow_changed): what the run goes on from, for the run's log to say.
    self.resume_changes = list(problems)
    if old_shard_by != self.shard_by:  # allowed: count in this run's batches
      old_origin, old_batch, old_procs = 0, self.global_batch_size, self.process_count
    if self.shard_by == "record":
      consumed, unit = old_origin + batches * old_batch, self.global_batch_size
    else:  # this process's own position: the examples consumed over all processes / P
      seen = (old_origin + batches * (old_batch // old_procs)) * old_procs
      consumed, unit = seen // self.process_count, self.local_batch_size
    if consumed % unit:
      self.origin, start = consumed, 0
    else:
      self.origin, start = 0, consumed // unit
    return {**it_state, "next_index": start}

  def balance_warning(self) -> str | None:
    """Under ``file``, one line when the processes' own record counts differ by more
    than 10%: each process cycles its own records, so the examples of the process with
    fewer are seen more often (None otherwise)."""
    counts = self.process_records
    if not counts or max(counts) <= 1.1 * min(counts):
      return None
    lo, hi = int(np.argmin(counts)), int(np.argmax(counts))
    return (f"`{self.field}` under `data.shard_by`='file': process {lo}'s files hold "
            f"{counts[lo]} records, process {hi}'s {counts[hi]}; each process cycles its own "
            f"records, so process {lo}'s examples are trained on {counts[hi] / counts[lo]:.1f}x "
            "as often as process "
            f"{hi}'s (records per process: {counts}). Use --config.data.shard_by=record for "
            "every example once per epoch, or write shards of about equal size "
            "(python -m experiments.make_shards --num_shards).")

  def large_row_groups_warning(self) -> str | None:
    """One line when this process's batches will decode its Parquet row groups again and
    again: row groups too large to cache, or more of them than the cache holds
    (:meth:`jaxcoll.data.sources.ParquetSource.large_row_groups`), else None."""
    large = getattr(self.source, "large_row_groups", None)
    return large(self.local_batch_size) if large is not None else None

  def describe(self) -> str:
    """One line: which files this process reads, and how."""
    names = data_sources.display_names(self.files, among=self.all_files)
    ignored = list(self.source.ignored_columns)
    nulls = list(self.source.null_columns)
    unused = list(self.source.unused_columns)
    conflicts = sorted(set(self.source.conflicts) - set(nulls))
    return (f"process {self.process_index}/{self.process_count} shard_by={self.shard_by}: "
            f"{self.num_records} records in {len(names)} file(s) {names}"
            + (f"; columns not read (not numbers): {ignored}" if ignored else "")
            + (f"; columns not read (not alike in every file): {conflicts}" if conflicts else "")
            + (f"; columns not read (hold nulls): {nulls}" if nulls else "")
            + (f"; columns not read (the model does not read them): {unused}" if unused else ""))


def eval_positions(num_examples: int, global_batch_size: int, batch: int,
                   process_index: int, process_count: int) -> tuple[np.ndarray, np.ndarray]:
  """This process's example numbers of eval batch ``batch`` and their mask.

  Eval batch ``b`` holds examples ``b*B .. b*B + B - 1`` in order, process
  ``p`` its contiguous ``B/P`` rows; positions past the last example repeat
  the last one with mask 0, so every example counts exactly once.
  """
  local = global_batch_size // process_count
  positions = batch * global_batch_size + process_index * local + np.arange(local)
  mask = (positions < num_examples).astype(np.float32)
  return np.minimum(positions, num_examples - 1), mask


def eval_batches(
    read_rows: Callable[[np.ndarray], Batch],
    num_examples: int,
    global_batch_size: int,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
) -> Iterator[tuple[Batch, np.ndarray]]:
  """``(local batch, local mask)`` for each of the ``ceil(N / B)`` eval batches."""
  process_index = jax.process_index() if process_index is None else process_index
  process_count = jax.process_count() if process_count is None else process_count
  for b in range(-(-num_examples // global_batch_size)):
    index, mask = eval_positions(num_examples, global_batch_size, b, process_index,
                                 process_count)
    yield read_rows(index), mask
