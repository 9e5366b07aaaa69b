"""Synthetic data sets: determinism, row slicing, per-process sharding."""

import dataclasses
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll import data
from jaxcoll.runtime import devices

DATASETS = {
    "mlp": data.TeacherMLPData(),
    "mlp_regression": data.TeacherMLPData(task="regression"),
    "image": data.TeacherImageData(image_size=8),
    "tokens": data.TokenData(),
    "clicks": data.ClickData(),
}
DATASET_IDS = list(DATASETS)


def assert_batches_equal(a, b):
  assert sorted(a) == sorted(b)
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def batches_equal(a, b):
  return all(np.array_equal(a[key], b[key]) for key in a)


@pytest.mark.parametrize("name", DATASET_IDS)
def test_batch_is_a_function_of_seed_step_and_size(name):
  ds = DATASETS[name]
  batch = ds.batch(step=5, global_batch_size=16)
  assert all(len(v) == 16 for v in batch.values())
  assert_batches_equal(batch, ds.batch(step=5, global_batch_size=16))
  # A fresh, equal data set (no cached teacher) gives the same batch.
  assert_batches_equal(batch, dataclasses.replace(ds).batch(step=5, global_batch_size=16))
  assert not batches_equal(batch, ds.batch(step=6, global_batch_size=16))
  other_seed = dataclasses.replace(ds, seed=1)
  assert not batches_equal(batch, other_seed.batch(step=5, global_batch_size=16))
  assert not batches_equal(batch, ds.batch(step=5, global_batch_size=16, split="eval"))


@pytest.mark.parametrize("name", DATASET_IDS)
def test_rows_of_a_batch_equal_the_slice_of_the_whole_batch(name):
  ds = DATASETS[name]
  whole = ds.batch(step=3, global_batch_size=12)
  part = ds.batch(step=3, global_batch_size=12, rows=slice(4, 10))
  assert_batches_equal(part, {k: v[4:10] for k, v in whole.items()})


def test_batches_follow_one_stream_of_examples():
  # Step s of batch size B holds examples s*B .. s*B + B - 1.
  ds = DATASETS["mlp"]
  assert_batches_equal(ds.batch(step=1, global_batch_size=8),
                       {k: v[8:] for k, v in ds.batch(step=0, global_batch_size=16).items()})


def test_uniform_and_normal_statistics():
  key = data.synthetic._key(0, 1)
  u = data.uniform(key, np.arange(20000), (5,))
  assert u.shape == (20000, 5) and 0.0 <= u.min() and u.max() < 1.0
  assert abs(u.mean() - 0.5) < 0.01
  z = data.normal(key, np.arange(20000), (5,))
  assert abs(z.mean()) < 0.02 and abs(z.std() - 1.0) < 0.02
  np.testing.assert_array_equal(data.uniform(key, np.arange(7, 9), (5,)), u[7:9])


def test_classification_labels_use_every_class():
  counts = np.bincount(DATASETS["mlp"].batch(0, 2048)["labels"], minlength=10)
  assert counts.min() > 2048 / 10 / 4, counts
  counts = np.bincount(DATASETS["image"].batch(0, 2048)["labels"], minlength=10)
  assert counts.min() > 2048 / 10 / 4, counts


def test_image_labels_come_from_the_teacher():
  ds = DATASETS["image"]
  batch = ds.batch(0, 64)
  assert batch["images"].shape == (64, 8, 8, 3) and batch["images"].dtype == np.float32
  np.testing.assert_array_equal(batch["labels"], np.argmax(ds.teacher(batch["images"]), -1))


def test_tokens_are_masked_as_bert():
  ds = DATASETS["tokens"]
  batch = ds.batch(0, 512)
  tokens, targets, weights = batch["tokens"], batch["targets"], batch["weights"]
  k = round(0.15 * 32)
  np.testing.assert_array_equal(weights.sum(axis=1), np.full(512, k))
  assert targets.min() >= 1 and targets.max() <= 127  # never [MASK]
  np.testing.assert_array_equal(tokens[weights == 0], targets[weights == 0])
  predicted = weights > 0
  masked = np.mean(tokens[predicted] == data.MASK_TOKEN)
  kept = np.mean(tokens[predicted] == targets[predicted])
  assert 0.75 < masked < 0.85, masked
  assert 0.08 < kept < 0.16, kept  # 10% unchanged + random tokens equal by chance


def test_clicks_follow_the_teacher():
  ds = DATASETS["clicks"]
  batch = ds.batch(0, 4096)
  assert batch["sparse"].dtype == np.int32
  assert (batch["sparse"] >= 0).all() and (batch["sparse"] < np.array(ds.table_sizes)).all()
  assert set(np.unique(batch["labels"])) == {0.0, 1.0}
  logits = ds.teacher(batch["dense"].astype(np.float64), batch["sparse"])
  assert batch["labels"][logits > 1].mean() > 0.7
  assert batch["labels"][logits < -1].mean() < 0.3


@pytest.mark.parametrize("process_count", [1, 2, 4, 8])
def test_process_slices_partition_the_global_batch(process_count):
  ds = DATASETS["clicks"]
  slices = [data.process_batch_slice(32, p, process_count) for p in range(process_count)]
  rows = np.concatenate([np.arange(32)[s] for s in slices])
  np.testing.assert_array_equal(rows, np.arange(32))
  parts = [
      ds.batch(2, 32, rows=data.process_batch_slice(32, process_index=p,
                                                   process_count=process_count))
      for p in range(process_count)
  ]
  joined = {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}
  assert_batches_equal(joined, ds.batch(2, 32))


def test_process_batch_slice_defaults_to_this_process():
  assert data.process_batch_slice(8) == slice(0, 8)


def test_process_batch_slice_rejects_indivisible_batch():
  with pytest.raises(ValueError, match=r"`global_batch_size` \(10\).*processes \(4\)"):
    data.process_batch_slice(10, 0, 4)
  with pytest.raises(ValueError, match="`process_index`"):
    data.process_batch_slice(8, 4, 4)


def test_global_batch_is_sharded_over_the_data_axis():
  ds = DATASETS["image"]
  mesh = devices.flat_mesh()
  batch = data.global_batch(ds, step=4, global_batch_size=16, mesh=mesh)
  expected = ds.batch(4, 16)
  for key, value in batch.items():
    assert isinstance(value, jax.Array)
    assert value.sharding == NamedSharding(mesh, P("data"))
    np.testing.assert_array_equal(np.asarray(value), expected[key])
    for shard in value.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), expected[key][shard.index])


def test_global_batch_over_a_two_level_mesh():
  ds = DATASETS["tokens"]
  mesh = devices.node_local_mesh(2, 4)
  batch = data.global_batch(ds, 1, 8, mesh, axis=("node", "local"))
  assert batch["tokens"].sharding.spec == P(("node", "local"))
  np.testing.assert_array_equal(np.asarray(batch["tokens"]), ds.batch(1, 8)["tokens"])


def test_global_batch_errors():
  ds = DATASETS["mlp"]
  mesh = devices.flat_mesh()
  with pytest.raises(ValueError, match=r"`global_batch_size` \(12\).*\(8\)"):
    data.global_batch(ds, 0, 12, mesh)
  with pytest.raises(ValueError, match="valid axes: \\('data',\\)"):
    data.global_batch(ds, 0, 16, mesh, axis="model")


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: DATASETS["mlp"].batch(-1, 8), "`step`"),
        (lambda: DATASETS["mlp"].batch(0, 0), "`global_batch_size`"),
        (lambda: DATASETS["mlp"].batch(0, 8, split="test"), "`split`"),
        (lambda: DATASETS["mlp"].batch(0, 8, rows=slice(0, 8, 2)), "`rows`"),
        (lambda: data.TeacherMLPData(task="ranking"), "`task`"),
        (lambda: data.TeacherImageData(image_size=30), "`image_size`"),
        (lambda: data.TokenData(mask_rate=0.0), "`mask_rate`"),
        (lambda: data.ClickData(table_sizes=()), "`table_sizes`"),
    ],
    ids=["step", "batch_size", "split", "rows", "task", "image_size", "mask_rate", "tables"],
)
def test_bad_arguments_raise_value_error(call, match):
  with pytest.raises(ValueError, match=match):
    call()


_TWO_PROCESS_SCRIPT = """
import os, sys
os.environ["JAXCOLL_CPU_DEVICES"] = "2"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
import jaxcoll
port, pid = sys.argv[1], int(sys.argv[2])
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)
import numpy as np
from jaxcoll import data
from jaxcoll.runtime import devices
ds = data.ClickData()
batch = data.global_batch(ds, 3, 8, devices.flat_mesh())
full = ds.batch(3, 8)
rows = sorted(shard.index[0].start for shard in batch["labels"].addressable_shards)
for key, value in batch.items():
  assert value.shape[0] == 8
  for shard in value.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), full[key][shard.index])
print("ROWS", pid, rows, data.process_batch_slice(8))
jax.distributed.shutdown()
"""


def test_global_batch_in_a_two_process_job(tmp_path):
  # Each process builds only its half of the batch; the shards of the global
  # array equal the rows of the whole batch.
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  script = tmp_path / "two_process.py"
  script.write_text(_TWO_PROCESS_SCRIPT)
  env = {**os.environ, "XLA_FLAGS": ""}
  env.pop("JAXCOLL_CPU_DEVICES", None)
  procs = [
      subprocess.Popen([sys.executable, str(script), str(port), str(pid)], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for pid in range(2)
  ]
  outputs = [proc.communicate(timeout=120)[0] for proc in procs]
  for proc, out in zip(procs, outputs, strict=True):
    assert proc.returncode == 0, out
  assert "ROWS 0 [0, 2] slice(0, 4, None)" in outputs[0]
  assert "ROWS 1 [4, 6] slice(4, 8, None)" in outputs[1]


@pytest.mark.parametrize("name", ["default", "resnet_dp8", "bert_zero3", "recommender_2x4"])
def test_files_variant_reads_the_shards_make_shards_writes(name, tmp_path, monkeypatch):
  """`:smoke,files` points at SHARDS/<name>_smoke; rows from the config's own generator
  (what `make_shards --config=configs/<name>.py:smoke` writes) fit its model."""
  import importlib  # noqa: PLC0415

  from configs import base  # noqa: PLC0415
  from jaxcoll.data import sources as data_sources  # noqa: PLC0415
  from jaxcoll import models  # noqa: PLC0415
  from jaxcoll.run import inputs  # noqa: PLC0415

  monkeypatch.setattr(base, "SHARDS", str(tmp_path))
  c = importlib.import_module(f"configs.{name}").get_config("smoke,files")
  assert c.data.train == f"{tmp_path}/{name}_smoke/train-*.parquet"
  assert c.data.shard_by == ("file" if name == "recommender_2x4" else "record")
  assert c.eval_every == c.steps
  w = models.make_workload(c.model, **dict(c.model_overrides))
  for split, count in (("train", 64), ("eval", 10)):
    data_sources.write_shards(w.dataset.examples(np.arange(count), split),
                              str(tmp_path / f"{name}_smoke"), num_shards=2, prefix=split)
  source = data_sources.open_source(c.data.train)
  assert len(source) == 64
  rows = source.read_rows(np.arange(3))
  for key, value in w.dataset.examples(np.arange(3)).items():
    np.testing.assert_array_equal(rows[key], value)
  inputs.check_columns(w, rows, "data.train", c.data.train)  # raises on a mismatch
