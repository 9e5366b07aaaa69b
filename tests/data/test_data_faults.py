"""Files a user brings, and a job resumed with something changed: the reader
is safe under grain's threads, damaged or changed files are named (file and
row group) and never trained on, a data position that no longer fits is
refused or continued exactly, and labels the model cannot take are refused
before training (issue 20, Build 1, 2, 3 and 11)."""

import json
import os
import sys
import threading
import time

import jobs
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from configs import minimal
from jaxcoll import models
from jaxcoll.data import files as data_files, sources as data_sources
from jaxcoll.run import inputs
from jaxcoll.run.config_error import ConfigError
from jaxcoll.runtime import devices


def _rows(n, seed=0):
  rng = np.random.default_rng(seed)
  return {"inputs": rng.normal(size=(n, 32)).astype(np.float32),
          "labels": rng.integers(0, 10, n).astype(np.int32)}


def _mlp_shards(directory, n=64, num_shards=2, row_group_size=8, **change):
  columns = {**_rows(n), **change}
  data_sources.write_shards(columns, str(directory), num_shards=num_shards, prefix="train",
                            row_group_size=row_group_size)
  return str(directory / "train-*.parquet")


def _config(**data):
  c = minimal.get_config("smoke")
  for k, v in data.items():
    c.data[k] = v
  return c


def _train_input(**data):
  config = _config(**data)
  workload = models.make_workload(config.model, **dict(config.model_overrides))
  return inputs.TrainInput(config, workload, devices.flat_mesh(), "data")


# -- Build 1: the reader under grain's threads ----------------------------------


class _Guarded:
  """A ParquetFile that records whether two threads ever used it at once."""

  overlaps = 0

  def __init__(self, *args, **kwargs):
    self._file = _REAL_PARQUET_FILE(*args, **kwargs)
    self._inside = threading.Lock()

  def read_row_group(self, *args, **kwargs):
    if not self._inside.acquire(blocking=False):
      _Guarded.overlaps += 1
      self._inside.acquire()
    try:
      time.sleep(0.002)  # widen the window a shared reader would be raced in
      return self._file.read_row_group(*args, **kwargs)
    finally:
      self._inside.release()

  def __getattr__(self, name):
    return getattr(self._file, name)


_REAL_PARQUET_FILE = pq.ParquetFile


def test_parquet_reader_threads_never_share_a_pyarrow_handle(tmp_path, monkeypatch):
  n = 4 * 25 * 4  # 4 files of 25 row groups (the case that segfaulted)
  data_sources.write_shards({"x": np.arange(n, dtype=np.int64)}, str(tmp_path), num_shards=4,
                            row_group_size=4)
  monkeypatch.setattr(pq, "ParquetFile", _Guarded)
  _Guarded.overlaps = 0
  loader = data_files.FileData(str(tmp_path / "*.parquet"), 16, seed=1, process_index=0,
                               process_count=1, num_threads=4, prefetch=4)
  loader.source._cache_bytes = 0  # every batch reads its row groups again
  it = loader.iterator()
  got = np.concatenate([next(it)["x"] for _ in range(25)])
  assert _Guarded.overlaps == 0
  want = np.concatenate([loader.source.read_rows(loader.batch_indices(b))["x"]
                         for b in range(25)])
  np.testing.assert_array_equal(got, want)
  assert sorted(got[:n]) == list(range(n))  # the first epoch: every record once


def test_parquet_reader_many_row_groups_two_threads_in_a_fresh_process(tmp_path):
  """The reported failure (25 row groups a file, num_threads=2): segfault,
  ArrowInvalid or a hang in 6 of 6 runs; here 3 runs must all end cleanly."""
  script = f"""
import numpy as np
from jaxcoll.data import files, sources
n = 4 * 25 * 16
sources.write_shards({{"x": np.arange(n, dtype=np.int64), "y": np.ones((n, 8), np.float32)}},
                     {str(tmp_path)!r}, num_shards=4, row_group_size=16)
for trial in range(3):
  fd = files.FileData({str(tmp_path / '*.parquet')!r}, 64, seed=trial, process_index=0,
                      process_count=1, num_threads=2)
  fd.source._cache_bytes = 2 * 16 * 40
  it = fd.iterator()
  seen = np.concatenate([next(it)["x"] for _ in range(60)])
  assert sorted(seen[:n]) == list(range(n)), trial  # 60 x 64 rows: over two epochs
print("OK")
"""
  out = jobs.run([sys.executable, "-c", script], devices=1, timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == "OK", out.stderr[-2000:]


def _damage_row_group(path, group, how="garbage"):
  """Overwrites the middle of row group ``group``'s first column chunk."""
  meta = pq.read_metadata(path)
  col = meta.row_group(group).column(0)
  start = col.dictionary_page_offset or col.data_page_offset
  with open(path, "r+b") as f:
    f.seek(start + col.total_compressed_size // 2)
    f.write(b"\xff" * 8 if how == "garbage" else b"")


def test_unreadable_row_group_is_named_with_its_file_and_row_group(tmp_path):
  pattern = _mlp_shards(tmp_path)
  path = str(tmp_path / "train-00001-of-00002.parquet")
  _damage_row_group(path, 2)
  source = data_sources.open_source(pattern)
  source.read_rows(np.arange(16))  # file 0 is intact
  with pytest.raises(data_sources.DataError) as e:
    source.read_rows([32 + 2 * 8 + 1])
  assert f"{path}, row group 2 (of 4)" in str(e.value)
  assert "Nothing of this row group was trained on" in str(e.value)


def _quiet_damage(path):
  """Damages one byte of a data page so that, without checksums, the page
  still decodes (to other values): the first such byte found."""
  meta = pq.read_metadata(path)
  col = meta.row_group(0).column(0)
  good = pq.read_table(path).column(0).to_numpy()
  original = open(path, "rb").read()
  for offset in range(col.data_page_offset + 16, col.data_page_offset
                      + col.total_compressed_size):
    damaged = bytearray(original)
    damaged[offset] ^= 0x10
    with open(path, "wb") as f:
      f.write(damaged)
    try:
      values = pq.ParquetFile(path).read_row_group(0).column(0).to_numpy()
    except Exception:  # noqa: BLE001, S112  (this byte breaks decoding: try the next)
      continue
    if len(values) == 8 and (values != good[:8]).any():
      return values
  raise AssertionError("no byte found that damages a page and still decodes")


def test_damaged_page_that_still_decodes_is_caught_by_its_checksum(tmp_path):
  data_sources.write_shards({"x": np.arange(64, dtype=np.float64)}, str(tmp_path),
                            row_group_size=8)  # as make_shards writes them
  path = str(tmp_path / "data-00000-of-00001.parquet")
  garbage = _quiet_damage(path)
  assert (garbage != np.arange(8)).any()  # what the old reader trained on
  source = data_sources.open_source(path)
  with pytest.raises(data_sources.DataError, match="row group 0 .* CRC checksum"):
    source.read_rows([3])
  np.testing.assert_array_equal(source.read_rows([9])["x"], [9.0])  # the rest reads


def test_make_shards_writes_page_checksums(tmp_path):
  columns = tmp_path / "in.npz"
  np.savez(columns, x=np.arange(64, dtype=np.float64))
  out = jobs.forked([sys.executable, "-m", "experiments.make_shards", f"--input={columns}",
                     "--num_shards=1", "--row_group_size=8", f"--out={tmp_path / 'out'}"],
                    devices=1)  # from a warm Python (~1.4 CPU-s less)
  assert out.returncode == 0, out.stderr[-2000:]
  path = str(tmp_path / "out" / "train-00000-of-00001.parquet")
  _quiet_damage(path)
  with pytest.raises(data_sources.DataError, match="CRC checksum"):
    data_sources.open_source(path).read_rows([0])


def test_reader_thread_error_ends_the_run_with_one_line_exit_2(tmp_path):
  """A damaged row group met by a grain reader thread mid-run: the main
  thread reports it (file and row group), exit 2 (not restarted), no hang."""
  pattern = _mlp_shards(tmp_path / "data", n=256, row_group_size=16)
  _damage_row_group(str(tmp_path / "data" / "train-00001-of-00002.parquet"), 5)
  t0 = time.time()
  out = jobs.train_forked("--config=configs/minimal.py:smoke", f"--config.data.train={pattern}",
                          "--config.steps=40", "--config.watchdog_s=60",
                          "--config.data.num_threads=2", f"--workdir={tmp_path / 'run'}",
                          timeout=240)
  assert out.returncode == 2, out.stderr[-3000:]
  lines = out.stderr.strip().splitlines()  # the start line, then the error
  errors = [line for line in lines if line.startswith("train: error")]
  assert len(errors) == 1 and lines[-1].startswith("train: error: "), out.stderr[-3000:]
  assert "train-00001-of-00002.parquet, row group 5 (of 8)" in lines[-1]
  assert "Traceback" not in out.stderr + out.stdout
  assert time.time() - t0 < 200


def test_damaged_row_group_on_one_process_ends_the_job_with_exit_2_not_restarted(tmp_path):
  """2 x 4 under shard_by=file: only process 1 reads the damaged file. It ends
  at once with the one line; the launcher stops process 0 (which waited in a
  collective: the job hung until the watchdog, exit 86, and was restarted)."""
  pattern = _mlp_shards(tmp_path / "data", n=256, num_shards=4, row_group_size=16)
  _damage_row_group(str(tmp_path / "data" / "train-00003-of-00004.parquet"), 2)
  t0 = time.time()
  out = jobs.launch(sys.executable, "-m", "experiments.train", "--config=configs/minimal.py:smoke",
                    f"--config.data.train={pattern}", "--config.data.shard_by=file",
                    "--config.steps=30", "--config.mesh_shape=", "--config.mesh_axes=",
                    "--config.algorithm=ring", "--config.watchdog_s=60",
                    f"--workdir={tmp_path / 'run'}", launcher_flags=["--max_restarts=2"],
                    timeout=240)
  text = out.stdout + out.stderr
  assert out.returncode == 2, text[-3000:]
  assert ("[p1] train: error: process 1 of 2: `data.train`: "
          f"{tmp_path / 'data' / 'train-00003-of-00004.parquet'}, row group 2") in text
  assert "not restarting" in text and "restart 1/2" not in text
  assert "Traceback" not in text and "watchdog" not in text
  assert time.time() - t0 < 120


# -- Build 11: globs are a list; a comma is part of a path ----------------------


def test_comma_inside_a_path_is_one_glob_not_two(tmp_path, monkeypatch):
  inside = tmp_path / "x" / "v1,v2"
  _mlp_shards(inside, n=16)
  decoy = tmp_path / "v2"  # what the old split trained on from this directory
  _mlp_shards(decoy, n=40)
  monkeypatch.chdir(tmp_path)
  pattern = f"{tmp_path}/x/v1,v2/*.parquet"
  assert data_sources.expand(pattern) == sorted(str(p) for p in inside.glob("*.parquet"))
  assert len(data_sources.open_source(pattern)) == 16


def test_glob_list_forms_and_the_old_comma_form(tmp_path):
  a, b = _mlp_shards(tmp_path / "a", n=16), _mlp_shards(tmp_path / "b", n=24)
  want = sorted(data_sources.expand(a) + data_sources.expand(b))
  assert data_sources.expand(json.dumps([a, b])) == want
  assert data_sources.expand(repr([a, b])) == want  # a Python literal ('...')
  assert data_sources.expand([a, b]) == want
  assert data_sources.expand(f"{a},{b}") == want  # unambiguous: each part matches files
  with pytest.raises(ValueError, match=r"neither as one path .*\(part '.*none-\*.parquet' "
                     r"matches no file\); to give several globs write a list"):
    data_sources.expand(f"{a},{tmp_path}/none-*.parquet")
  with pytest.raises(ValueError, match=r"'.*none\*' \(of .*\) matches no file"):
    data_sources.expand([a, f"{tmp_path}/none*"])
  with pytest.raises(ValueError, match="not a JSON or Python list"):
    data_sources.expand('["a.parquet"')


def test_glob_matching_a_directory_says_so(tmp_path):
  _mlp_shards(tmp_path / "shards", n=16)
  with pytest.raises(ValueError, match=r"matches the directory .*shards, not files: e.g. "
                     r".*shards/\*.parquet"):
    data_sources.expand(str(tmp_path / "shard*"))


# -- Build 2: a resume that changes what the data position means ----------------


def _loader(pattern, batch, p=0, procs=1, shard_by="record"):
  return data_files.FileData(pattern, batch, shard_by=shard_by, seed=5, process_index=p,
                             process_count=procs)


def _take(loader, it, count):
  return [next(it)["inputs"][:, 0] for _ in range(count)]


@pytest.fixture
def four_files(tmp_path):
  return _mlp_shards(tmp_path / "d", n=96, num_shards=4)


def test_resume_with_another_global_batch_size_continues_the_same_examples(four_files):
  straight = _loader(four_files, 8)
  want = np.concatenate(_take(straight, straight.iterator(), 12))  # 96 examples
  first = _loader(four_files, 8)
  it = first.iterator()
  head = _take(first, it, 3)  # 24 examples
  saved = json.loads(json.dumps(first.checkpoint_state(it)))
  bigger = _loader(four_files, 16)
  state = bigger.resume(saved, 3)
  assert (bigger.origin, state["next_index"]) == (24, 0)  # 24 is no whole number of 16s
  it2 = bigger.iterator(state)
  rest = _take(bigger, it2, 2)  # 32 more, cut into the new batches
  np.testing.assert_array_equal(np.concatenate(head + rest), want[:56])
  again = json.loads(json.dumps(bigger.checkpoint_state(it2)))  # 56 examples consumed
  back = _loader(four_files, 8)
  it3 = back.iterator(back.resume(again, 5))
  np.testing.assert_array_equal(np.concatenate(_take(back, it3, 5)), want[56:96])


def test_resume_with_another_batch_size_under_shard_by_file_continues_each_process(four_files):
  def run(batch, count, state=None, step=0):
    loaders = [_loader(four_files, batch, p, 2, "file") for p in (0, 1)]
    its = [ld.iterator(ld.resume(state, step) if state else None) for ld in loaders]
    got = [np.concatenate(_take(ld, it, count)) for ld, it in zip(loaders, its, strict=True)]
    return got, json.loads(json.dumps(loaders[0].checkpoint_state(its[0])))
  straight, _ = run(8, 6)
  head, saved = run(8, 2)
  rest, _ = run(16, 2, saved, 2)  # 8 rows a process after 4 a process
  for p in (0, 1):
    np.testing.assert_array_equal(np.concatenate([head[p], rest[p]]), straight[p])


def test_epochs_read_out_of_order_come_back_alike(four_files):
  loader = _loader(four_files, 8)
  fresh = [_loader(four_files, 8).batch_indices(b) for b in (25, 37, 2)]  # epochs 2, 3, 0
  got = [loader.batch_indices(b) for b in (25, 37, 2)]  # epoch 0 after 2, 3: was a KeyError
  for a, b in zip(got, fresh, strict=True):
    np.testing.assert_array_equal(a, b)


def test_resume_on_another_process_count_under_shard_by_file_is_refused(four_files):
  loaders = [_loader(four_files, 8, p, 2, "file") for p in (0, 1)]
  assert loaders[0].fingerprint == loaders[1].fingerprint  # all files, on every process
  its = [ld.iterator() for ld in loaders]
  for ld, it in zip(loaders, its, strict=True):
    _take(ld, it, 3)
  saved = json.loads(json.dumps(loaders[0].checkpoint_state(its[0])))
  one = _loader(four_files, 8, 0, 1, "file")
  with pytest.raises(data_sources.DataError) as e:
    one.resume(saved, 3)
  message = str(e.value)
  assert "step 3" in message and "written by 2 process(es), this run has 1" in message
  assert "--config.data.allow_changed_files=True" in message and "\n" not in message
  state = one.resume(saved, 3, allow_changed=True)  # on purpose: the same examples consumed
  assert state["next_index"] == 3  # 24 of 96 consumed = 3 batches of 8 on one process


@pytest.mark.parametrize("change", ["removed", "added", "rewritten"])
def test_resume_with_changed_files_is_refused_naming_the_change(four_files, change):
  first = _loader(four_files, 8)
  it = first.iterator()
  _take(first, it, 2)
  saved = json.loads(json.dumps(first.checkpoint_state(it)))
  directory = os.path.dirname(four_files)
  if change == "removed":
    os.remove(os.path.join(directory, "train-00003-of-00004.parquet"))
    want = "train-00003-of-00004.parquet gone (were 4 file(s), 96 records, now 3 file(s), 72"
  elif change == "added":
    data_sources.write_shards(_rows(8, seed=9), directory, prefix="train-extra")
    want = "train-extra-00000-of-00001.parquet added"
  else:
    data_sources.write_shards(_rows(30, seed=9), directory, prefix="train", num_shards=4)
    want = "train-00000-of-00004.parquet changed ("
  again = _loader(four_files, 8)
  with pytest.raises(data_sources.DataError, match="the files of `data.train` changed") as e:
    again.resume(saved, 2)
  assert want in str(e.value)
  assert again.resume(saved, 2, allow_changed=True)["next_index"] == 2


def test_checkpoint_without_a_data_fingerprint_still_resumes(four_files):
  straight = _loader(four_files, 8)
  want = _take(straight, straight.iterator(), 5)
  old = _loader(four_files, 8)  # what checkpoints before issue 20 kept
  state = old.resume({"data_iterator": {"next_index": 3}, "data_shard_by": "record",
                      "config": {"global_batch_size": 8}}, 3)
  np.testing.assert_array_equal(np.concatenate(_take(old, old.iterator(state), 2)),
                                np.concatenate(want[3:]))


def test_changed_files_refused_at_train_input_restore(tmp_path):
  pattern = _mlp_shards(tmp_path / "data", n=128, num_shards=4)
  train = _train_input(train=pattern)
  train.restore(0, None)
  for step in range(3):
    train.batch(step)
  extra = json.loads(json.dumps({"config": {"global_batch_size": 16}, **train.state()}))
  assert extra["data_files"]["files"] == 4 and extra["data_iterator"] == {"next_index": 3}
  os.remove(tmp_path / "data" / "train-00002-of-00004.parquet")
  again = _train_input(train=pattern)
  with pytest.raises(ConfigError, match="checkpoint at step 3 does not fit this run: the files "
                     "of `data.train` changed: train-00002-of-00004.parquet gone"):
    again.restore(3, extra)
  allowed = _train_input(train=pattern, allow_changed_files=True)
  allowed.restore(3, extra)
  assert allowed.state()["data_files"]["files"] == 3  # the next checkpoint has the new files


@pytest.mark.slow  # ~60-100 s (three runs); fast cover: ..._refused_at_train_input_restore
def test_changed_files_refused_at_resume_through_the_cli(tmp_path):
  pattern = _mlp_shards(tmp_path / "data", n=128, num_shards=4)
  flags = ["--config=configs/minimal.py:smoke", f"--config.data.train={pattern}",
           "--config.checkpoint_every=2"]
  first = jobs.train(*flags, f"--workdir={tmp_path / 'run'}")
  assert first.returncode == 0, first.stderr[-2000:]
  os.remove(tmp_path / "data" / "train-00002-of-00004.parquet")
  refused = jobs.train(*flags, "--config.steps=6", f"--workdir={tmp_path / 'run'}")
  assert refused.returncode == 2, refused.stderr[-2000:]
  lines = refused.stderr.strip().splitlines()
  assert "train-00002-of-00004.parquet gone" in lines[-1] and "Traceback" not in refused.stderr
  assert jobs.summary(tmp_path / "run")["steps"] == 4  # nothing trained, nothing lost
  allowed = jobs.train(*flags, "--config.steps=6", "--config.data.allow_changed_files=True",
                       f"--workdir={tmp_path / 'run'}")
  assert allowed.returncode == 0, allowed.stderr[-2000:]
  assert jobs.summary(tmp_path / "run")["steps"] == 6


# -- Build 3: labels and inputs against the model -------------------------------


@pytest.mark.parametrize("label,where", [(10, "holds 10"), (-1, "holds -1")])
def test_labels_outside_the_class_count_are_refused_before_training(tmp_path, label, where):
  labels = _rows(64)["labels"]
  labels[45] = label  # file 1, row 13: row group 1
  pattern = _mlp_shards(tmp_path, labels=labels)
  with pytest.raises(ConfigError) as e:
    _train_input(train=pattern)
  message = str(e.value)
  assert f"column 'labels' {where} (" in message and "10 classes (ids 0..9)" in message
  assert "train-00001-of-00002.parquet, row group 1" in message


def test_labels_outside_the_range_without_statistics_stop_at_the_batch(tmp_path):
  labels = _rows(64)["labels"]
  labels[:] = 3
  labels[50] = 10
  data_sources.write_shards({**_rows(64), "labels": labels}, str(tmp_path), num_shards=2,
                            prefix="train", fmt="array_record")
  train = _train_input(train=str(tmp_path / "*.array_record"))
  with pytest.raises(ConfigError, match=r"'labels' holds 10 \(.*train-00001-of-00002"
                     r".array_record, record 18\)"):
    for step in range(8):  # 64 rows in batches of 16: row 50 comes within an epoch
      train.batch(step)


def test_float_labels_for_a_classifier_are_refused(tmp_path):
  pattern = _mlp_shards(tmp_path, labels=np.zeros(64, np.float32))
  with pytest.raises(ConfigError, match="column 'labels' holds float32 values, but the model "
                     "takes integers there"):
    _train_input(train=pattern)


def _user_loss(logits, batch):
  import optax  # noqa: PLC0415

  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def test_float_labels_for_a_user_model_are_named_by_the_trace(tmp_path):
  import flax.linen as nn  # noqa: PLC0415

  workload = models.from_flax(nn.Dense(3), _user_loss, inputs=("features",),
                              sample_batch={"features": np.zeros((1, 4), np.float32)})
  sample = {"features": np.zeros((1, 4), np.float32), "label": np.zeros(1, np.float32)}
  with pytest.raises(ConfigError, match="column 'label' holds float32 values, but the model's "
                     "loss needs integers there"):
    inputs.check_columns(workload, sample, "data.train", "x")
  inputs.check_columns(workload, {**sample, "label": np.zeros(1, np.int32)}, "data.train", "x")


def _with_null(tmp_path, column="labels"):
  rows = _rows(64)
  arrays = {k: pa.array(list(v)) if v.ndim == 1 else pa.array(list(v.tolist()))
            for k, v in rows.items()}
  values = rows[column].tolist()
  values[20] = None
  arrays[column] = pa.array(values, pa.int32())
  table = pa.table(arrays)
  path = tmp_path / "train-00000-of-00001.parquet"
  pq.write_table(table, path, row_group_size=16)
  return str(path)


def test_a_null_label_is_refused_naming_file_and_row_group(tmp_path):
  path = _with_null(tmp_path)
  with pytest.raises(ConfigError, match=r"row group 1: column 'labels' has 1 null value"):
    _train_input(train=path)
  pq.write_table(pq.read_table(path), path, write_statistics=False, row_group_size=16)
  with pytest.raises(data_sources.DataError, match=r"row group 1 .*'labels' has 1 null"):
    data_sources.open_source(path).read_rows([20])  # no statistics: found when read


def test_ragged_list_column_is_refused_naming_file_and_row_group(tmp_path):
  path = tmp_path / "train.parquet"
  rows = [[1.0, 2.0], [3.0, 4.0], [5.0], [6.0, 7.0, 8.0], [1.0, 2.0], [1.0, 2.0, 3.0]]
  pq.write_table(pa.table({"inputs": pa.array(rows), "labels": pa.array([0] * 6)}), path,
                 row_group_size=2)
  source = data_sources.open_source(str(path))
  np.testing.assert_array_equal(source.read_rows([0, 1])["inputs"], [[1, 2], [3, 4]])
  # 4 values in 2 rows: the old check (values % rows) reshaped it as [[5, 6], [7, 8]]
  with pytest.raises(data_sources.DataError, match=r"train.parquet, row group 1 \(of 3\): "
                     r".*lists of different lengths \(1 to 3 values a row\)"):
    source.read_rows([2])
  with pytest.raises(data_sources.DataError, match=r"row group 2 .*lists of different lengths"):
    source.read_rows([5])


def test_eval_file_with_a_corrupt_row_group_is_named(tmp_path):
  pattern = _mlp_shards(tmp_path, n=64)
  _damage_row_group(str(tmp_path / "train-00001-of-00002.parquet"), 3)
  config = _config(eval=pattern)
  config.eval_every = 2
  workload = models.make_workload(config.model, **dict(config.model_overrides))
  mesh = devices.flat_mesh()
  evaluator = inputs.make_evaluator(config, workload, mesh, "data")
  params = workload.init_params(0)
  with pytest.raises(ConfigError, match=r"`data.eval`: .*train-00001-of-00002.parquet, row "
                     "group 3"):
    evaluator.run(params)


@pytest.mark.parametrize("field,value,message", [
    ("eval_batch_size", -8, "`config.data.eval_batch_size`=-8: must be an integer >= 0"),
    ("prefetch", -1, "`config.data.prefetch`=-1: must be an integer >= 0"),
    ("num_threads", -2, "`config.data.num_threads`=-2: must be an integer >= 0"),
    ("cache_mib", 0, "`config.data.cache_mib`=0: must be a positive integer"),
])
def test_bad_reader_fields_are_one_line(tmp_path, field, value, message):
  config = _config(train=_mlp_shards(tmp_path), **{field: value})
  config.eval_every = 2
  workload = models.make_workload(config.model, **dict(config.model_overrides))
  with pytest.raises(ConfigError) as e:
    inputs.TrainInput(config, workload, devices.flat_mesh(), "data")
    inputs.make_evaluator(config, workload, devices.flat_mesh(), "data")
  assert str(e.value).startswith(message)


def test_eval_batch_not_a_multiple_of_both_data_axes_is_one_line():
  """make_evaluator counts the devices of every data axis (checks.axis_size): 2 x 4 = 8."""
  config = _config(eval_batch_size=12)
  config.eval_every = 2
  workload = models.make_workload(config.model, **dict(config.model_overrides))
  with pytest.raises(ConfigError) as e:
    inputs.make_evaluator(config, workload, devices.node_local_mesh(2, 4), ("node", "local"))
  assert str(e.value).startswith("`config.data.eval_batch_size`=12: must be a multiple of the 8 "
                                 "devices of the data axis"), str(e.value)
