"""File data: Parquet/ArrayRecord sources, per-process sharding through grain,
iterator state, process-local batches; and the runs on files (1 x 8 == 2 x 4,
shard_by=file, kill + restart)."""

import json
import os
import sys

import jobs
import numpy as np
import pytest

from jaxcoll import data
from jaxcoll.data import files as data_files, sources as data_sources
from jaxcoll.runtime import devices

N = 44  # records in 4 files of 11: no batch size below divides them


def _columns(n=N):
  return {
      "x": np.arange(n, dtype=np.float32),
      "img": np.arange(n * 12, dtype=np.int32).reshape(n, 2, 2, 3),
      "ids": (np.arange(n * 3, dtype=np.int64) % 7).reshape(n, 3),
  }


@pytest.fixture(params=["parquet", "array_record"])
def shards(request, tmp_path):
  data_sources.write_shards(_columns(), str(tmp_path), num_shards=4, fmt=request.param,
                            prefix="train", row_group_size=4)
  ext = "parquet" if request.param == "parquet" else "array_record"
  return str(tmp_path / f"train-*.{ext}")


def test_rows_come_back_with_their_values_and_shapes(shards):
  source = data_sources.open_source(shards)
  assert len(source) == N
  rows = source.read_rows([43, 0, 17])
  want = {k: v[[43, 0, 17]] for k, v in _columns().items()}
  for k, v in want.items():
    np.testing.assert_array_equal(rows[k], v)
    assert rows[k].dtype == v.dtype



def test_every_source_says_which_columns_it_does_not_read(shards):
  # The run and FileData.describe read `conflicts` / `ignored_columns` of any source
  # (they were getattr(source, "conflicts", {}): only ParquetSource had it).
  source = data_sources.open_source(shards, strict=False)
  assert dict(source.conflicts) == {} and list(source.ignored_columns) == []
  loader = data_files.FileData(shards, 8, process_index=0, process_count=1, strict=False)
  assert "columns not read" not in loader.describe()

def _batches(pattern, batch, steps, p, procs, *, shard_by="record", state=None):
  loader = data_files.FileData(pattern, batch, shard_by=shard_by, seed=3,
                               process_index=p, process_count=procs)
  it = loader.iterator(state)
  return loader, [next(it)["x"] for _ in range(steps)], it


def test_record_mode_same_batches_for_any_process_count_and_epochs_reshuffle(shards):
  steps = 11  # 88 rows: two epochs of 44
  _, one, _ = _batches(shards, 8, steps, 0, 1)
  halves = [_batches(shards, 8, steps, p, 2)[1] for p in (0, 1)]
  quarters = [_batches(shards, 8, steps, p, 4)[1] for p in range(4)]
  for s in range(steps):
    np.testing.assert_array_equal(one[s], np.concatenate([h[s] for h in halves]))
    np.testing.assert_array_equal(one[s], np.concatenate([q[s] for q in quarters]))
  seq = np.concatenate(one)
  epoch1, epoch2 = seq[:N], seq[N:2 * N]
  assert sorted(epoch1) == list(range(N)) and sorted(epoch2) == list(range(N))
  assert (epoch1 != epoch2).any()  # a new permutation each epoch
  assert (epoch1 != np.arange(N)).any()  # shuffled


def test_iterator_state_resumes_the_same_sequence(shards):
  _, straight, _ = _batches(shards, 8, 7, 1, 2)
  _, first, it = _batches(shards, 8, 3, 1, 2)
  state = it.get_state()
  assert state == {"next_index": 3}
  _, rest, _ = _batches(shards, 8, 4, 1, 2, state=json.loads(json.dumps(state)))
  np.testing.assert_array_equal(np.concatenate(first + rest), np.concatenate(straight))


def test_record_mode_continues_the_sequence_after_a_change_of_process_count(shards):
  _, straight, _ = _batches(shards, 8, 8, 0, 1)
  its = [_batches(shards, 8, 5, p, 2)[2] for p in (0, 1)]
  state = its[0].get_state()  # what the checkpoint keeps (the same on every process)
  assert state == its[1].get_state() == {"next_index": 5}
  _, rest, _ = _batches(shards, 8, 3, 0, 1, state=state)  # resumed on one process
  np.testing.assert_array_equal(np.concatenate(rest), np.concatenate(straight[5:]))


def test_file_mode_reads_only_own_files(shards):
  for p in (0, 1):
    loader, batches, _ = _batches(shards, 8, 6, p, 2, shard_by="file")
    own = [os.path.basename(f) for f in loader.files]
    assert own == [f"train-{2 * p + i:05d}-of-00004.{shards.rsplit('.', 1)[1]}"
                   for i in (0, 1)]
    assert loader.source.files_read == loader.files
    rows = np.concatenate(batches)
    assert set(rows) <= set(range(22 * p, 22 * p + 22))  # only its own records
    assert sorted(rows[:22]) == list(range(22 * p, 22 * p + 22))  # its epoch: each once


def test_file_mode_count_not_divisible_names_both(shards):
  with pytest.raises(ValueError, match="matches 4 files, which do not divide among 3"):
    data_files.FileData(shards, 6, shard_by="file", process_index=0, process_count=3)


def test_mixed_schemas_and_empty_glob_are_errors(tmp_path):
  data_sources.write_shards({"x": np.zeros(4, np.float32)}, str(tmp_path), prefix="a")
  data_sources.write_shards({"x": np.zeros(4, np.int32)}, str(tmp_path), prefix="b")
  with pytest.raises(ValueError, match="mixes schemas: a-00000-of-00001.parquet"):
    data_sources.open_source(str(tmp_path / "*.parquet"))
  with pytest.raises(ValueError, match="matches no file"):
    data_sources.open_source(str(tmp_path / "nothing-*.parquet"))


def test_array_records_of_msgpack_dicts_read_and_of_pickles_name_what_they_hold(tmp_path):
  """A user's own ArrayRecord files: flax msgpack'd dicts read as they are; records of
  pickles (or JSON) were 'cannot read ... as ArrayRecord (ExtraData: unpack(b) received
  extra data.)', though the file is ArrayRecord: one line saying what the records are and
  how to write ones jaxcoll reads."""
  import pickle  # noqa: PLC0415

  from array_record.python import array_record_module  # noqa: PLC0415
  from flax import serialization  # noqa: PLC0415

  rows = [{"x": np.full(3, i, np.float32), "label": np.int64(i % 2)} for i in range(5)]
  for name, encode in (("msgpack", serialization.msgpack_serialize), ("pickle", pickle.dumps)):
    writer = array_record_module.ArrayRecordWriter(str(tmp_path / f"{name}.array_record"), "")
    for row in rows:
      writer.write(encode(row))
    writer.close()
  got = data_sources.open_source(str(tmp_path / "msgpack.array_record")).read_rows([4, 1])
  assert got["x"].tolist() == [[4.0] * 3, [1.0] * 3] and got["label"].tolist() == [0, 1]
  with pytest.raises(data_sources.DataError, match=r"pickle.array_record is an ArrayRecord "
                     r"file, but its records are not examples jaxcoll reads: record 0 \(\d+ "
                     r"bytes, starting b'\\x80.*', a pickle\) .*write_shards\(columns, DIR, "
                     r"fmt='array_record'\)"):
    data_sources.open_source(str(tmp_path / "pickle.array_record"))


def test_a_row_group_larger_than_the_cache_is_decoded_once_and_named(tmp_path, monkeypatch):
  """pandas and pyarrow write up to 1Mi rows a row group; one larger decoded than the
  reader's cache was evicted as soon as it was cached, so every batch, an eval's sequential
  ones too, decoded it whole again (a 300 MB row group: 10-17 s a batch). The newest row
  group stays; with several such row groups the run is told to write smaller ones."""
  import pyarrow.parquet as pq  # noqa: PLC0415

  decoded = []
  real = pq.ParquetFile.read_row_group
  monkeypatch.setattr(pq.ParquetFile, "read_row_group",
                      lambda self, i, **kw: decoded.append(i) or real(self, i, **kw))
  columns = {"x": np.arange(4096, dtype=np.float32).reshape(512, 8)}  # 16 KiB
  data_sources.write_shards(columns, str(tmp_path / "one"), row_group_size=512)
  source = data_sources.ParquetSource([str(tmp_path / "one" / "data-00000-of-00001.parquet")],
                                      cache_bytes=4096)
  for batch in range(8):  # eval batches in order
    assert source.read_rows(np.arange(batch * 64, batch * 64 + 64))["x"][0, 0] == batch * 512
  assert decoded == [0]
  assert source.large_row_groups() is None  # the only row group: it stays cached
  data_sources.write_shards(columns, str(tmp_path / "two"), row_group_size=256)
  source = data_sources.open_source(str(tmp_path / "two"))
  assert source.large_row_groups() is None  # 8 KiB each, far below 256 MiB
  source._cache_bytes = 4096
  assert source.large_row_groups().startswith(
      "`data.train`: row group 0 of ") and "holds 256 rows, 0.0 MiB decoded (2 row group(s) " \
      "of the 2 are larger than the reader's 0.0 MiB cache" in source.large_row_groups()
  assert "make_shards --input=DIR --out=NEW_DIR --row_group_size=1024" in \
      source.large_row_groups()


def test_a_row_group_another_reader_thread_cached_meanwhile_is_the_newest(tmp_path):
  """Two reader threads missed the same row group; the second to decode it found it cached
  and left it where the first put it, so the next row group read evicted it, the group in
  use, and kept an older one: it is moved to the newest end, as a cache hit is."""
  columns = {"x": np.arange(768 * 8, dtype=np.float32).reshape(768, 8)}  # 3 groups, 8 KiB each
  data_sources.write_shards(columns, str(tmp_path), row_group_size=256)
  source = data_sources.ParquetSource([str(tmp_path / "data-00000-of-00001.parquet")],
                                      cache_bytes=2 * 8192)
  source.read_rows([256])
  source.read_rows([512])
  real, other = source._handle, []

  def handle(f):  # while this thread reads group 0, another reads it, then group 2
    if not other:
      other.append(f)
      source.read_rows([0])
      source.read_rows([512])
    return real(f)

  source._handle = handle
  assert source.read_rows([1])["x"][0, 0] == 8
  source._handle = real
  assert list(source._cache) == [2, 0]
  source.read_rows([256])  # a row group not cached: the oldest goes
  assert list(source._cache) == [0, 1]


def test_from_process_local_builds_the_global_batch_and_names_sizes():
  mesh = devices.flat_mesh(8)
  batch = data.from_process_local({"x": np.arange(16.0)}, mesh)
  assert batch["x"].shape == (16,)
  np.testing.assert_array_equal(np.asarray(batch["x"]), np.arange(16.0))
  with pytest.raises(ValueError, match="has 12 rows on this process, so the global batch is 12"):
    data.from_process_local({"x": np.arange(12.0)}, mesh)


# -- runs on files, through the CLI and the launcher -----------------------------

SMOKE = "--config=configs/recommender_2x4.py:smoke"


@pytest.fixture(scope="module")
def rec_shards(tmp_path_factory):
  out = tmp_path_factory.mktemp("rec_shards")
  made = jobs.run([sys.executable, "-m", "experiments.make_shards", SMOKE,
                   "--examples=200", "--num_shards=4", f"--out={out}"], devices=1)
  assert made.returncode == 0, made.stderr[-2000:]
  return str(out / "train-*.parquet")


def _flags(shards, *extra):
  return [SMOKE, f"--config.data.train={shards}", "--config.algorithm=ring",
          "--config.steps=6", "--config.checkpoint_every=2", *extra]


# Slow: the default run has the record-mode batches equal for any process count
# (test_record_mode_same_batches_...) and 1 vs 2 processes training alike
# (test_experiments' test_two_processes_match_one_process).
@pytest.mark.slow
def test_record_mode_1x8_equals_2x4(rec_shards, tmp_path):
  one = jobs.train(*_flags(rec_shards, "--config.mesh_shape=", "--config.mesh_axes="),
                   f"--workdir={tmp_path / 'one'}")
  assert one.returncode == 0, one.stderr[-2000:]
  two = jobs.launch(sys.executable, "-m", "experiments.train",
                    *_flags(rec_shards, "--config.mesh_shape=", "--config.mesh_axes="),
                    f"--workdir={tmp_path / 'two'}")
  assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-2000:]
  a, b = jobs.summary(tmp_path / "one"), jobs.summary(tmp_path / "two")
  assert (a["num_processes"], b["num_processes"]) == (1, 2)
  assert a["params_sha256"] == b["params_sha256"]


@pytest.fixture(scope="module")
def file_mode_run(rec_shards, tmp_path_factory):
  """A 2 x 4 run with shard_by=file: (its command, its workdir, its output)."""
  cmd = [sys.executable, "-m", "experiments.train",
         *_flags(rec_shards, "--config.data.shard_by=file")]
  workdir = tmp_path_factory.mktemp("file_mode") / "straight"
  out = jobs.launch(*cmd, f"--workdir={workdir}")
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  return cmd, workdir, out


@pytest.mark.slow  # one process's own files by default: test_file_mode_reads_only_own_files
def test_file_mode_each_process_reads_only_its_own_files(file_mode_run):
  _, _, out = file_mode_run
  for p, own in ((0, "['train-00000-of-00004.parquet', 'train-00001-of-00004.parquet']"),
                 (1, "['train-00002-of-00004.parquet', 'train-00003-of-00004.parquet']")):
    line = next(x for x in out.stdout.splitlines() if x.startswith(f"[p{p}] data:"))
    assert line.endswith(f"read {own}"), line


@pytest.mark.slow  # ~60-150 s; fast cover: test_iterator_state_resumes_the_same_sequence
def test_file_mode_restart_after_a_lost_process_is_bit_identical(file_mode_run, tmp_path):
  cmd, straight, _ = file_mode_run
  failing = jobs.launch(*cmd, "--config.fail_at_step=5", f"--workdir={tmp_path / 'failing'}",
                        launcher_flags=["--max_restarts=1"])
  assert failing.returncode == 0, failing.stdout[-2000:] + failing.stderr[-2000:]
  resumed = jobs.summary(tmp_path / "failing")
  assert resumed["start_step"] in (2, 4)  # the data iterator resumed mid-run
  assert resumed["params_sha256"] == jobs.summary(straight)["params_sha256"]

def test_process_local_rows_train_on_all_rows_and_raw_local_batch_is_refused():
  out = jobs.launch(sys.executable, os.path.join(jobs.REPO, "tests", "_local_batch_worker.py"))
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  results = [json.loads(line.split("RESULT ", 1)[1]) for line in out.stdout.splitlines()
             if "RESULT " in line]
  assert len(results) == 2
  want = float(np.mean(np.arange(32.0) ** 2))  # every row of both processes
  for r in results:
    assert r["loss"] == pytest.approx(want, rel=1e-6)
    assert "differs across the 2 processes (16 rows here)" in r["error"]
    assert "16 x 2 = 32" in r["error"] and "from_process_local" in r["error"]


def test_double_star_glob_finds_files_at_any_depth(tmp_path):
  """Hive-partitioned data (date=.../hour=.../part.parquet): `**` matched one level only,
  so DIR/**/*.parquet matched nothing two levels down."""
  for d in ("date=1/hour=0", "date=1/hour=1", "date=2/hour=0"):
    data_sources.write_shards({"x": np.arange(3.0)}, str(tmp_path / d), prefix="part")
  found = data_sources.expand(str(tmp_path / "**" / "*.parquet"))
  assert len(found) == 3 and len(data_sources.open_source(found)) == 9


def test_make_shards_refuses_empty_csv_cells_instead_of_writing_nan(tmp_path):
  """An empty CSV cell was written as NaN (a float column) or turned an int column to floats."""
  (tmp_path / "m.csv").write_text("a,b\n1,2.5\n2,\n")
  line = jobs.one_line(jobs.forked([sys.executable, "-m", "experiments.make_shards",
                                    f"--input={tmp_path / 'm.csv'}", f"--out={tmp_path / 'o'}",
                                    "--num_shards=1"]), prefix="make_shards: error:")
  assert "m.csv: column 'b' has 1 empty value(s)" in line, line
  assert not (tmp_path / "o").exists()


def test_a_dot_in_a_column_name_is_not_a_nesting_level(tmp_path):
  """Parquet's leaf path joins names with '.': nulls in an unread text column `meta.text`
  were refused as if in a column `meta`, and the range of list column `x` (leaf
  `x.list.element`) was read from the statistics of column `x.y`."""
  import pyarrow as pa  # noqa: PLC0415
  import pyarrow.parquet as pq  # noqa: PLC0415

  pq.write_table(pa.table({"x.y": pa.array(np.arange(6.0)), "x": pa.array([[1.0, 2.0]] * 6),
                           "meta.text": pa.array([None, "a"] * 3)}), tmp_path / "d.parquet")
  source = data_sources.open_source(str(tmp_path / "d.parquet"))
  assert source.ignored_columns == ["meta.text"]
  assert source.column_range("x")[:2] == (1.0, 2.0)
  assert source.column_range("x.y")[:2] == (0.0, 5.0)
