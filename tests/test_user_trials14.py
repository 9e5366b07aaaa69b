"""Cases a user brought that no other test had tried (engineer trial14): their own
model (a CNN on (N, 28, 28, 1) images, a text classifier with token ids and a padding
mask) and data as they have it (an .npz with extra arrays). Each test of a fix fails
without it."""

import sys

import jobs
import numpy as np
import pyarrow.parquet as pq


def _make_shards(*args):
  return jobs.forked([sys.executable, "-m", "experiments.make_shards", "--num_shards=1",
                      *map(str, args)], devices=1)


def test_make_shards_leaves_an_npz_s_scalars_text_and_object_arrays_out_and_names_them(
    tmp_path):
  """An .npz as users save one: images and labels plus `num_classes=10` (a 0-d array),
  `names` (text) and `info` (an object array). It was numpy's 'zero-dimensional arrays
  cannot be concatenated' / 'Object arrays cannot be loaded when allow_pickle=False'
  (naming no array), and a text array was written as a string column, unlike CSV's."""
  n = 12
  r = np.random.default_rng(0)
  image = r.normal(size=(n, 28, 28, 1)).astype(np.float32)
  np.savez(tmp_path / "img.npz", image=image, label=r.integers(0, 10, n), num_classes=10,
           names=np.array([f"img{i}" for i in range(n)]),
           info=np.array([{"a": i} for i in range(n)], dtype=object))
  out = _make_shards(f"--input={tmp_path / 'img.npz'}", f"--out={tmp_path / 'o'}")
  assert out.returncode == 0, out.stderr[-2000:]
  assert ("not written: column 'num_classes' (a scalar (10), not one value per row); "
          "column 'names' (<U5, not numbers); column 'info' (an object array, not numbers; "
          "pickled objects are not loaded)") in out.stdout
  table = pq.read_table(tmp_path / "o" / "train-00000-of-00001.parquet")
  assert table.column_names == ["image", "label"]
  np.testing.assert_array_equal(
      np.asarray(table.column("image").combine_chunks().flatten()).reshape(image.shape), image)


def test_make_shards_names_the_npz_array_of_another_length_and_the_columns_to_write(
    tmp_path):
  """`class_weights` (10 rows) next to 12 images: 'every column must have the same number
  of rows, got {...}' gave no fix; it names the array and the --columns that leave it out."""
  n = 12
  np.savez(tmp_path / "img.npz", image=np.zeros((n, 28, 28, 1), np.float32),
           label=np.zeros(n, np.int64), class_weights=np.ones(10))
  line = jobs.one_line(_make_shards(f"--input={tmp_path / 'img.npz'}",
                                    f"--out={tmp_path / 'o'}"), prefix="make_shards: error:")
  assert line == ("make_shards: error: `--input`: img.npz: array 'class_weights' has 10 rows, "
                  "but 'image' has 12; every column needs one row per example: leave it out, "
                  "--columns=image,label.")
  assert not (tmp_path / "o").exists()


def test_a_typo_d_model_override_names_config_model_overrides_and_the_closest_key():
  """`--config.model_overrides='{"widht": 64}'` said "`config.model`='mlp': Unknown
  override(s) ['widht'] ...": the field to fix is model_overrides, and 'width' is close."""
  import pytest

  from jaxcoll.run import config as run_config
  from jaxcoll.run import inputs

  c = run_config.RunConfig(model="mlp", model_overrides={"widhts": (8,)})
  with pytest.raises(run_config.ConfigError) as e:
    inputs.make_workload(c)
  assert str(e.value).startswith("`config.model_overrides`={'widhts': (8,)}: Unknown "
                                 "override(s) ['widhts'] for workload 'mlp' (did you mean "
                                 "'widths'?); valid: (")
  with pytest.raises(run_config.ConfigError, match=r"^`config.model`='mlpp': "):
    inputs.make_workload(run_config.RunConfig(model="mlpp"))


def test_make_shards_of_a_file_of_fewer_rows_than_the_default_shard_count_writes_it(tmp_path):
  """A 3-row eval file and no --num_shards: 'make_shards: error: `num_shards` must be in
  1..3 (the number of rows), got 4', a flag the user never passed. The default (4) is
  capped at the rows; a --num_shards given is checked and named as the flag."""
  (tmp_path / "tiny.jsonl").write_text(
      "".join(f'{{"x": [{i}, 1.5], "label": {i % 2}}}\n' for i in range(3)))
  out = jobs.forked([sys.executable, "-m", "experiments.make_shards", "--split=eval",
                     f"--input={tmp_path / 'tiny.jsonl'}", f"--out={tmp_path / 'o'}"],
                    devices=1)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "wrote 3 rows, columns {'x': [2], 'label': []}, in 3 parquet shards:" in out.stdout
  assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [
      f"eval-0000{i}-of-00003.parquet" for i in range(3)]
  line = jobs.one_line(_make_shards(f"--input={tmp_path / 'tiny.jsonl'}", "--num_shards=5",
                                    f"--out={tmp_path / 'p'}"), prefix="make_shards: error:")
  # _make_shards passes --num_shards=1 first; the later flag wins, as absl reads them
  assert line == ("make_shards: error: `--num_shards`=5: must be in 1..3 (the number of "
                  "rows), e.g. --num_shards=3.")


def test_make_shards_of_an_npz_with_no_array_of_numbers_says_so(tmp_path):
  """Only text and a scalar: it was 'every column must have the same number of rows,
  got {}'."""
  np.savez(tmp_path / "s.npz", names=np.array(["a", "b"]), n=3)
  line = jobs.one_line(_make_shards(f"--input={tmp_path / 's.npz'}", f"--out={tmp_path / 'o'}"),
                       prefix="make_shards: error:")
  assert line == (f"make_shards: error: `--input`='{tmp_path / 's.npz'}': no column of numbers "
                  "to write (names: <U1, not numbers; n: a scalar (3), not one value per "
                  "row); give arrays of numbers, one row per example.")


def test_write_shards_refuses_a_scalar_column_in_one_line(tmp_path):
  """`write_shards({"x": x, "num_classes": 10}, d)` was `TypeError: len() of unsized
  object`."""
  import pytest

  from jaxcoll.data import sources as data_sources

  with pytest.raises(ValueError, match=r"^`columns`\['n'\] is a scalar \(3\), not one value "
                                       r"per row; "):
    data_sources.write_shards({"x": np.zeros((4, 2)), "n": 3}, str(tmp_path / "o"))
  with pytest.raises(ValueError, match=r"^`columns` is empty"):
    data_sources.write_shards({}, str(tmp_path / "o"))
  assert not (tmp_path / "o").exists()


def test_a_model_override_given_as_text_where_the_default_is_a_number_is_one_line():
  """`--config.model_overrides='{"ch": "8"}'` (a quoted number) reached the user's flax
  module: a traceback, `TypeError: Shapes must be 1D sequences of concrete values of
  integer type, got (3, 3, 1, '8')`; `{"widths": "32"}` for the mlp said "`widths` must be
  a positive integer, got '3'" (a character of the text)."""
  import pytest

  from jaxcoll.run import config as run_config
  from jaxcoll.run import inputs

  with pytest.raises(run_config.ConfigError) as e:
    inputs.make_workload(run_config.RunConfig(model="mlp", model_overrides={"widths": "32"}))
  assert str(e.value) == (
      "`config.model_overrides`={'widths': '32'}: override 'widths'='32' is text, but the "
      "default of 'mlp' for it is (64, 64): pass a list, unquoted, as in "
      '{"widths": [64, 64]}.')
  with pytest.raises(run_config.ConfigError, match=r"'input_dim'='8' is text, .* is 32: "
                                                   r"pass a number, unquoted"):
    inputs.make_workload(run_config.RunConfig(model="mlp", model_overrides={"input_dim": "8"}))
  assert inputs.make_workload(run_config.RunConfig(
      model="mlp", model_overrides={"widths": [8], "input_dim": 4})).name


def test_a_relative_glob_that_matches_nothing_names_the_directory_it_was_looked_for_in(
    tmp_path, monkeypatch):
  """A run trained with `--config.data.eval='pq_shards/train-*.parquet'` in /tmp/mine,
  evaluated (`experiments.eval`, the saved config) or resumed from another directory:
  "matches no file" did not say the path is relative to where the command runs."""
  import pytest

  from jaxcoll.data import sources as data_sources

  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError) as e:
    data_sources.expand("pq_shards/train-*.parquet", "data.eval")
  assert str(e.value).startswith(
      "`data.eval`='pq_shards/train-*.parquet' matches no file (a relative path: looked for "
      f"in the current directory, {tmp_path}); give a glob of Parquet")
  with pytest.raises(ValueError) as e:
    data_sources.expand(str(tmp_path / "x-*.parquet"), "data.eval")
  assert "(a relative path" not in str(e.value)


def test_an_unknown_config_field_at_the_command_line_names_the_one_meant(tmp_path):
  """`--config.batch_size=32`, `--config.warmup=5`, `--config.data.eval_every=2`,
  `--config.lr=1e-3` listed the valid fields without saying which was meant (README:
  'did you mean ...?'); `--config.devices=4` did not say the device count is the job's."""
  expected = {
      "--config.batch_size=32": "did you mean 'global_batch_size'? valid fields of the config:",
      "--config.warmup=5": "did you mean 'warmup_steps'? valid fields of the config:",
      "--config.data.eval_every=2": "did you mean 'eval_every'? valid fields of data:",
      "--config.lr=1e-3": "did you mean 'learning_rate'? valid fields of the config:",
      "--config.devices=4": "the device count is the job's, not a config field (on CPU: "
                            "JAXCOLL_CPU_DEVICES=N in the environment;",
  }
  for flag, words in expected.items():
    line = jobs.one_line(jobs.forked([sys.executable, "-m", "experiments.train",
                                      "--config=configs/minimal.py:smoke", flag,
                                      f"--workdir={tmp_path / 'w'}"]), prefix="train: error:")
    name = flag[len("--config."):].split("=")[0]
    assert line.startswith(f"train: error: unknown config field {name!r} (from "
                           f"--config.{name}); {words}"), line
  assert not (tmp_path / "w").exists()


def test_a_config_file_s_model_overrides_for_another_model_are_named_with_the_way_out():
  """`--config=configs/minimal.py --config.model=my_model:make` without
  `--config.model_overrides='{}'`: "Unknown override(s) ['widths'] for workload
  'my_model:make'", an override the user never gave (minimal.py's, for its mlp)."""
  import pytest

  from configs import minimal
  from jaxcoll.run import config as run_config
  from jaxcoll.run import inputs

  c = minimal.get_config()
  c.model = "resnet"  # takes width, not widths
  with pytest.raises(run_config.ConfigError) as e:
    inputs.make_workload(c)
  assert str(e.value).startswith("`config.model_overrides`={'widths': (32,)}: Unknown "
                                 "override(s) ['widths'] for workload 'resnet' (did you mean "
                                 "'width'?)")
  assert str(e.value).endswith(
      " The config file's model_overrides count too (a config made for another model passes "
      "its own): give them all, e.g. --config.model_overrides='{}' to clear them.")


def test_eval_examples_with_eval_files_says_it_has_no_effect(tmp_path, caplog):
  """`experiments.eval --config.data.eval_examples=10` on a run with `data.eval` files
  evaluated all 500 records without a word: eval_examples counts the synthetic set only."""
  import jax

  from jaxcoll import devices
  from jaxcoll.data import sources as data_sources
  from jaxcoll.run import config as run_config
  from jaxcoll.run import inputs

  x = np.random.default_rng(0).normal(size=(40, 32)).astype(np.float32)
  data_sources.write_shards({"inputs": x, "labels": (x[:, 0] > 0).astype(np.int64)},
                            str(tmp_path / "ev"), prefix="eval")
  mesh = devices.flat_mesh(len(jax.devices()))

  def evaluator(**data):
    c = run_config.RunConfig(model_overrides={"widths": (8,)}, eval_every=1,
                             global_batch_size=len(jax.devices()),
                             data=run_config.DataConfig(eval=str(tmp_path / "ev"), **data))
    caplog.clear()
    return inputs.make_evaluator(c, inputs.make_workload(c), mesh, "data")

  assert evaluator(eval_examples=10) is not None
  assert ("`config.data.eval_examples`=10 counts the synthetic eval set only: with "
          "`config.data.eval` every record of its files is evaluated (40)") in caplog.text
  evaluator()
  assert "eval_examples" not in caplog.text


def test_eval_only_with_eval_files_does_not_warn_about_the_saved_runs_eval_examples(
    tmp_path, caplog):
  """A run that evaluated 37 synthetic examples, evaluated again on files: the saved
  eval_examples is not this command's, so no warning; given on the command line, it is."""
  import jax

  from jaxcoll.data import sources as data_sources
  from jaxcoll.run import config as run_config
  from jaxcoll.run import eval_only, loop

  n = len(jax.devices())
  c = run_config.RunConfig(model_overrides={"widths": (8,), "input_dim": 4}, steps=2,
                           global_batch_size=n, checkpoint_every=2, eval_every=2, log_every=2,
                           tensorboard=False, data=run_config.DataConfig(eval_examples=37))
  loop.train_and_evaluate(c, str(tmp_path / "w"))
  x = np.random.default_rng(0).normal(size=(12, 4)).astype(np.float32)
  data_sources.write_shards({"inputs": x, "labels": np.zeros(12, np.int64)},
                            str(tmp_path / "ev"), prefix="eval")
  caplog.clear()
  row = eval_only.evaluate_checkpoint(str(tmp_path / "w"),
                                      overrides={"data.eval": str(tmp_path / "ev")})
  assert row["eval_examples"] == 12 and "eval_examples" not in caplog.text
  eval_only.evaluate_checkpoint(str(tmp_path / "w"), overrides={
      "data.eval": str(tmp_path / "ev"), "data.eval_examples": 10})
  assert "`config.data.eval_examples`=10 counts the synthetic eval set only" in caplog.text


def test_a_model_module_that_does_not_import_is_named_once():
  """"`config.model`='my_cnn:make': 'my_cnn:make': module 'my_cnn' does not import": the
  value twice."""
  import pytest

  from jaxcoll.run import config as run_config
  from jaxcoll.run import inputs

  with pytest.raises(run_config.ConfigError) as e:
    inputs.make_workload(run_config.RunConfig(model="no_such_module_14:make"))
  assert str(e.value).startswith("`config.model`='no_such_module_14:make': module "
                                 "'no_such_module_14' does not import (ModuleNotFoundError")
