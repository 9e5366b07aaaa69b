"""Cases a user brought that no other test had tried (engineer trial10): data as other
tools write it (a directory of Parquet files as pyarrow.dataset / Hugging Face datasets
read one, pandas' index column in some files, columns of other int widths, gzip'd CSV and
JSON Lines, nested objects and missing keys). Each test of a fix fails without it."""

import gzip
import json
import os
import pickle
import sys

import jobs
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxcoll.data import files as data_files
from jaxcoll.data import sources as data_sources


def _write(path, n, *, seed=0, label_type=pa.int32(), as_list=False, **extra):
  """``n`` rows of ``features`` (8 floats, fixed-size lists; ``as_list``: ``list<float>``,
  as pandas writes arrays) and ``label``, as pyarrow writes them; ``extra``: more columns
  (name: array)."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  x = np.random.default_rng(seed).normal(size=(n, 8)).astype(np.float32)
  features = (pa.array(list(x), pa.list_(pa.float32())) if as_list else
              pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 8))
  columns = {"features": features,
             "label": pa.array((x[:, 0] > 0).astype(np.int64), type=label_type), **extra}
  pq.write_table(pa.table(columns), str(path))
  return x


def test_a_directory_is_its_data_files_at_any_depth_sorted_as_pyarrow_dataset_reads_it(
    tmp_path):
  """`--config.data.train=/data/clicks` (a directory, as pyarrow.dataset.dataset(path) and
  datasets.load_dataset('parquet', data_dir=...) take it) was refused: 'matches the
  directory ..., not files'."""
  d = tmp_path / "clicks"
  for seed, name in enumerate(("date=2/part-0.parquet", "date=1/part-1.parquet",
                                "date=1/part-0.parquet")):
    _write(d / name, 5, seed=seed)
  (d / "_SUCCESS").write_text("")  # Spark's marker, hidden files and temporary dirs
  (d / "date=1" / ".part-0.parquet.crc").write_text("")
  _write(d / "_temporary" / "0" / "part-9.parquet", 5)
  (d / "README.md").write_text("not data")
  os.symlink(d / "date=2", d / "latest")  # a link to a partition, and a cycle: not entered
  os.symlink(d, d / "date=1" / "loop")
  expected = [str(d / n) for n in ("date=1/part-0.parquet", "date=1/part-1.parquet",
                                   "date=2/part-0.parquet")]
  assert data_sources.expand(str(d)) == expected
  assert data_sources.expand(str(d) + "/") == expected
  assert len(data_sources.open_source(str(d))) == 15
  one = data_files.FileData(str(d), 6, process_index=0, process_count=1)
  glob = data_files.FileData(str(d / "date=*" / "part-*.parquet"), 6, process_index=0,
                             process_count=1)  # the same order: the same batches
  np.testing.assert_array_equal(next(one.iterator())["features"],
                                next(glob.iterator())["features"])
  empty = tmp_path / "empty"
  (empty / "_logs").mkdir(parents=True)
  with pytest.raises(ValueError, match="is a directory that holds no .parquet or .array_record "
                     "file at any depth"):
    data_sources.expand(str(empty))
  (empty / "clicks.csv.gz").write_bytes(gzip.compress(b"a,label\n1,0\n"))
  with pytest.raises(ValueError, match=r"names \.csv files \(clicks\.csv\.gz\), which the "
                     r"trainer does not read .*make_shards --input="):
    data_sources.open_source(str(empty))


def test_columns_the_files_disagree_on_are_not_read_unless_the_model_needs_them(tmp_path):
  """pandas writes its index as `__index_level_0__` when it is not a RangeIndex (so in some
  files only); a `score` column in some files; labels int32 in one file and int64 in
  another (two writers); features as fixed-size lists in one file, pandas' `list<float>` in
  another: each was 'mixes schemas', exit 2, though the model reads neither extra column,
  int32 labels read as int64 lose nothing and lists of 8 are lists of 8."""
  d = tmp_path / "d"
  _write(d / "a.parquet", 20, __index_level_0__=pa.array(np.arange(100, 120)),
         score=pa.array(np.ones(20)))
  _write(d / "b.parquet", 12, seed=1, label_type=pa.int64(), as_list=True)
  _write(d / "c.parquet", 0, label_type=pa.int8(), other=pa.array([], pa.float32()))
  _write(d / "d.parquet", 8, seed=2)  # int32 labels
  pattern = str(d / "*.parquet")
  with pytest.raises(ValueError, match="mixes schemas"):  # the library's default: exact
    data_sources.open_source(pattern)
  source = data_sources.open_source(pattern, strict=False)  # the trainer's
  assert sorted(source.conflicts) == ["__index_level_0__", "score"]
  assert "column 'score' is in a.parquet but not in b.parquet" in source.conflicts["score"]
  rows = source.read_rows(np.arange(40))
  assert sorted(rows) == ["features", "label"] and rows["label"].dtype == np.int64
  assert rows["features"].shape == (40, 8)
  for index in ([0], [31], [39], [5, 25]):  # every batch one dtype, whichever file it reads first
    assert source.read_rows(index)["label"].dtype == np.int64
  # Under shard_by=file each process's own files give the dtype and columns of all files.
  two = [data_files.FileData(pattern, 6, shard_by="file", process_index=p, process_count=2,
                             strict=False) for p in (0, 1)]
  for loader in two:  # process 1's own files hold int32 labels only
    batch = next(loader.iterator())
    assert sorted(batch) == ["features", "label"] and batch["label"].dtype == np.int64
  assert two[1].describe().endswith(
      "columns not read (not alike in every file): ['__index_level_0__', 'score']")


def test_the_run_trains_past_a_column_it_does_not_need_and_names_one_it_needs(tmp_path):
  """Through the command line: the pandas index column in one file trains; labels that are
  text in one file are one line naming the column and the files."""
  d = tmp_path / "d"
  _write(d / "a.parquet", 32, __index_level_0__=pa.array(np.arange(32)))
  _write(d / "b.parquet", 32, seed=1)
  model = ["--config.model=test_user_trials5:make_classifier", "--config.model_overrides={}"]
  out = jobs.train_forked("--config=configs/minimal.py:smoke", *model,
                          f"--config.data.train={d}", f"--workdir={tmp_path / 'run'}",
                          devices=2)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "columns not read (not alike in every file): ['__index_level_0__']" in out.stdout
  x = np.zeros((4, 8), np.float32)
  pq.write_table(pa.table({"features": pa.FixedSizeListArray.from_arrays(
      pa.array(x.reshape(-1)), 8), "label": pa.array(["1"] * 4)}), str(d / "c.parquet"))
  line = jobs.one_line(jobs.train_forked("--config=configs/minimal.py:smoke", *model,
                                         f"--config.data.train={d}",
                                         f"--workdir={tmp_path / 'run2'}", devices=2),
                       prefix="train: error:")
  assert ("the model needs column 'label', but `data.train` mixes schemas: a.parquet and "
          "c.parquet differ: column 'label' is in a.parquet but string, not numbers, in "
          "c.parquet") in line
  assert not (tmp_path / "run2").exists()


def _make_shards(*args):
  return jobs.forked([sys.executable, "-m", "experiments.make_shards", "--num_shards=1",
                      *map(str, args)], devices=1)


def test_make_shards_reads_gzip_text_directories_nested_objects_and_missing_keys(tmp_path):
  """`--input=events.jsonl.gz` (or .csv.gz) was 'files of one kind ... got ['.gz']'; a
  nested object in every line ('meta') stopped the conversion; a key some lines lack had
  no way out but editing the files; a directory was 'got ['']'; a CSV of only its header
  among others was 'has columns [...], but ... has []' (an empty .jsonl: 'Empty JSON
  file')."""
  x = np.random.default_rng(0).normal(size=(10, 8))
  with gzip.open(tmp_path / "events.jsonl.gz", "wt") as f:
    for i, row in enumerate(x):
      line = {"features": row.tolist(), "label": int(row[0] > 0), "meta": {"src": "a", "k": i}}
      if i % 3 == 0:
        line["extra"] = 1  # some lines only
      f.write(json.dumps(line) + "\n")
  out = _make_shards(f"--input={tmp_path}/events.jsonl.gz", f"--out={tmp_path / 'a'}")
  line = jobs.one_line(out, prefix="make_shards: error:")
  assert ("column 'extra' has 6 null or missing value(s); every row needs a value: fill or "
          "drop them before converting, or leave the column out: --columns=NAME,NAME,...") in line
  out = _make_shards(f"--input={tmp_path}/events.jsonl.gz", "--columns=features,label",
                     f"--out={tmp_path / 'a'}")
  assert out.returncode == 0, out.stderr
  assert "not written: column 'meta' (struct<src: string, k: int64>, not numbers)" in out.stdout
  rows = data_sources.open_source(str(tmp_path / "a")).read_rows(np.arange(10))
  assert sorted(rows) == ["features", "label"]
  np.testing.assert_array_equal(rows["features"], x)
  text = tmp_path / "csv" / "part"
  os.makedirs(text)
  for i in range(2):
    with gzip.open(text / f"{i}.csv.gz", "wt") as f:
      f.write("f0,user,label\n" + "".join(f"{x[j, 0]},u{j},{j % 2}\n"
                                           for j in range(5 * i, 5 * i + 5)))
  with gzip.open(text / "9-empty.csv.gz", "wt") as f:
    f.write("f0,user,label\n")  # a header only: its columns have no types
  out = _make_shards(f"--input={tmp_path / 'csv'}", f"--out={tmp_path / 'b'}")
  assert out.returncode == 0, out.stderr
  assert "wrote 10 rows, columns {'f0': [], 'label': []}" in out.stdout
  assert "files of no rows (read past, as the trainer reads past empty shards) 1: " \
      "9-empty.csv.gz" in out.stdout
  rows = data_sources.open_source(str(tmp_path / "b")).read_rows(np.arange(10))
  np.testing.assert_array_equal(rows["f0"], x[:, 0])
  np.testing.assert_array_equal(rows["label"], np.arange(10) % 2)



def test_make_shards_names_why_a_parquet_column_it_cannot_write_was_skipped(tmp_path):
  """`--columns` asks for a column the Parquet files disagree on: the line gives the short
  reason, which ParquetSource keeps beside its message (SchemaConflict.reason)."""
  d = tmp_path / "d"
  _write(d / "a.parquet", 6, score=pa.array(np.ones(6)))
  _write(d / "b.parquet", 6, seed=1)
  source = data_sources.open_source(str(d / "*.parquet"), strict=False)
  why = source.conflicts["score"]
  assert why.reason == "a.parquet and b.parquet differ: column 'score' is in a.parquet but " \
      "not in b.parquet"
  assert why.startswith(f"`data.train` mixes schemas: {why.reason}; every file must have ")
  assert pickle.loads(pickle.dumps(why)).reason == why.reason  # copied to other processes
  out = _make_shards(f"--input={d}", "--columns=features,score", f"--out={tmp_path / 'o'}")
  assert jobs.one_line(out, prefix="make_shards: error:") == (
      "make_shards: error: `--columns`: the files has no column 'score' of numbers "
      f"({why.reason}); its columns of numbers: ['features', 'label'].")

def make_failing_on_process_1():
  """The README's classifier, but its model function needs a file process 1's host lacks."""
  if os.environ.get("JAXCOLL_PROCESS_ID") == "1":
    open("/nonexistent/vocab.txt")  # noqa: SIM115
  import test_user_trials5  # noqa: PLC0415

  return test_user_trials5.make_classifier()


def _two_by_hand(tmp_path, per_process):
  """Processes 0, 1, ... of a job started by hand (no launcher), each with its own extra
  environment and flags (``per_process[pid] = (env, flags)``); their (status, stderr,
  seconds)."""
  cmd = jobs.train_cmd("--config=configs/minimal.py:smoke", f"--workdir={tmp_path / 'run'}")
  outs = jobs.by_hand(cmd, [(1, env, flags) for env, flags in per_process])
  return [(status, err, seconds) for status, _, err, seconds in outs]


def _errors(err):
  return [line for line in err.splitlines() if "error:" in line or "jaxcoll.distributed:" in line]


def test_a_process_told_another_process_count_is_one_line_and_the_job_ends_at_once(tmp_path):
  """Process 1 with JAXCOLL_NUM_PROCESSES=3 in a job of 2: JAX took process 0's count,
  and the job trained, exit 0 on both, without a word about the wrong setting."""
  (s0, e0, _), (s1, e1, t) = _two_by_hand(tmp_path, [({}, []),
                                                     ({"JAXCOLL_NUM_PROCESSES": "3"}, [])])
  assert s1 == 2 and _errors(e1) == [
      "train: error: this process (id 1) was told the job has 3 processes (settings from "
      "JAXCOLL_COORDINATOR, JAXCOLL_NUM_PROCESSES=3, JAXCOLL_PROCESS_ID=1), but the job at "
      f"{e1.split('but the job at ')[1].split(' ')[0]} has 2, the count process 0 was given; "
      "give every process the same count (python -m jaxcoll.launch sets it for all)."], e1
  assert s0 == 76 and "process 1 of 2 failed" in e0, e0  # not JAX's abort, not a hang
  assert "Traceback" not in e0 + e1 and "Check failure" not in e1 and t < 60
  assert not (tmp_path / "run").exists()


def test_a_data_path_only_one_process_lacks_is_said_naming_that_process(tmp_path):
  """Process 1's `data.train` matched nothing (a mount missing on its host): process 0 said
  process 1's line about a path it had never been given, as if its own."""
  d = tmp_path / "d"
  _write(d / "a.parquet", 32)
  model = ["--config.model=test_user_trials5:make_classifier", "--config.model_overrides={}"]
  (s0, e0, _), (s1, e1, t) = _two_by_hand(tmp_path, [
      ({}, [*model, f"--config.data.train={d}"]),
      ({}, [*model, f"--config.data.train={tmp_path / 'not-mounted'}"])])
  assert (s0, s1) == (2, 2) and t < 60
  line = f"`data.train`='{tmp_path / 'not-mounted'}' matches no file"
  assert _errors(e1)[0].startswith(f"train: error: {line}"), e1
  assert _errors(e0)[0].startswith(f"train: error: process 1 of 2: {line}"), e0
  assert len(_errors(e0)) == len(_errors(e1)) == 1


def test_one_of_three_processes_failing_at_start_ends_the_others_with_one_line_each(tmp_path):
  """3 processes, process 1's model function raising (a file its host lacks): process 0
  ended at once (exit 76), and process 2, seeing the coordinator go with it, printed JAX's
  fatal-error lines ('Polled an error from coordination service', 'Terminating process
  because the JAX distributed service detected fatal errors', gRPC's 'Socket closed')
  before, or instead of, its one line."""
  model = [f"--config.model={__name__}:make_failing_on_process_1", "--config.model_overrides={}",
           f"--config.data.train={tmp_path / 'd'}"]
  _write(tmp_path / "d" / "a.parquet", 32)
  outs = _two_by_hand(tmp_path, [({}, model)] * 3)
  assert [s for s, _, _ in outs] == [76, 1, 76] and outs[-1][2] < 60, outs
  assert "FileNotFoundError" in outs[1][1]
  for pid in (0, 2):
    err = outs[pid][1]
    assert _errors(err) == [line for line in err.splitlines() if line.strip()], err
    assert len(_errors(err)) == 1 and "failed (an uncaught exception" in err, err


def test_a_partition_added_to_a_directory_is_named_at_the_resume(tmp_path):
  """Partitions `date=1/part-0.parquet`, `date=2/part-0.parquet` and then `date=3/...`
  appended: the resume was refused saying 'the same files in another order' (the
  fingerprint named files without their directory, so every partition was 'part-0')."""
  d = tmp_path / "hive"
  for day in (1, 2):
    _write(d / f"date={day}" / "part-0.parquet", 10, seed=day)
  first = data_files.FileData(str(d), 4, process_index=0, process_count=1)
  saved = first.checkpoint_state(first.iterator())
  assert [e[0] for e in saved["data_files"]["list"]] == ["date=1/part-0.parquet",
                                                         "date=2/part-0.parquet"]
  # A checkpoint written before (names alone) still resumes on the same files.
  old = {**saved, "data_files": data_sources.fingerprint(first.all_files, [10, 10],
                                                         basenames=True)}
  data_files.FileData(str(d), 4, process_index=0, process_count=1).resume(old, 2)
  _write(d / "date=3" / "part-0.parquet", 10, seed=3)
  with pytest.raises(data_sources.DataError, match=r"changed: date=3/part-0\.parquet added "
                     r"\(were 2 file\(s\), 20 records, now 3 file\(s\), 30 records\)"):
    data_files.FileData(str(d), 4, process_index=0, process_count=1).resume(saved, 2)


def test_make_shards_does_not_read_a_zero_padded_id_column_as_numbers(tmp_path):
  """A CSV column of ids "007", "012" (zip codes "02134") was inferred int64 by pyarrow
  and written as 7, 12: the text lost ("07" and "007" one id). Left out and named, as
  other text columns are; a plain int column beside it is still written."""
  (tmp_path / "u.csv").write_text("user,n,label\n007,0,1\n012,10,0\n300,3,1\n")
  out = _make_shards(f"--input={tmp_path / 'u.csv'}", f"--out={tmp_path / 'o'}")
  assert out.returncode == 0, out.stderr
  assert "column 'user' (text with leading zeros, e.g. '007', not numbers)" in out.stdout
  rows = data_sources.open_source(str(tmp_path / "o")).read_rows(np.arange(3))
  assert sorted(rows) == ["label", "n"]
  np.testing.assert_array_equal(rows["n"], [0, 10, 3])
