"""Cases a user brought that no other test had tried (engineer trial5): data laid out as
users have it (shards of uneven size, empty shards, schemas that differ, .npz / JSON Lines),
resumes with the layout changed, and evaluation of a user's own flax models under ZeRO-3.
Each test of a fix fails without it; the others keep what was tried and worked."""

import functools
import json
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import jobs
import numpy as np
import optax
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import jaxcoll
from jaxcoll.data import files as data_files
from jaxcoll.data import sources as data_sources
from jaxcoll.run import evaluate

_MODEL = [f"--config.model={__name__}:make_classifier", "--config.model_overrides={}"]


def make_classifier():
  """The README's `my_model:make`: 8 features, 2 classes."""

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(2)(nn.relu(nn.Dense(16)(x)))

  def loss(logits, batch):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return ce, {"accuracy": jnp.mean(logits.argmax(-1) == batch["label"])}

  return jaxcoll.models.from_flax(Net(), loss, inputs=("features",),
                                  sample_batch={"features": np.zeros((1, 8), np.float32)},
                                  label_classes={"label": 2})


def _parquet(directory, sizes, *, row_group_size=16, label_type=None, extra=(),
             order=("id", "features", "label")):
  """Files ``part-NNN.parquet`` of ``sizes[i]`` rows each (0: an empty file with the
  schema), as pyarrow writes them (no jaxcoll metadata); column ``id`` numbers the
  examples 0.. over the files. ``extra``: indices of files with one more column."""
  os.makedirs(directory, exist_ok=True)
  rng, start = np.random.default_rng(0), 0
  label_type = pa.int32() if label_type is None else label_type
  for i, n in enumerate(sizes):
    x = rng.normal(size=(n, 8)).astype(np.float32)
    columns = {"id": pa.array(np.arange(start, start + n, dtype=np.int64)),
               "features": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 8),
               "label": pa.array((x[:, 0] > 0).astype(np.int64), type=label_type[i]
                                 if isinstance(label_type, list) else label_type)}
    table = pa.table({k: columns[k] for k in order})
    if i in extra:
      table = table.append_column("weight", pa.array(np.ones(n, np.float32)))
    pq.write_table(table, os.path.join(directory, f"part-{i:03d}.parquet"),
                   row_group_size=max(1, min(row_group_size, n)))
    start += n
  return os.path.join(directory, "*.parquet")


def _ids(loaders, states, batches):
  """The ``id`` of every example the processes' ``loaders`` give in ``batches`` global
  batches, process 0's rows first in each (the global batch's order), and the iterators."""
  its = [loader.iterator(state) for loader, state in zip(loaders, states, strict=True)]
  seen = [np.concatenate([next(it)["id"] for it in its]) for _ in range(batches)]
  return np.concatenate(seen), its


# --- B. Data laid out the way users have it -----------------------------------------------


def test_uneven_and_empty_shards_cover_every_example_once_per_epoch_across_resumes(tmp_path):
  """500 examples in 8 files of 0 to 300 rows (two empty, row groups of 16), shard_by=record:
  2 processes x batch 32 for 5 batches, resumed on 1 process with batch 24, then on 2 with
  batch 48: every epoch of the examples seen is each example exactly once (by id)."""
  pattern = _parquet(tmp_path, [1, 300, 0, 7, 0, 60, 2, 130])
  n = 500
  two = [data_files.FileData(pattern, 32, process_index=p, process_count=2) for p in (0, 1)]
  first, its = _ids(two, [None, None], 5)
  saved = json.loads(json.dumps(two[0].checkpoint_state(its[0])))  # what the checkpoint keeps
  one = data_files.FileData(pattern, 24, process_index=0, process_count=1)
  second, its = _ids([one], [one.resume(saved, 5)], 40)
  saved = json.loads(json.dumps(one.checkpoint_state(its[0])))
  again = [data_files.FileData(pattern, 48, process_index=p, process_count=2) for p in (0, 1)]
  third, _ = _ids(again, [loader.resume(saved, 45) for loader in again], 20)
  seen = np.concatenate([first, second, third])
  assert len(seen) == 5 * 32 + 40 * 24 + 20 * 48 == 2080
  for epoch in range(len(seen) // n):
    assert sorted(seen[epoch * n:(epoch + 1) * n].tolist()) == list(range(n)), epoch


@pytest.mark.parametrize("where", ["first", "last"])
def test_an_empty_array_record_shard_is_read_past(tmp_path, where):
  """A writer shard that got no rows (an ArrayRecord file of 0 records) made the glob
  'mix schemas' with {} (an empty file has no record to take a layout from)."""
  from array_record.python import array_record_module  # noqa: PLC0415

  data_sources.write_shards({"id": np.arange(40), "x": np.ones((40, 3), np.float32)},
                            str(tmp_path), num_shards=2, fmt="array_record")
  name = "data-00000-a-empty" if where == "first" else "data-99999-empty"
  array_record_module.ArrayRecordWriter(str(tmp_path / f"{name}.array_record"),
                                        "group_size:1").close()
  pattern = str(tmp_path / "*.array_record")
  source = data_sources.open_source(pattern)
  assert len(source) == 40 and source.schema == {"id": "int64[]", "x": "float32[3]"}
  ids, _ = _ids([data_files.FileData(pattern, 8, process_index=0, process_count=1)], [None], 5)
  assert sorted(ids.tolist()) == list(range(40))


def test_an_empty_parquet_shard_of_another_schema_is_not_compared(tmp_path):
  """An empty shard (the first file) written with other columns and types (an empty
  frame's): its schema was the one every file was compared with."""
  pq.write_table(pa.table({"id": pa.array([], pa.int32()), "other": pa.array([], pa.float64())}),
                 str(tmp_path / "part-!empty.parquet"))  # sorts first
  pattern = _parquet(tmp_path, [30, 20])
  source = data_sources.open_source(pattern)
  assert len(source) == 50 and set(source.schema) == {"id", "features", "label"}
  assert sorted(source.read_rows(np.arange(50))["id"].tolist()) == list(range(50))


def test_columns_in_another_order_are_read_by_name(tmp_path):
  pattern = _parquet(tmp_path, [20, 20], order=("label", "id", "features"))
  _parquet(tmp_path / "other", [20], order=("id", "features", "label"))
  os.replace(tmp_path / "other" / "part-000.parquet", tmp_path / "part-002.parquet")
  rows = data_sources.open_source(pattern).read_rows(np.arange(60))
  assert rows["features"].shape == (60, 8) and rows["label"].dtype == np.int32
  np.testing.assert_array_equal(rows["label"], (rows["features"][:, 0] > 0).astype(np.int32))


@pytest.mark.parametrize("case,expected", [
    ("int32_int64", "column 'label' is int32 in part-000.parquet but int64 in part-001.parquet"),
    ("extra_column", "column 'weight' is in part-001.parquet but not in part-000.parquet"),
    ("string_label", "column 'label' is in part-000.parquet but string, not numbers, in "
                     "part-001.parquet"),
], ids=["int32_int64", "extra_column", "string_label"])
def test_mixed_schemas_name_the_column_that_differs(tmp_path, case, expected):
  """The line showed both whole schemas (a diff by eye, with many columns) and said to
  rewrite them with make_shards, which refuses the same files."""
  if case == "int32_int64":
    pattern = _parquet(tmp_path, [20, 20], label_type=[pa.int32(), pa.int64()])
  elif case == "extra_column":
    pattern = _parquet(tmp_path, [20, 20], extra=(1,))
  else:  # labels read from a CSV as text in one file
    pattern = _parquet(tmp_path, [20])
    pq.write_table(pa.table({"id": np.arange(20), "features": pq.read_table(
        tmp_path / "part-000.parquet")["features"], "label": pa.array(["1"] * 20)}),
        str(tmp_path / "part-001.parquet"))
  with pytest.raises(ValueError, match="mixes schemas") as e:
    data_sources.open_source(pattern)
  assert expected in str(e.value) and "leave the odd files out of the glob" in str(e.value)


def test_list_columns_of_another_length_in_another_file_are_one_line(tmp_path):
  """pandas / pyarrow write lists as variable-length `list<float>`, whose type does not say
  the length: lists of 8 in one file and 9 in another passed the schema check, and a batch
  of both was numpy's 'shape mismatch' traceback from grain's reader thread (exit 1)."""
  rng = np.random.default_rng(0)
  for i, length in enumerate((8, 9)):
    x = rng.normal(size=(20, length)).astype(np.float32)
    pq.write_table(pa.table({"features": pa.array(list(x), type=pa.list_(pa.float32())),
                             "label": pa.array(np.zeros(20, np.int32))}),
                   str(tmp_path / f"part-{i}.parquet"))
  source = data_sources.open_source(str(tmp_path / "*.parquet"))
  assert source.read_rows(np.arange(20))["features"].shape == (20, 8)  # one file: fine
  with pytest.raises(data_sources.DataError) as e:
    source.read_rows(np.arange(40))
  assert str(e.value) == (
      f"`data.train`: {tmp_path}/part-1.parquet, row group 0 (of 1): column 'features' has "
      f"per-row shape [9], but {tmp_path}/part-0.parquet, row group 0 (of 1) has [8]; every "
      "row of a column must have the same shape: pad or cut the lists to one length (or "
      "write fixed-size lists, as make_shards does), or leave the file out of the glob.")


def test_shard_by_file_compares_every_processes_files(tmp_path):
  """Under shard_by=file each process compared only its own files: process 0 (int32
  labels) and process 1 (int64) trained on batches of other types, a column only process
  1's files had was a batch key there alone (the launched job exited 0)."""
  pattern = _parquet(tmp_path, [20, 20], label_type=[pa.int32(), pa.int64()])
  for p in (0, 1):
    with pytest.raises(ValueError, match="column 'label' is int32 in part-000.parquet"):
      data_files.FileData(pattern, 8, shard_by="file", process_index=p, process_count=2)


def test_shard_by_file_names_the_process_whose_files_are_empty(tmp_path):
  """Process 1's two files were empty: it said '`data.train`=...: the files hold no
  records' (of a glob holding 80) and process 0 passed the line on as its own."""
  pattern = _parquet(tmp_path, [50, 30, 0, 0])
  for p in (0, 1):  # every process says it, before any collective
    with pytest.raises(ValueError) as e:
      data_files.FileData(pattern, 8, shard_by="file", process_index=p, process_count=2)
    assert ("under `data.shard_by`='file' process 1 of 2 gets the files ['part-002.parquet', "
            "'part-003.parquet'], which hold no records (the 80 records are in the other "
            "processes' files); use --config.data.shard_by=record") in str(e.value)


def test_shard_by_file_with_unbalanced_processes_warns_and_balanced_does_not(tmp_path):
  """308 vs 192 records: each process cycles its own, so process 1's examples are trained
  on 1.6x as often, and nothing said so."""
  pattern = _parquet(tmp_path, [1, 300, 0, 7, 0, 60, 2, 130])
  loaders = [data_files.FileData(pattern, 8, shard_by="file", process_index=p, process_count=2)
             for p in (0, 1)]
  assert [loader.process_records for loader in loaders] == [[308, 192]] * 2
  line = loaders[0].balance_warning()
  assert line == loaders[1].balance_warning()
  assert ("process 1's files hold 192 records, process 0's 308; each process cycles its own "
          "records, so process 1's examples are trained on 1.6x as often") in line
  ids, _ = _ids(loaders, [None, None], 48)  # 4 rows of each process a batch: 192 each
  own = ids.reshape(48, 2, 4)
  assert sorted(own[:, 1].ravel().tolist()) == list(range(308, 500))  # process 1: one epoch
  p0 = own[:, 0].ravel()  # process 0: 192 of its 308, each once so far
  assert len(set(p0.tolist())) == 192 and p0.max() < 308
  balanced = _parquet(tmp_path / "even", [100, 100, 95, 105])
  assert data_files.FileData(balanced, 8, shard_by="file", process_index=0,
                             process_count=2).balance_warning() is None
  assert data_files.FileData(pattern, 8, process_index=0, process_count=2).balance_warning() \
      is None  # shard_by=record: every example once per epoch whatever the files


@pytest.mark.parametrize("ext", [".npz", ".jsonl"])
def test_arrays_the_trainer_does_not_read_are_one_line_with_the_convert_command(tmp_path, ext):
  """`--config.data.train=clicks.npz` said 'rename them or write them with make_shards':
  renaming an .npz to .parquet does not make it one."""
  path = tmp_path / f"clicks{ext}"
  path.write_text("{}")
  line = jobs.one_line(jobs.train_forked("--config=configs/minimal.py:smoke", *_MODEL,
                                         f"--config.data.train={path}",
                                         f"--workdir={tmp_path / 'run'}"), prefix="train: error:")
  assert (f"names {ext} files (clicks{ext}), which the trainer does not read (it reads Parquet "
          f"or ArrayRecord); convert them once: python -m experiments.make_shards "
          f"--input='{path}' --out=DIR") in line
  assert "rename" not in line and not (tmp_path / "run").exists()


def test_make_shards_converts_json_lines_and_the_run_trains_on_them(tmp_path):
  """JSON Lines (one object a line, features a list of 8 numbers): make_shards took
  .npz, .csv and .parquet only."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(40, 8))
  with open(tmp_path / "events.jsonl", "w") as f:
    for row in x:
      f.write(json.dumps({"features": row.tolist(), "label": int(row[0] > 0)}) + "\n")
  out = jobs.forked([sys.executable, "-m", "experiments.make_shards",
                     f"--input={tmp_path}/events.jsonl", "--num_shards=2",
                     f"--out={tmp_path / 'shards'}"])
  assert out.returncode == 0 and "wrote 40 rows, columns {'features': [8], 'label': []}" \
      in out.stdout, out.stderr
  rows = data_sources.open_source(str(tmp_path / "shards" / "*.parquet")).read_rows(
      np.arange(40))
  np.testing.assert_array_equal(rows["features"], x)
  np.testing.assert_array_equal(rows["label"], (x[:, 0] > 0).astype(np.int64))
  with open(tmp_path / "ragged.jsonl", "w") as f:
    f.write('{"features": [1, 2], "label": 1}\n{"features": [1], "label": 0}\n')
  line = jobs.one_line(jobs.forked([sys.executable, "-m", "experiments.make_shards",
                                    f"--input={tmp_path}/ragged.jsonl",
                                    f"--out={tmp_path / 'bad'}"]))
  assert line == ("make_shards: error: `--input`: ragged.jsonl: column 'features' holds lists "
                  "of different lengths (1 to 2 values a row); every row must have the same "
                  "length.")


def test_eval_files_without_eval_every_say_they_are_not_read(tmp_path, caplog):
  """`--config.data.eval=GLOB` without `--config.eval_every`: the run never evaluated and
  nothing said so (no eval row, no eval in summary.json)."""
  import logging  # noqa: PLC0415

  from jaxcoll.run import config as run_config  # noqa: PLC0415
  from jaxcoll.run import inputs  # noqa: PLC0415

  pattern = _parquet(tmp_path, [5])
  config = run_config.parse({"model": f"{__name__}:make_classifier",
                             "data": {"train": pattern, "eval": pattern}})
  with caplog.at_level(logging.WARNING):
    assert inputs.make_evaluator(config, make_classifier(), jaxcoll.devices.flat_mesh(8),
                                 "data") is None
  assert [r.getMessage() for r in caplog.records] == [
      f"`config.data.eval`={pattern!r} is set but `config.eval_every`=0, so the run does not "
      "evaluate; pass --config.eval_every=N to evaluate every N steps and at the last one"]


# --- C. Eval under ZeRO-3 / FSDP units on a user's own flax models -------------------------

_V, _D, _T = 256, 64, 8


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    h = nn.MultiHeadDotProductAttention(num_heads=4, deterministic=True)(nn.LayerNorm()(x))
    x = x + h
    return x + nn.Dense(_D)(nn.gelu(nn.Dense(4 * _D)(nn.LayerNorm()(x)))), None


_Unit = jaxcoll.fsdp_unit(_Block)


class _TiedLM(nn.Module):
  """A user's transformer: tied input / output embedding, an nn.scan stack of FSDP units."""

  layers: int = 2

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(_V, _D)
    x = embed(tokens)
    x, _ = nn.scan(_Unit, variable_axes={"params": 0}, split_rngs={"params": True},
                   length=self.layers)()(x, None)
    return embed.attend(nn.LayerNorm()(x))


class _ConvNet(nn.Module):
  @nn.compact
  def __call__(self, image):
    x = nn.max_pool(nn.relu(nn.Conv(8, (3, 3))(image)), (2, 2), (2, 2))
    return nn.Dense(10)(nn.relu(nn.Conv(16, (3, 3))(x)).mean((1, 2)))


def _classify(target):
  def loss(logits, batch):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[target]).mean()
    return ce, {"accuracy": jnp.mean(logits.argmax(-1) == batch[target])}
  return loss


@functools.cache
def _lm(layers):
  tokens = np.random.default_rng(0).integers(0, _V, size=(37, _T)).astype(np.int32)
  w = jaxcoll.models.from_flax(_TiedLM(layers), _classify("targets"), inputs=("tokens",),
                               sample_batch={"tokens": tokens[:1]})
  return w, {"tokens": tokens, "targets": np.roll(tokens, -1, 1)}


@functools.cache
def _conv():
  rng = np.random.default_rng(1)
  images = rng.normal(size=(37, 8, 8, 3)).astype(np.float32)
  w = jaxcoll.models.from_flax(_ConvNet(), _classify("label"), inputs=("image",),
                               sample_batch={"image": images[:1]})
  return w, {"image": images, "label": rng.integers(0, 10, 37).astype(np.int32)}


_ZERO3 = {"zero3": lambda: (jaxcoll.ZeRO(stage=3), jaxcoll.devices.flat_mesh(8), "data"),
          "hybrid": lambda: (jaxcoll.ZeRO(stage=3, axis="local", replica_axis="node"),
                             jaxcoll.devices.node_local_mesh(2, 4), ("node", "local"))}


@functools.cache
def _params(w):
  """The model's initial params, on the host (one jitted init: flax's eager init of a conv
  net takes seconds)."""
  return jax.tree.map(np.asarray, jax.jit(w.init_params)(jax.random.key(0)))


def _eval(w, rows, strategy, mesh, axis, *, n):
  trainer = jaxcoll.Trainer(w.loss_fn, optax.adam(1e-3), mesh, strategy, has_aux=True)
  state = trainer.init(_params(w))
  ev = evaluate.Evaluator(w, mesh, axis, lambda i: {k: v[i] for k, v in rows.items()},
                          num_examples=n, global_batch_size=16)
  return trainer, state, ev, ev.run(trainer=trainer, state=state)


@pytest.mark.parametrize("model,layout,n", [
    ("tied_scan_lm", "hybrid", 5), ("conv", "zero3", 37)])  # 5: under one global batch (16)
def test_eval_of_a_users_model_under_zero3_equals_one_device(model, layout, n):
  w, rows = _lm(2) if model == "tied_scan_lm" else _conv()
  _, _, _, one = _eval(w, rows, jaxcoll.DataParallel(), jaxcoll.devices.flat_mesh(1), "data",
                       n=n)
  _, _, _, got = _eval(w, rows, *_ZERO3[layout](), n=n)
  assert got["eval_examples"] == one["eval_examples"] == n
  for k in one:
    assert got[k] == pytest.approx(one[k], rel=1e-6, abs=1e-7), k


def test_eval_under_zero3_holds_one_layer_of_a_scanned_tied_lm():
  """The compiled eval program of a 6-layer stack holds the leaves outside units (the tied
  embedding) and about one layer, not the model: its temporaries are under 2 x (outside + one
  layer), its arguments 1/8 of the model, and it needs less than the train step."""
  layers = 6
  w, rows = _lm(layers)
  trainer, state, ev, _ = _eval(w, rows, *_ZERO3["zero3"](), n=37)
  stats = ev.compile_on(trainer, state).memory_analysis()
  sizes = {jax.tree_util.keystr(k): x.size * 4
           for k, x in jax.tree_util.tree_leaves_with_path(w.param_shapes)}
  params = sum(sizes.values())
  layer = sum(v for k, v in sizes.items() if "Scan" in k) // layers
  outside = params - layer * layers
  assert layer * layers > 0.8 * params  # the stack is most of the model
  assert stats.temp_size_in_bytes < 2 * (outside + layer) < params / 2, (stats, outside, layer)
  assert stats.argument_size_in_bytes < params / 8 + 65536
  step = trainer.compile_step(state, {k: v[:16] for k, v in rows.items()}).memory_analysis()
  assert (stats.argument_size_in_bytes + stats.temp_size_in_bytes
          < step.argument_size_in_bytes + step.temp_size_in_bytes), (stats, step)


def test_params_digest_of_hybrid_zero3_in_one_process_is_the_params(tmp_path):
  """summary.json's params_global_norm / params_sha256 of a one-process hybrid ZeRO-3 run
  (`--config.mesh_shape=2,4 --config.replica_axis=node`) hashed each row once per replica
  group: another norm (33.907 for 33.763) and sha than the params it saved."""
  from jaxcoll.run import loop  # noqa: PLC0415

  w, _ = _lm(3)
  strategy, mesh, _ = _ZERO3["hybrid"]()
  trainer = jaxcoll.Trainer(w.loss_fn, optax.adam(1e-3), mesh, strategy, has_aux=True)
  state = trainer.init_from(lambda: w.init_params(0))
  norm, sha, nonfinite = trainer.params_digest(state)
  assert (norm, sha) == loop.params_digest(jax.tree.map(np.asarray, trainer.params(state)))
  assert nonfinite == []


# --- A. Resume with what a user changes on a cluster ---------------------------------------

_RING = ["--config=configs/default.py:smoke", "--config.algorithm=ring",
         "--config.global_batch_size=48", "--config.checkpoint_every=3",
         "--config.keep_checkpoints=5"]


def _saved_params(workdir, step):
  """Checkpoint ``step`` of a run's workdir, restored onto one device: its params."""
  import dataclasses  # noqa: PLC0415

  from jaxcoll.run import config as run_config  # noqa: PLC0415
  from jaxcoll.run import inputs, loop  # noqa: PLC0415
  from jaxcoll.train.checkpoint import Checkpointer  # noqa: PLC0415

  with Checkpointer(os.path.join(workdir, "checkpoints")) as ckpt:
    config = run_config.parse(ckpt.metadata(step)["extra"]["config"])
    config = dataclasses.replace(config, strategy="dp", mesh_shape="", mesh_axes="",
                                 replica_axis="", grad_accum_steps=1)
    w = inputs.make_workload(config)
    trainer = loop.build_trainer(config, w, jaxcoll.devices.flat_mesh(1), "data")
    trainer.abstract_state(w.param_shapes)
    state, position, _ = ckpt.restore(trainer, step)
  assert position == step
  return jax.tree.map(np.asarray, trainer.params(state))


def test_a_resume_with_more_accumulation_steps_is_no_config_change():
  """Resumed with grad_accum_steps 1 -> 2 (to fit a device with less memory): one warning
  said the run 'trains as this config says, not as the run that wrote it' and to pass the old
  value, of a change that computes the same update (as a change of strategy or mesh, which
  it did not name)."""
  from jaxcoll.run import config as run_config  # noqa: PLC0415
  from jaxcoll.run import loop  # noqa: PLC0415

  saved = json.loads(json.dumps(run_config.RunConfig().to_dict(), default=str))
  changed = run_config.RunConfig(grad_accum_steps=2, strategy="zero3", mesh_shape="2,3",
                                 mesh_axes="node,local", replica_axis="node")
  assert loop.config_changes(saved, changed) == []
  assert loop.config_changes(saved, run_config.RunConfig(global_batch_size=64)) == [
      "global_batch_size 256 -> 64"]


def test_a_resume_that_allow_changed_files_lets_go_on_says_what_changed(tmp_path, caplog):
  """shard_by=file written by 2 processes, resumed on 1 with data.allow_changed_files=True:
  the only line was 'config changed: data.allow_changed_files False -> True; ... pass the
  old values to continue that run unchanged' (which refuses); what changed was not said."""
  import logging  # noqa: PLC0415

  from jaxcoll.run import config as run_config  # noqa: PLC0415
  from jaxcoll.run import inputs, loop  # noqa: PLC0415

  pattern = _parquet(tmp_path, [40, 40])
  two = [data_files.FileData(pattern, 8, shard_by="file", process_index=p, process_count=2)
         for p in (0, 1)]
  its = [loader.iterator() for loader in two]
  for _ in range(3):
    for it in its:
      next(it)
  saved = json.loads(json.dumps(two[0].checkpoint_state(its[0])))
  config = run_config.parse({"global_batch_size": 8, "model": f"{__name__}:make_classifier",
                             "data": {"train": pattern, "shard_by": "file",
                                      "allow_changed_files": True}})
  train_input = inputs.TrainInput(config, make_classifier(), jaxcoll.devices.flat_mesh(8),
                                  "data")
  with caplog.at_level(logging.WARNING):
    train_input.restore(3, saved)
  lines = [r.getMessage() for r in caplog.records]
  assert lines == [
      "the data position in the checkpoint at step 3 does not fit this run: it was written by "
      "2 process(es), this run has 1, and under `data.shard_by`='file' each process's files "
      "and order depend on the count; data.allow_changed_files=True: going on from the same "
      "number of examples in the new order (this epoch may repeat or skip examples)"]
  before = json.loads(json.dumps(run_config.parse(
      {"global_batch_size": 8, "model": f"{__name__}:make_classifier",
       "data": {"train": pattern, "shard_by": "file"}}).to_dict(), default=str))
  assert loop.config_changes(before, config) == []  # the permission is no training change


def test_adafactor_under_zero_with_checkpoints_trains_and_saves(tmp_path):
  """`--config.optimizer=adafactor --config.strategy=zero2` trained 3 steps, then the first
  save raised ValueError (a traceback, exit 1): adafactor's factored moments of ZeRO's rows
  had no layout-free form (trial5 refused it up front). ZeRO now runs such an update on the
  full-shaped leaves (zeroexact), so the state is one device's and the run saves it."""
  workdir = tmp_path / "run"
  out = jobs.train_forked("--config=configs/default.py:smoke", "--config.optimizer=adafactor",
                          "--config.strategy=zero2", f"--workdir={workdir}")
  assert out.returncode == 0, out.stderr[-3000:]
  assert "NotElementwiseWarning" not in out.stderr and "Traceback" not in out.stderr
  assert json.loads((workdir / "summary.json").read_text())["steps"] > 0
  assert any((workdir / "checkpoints").iterdir())


@pytest.mark.parametrize("field,saved,now", [
    ("model_overrides", {"input_dim": 32, "widths": [128, 128]},
     {"input_dim": 32, "widths": [64, 64]}),
    ("optimizer", "adam", "sgd")], ids=["model_overrides", "optimizer"])
def test_the_fix_a_refused_resume_shows_works_pasted_into_a_shell(field, saved, now):
  """Resumed with other model_overrides, the line said to pass
  `--config.model_overrides={'input_dim': 32, 'widths': [128, 128]}`: pasted, the shell
  split it at its spaces and the flag failed to parse ('{' was never closed)."""
  import ast  # noqa: PLC0415
  import shlex  # noqa: PLC0415

  from jaxcoll.run import config as run_config  # noqa: PLC0415
  from jaxcoll.run import loop  # noqa: PLC0415

  class Saved:  # a Checkpointer's newest checkpoint, as _check_checkpoints_fit reads it
    directory = "/w/checkpoints"

    def latest_step(self):
      return 6

    def metadata(self, step):
      return {"extra": {"config": {**run_config.RunConfig().to_dict(), field: saved}}}

  config = run_config.parse({field: now})
  with pytest.raises(run_config.ConfigError) as e:
    loop._check_checkpoints_fit(Saved(), config)
  fix = str(e.value).split("; pass ")[1].split(" to resume them")[0]
  words = shlex.split(fix)
  assert len(words) == 1 and words[0].startswith(f"--config.{field}=")
  value = words[0].split("=", 1)[1]  # what the flag gets
  assert (value if isinstance(saved, str) else ast.literal_eval(value)) == saved


@pytest.mark.slow  # ~25 s: three runs of the command line, each compiling its programs
def test_resume_on_6_devices_hybrid_zero3_with_accumulation_continues_the_run(tmp_path):
  """DP on 8 devices for 3 steps, resumed as hybrid ZeRO-3 on a (2, 3) mesh of 6 devices with
  2 accumulation steps: at step 6 the params equal an uninterrupted 8-device DP run's (float
  reduction order apart), and so does summary.json's params_global_norm (a one-process hybrid
  run's was another's, test_params_digest_of_hybrid_zero3_in_one_process_is_the_params)."""
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  for flags, devices in [((*_RING, "--config.steps=6", f"--workdir={straight}"), 8),
                         ((*_RING, "--config.steps=3", f"--workdir={resumed}"), 8),
                         ((*_RING, "--config.steps=6", f"--workdir={resumed}",
                           "--config.strategy=zero3", "--config.mesh_shape=2,3",
                           "--config.mesh_axes=node,local", "--config.replica_axis=node",
                           "--config.grad_accum_steps=2"), 6)]:
    out = jobs.train_forked(*flags, devices=devices)
    assert out.returncode == 0, out.stderr[-3000:]
  assert ("Resuming from step 3 of 6 in " in out.stderr and "strategy ZeRO-3 (hybrid) on 6 "
          "devices in 1 process, resharded from 8 devices / strategy DP(ring)" in out.stderr)
  assert "config changed" not in out.stderr  # nothing that changes what is trained
  want, got = _saved_params(straight, 6), _saved_params(resumed, 6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), want, got)
  assert jobs.summary(resumed)["params_global_norm"] == pytest.approx(
      jobs.summary(straight)["params_global_norm"], rel=1e-6)


@pytest.mark.slow  # ~30 s: three launches of 2 processes
def test_files_resumed_from_2_processes_on_1_and_back_end_bit_identical(tmp_path):
  """Uneven shards (empty ones too) under shard_by=record, algorithm=ring: 2 gloo
  processes x 4 devices for 4 steps, 1 process x 8 to step 8, 2 x 4 to step 12: the same
  params_sha256 as 12 steps on 1 x 8."""
  pattern = _parquet(tmp_path / "data", [1, 300, 0, 7, 0, 60, 2, 130])
  common = ["--config=configs/minimal.py", *_MODEL, "--config.global_batch_size=32",
            "--config.algorithm=ring", "--config.checkpoint_every=4",
            f"--config.data.train={pattern}"]
  env = {"PYTHONPATH": os.pathsep.join([jobs.REPO, os.path.dirname(__file__)])}
  straight = tmp_path / "straight"
  assert jobs.train(*common, "--config.steps=12", f"--workdir={straight}").returncode == 0
  workdir = tmp_path / "resumed"
  for steps, processes in [(4, 2), (8, 1), (12, 2)]:
    flags = [*common, f"--config.steps={steps}", f"--workdir={workdir}"]
    out = (jobs.launch(*jobs.train_cmd(*flags), processes=2, devices=4) if processes == 2
           else jobs.train(*flags, **env))
    assert out.returncode == 0, out.stderr[-3000:]
  assert jobs.summary(workdir)["params_sha256"] == jobs.summary(straight)["params_sha256"]


def test_a_mesh_shape_that_no_longer_fits_names_the_config_field(tmp_path):
  """Resumed on 4 devices with a config whose mesh_shape is 2,4 (configs/hybrid_2x4.py): the
  line named `mesh_shape`, not the field to change, `config.mesh_shape`."""
  line = jobs.one_line(jobs.train_forked("--config=configs/hybrid_2x4.py:smoke",
                                         f"--workdir={tmp_path}", devices=4))
  assert line.startswith("train: error: `config.mesh_shape` (2, 4) has 8 devices but 4 are "
                         "available; choose a shape whose product is 4"), line
