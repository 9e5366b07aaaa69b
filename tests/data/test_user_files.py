"""Files a user brings that no make_shards wrote: Spark's directories, nullable
bookkeeping columns, odd dtypes, row groups of any size; read as the model
needs, each example once per epoch across processes, and resumed exactly."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import jobs
from configs import minimal
from jaxcoll import models
from jaxcoll.data import files as data_files, sources as data_sources
from jaxcoll.run import inputs
from jaxcoll.run.config_error import ConfigError
from jaxcoll.runtime import devices


def _table(n, start=0, null_every=7):
  """The minimal MLP's columns, and bookkeeping ones as Spark writes them."""
  rng = np.random.default_rng(start)
  ids = np.arange(start, start + n)
  return pa.table({
      "id": pa.array(ids, pa.int64()),
      "inputs": pa.array(list(rng.normal(size=(n, 32)).astype(np.float32)),
                         pa.list_(pa.float32())),
      "labels": pa.array(rng.integers(0, 10, n).astype(np.int32)),
      "score": pa.array([None if i % null_every == 0 else float(i) for i in ids], pa.float64()),
      "name": pa.array([f"u{i}" for i in ids]),
  })


def _train_input(pattern):
  config = minimal.get_config("smoke")
  config.data.train = pattern
  workload = models.make_workload(config.model, **dict(config.model_overrides))
  return inputs.TrainInput(config, workload, devices.flat_mesh(), "data")


def test_a_column_of_nulls_the_model_does_not_read_blocks_nothing(tmp_path):
  # A nullable column the model never reads (Spark writes them) stopped the run at the
  # start: "column 'score' has 8 null value(s); every row needs a value".
  pq.write_table(_table(64), tmp_path / "part-0.parquet", row_group_size=16)
  pq.write_table(_table(40, 64), tmp_path / "part-1.parquet", row_group_size=16)
  train = _train_input(str(tmp_path))
  assert "score" not in train.files.schema and "score" in train.files.source.conflicts
  assert "columns not read (hold nulls): ['score']" in train.files.describe()
  batch = train.batch(0)
  assert batch["inputs"].shape == (16, 32) and "score" not in batch
  # One the model needs is one line naming the file and row group (and the column).
  pq.write_table(_table(64).drop(["labels"]).append_column(
      "labels", pa.array([None] + [1] * 63, pa.int32())), tmp_path / "part-0.parquet",
      row_group_size=16)
  with pytest.raises(ConfigError, match=r"needs column 'labels', but `data.train`: "
                     r".*part-0.parquet, row group 0: column 'labels' has 1 null value"):
    _train_input(str(tmp_path))
  # The exact source (strict) still refuses it.
  with pytest.raises(data_sources.DataError, match="column 'score' has 3 null"):
    data_sources.open_source(str(tmp_path))


def test_row_groups_that_together_overflow_the_cache_are_named_with_the_cache_to_set(
    tmp_path, monkeypatch):
  # A 1 GB file in pyarrow's default 1Mi-row groups: each 252 MiB decoded, under the 256 MiB
  # cache, so no warning, but a batch of 256 random rows drew from all four and decoded
  # three again: 1.3-4 s a batch, 0.02 s with the cache holding all (data.cache_mib=1100).
  monkeypatch.setattr(data_sources, "REDECODE_BYTES", 16 << 10)
  pq.write_table(_table(4096, 1).drop(["name", "score"]), tmp_path / "one.parquet",
                 row_group_size=1024)  # 4 row groups of ~140 KiB decoded
  pattern = str(tmp_path / "one.parquet")
  small = data_files.FileData(pattern, 64, process_index=0, process_count=1,
                              cache_bytes=256 << 10)
  warning = small.large_row_groups_warning()
  assert warning is not None and warning.startswith(
      "`data.train`: a batch draws its 64 rows at random from 4 row group(s) of "), warning
  assert "--config.data.cache_mib to 1 if this process has the memory" in warning
  roomy = data_files.FileData(pattern, 64, process_index=0, process_count=1,
                              cache_bytes=1 << 20)
  assert roomy.large_row_groups_warning() is None
  # What the run passes: data.cache_mib, to the training source and the eval one.
  config = minimal.get_config("smoke")
  config.data.train = config.data.eval = pattern
  config.data.cache_mib = 3
  config.eval_every = 2
  workload = models.make_workload(config.model, **dict(config.model_overrides))
  train = inputs.TrainInput(config, workload, devices.flat_mesh(), "data")
  assert train.files.source._cache_bytes == 3 << 20
  evaluator = inputs.make_evaluator(config, workload, devices.flat_mesh(), "data")
  assert evaluator is not None


def test_a_glob_that_takes_in_sparks_marker_files_says_which_glob_to_give(tmp_path):
  # `DIR/*` over a Spark output took in _SUCCESS and README.txt: the line said "rename
  # them", a fix that does not apply.
  for i in range(2):
    pq.write_table(_table(8, 8 * i).drop(["score"]), tmp_path / f"part-{i:05d}-x.snappy.parquet")
    (tmp_path / f".part-{i:05d}-x.snappy.parquet.crc").write_bytes(b"crc")
  (tmp_path / "_SUCCESS").write_text("")
  (tmp_path / "README.txt").write_text("written by a Spark job")
  with pytest.raises(ValueError) as e:
    data_files.FileData(str(tmp_path / "*"), 8, process_index=0, process_count=1)
  assert str(e.value) == (
      f"`data.train`={str(tmp_path / '*')!r} matches 2 file(s) that are not Parquet or "
      "ArrayRecord (['README.txt', '_SUCCESS']) with its 2 .parquet file(s); give only the "
      f"data files, --config.data.train='{tmp_path / '*.parquet'}', or their directory (names "
      "starting with '.' or '_', such as Spark's _SUCCESS and .crc files, are skipped).")
  for fixed in (tmp_path / "*.parquet", tmp_path):  # both fixes it names read the 16 rows
    loader = data_files.FileData(str(fixed), 8, process_index=0, process_count=1)
    assert loader.num_records == 16


def test_a_glob_of_sparks_name_parquet_directories_reads_all_of_them(tmp_path):
  # df.write.parquet("/data/train_2024.parquet") writes a directory; the glob
  # train_*.parquet named two of them, and the line suggested the files of one only
  # (train_2025.parquet: glob order), which trained on half the data without a word.
  for year, start in ((2024, 0), (2025, 8)):
    out = tmp_path / f"train_{year}.parquet"
    out.mkdir()
    pq.write_table(_table(8, start).drop(["score"]), out / "part-00000-x.snappy.parquet")
    (out / "_SUCCESS").write_text("")
  files = data_sources.expand(str(tmp_path / "train_*.parquet"))
  assert [f.split("/")[-2] for f in files] == ["train_2024.parquet", "train_2025.parquet"]
  loader = data_files.FileData(str(tmp_path / "train_*.parquet"), 16, process_index=0,
                               process_count=1)
  assert sorted(next(loader.iterator())["id"].tolist()) == list(range(16))
  # Directories not named as data (train/ and eval/ under `/data/*`) are not read: one line
  # naming them all, with the glob of all their files.
  for name in ("train", "eval"):
    (tmp_path / "plain" / name).mkdir(parents=True)
    pq.write_table(_table(4).drop(["score"]), tmp_path / "plain" / name / "a.parquet")
  with pytest.raises(ValueError, match=(
      r"matches 2 directories \(.*plain/eval, .*plain/train\), not files: e.g. "
      r".*plain/\*/\*.parquet for the files of all of them")):
    data_sources.expand(str(tmp_path / "plain" / "*"))


def test_make_shards_reads_sparks_directories_and_leaves_a_null_column_out(tmp_path):
  # make_shards --input='/data/train_*.parquet' over Spark's output directories was
  # "matches no file"; and a nullable column stopped it ("every row needs a value").
  # Run as the command (importing experiments.make_shards here defines absl flags that
  # another command's module, imported earlier in this worker, may hold: DuplicateFlagError).
  for year, start in ((2024, 0), (2025, 8)):
    out = tmp_path / f"train_{year}.parquet"
    out.mkdir()
    pq.write_table(_table(8, start), out / "part-00000-x.snappy.parquet")
    (out / "_SUCCESS").write_text("")
  done = jobs.forked([sys.executable, "-m", "experiments.make_shards", "--num_shards=1",
                      f"--input={tmp_path / 'train_*.parquet'}", f"--out={tmp_path / 'o'}"],
                     devices=1)
  assert done.returncode == 0, done.stderr
  assert "column 'score' has 2 null value(s) in part-00000-x" in done.stdout
  rows = data_sources.open_source(str(tmp_path / "o")).read_rows(np.arange(16))
  assert sorted(rows) == ["id", "inputs", "labels"]
  assert rows["id"].tolist() == list(range(16))


def _with_tags(tmp_path, ragged_group=2):
  """64 rows in 4 row groups; `tags` (list<int32>) has 2 values a row, but 1 or 2 in row
  group ``ragged_group``; `score` has a null, in files written without statistics."""
  table = _table(64, null_every=10**9)
  tags = [[1] if i // 16 == ragged_group and i % 2 else [1, 2] for i in range(64)]
  table = table.set_column(table.schema.get_field_index("score"), "score",
                           pa.array([None if i == 40 else 1.0 for i in range(64)]))
  table = table.append_column("tags", pa.array(tags, pa.list_(pa.int32())))
  pq.write_table(table, tmp_path / "part-0.parquet", row_group_size=16, write_statistics=False)
  return str(tmp_path)


def test_columns_the_model_does_not_read_are_not_read(tmp_path):
  # A list column of several lengths (tags) or a null without statistics in a column the
  # model never reads stopped the run mid-way, at the batch that first drew from that row
  # group ("column 'tags' holds lists of different lengths"); they are not read now.
  train = _train_input(_with_tags(tmp_path))
  assert sorted(train.files.source.unused_columns) == ["id", "score", "tags"]
  assert "columns not read (the model does not read them): ['id', 'score', 'tags']" in \
      train.files.describe()
  for step in range(8):  # two epochs of 64 rows in batches of 16: every row group
    assert sorted(train.batch(step)) == ["inputs", "labels"]


def test_an_unreadable_column_the_model_reads_is_one_line_at_the_start(tmp_path):
  # A model that reads the tags is told at once, naming the file and row group, when row
  # group 0 holds lists of several lengths; the exact source still refuses the column.
  pattern = _with_tags(tmp_path, ragged_group=0)
  config = minimal.get_config("smoke")
  config.data.train = pattern

  def loss_fn(params, batch):
    return (params["w"] * batch["inputs"].sum() + batch["tags"].sum()).mean()

  workload = models.Workload(name="tags", loss_fn=loss_fn,
                             init_params=lambda rng: {"w": np.zeros((), np.float32)})
  with pytest.raises(ConfigError, match=r"the model needs column 'tags', but `data.train`: "
                     r".*part-0.parquet, row group 0 \(of 4\): column 'tags' holds lists of "
                     r"different lengths"):
    inputs.TrainInput(config, workload, devices.flat_mesh(), "data")


def test_a_loss_that_takes_only_a_columns_shape_still_gets_the_column(tmp_path):
  # The loss reads no value of `score` (its jaxpr drops it) but indexes the batch for it:
  # it keeps every column.
  pq.write_table(_table(64, 1, null_every=10**9), tmp_path / "part-0.parquet", row_group_size=16)
  config = minimal.get_config("smoke")
  config.data.train = str(tmp_path)

  def loss_fn(params, batch):
    return (params["w"] * batch["inputs"]).mean() * batch["score"].shape[0]

  workload = models.Workload(name="shape", loss_fn=loss_fn,
                             init_params=lambda rng: {"w": np.zeros((32,), np.float32)})
  train = inputs.TrainInput(config, workload, devices.flat_mesh(), "data")
  assert "score" in train.batch(0) and train.files.source.unused_columns == []


def _user_workload():
  def loss_fn(params, batch):
    logits = batch["inputs"] @ params["w"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["labels"][:, None],
                                         axis=1)), {}

  return models.Workload(name="user", loss_fn=loss_fn,
                         init_params=lambda rng: {"w": jnp.zeros((32, 10), jnp.float32)})


@pytest.mark.parametrize("user", [False, True], ids=["builtin", "user_loss"])
def test_eval_columns_the_metrics_do_not_read_are_not_read(tmp_path, user):
  # The same files as eval set: the tags of several lengths stopped the eval mid-way.
  config = minimal.get_config("smoke")
  config.data.eval = _with_tags(tmp_path)
  config.eval_every = 2
  workload = (_user_workload() if user else
              models.make_workload(config.model, **dict(config.model_overrides)))
  evaluator = inputs.make_evaluator(config, workload, devices.flat_mesh(), "data")
  metrics = evaluator.run(workload.init_params(jax.random.key(0)))
  assert metrics["eval_examples"] == 64


def test_shard_by_file_processes_leave_the_null_column_out_alike(tmp_path):
  # Each process of shard_by=file opens its own files with the columns every file has:
  # the column of nulls (in process 1's file only) is left out on both.
  pq.write_table(_table(40, 1, null_every=10**9), tmp_path / "part-0.parquet")
  pq.write_table(_table(40, 40), tmp_path / "part-1.parquet")
  for p in (0, 1):
    loader = data_files.FileData(str(tmp_path), 16, shard_by="file", process_index=p,
                                 process_count=2, strict=False)
    assert "columns not read (hold nulls): ['score']" in loader.describe()
    assert sorted(next(loader.iterator())) == ["id", "inputs", "labels"]


def test_hives_parquet_files_without_an_extension_are_read(tmp_path):
  # Hive and Impala name a table's Parquet files 000000_0: "holds no .parquet or
  # .array_record file", so the user had to rename every file.
  table = tmp_path / "warehouse" / "clicks"
  table.mkdir(parents=True)
  pq.write_table(_table(8, 1, null_every=10**9), table / "000000_0")
  pq.write_table(_table(8, 9, null_every=10**9), table / "000001_0")
  (table / "_SUCCESS").write_text("")
  (table / "NOTES").write_text("not Parquet")
  for pattern in (table, table / "0*"):
    loader = data_files.FileData(str(pattern), 16, process_index=0, process_count=1)
    assert sorted(next(loader.iterator())["id"].tolist()) == list(range(1, 17))
  with pytest.raises(ValueError, match=r"matches 2 file\(s\) that are not Parquet or "
                     r"ArrayRecord \(\['NOTES', '_SUCCESS'\]\) with its 2 Parquet file\(s\); "
                     r"give their directory, --config.data.train='.*/warehouse/clicks'"):
    data_files.FileData(str(table / "*"), 16, process_index=0, process_count=1)


def test_a_small_file_of_many_row_groups_is_decoded_in_one_read(tmp_path, monkeypatch):
  # A streaming writer's 32 MB file of 31,250 row groups of 16 rows: a batch of 256 random
  # rows read ~254 row groups one by one (0.2 ms each), 58 ms a batch until all were
  # cached; the file, at most 1/8 of the cache decoded, is now read whole once: 4 ms.
  calls = []
  real_group, real_read = pq.ParquetFile.read_row_group, pq.ParquetFile.read
  monkeypatch.setattr(pq.ParquetFile, "read_row_group",
                      lambda self, i, **kw: calls.append("group") or real_group(self, i, **kw))
  monkeypatch.setattr(pq.ParquetFile, "read",
                      lambda self, **kw: calls.append("file") or real_read(self, **kw))
  pq.write_table(_table(256, 1, null_every=10**9), tmp_path / "a.parquet", row_group_size=4)
  source = data_sources.open_source(str(tmp_path / "a.parquet"), strict=False)
  rows = np.random.default_rng(0).permutation(256)[:64]
  got = source.read_rows(rows)
  assert calls == ["file"] and len(source._cache) == 64
  np.testing.assert_array_equal(got["id"], rows + 1)
  np.testing.assert_array_equal(source.read_rows(np.arange(256))["id"], np.arange(1, 257))
  assert calls == ["file"]
  # Too large a share of the cache: row group by row group, as before.
  calls.clear()
  source = data_sources.ParquetSource([str(tmp_path / "a.parquet")], strict=False,
                                      cache_bytes=64 << 10)
  source.read_rows([0, 100, 200])  # three row groups
  assert calls == ["group"] * 3
