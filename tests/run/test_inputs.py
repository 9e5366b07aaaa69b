"""jaxcoll.run.inputs: what the loop trains and evaluates on, checked against the model.

(The label, null and shape checks of file data are in tests/data/test_data_faults.py.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from configs import minimal
from jaxcoll import models
from jaxcoll.data import sources as data_sources
from jaxcoll.run import inputs
from jaxcoll.run.config_error import ConfigError
from jaxcoll.runtime import devices

_MS = 1733000000000  # 2024-11-30 in milliseconds since 1970: past int32


def _regression(reads_ts: bool, pmean: bool = False, rng: bool = False) -> models.Workload:
  """y ~ x @ w (+ a feature of the timestamp column when ``reads_ts``); with ``pmean``, x
  centred by its mean over the data axis (a collective, as nn.BatchNorm(axis_name="data"));
  with ``rng``, the loss takes a key (dropout's), unused."""
  def loss_fn(params, batch):
    x = batch["x"] - lax.pmean(batch["x"].mean(0), "data") if pmean else batch["x"]
    pred = x @ params["params"]["w"]
    if reads_ts:
      pred = pred + (batch["ts"] - 1_000_000).astype(jnp.float32) * 1e-9
    return jnp.mean((pred - batch["y"]) ** 2), {}

  def loss_with_key(params, batch, key):
    return loss_fn(params, batch)

  return models.Workload(name="ts", loss_fn=loss_with_key if rng else loss_fn,
                         init_params=lambda rng: {"params": {"w": jnp.zeros(4, jnp.float32)}})


def _columns(ts):
  x = np.random.default_rng(0).normal(size=(len(ts), 4)).astype(np.float32)
  return {"x": x, "ts": np.asarray(ts, np.int64), "y": x.sum(1)}


def _config(**data):
  c = minimal.get_config("smoke")
  c.global_batch_size = 16
  for k, v in data.items():
    c.data[k] = v
  return c


def _train_input(workload, pattern):
  return inputs.TrainInput(_config(train=pattern), workload, devices.flat_mesh(), "data")


def test_an_int64_column_past_int32_that_the_model_reads_is_one_line(tmp_path):
  """JAX (without jax_enable_x64) holds int64 as int32: a timestamp in milliseconds came
  to the model wrapped around (1733000000000 as 2128179712), silently. From the Parquet
  statistics, before training; a model that does not read the column trains as before
  (the column is not read at all); values within int32 pass."""
  data_sources.write_shards(_columns(_MS + np.arange(64) * 1000), str(tmp_path / "big"),
                            num_shards=2, row_group_size=8)
  with pytest.raises(ConfigError, match=r"column 'ts' holds 1733000000000 \(.*data-00000-of-"
                     r"00002.parquet, row group 0\), outside int32 .* the model would get "
                     r"2128179712 instead, silently; write it as a float"):
    _train_input(_regression(True), str(tmp_path / "big"))
  train = _train_input(_regression(False), str(tmp_path / "big"))
  assert train.files.source.unused_columns == ["ts"] and sorted(train.batch(0)) == ["x", "y"]
  data_sources.write_shards(_columns(2**31 - 64 + np.arange(64)), str(tmp_path / "fits"))
  assert _train_input(_regression(True), str(tmp_path / "fits")).narrowed == {}


@pytest.mark.parametrize("rng", [False, True], ids=["loss", "loss_with_key"])
def test_an_unread_int64_column_past_int32_trains_beside_a_collective(tmp_path, rng):
  """A loss with a collective over the data axis (nn.BatchNorm(axis_name="data"), a pmean)
  did not trace outside the trainer's shard_map (nor one taking dropout's key, traced
  without it), so every column was taken as read: an id column the model never reads,
  past int32 in the statistics, stopped the run (exit 2). The loss is traced as the step
  runs it, with the mesh's axes bound; a column it does read is still refused."""
  data_sources.write_shards(_columns(_MS + np.arange(64) * 1000), str(tmp_path),
                            num_shards=2, row_group_size=8)
  train = _train_input(_regression(False, pmean=True, rng=rng), str(tmp_path))
  assert train.narrowed == {}
  assert train.batch(0)["x"].shape == (16, 4) and "ts" not in train.batch(1)
  with pytest.raises(ConfigError, match=r"column 'ts' holds 1733000000000 \(.*row group 0\), "
                     r"outside int32"):
    _train_input(_regression(True, pmean=True, rng=rng), str(tmp_path))


def test_an_int64_column_past_int32_is_checked_per_batch_when_the_loss_does_not_trace(
    tmp_path):
  """A loss that does not trace before training (its own code fails; the first step says
  why) is not taken to read every column up front: the 64-bit columns past int32 in the
  statistics are checked in every batch instead."""
  data_sources.write_shards(_columns(_MS + np.arange(64) * 1000), str(tmp_path))

  def loss_fn(params, batch):
    raise RuntimeError("the model's own bug")

  workload = models.Workload(name="bad", loss_fn=loss_fn,
                             init_params=lambda rng: {"params": {"w": jnp.zeros(4)}})
  assert _train_input(workload, str(tmp_path)).narrowed == {"ts": np.dtype(np.int64)}


def test_an_int64_column_without_statistics_is_checked_in_every_batch(tmp_path):
  """ArrayRecord has no statistics: the batch holding the value stops the run, in one line
  naming the file and record."""
  ts = np.arange(64)
  ts[40] = _MS
  data_sources.write_shards(_columns(ts), str(tmp_path), num_shards=2, fmt="array_record")
  train = _train_input(_regression(True), str(tmp_path))
  assert train.narrowed == {"ts": np.dtype(np.int64)}
  with pytest.raises(ConfigError, match=r"column 'ts' holds 1733000000000 \(.*data-00001-of-"
                     r"00002.array_record, record 8\), outside int32"):
    for step in range(4):  # 64 records in batches of 16: record 40 comes within the epoch
      train.batch(step)
  assert _train_input(_regression(False), str(tmp_path)).narrowed == {}


def test_an_eval_column_past_int32_is_one_line(tmp_path):
  data_sources.write_shards(_columns(_MS + np.arange(16)), str(tmp_path))
  config = _config(eval=str(tmp_path))
  config.eval_every = 2
  with pytest.raises(ConfigError, match=r"`config.data.eval`=.*column 'ts' holds "
                     r"1733000000000 .* outside int32"):
    inputs.make_evaluator(config, _regression(True), devices.flat_mesh(), "data")
  assert inputs.make_evaluator(config, _regression(False), devices.flat_mesh(), "data")


def test_a_needed_column_the_files_hold_as_bytes_is_named_so_not_as_lacking():
  """Images as binary blobs (fixed_size_binary, as many pipelines store them): the message
  said the files lacked the column, which they hold."""
  import flax.linen as nn  # noqa: PLC0415

  workload = models.from_flax(nn.Dense(2), lambda logits, batch: jnp.mean(logits),
                              inputs=("image",),
                              sample_batch={"image": np.zeros((1, 64), np.uint8)})
  with pytest.raises(ConfigError, match=r"needs column 'image', which the files hold but not "
                     r"as numbers, so it is not read .*\(image bytes as uint8: pyarrow."
                     r"FixedSizeListArray"):
    inputs.check_columns(workload, {"label": np.zeros(1)}, "data.train", "x", ["image"])
  with pytest.raises(ConfigError, match="needs column 'image', which the files lack"):
    inputs.check_columns(workload, {"label": np.zeros(1)}, "data.train", "x", ["name"])


@pytest.mark.parametrize("shard_by,named", [("file", True), ("record", False)])
def test_each_process_names_the_large_row_groups_of_its_own_files(tmp_path, monkeypatch,
                                                                   shard_by, named):
  """Under shard_by=file each process reads files of its own, but only process 0 said which
  of its files hold row groups too large to cache (process 1 computed the line for its own
  and dropped it). Each names its own; under record (the same files everywhere) process 0
  alone, and the others do not look."""
  data_sources.write_shards(_columns(np.arange(64)), str(tmp_path), num_shards=2)
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  looked = []
  monkeypatch.setattr(data_sources.ParquetSource, "large_row_groups",
                      lambda self, batch_rows=0: looked.append(self.paths)
                      or f"large: {self.paths}")
  warned = []
  monkeypatch.setattr(inputs.logging, "warning", lambda fmt, *args: warned.append(fmt % args))
  train = inputs.TrainInput(_config(train=str(tmp_path), shard_by=shard_by),
                            _regression(False), devices.flat_mesh(), "data")
  if named:
    assert train.files.files == [str(tmp_path / "data-00001-of-00002.parquet")]
    assert looked == [train.files.files]
    assert f"large: {train.files.files}" in warned, warned
  else:
    assert looked == [] and not any(w.startswith("large") for w in warned), warned
