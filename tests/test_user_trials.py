"""Cases a user brought that no other test had tried (engineer "trial").

Each test guards one fix; each is fast (seconds) and reuses tiny models.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcoll


def _tiny_loss(p, b):
  return jnp.mean((b["x"] @ p["w"]) ** 2) + jnp.sum(p["b"] ** 2)


def test_a_zero_size_parameter_leaf_is_digested_checkpointed_and_restored(tmp_path):
  # orbax refuses to save an array of zero size ("Cannot save arrays with zero
  # size"): a model with a (0, 4) leaf trained, then failed at its first
  # checkpoint. The empty leaf is left out of the orbax item and made again on
  # restore, with its shape, dtype and the restoring trainer's sharding.
  params = {"w": np.ones((16, 4), np.float32), "b": np.zeros(3, np.float32),
            "empty": np.zeros((0, 4), np.float32)}
  batch = {"x": np.ones((8, 16), np.float32)}
  trainer = jaxcoll.Trainer(_tiny_loss, optax.adam(1e-2), jaxcoll.devices.flat_mesh(2),
                            jaxcoll.ZeRO(stage=3))
  state, _ = trainer.step(trainer.init(params), batch)
  saved = jax.tree.map(np.asarray, trainer.params(state))
  from jaxcoll.run import loop  # noqa: PLC0415
  norm, sha, bad = trainer.params_digest(state)  # summary.json's (np.concatenate([]) raised)
  assert (norm, sha, bad) == (*loop.params_digest(saved), [])
  with jaxcoll.checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, trainer, state, data_position=1)
  other = jaxcoll.Trainer(_tiny_loss, optax.adam(1e-2), jaxcoll.devices.flat_mesh(1),
                          jaxcoll.DataParallel())
  other.init(params)
  with jaxcoll.checkpoint.Checkpointer(tmp_path) as ckpt:
    state, position, _ = ckpt.restore(other)
  restored = jax.tree.map(np.asarray, other.params(state))
  assert position == 1
  assert restored["empty"].shape == (0, 4) and restored["empty"].dtype == np.float32
  np.testing.assert_array_equal(restored["w"], saved["w"])
  np.testing.assert_array_equal(restored["b"], saved["b"])
  state, metrics = other.step(state, batch)  # and it trains on
  assert np.isfinite(float(metrics["loss"]))


def test_from_flax_with_batchnorm_trains_its_statistics_like_one_device():
  # from_flax applied a BatchNorm model with every collection immutable: the first
  # training step raised flax's ModifyScopeVariableError ("batch_stats" is
  # immutable). Now the state collections are mutable in training and come back
  # through aux (state_collections + merge_aux); 2 devices with
  # BatchNorm(axis_name="data") equal 1 device, statistics included.
  import flax.linen as nn  # noqa: PLC0415

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
      x = nn.BatchNorm(use_running_average=not train, axis_name="data")(nn.Dense(8)(x))
      return nn.Dense(2)(nn.relu(x))

  def loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

  w = jaxcoll.models.from_flax(Net(), loss, inputs=("x",),
                               sample_batch={"x": np.zeros((1, 4), np.float32)})
  assert w.state_collections == ("batch_stats",)
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(16, 4)).astype(np.float32) + 3.0,
           "label": rng.integers(0, 2, 16).astype(np.int32)}
  out = []
  for n in (1, 2):
    trainer = jaxcoll.Trainer(w.loss_fn, optax.sgd(0.1), jaxcoll.devices.flat_mesh(n),
                              jaxcoll.DataParallel(), has_aux=True, merge_aux=w.merge_aux,
                              rng=0)
    state, _ = trainer.step(trainer.init(w.init_params(0)), batch)
    out.append(jax.tree.map(np.asarray, trainer.params(state)))
  stats = out[0]["batch_stats"]["BatchNorm_0"]
  assert np.abs(stats["mean"]).max() > 0.01  # moved from its initial zeros
  for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  metrics = w.eval_fn(out[0], batch)  # evaluation reads the running averages only
  assert set(metrics) == {"loss"}


def test_parquet_columns_that_are_not_numbers_are_left_unread(tmp_path):
  # A user's Parquet has an id (strings, some null) beside the model's columns:
  # every read stopped on "column 'id' has type string, not numbers", although
  # the model never uses it. Such columns are now not read (nor checked for
  # nulls, nor compared across files); a model that needs one is told it is
  # there but not numbers.
  import pyarrow as pa  # noqa: PLC0415
  import pyarrow.parquet as pq  # noqa: PLC0415
  import pytest  # noqa: PLC0415

  from jaxcoll.data import sources  # noqa: PLC0415
  from jaxcoll.run import inputs  # noqa: PLC0415

  x = np.arange(40, dtype=np.float64).reshape(10, 4)
  pq.write_table(pa.table({
      "features": pa.array(list(x), type=pa.list_(pa.float64())),
      "label": pa.array(np.arange(10) % 2, type=pa.int64()),
      "id": pa.array([None if i == 3 else f"row{i}" for i in range(10)], type=pa.string()),
      "ok": pa.array(np.arange(10) % 3 == 0),
  }), tmp_path / "a.parquet", row_group_size=4)
  source = sources.open_source(str(tmp_path / "*.parquet"))
  assert source.ignored_columns == ["id"]
  rows = source.read_rows([9, 0, 5])
  assert sorted(rows) == ["features", "label", "ok"]
  np.testing.assert_array_equal(rows["features"], x[[9, 0, 5]])
  np.testing.assert_array_equal(rows["ok"], [True, True, False])

  w = jaxcoll.models.make_workload("mlp", input_dim=4, widths=(4,), num_outputs=2)
  sample = {"inputs": rows["features"], "label": rows["label"]}  # no "labels" column
  with pytest.raises(Exception, match=r"needs column 'labels'.*not numbers, so not read: \['id'\]"):
    inputs.check_columns(w, sample, "data.train", "x", source.ignored_columns)


def test_resume_with_another_seed_on_files_is_refused(tmp_path):
  # The records' order in each epoch is a permutation drawn from `seed`: a run
  # resumed with --config.seed changed went on in another order from the same
  # position, repeating and skipping examples of the epoch without a word.
  import pytest  # noqa: PLC0415

  from jaxcoll.data import files, sources  # noqa: PLC0415

  sources.write_shards({"inputs": np.arange(64, dtype=np.float32)[:, None]}, str(tmp_path),
                       num_shards=2)
  pattern = str(tmp_path / "*.parquet")
  first = files.FileData(pattern, 8, seed=1, process_index=0, process_count=1)
  it = first.iterator()
  seen = [next(it)["inputs"][:, 0] for _ in range(3)]
  saved = first.checkpoint_state(it)
  other = files.FileData(pattern, 8, seed=2, process_index=0, process_count=1)
  with pytest.raises(sources.DataError, match=r"`seed` was 1, now 2"):
    other.resume(saved, 3)
  it = other.iterator(other.resume(saved, 3, allow_changed=True))  # on purpose: goes on
  assert next(it)["inputs"].shape == (8, 1)
  same = files.FileData(pattern, 8, seed=1, process_index=0, process_count=1)
  rest = next(same.iterator(same.resume(saved, 3)))["inputs"][:, 0]
  assert not set(rest) & set(np.concatenate(seen))  # the epoch goes on: no repeats


def test_label_range_of_a_list_column_is_checked_from_the_statistics(tmp_path):
  # Token ids in a list column (an LM's "tokens"): the statistics are the leaf
  # column "tokens.list.element"'s, which the pre-check did not match, so an id
  # past the vocabulary was found only in the first batch read, after the
  # workdir and checkpoints/ were made. Now it is refused before training.
  import types  # noqa: PLC0415

  import pyarrow as pa  # noqa: PLC0415
  import pyarrow.parquet as pq  # noqa: PLC0415
  import pytest  # noqa: PLC0415

  from jaxcoll.data import sources  # noqa: PLC0415
  from jaxcoll.run import config_error, inputs  # noqa: PLC0415

  tokens = np.arange(48, dtype=np.int16).reshape(12, 4) % 10
  tokens[7, 2] = 12
  pq.write_table(pa.table({"tokens": pa.array(list(tokens), type=pa.list_(pa.int16()))}),
                 tmp_path / "a.parquet", row_group_size=4)
  source = sources.open_source(str(tmp_path / "a.parquet"))
  assert source.column_range("tokens")[:2] == (0, 12)
  model = types.SimpleNamespace(label_classes={"tokens": 10})
  sample = source.read_rows([0])
  with pytest.raises(config_error.ConfigError, match=r"'tokens' holds 12 .*row group 1\)"):
    inputs.check_label_ranges(model, source, sample, "data.train", "x")
  inputs.check_label_ranges(types.SimpleNamespace(label_classes={"tokens": 13}), source,
                            sample, "data.train", "x")


def test_bad_shard_by_and_steps_past_int32_are_config_errors():
  # `data.shard_by=row` trained (exit 0) when no files were given: it was checked
  # only where files are opened. `steps=10**23` ended in a traceback from
  # TensorBoard's hparams after the workdir was written; the step counter is an
  # int32 anyway.
  import pytest  # noqa: PLC0415

  from jaxcoll.data import files  # noqa: PLC0415
  from jaxcoll.run import config  # noqa: PLC0415

  assert config.SHARD_BY == files.SHARD_BY
  with pytest.raises(config.ConfigError, match=r"`config.data.shard_by`='row': valid choices"):
    config.parse({"data": {"shard_by": "row"}})
  with pytest.raises(config.ConfigError, match=r"`config.steps`=2147483648: must be an "
                     r"integer <= 2147483647"):
    config.parse({"steps": 2**31})
  assert config.parse({"steps": 2**31 - 1, "data": {"shard_by": "file"}}).steps == 2**31 - 1


_FILES_ONLY_MODEL = '''
import flax.linen as nn, numpy as np, optax, jaxcoll

def make():
  def loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return jaxcoll.models.from_flax(nn.Dense(2), loss, inputs=("features",),
                                  sample_batch={"features": np.zeros((1, 4), np.float32)})
'''


def test_memory_plan_of_a_model_trained_only_on_files_takes_their_shapes(tmp_path):
  # The README's own model (from_flax, no synthetic set) through
  # `memory_plan --model=my_model:make`: a traceback from make_batch ("has no
  # synthetic data set"). Now `--data=GLOB` gives the batch's shapes from the
  # files' first row, and without it the command says so in one line, exit 2.
  import sys  # noqa: PLC0415

  import jobs  # noqa: PLC0415

  (tmp_path / "files_only_model.py").write_text(_FILES_ONLY_MODEL)
  from jaxcoll.data import sources  # noqa: PLC0415

  sources.write_shards({"features": np.ones((8, 4), np.float32),
                        "label": np.zeros(8, np.int32)}, str(tmp_path))
  cmd = [sys.executable, "-m", "experiments.memory_plan", "--model=files_only_model:make",
         "--devices=2", "--batch_size=4"]
  # From tmp_path (python -m puts it first on the path: files_only_model imports), forked
  # from a warm Python (jobs.forked: ~1.4 CPU-s less each).
  line = jobs.one_line(jobs.forked(cmd, devices=2, cwd=tmp_path))
  assert "`--model`='files_only_model:make' has no synthetic data set: pass --data=GLOB" in line
  out = jobs.forked([*cmd, f"--data={tmp_path}/*.parquet"], devices=2, cwd=tmp_path)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "Ψ=10 params, N=2 devices" in out.stdout and "ZeRO-3" in out.stdout


@pytest.mark.slow
def test_bench_trainer_of_a_model_trained_only_on_files_needs_data(tmp_path):
  # The same for bench_trainer (its batches from the files' first records).
  import sys  # noqa: PLC0415

  import jobs  # noqa: PLC0415

  (tmp_path / "files_only_model.py").write_text(_FILES_ONLY_MODEL)
  bench = [sys.executable, "-m", "experiments.bench_trainer", "--model=files_only_model:make",
           "--devices=2", "--batch_size=4"]
  env = {"PYTHONPATH": os.pathsep.join([jobs.REPO, str(tmp_path)])}
  line = jobs.one_line(jobs.run(bench, devices=2, **env))
  assert line.startswith("bench_trainer: error: `--model`='files_only_model:make' has no")


def test_a_glob_under_a_directory_with_brackets_in_its_name_finds_the_files(tmp_path):
  # "/data [1]/*.parquet": glob reads "[1]" as a character class and matched
  # nothing ("matches no file") though the directory exists. A directory part
  # that exists is now taken as it is, as a whole path already was.
  from jaxcoll.data import sources  # noqa: PLC0415

  d = tmp_path / "run [1]" / "v2"
  files = sources.write_shards({"x": np.zeros((4, 1), np.float32)}, str(d), num_shards=2)
  assert sources.expand(str(d / "*.parquet")) == sorted(files)
  assert sources.expand(str(tmp_path / "run [1]" / "v*" / "*.parquet")) == sorted(files)


def test_a_resume_with_checkpoint_every_0_saves_its_last_step(tmp_path):
  # A workdir with checkpoints, run again with configs/minimal.py's
  # checkpoint_every=0: the resumed steps were trained and not saved, while
  # summary.json said the run reached them; the next run went back to the old
  # checkpoint. A resumed run now saves its last step (and says so once).
  from configs import minimal  # noqa: PLC0415

  from jaxcoll.run import loop  # noqa: PLC0415

  config = minimal.get_config("smoke")
  config.checkpoint_every = 2
  loop.train_and_evaluate(config, str(tmp_path))
  config.checkpoint_every, config.steps = 0, 6
  summary = loop.train_and_evaluate(config, str(tmp_path))
  assert summary["steps"] == 6 and summary["start_step"] == 4
  assert sorted(os.listdir(tmp_path / "checkpoints"))[-1] == "6"
  again = loop.train_and_evaluate(config, str(tmp_path))
  assert again["nothing_to_do"] and again["params_sha256"] == summary["params_sha256"]
  fresh = minimal.get_config("smoke")  # and a fresh run with checkpoint_every=0 saves nothing
  loop.train_and_evaluate(fresh, str(tmp_path / "fresh"))
  assert not os.listdir(tmp_path / "fresh" / "checkpoints")


@pytest.mark.parametrize("field,value", [("compression", "fp8"), ("bucket_bytes", -3),
                                         ("algorithm", "foo"), ("nan_policy", "foo")])
def test_a_config_field_the_library_checks_is_named_as_the_config_field(tmp_path, field, value):
  # The library's check names its own argument ("DataParallel: `compression` must be
  # ..."): the command line's line read as if there were a --compression flag.
  from configs import minimal  # noqa: PLC0415

  from jaxcoll.run import loop  # noqa: PLC0415
  from jaxcoll.run.config_error import ConfigError  # noqa: PLC0415

  config = minimal.get_config("smoke")
  config[field] = value
  with pytest.raises(ConfigError) as e:
    loop.train_and_evaluate(config, str(tmp_path / "w"))
  assert str(e.value).startswith(f"`config.{field}` must be"), str(e.value)
  assert repr(value) in str(e.value) or str(value) in str(e.value)
  assert not (tmp_path / "w").exists()
