"""Cases a user of the file data, checkpoints, eval-only and the launcher brought that no
other test had tried (engineer trial17): their own Parquet layouts (hive-partitioned
directories whose files all share one name, as Spark and pyarrow's write_to_dataset write
them). Each test of a fix fails without it."""

import os

import jobs
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jaxcoll.data import files as data_files


def _hive(root, rows_per_day):
  for day, n in enumerate(rows_per_day):
    os.makedirs(root / f"day={day}")
    pq.write_table(pa.table({"x": np.arange(n, dtype=np.float32)}),
                   root / f"day={day}" / "part-0.parquet", row_group_size=3)


def test_data_line_names_partitioned_files_by_their_partition(tmp_path):
  """A hive-partitioned directory (`day=0/part-0.parquet`, `day=1/part-0.parquet`, ...)
  under `shard_by=file` on 2 processes: the run's `data:` line, which README says names the
  files each process read, named every one `part-0.parquet`, so the user could not tell
  which partitions a process had (the checkpoint's fingerprint already named them by their
  path below the directory). Now the line, and the error for a process whose files hold no
  records, name them as the fingerprint does."""
  _hive(tmp_path, [5, 7, 6, 4])
  data = [data_files.FileData(str(tmp_path), 4, shard_by="file", process_index=p,
                              process_count=2) for p in (0, 1)]
  assert "['day=2/part-0.parquet', 'day=3/part-0.parquet']" in data[1].describe()
  assert "['day=0/part-0.parquet', 'day=1/part-0.parquet']" in data[0].describe()
  # Unique names stay as they were: the name alone.
  flat = tmp_path / "flat"
  os.makedirs(flat)
  for i in range(2):
    pq.write_table(pa.table({"x": np.arange(4.0)}), flat / f"s{i}.parquet")
  assert "['s1.parquet']" in data_files.FileData(
      str(flat), 2, shard_by="file", process_index=1, process_count=2).describe()


def test_empty_process_error_names_partitions(tmp_path):
  _hive(tmp_path, [5, 7, 0, 0])
  try:
    data_files.FileData(str(tmp_path), 4, shard_by="file", process_index=0, process_count=2)
  except ValueError as e:
    assert "['day=2/part-0.parquet', 'day=3/part-0.parquet']" in str(e), e
  else:
    raise AssertionError("no error for a process without records")


def test_a_label_that_is_a_hive_partition_key_is_named_as_one(tmp_path):
  """`pyarrow.parquet.write_to_dataset(table, DIR, partition_cols=["labels"])` writes
  `labels=0/<uuid>-0.parquet` files without the column: pyarrow.dataset reads it back from
  the paths, jaxcoll reads only the files' own columns. The run said the files lack
  'labels' (their columns: {'inputs': ...}), which the user, who wrote the column, could
  not match to anything. Now the line says it is a partition key of the paths and how to
  put it into the files; exit 2, no workdir."""
  x = np.random.default_rng(0).normal(size=(16, 32)).astype(np.float32)
  table = pa.table({"inputs": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 32),
                    "labels": np.arange(16) % 2})
  pq.write_to_dataset(table, str(tmp_path / "data"), partition_cols=["labels"])
  out = jobs.train_forked("--config=configs/minimal.py:smoke",
                          f"--config.data.train={tmp_path / 'data'}",
                          f"--workdir={tmp_path / 'run'}")
  line = jobs.one_line(out)
  assert "the model needs column 'labels', which the files lack: it is a partition key of " \
         "their paths ('labels=0' in " in line, line
  assert "partitioning='hive'" in line
  assert not (tmp_path / "run").exists()


def test_a_checkpoint_directory_with_a_bracket_is_refused_before_anything_is_saved(tmp_path):
  """`--workdir='/runs/sweep[lr=3e-3]'`: every save "committed", and the next run (and
  `experiments.eval`) skipped each as damaged (tensorstore NOT_FOUND '.zarray': orbax
  merges the processes' OCDBT files by a glob of the path, and a '[' there matches
  nothing, so the manifest of the arrays was never written), then "No intact checkpoint".
  Now the Checkpointer refuses such a directory in one line before it writes anything (a
  ']' alone globs as itself and works)."""
  from jaxcoll.train import checkpoint  # noqa: PLC0415

  where = tmp_path / "sweep[lr=3e-3]" / "checkpoints"
  try:
    checkpoint.Checkpointer(where)
  except ValueError as e:
    assert "contains '['" in str(e) and "without '['" in str(e), e
  else:
    raise AssertionError("a checkpoint directory with '[' was taken")
  assert not where.exists()
  try:
    checkpoint.Checkpointer(where, read_only=True)
  except ValueError as e:
    assert "contains '['" in str(e), e
  else:
    raise AssertionError("a read-only checkpoint directory with '[' was taken")
