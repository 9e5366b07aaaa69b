"""Cases a user brought that no other test had tried (engineer trial25): their own
models (a classifier reporting per-class accuracy, ...) through the trainers and the
runner. Each test of a fix fails without it."""

import sys
import textwrap

import numpy as np
import pytest

_PER_CLASS_MODEL = textwrap.dedent('''
    import flax.linen as nn, jax.numpy as jnp, numpy as np, optax, jaxcoll

    class Net(nn.Module):
      @nn.compact
      def __call__(self, x):
        return nn.Dense(3)(x)

    def loss(logits, batch):
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
      pred = logits.argmax(-1)
      return ce, {"accuracy": jnp.mean(pred == batch["label"]),
                  "per_class": jnp.stack([jnp.mean(pred == c) for c in range(3)])}

    def make():
      return jaxcoll.models.from_flax(Net(), loss, inputs=("features",),
                                      sample_batch={"features": np.zeros((1, 4), np.float32)},
                                      label_classes={"label": 3})
''')


def test_a_metric_that_is_not_a_scalar_is_named_not_dropped_silently(tmp_path, monkeypatch,
                                                                      caplog):
  """A per-class accuracy vector in the loss's aux (as torchmetrics' `average=None`
  gives one) was left out of every eval row, metrics.jsonl and summary.json, without a
  word: only the scalars were reported. It is named in one warning line at the start."""
  import jax

  from jaxcoll import devices
  from jaxcoll.data import sources as data_sources
  from jaxcoll.run import config as run_config
  from jaxcoll.run import inputs

  (tmp_path / "per_class_model.py").write_text(_PER_CLASS_MODEL)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.delitem(sys.modules, "per_class_model", raising=False)
  x = np.random.default_rng(0).normal(size=(24, 4)).astype(np.float32)
  data_sources.write_shards({"features": x, "label": np.digitize(x[:, 0], [-0.5, 0.5])},
                            str(tmp_path / "ev"), prefix="eval")
  n = len(jax.devices())
  c = run_config.RunConfig(model="per_class_model:make", eval_every=1, global_batch_size=n,
                           data=run_config.DataConfig(eval=str(tmp_path / "ev")))
  workload = inputs.make_workload(c)
  caplog.clear()
  evaluator = inputs.make_evaluator(c, workload, devices.flat_mesh(n), "data")
  assert ("model 'per_class_model:make' reports metric(s) the evaluation leaves out: "
          "'per_class' (shape (3,) per example); an eval metric is a scalar per batch (a "
          "mean) or a (sum, count) pair of scalars") in caplog.text
  assert evaluator.left_out_metrics() == {"per_class": "shape (3,)"}
  row = evaluator.run(workload.init_params(0))
  assert sorted(row) == ["eval_accuracy", "eval_examples", "eval_loss"]
  assert evaluator.metric_names() == ("eval_accuracy", "eval_loss")
  # A model whose metrics are all scalars (the built-in MLP) gets no such line.
  caplog.clear()
  mlp = run_config.RunConfig(model_overrides={"widths": (8,)}, eval_every=1,
                             global_batch_size=n)
  inputs.make_evaluator(mlp, inputs.make_workload(mlp), devices.flat_mesh(n), "data")
  assert "leaves out" not in caplog.text


def test_a_config_file_may_set_data_train_to_a_list_of_globs(tmp_path):
  """README: several globs are a list, "in a config file a list or tuple of strings". A
  config built as the shipped ones are, from `configs.base.base_config()`, refused
  `c.data.train = [...]`: ml_collections' TypeError ("... is of original type <class
  'list'> and cannot be casted to type <class 'str'>"), `cannot load --config`, exit 2."""
  import jobs

  from configs import base
  from jaxcoll.data import sources as data_sources
  from jaxcoll.run import config as run_config

  c = base.base_config()
  c.data.train = ["/data/a/*.parquet", "/data/b/*.parquet"]
  c.data.eval = ("/data/eval-*.parquet",)
  parsed = run_config.parse(c)
  assert parsed.data.train == ("/data/a/*.parquet", "/data/b/*.parquet")
  assert parsed.data.eval == ("/data/eval-*.parquet",)
  c.data.num_threads = "2"  # every other field's type is still checked, in one line
  with pytest.raises(run_config.ConfigError, match="`config.data.num_threads`='2': must be an "
                                                   "integer, not str"):
    run_config.parse(c)

  # The same through the command line, training on the files of both globs.
  rng = np.random.default_rng(0)
  for part in ("a", "b"):
    x = rng.normal(size=(32, 32)).astype(np.float32)
    data_sources.write_shards({"inputs": x, "labels": (x[:, 0] > 0).astype(np.int64)},
                              str(tmp_path / part), prefix="train")
  (tmp_path / "mine.py").write_text(textwrap.dedent(f'''
      from configs import base

      def get_config():
        c = base.base_config()
        c.model_overrides.widths = (8,)
        c.data.train = ["{tmp_path}/a/*.parquet", "{tmp_path}/b/*.parquet"]
        c.steps, c.global_batch_size, c.checkpoint_every = 2, 16, 0
        return c
  '''))
  out = jobs.train_forked(f"--config={tmp_path / 'mine.py'}", f"--workdir={tmp_path / 'w'}")
  assert out.returncode == 0, out.stderr[-2000:]
  assert "64 records in 2 file(s)" in out.stdout
  assert jobs.summary(tmp_path / "w")["steps"] == 2


_BF16_MODEL = textwrap.dedent('''
    import flax.linen as nn, jax.numpy as jnp, numpy as np, optax, jaxcoll

    class Net(nn.Module):  # mixed precision as MaxText's weight_dtype gives it
      @nn.compact
      def __call__(self, x):
        h = nn.Dense(16, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)(x)
        h = nn.LayerNorm(param_dtype=jnp.float32)(h)
        return nn.Dense(2, param_dtype=jnp.bfloat16)(nn.relu(h)).astype(jnp.float32)

    def loss(logits, batch):
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    def make():
      return jaxcoll.models.from_flax(Net(), loss, inputs=("features",),
                                      sample_batch={"features": np.zeros((1, 8), np.float32)},
                                      label_classes={"label": 2})
''')


def test_a_model_with_bfloat16_weights_trains_through_the_runner(tmp_path, monkeypatch):
  """`nn.Dense(param_dtype=jnp.bfloat16)` in the user's model: the runner refused it before
  training, "its variable ['params']['Dense_0']['bias'] is bfloat16, but every variable
  ... must be floating point" (numpy's issubdtype does not count ml_dtypes' bfloat16 as
  floating; the Trainer itself trains such params)."""
  import jax

  from jaxcoll.data import sources as data_sources
  from jaxcoll.run import config as run_config
  from jaxcoll.run import inputs, loop

  (tmp_path / "bf16_model.py").write_text(_BF16_MODEL)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.delitem(sys.modules, "bf16_model", raising=False)
  x = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
  data_sources.write_shards({"features": x, "label": (x[:, 0] > 0).astype(np.int32)},
                            str(tmp_path / "d"), prefix="train")
  n = len(jax.devices())
  c = run_config.RunConfig(model="bf16_model:make", steps=2, global_batch_size=2 * n,
                           checkpoint_every=0, log_every=1, eval_every=2, tensorboard=False,
                           strategy="zero3",
                           data=run_config.DataConfig(train=str(tmp_path / "d"),
                                                      eval=str(tmp_path / "d")))
  dtypes = {jax.tree_util.keystr(p): str(s.dtype) for p, s in
            jax.tree_util.tree_flatten_with_path(inputs.make_workload(c).param_shapes)[0]}
  assert dtypes["['params']['Dense_0']['kernel']"] == "bfloat16"
  assert dtypes["['params']['LayerNorm_0']['scale']"] == "float32"
  summary = loop.train_and_evaluate(c, str(tmp_path / "w"))
  assert summary["steps"] == 2 and np.isfinite(summary["final_loss"])
  assert summary["eval_examples"] == 64 and np.isfinite(summary["eval_loss"])


_WIDTH_MODEL = textwrap.dedent('''
    import flax.linen as nn, numpy as np, optax, jaxcoll

    class Net(nn.Module):
      width: int = 32
      @nn.compact
      def __call__(self, x):
        return nn.Dense(2)(nn.relu(nn.Dense(self.width)(x)))

    def loss(logits, batch):
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    def make(width=32):
      return jaxcoll.models.from_flax(Net(width), loss, inputs=("inputs",),
                                      sample_batch={"inputs": np.zeros((1, 32), np.float32)},
                                      label_classes={"labels": 2})
''')


def test_a_keyword_of_my_own_model_as_a_dotted_override_says_to_give_the_whole_mapping(
    tmp_path):
  """`--config.model=my_mlp:make --config.model_overrides.width=64` (configs/minimal.py's
  overrides have only the MLP's `widths`): the line said "did you mean
  'model_overrides.widths'?", another model's argument, which then failed in `make`. It
  now also gives the form that passes `width`, and that command, pasted, trains."""
  import os
  import shlex

  import jobs

  from jaxcoll.data import sources as data_sources

  (tmp_path / "width_model.py").write_text(_WIDTH_MODEL)
  x = np.random.default_rng(0).normal(size=(64, 32)).astype(np.float32)
  data_sources.write_shards({"inputs": x, "labels": (x[:, 0] > 0).astype(np.int64)},
                            str(tmp_path / "d"), prefix="train")
  flags = ["--config=configs/minimal.py", "--config.model=width_model:make",
           f"--config.data.train={tmp_path / 'd'}", "--config.steps=2",
           "--config.global_batch_size=16", f"--workdir={tmp_path / 'w'}"]
  line = jobs.one_line(jobs.train_forked(*flags, "--config.model_overrides.width=64"),
                       prefix="train: error: ")
  assert line.endswith(
      "To pass a keyword argument the config's model_overrides do not have to the model "
      "function, give them all as one mapping, which replaces the config's own "
      "({'widths': (32,)}): --config.model_overrides='{\"width\": 64}'.")
  assert not (tmp_path / "w").exists()
  fix = shlex.split(line[line.rindex("--config.model_overrides="):].rstrip("."))
  path = os.pathsep.join([jobs.REPO, str(tmp_path)])
  out = jobs.train(*flags, *fix, PYTHONPATH=path)
  assert out.returncode == 0, out.stderr[-2000:]
  assert jobs.summary(tmp_path / "w")["config"]["model_overrides"] == {"width": 64}


def test_a_model_named_by_its_file_or_with_a_dot_says_the_module_colon_function_form(
    tmp_path):
  """Ways users name their model function: by its file (`--config.model=/src/my_mlp.py:make`,
  as for `torchrun /src/train.py`) said "module '/src/my_mlp.py' does not import
  (ModuleNotFoundError ...); put it on PYTHONPATH"; with a dot (`my_mlp.make`, Python's own
  spelling) it said only "valid models: mlp, resnet, transformer, recommender". Each line
  now gives the name that works, and the first one, pasted, trains."""
  import os

  import jobs

  from jaxcoll.data import sources as data_sources
  from jaxcoll.run import config as run_config

  with pytest.raises(run_config.ConfigError, match=r"^`config.model`='my_mlp.make': valid "
                     r"models: mlp, resnet, transformer, recommender or your own model's "
                     r"'module:function' path \(did you mean 'my_mlp:make'\?\)\.$"):
    run_config.RunConfig(model="my_mlp.make")
  with pytest.raises(run_config.ConfigError, match=r"\(did you mean 'mlp'\?\)"):
    run_config.RunConfig(model="mpl")

  (tmp_path / "src").mkdir()
  (tmp_path / "src" / "width_model.py").write_text(_WIDTH_MODEL)
  x = np.random.default_rng(0).normal(size=(32, 32)).astype(np.float32)
  data_sources.write_shards({"inputs": x, "labels": (x[:, 0] > 0).astype(np.int64)},
                            str(tmp_path / "d"), prefix="train")
  flags = ["--config=configs/minimal.py", "--config.model_overrides={}",
           f"--config.data.train={tmp_path / 'd'}", "--config.steps=2",
           "--config.global_batch_size=16", f"--workdir={tmp_path / 'w'}"]
  line = jobs.one_line(jobs.train_forked(
      *flags, f"--config.model={tmp_path / 'src' / 'width_model.py'}:make"), prefix="train: ")
  src = tmp_path / "src"
  assert line.endswith(f"is a file path; a model is named by its module: put {src} on "
                       f"PYTHONPATH and name 'width_model:make' (e.g. PYTHONPATH={src} python "
                       "-m experiments.train ... --config.model=width_model:make)."), line
  assert not (tmp_path / "w").exists()
  out = jobs.train(*flags, "--config.model=width_model:make",
                   PYTHONPATH=os.pathsep.join([jobs.REPO, str(src)]))
  assert out.returncode == 0, out.stderr[-2000:]
  assert jobs.summary(tmp_path / "w")["steps"] == 2


def test_a_batch_with_text_ids_or_python_lists_is_one_line_naming_the_leaf():
  """Batches as a user's loader gives them: the example ids beside the features (a numpy
  array of str, as pandas / Hugging Face datasets keep them) was JAX's `TypeError: Dtype
  <U3 is not a valid JAX array type`, naming no leaf; a feature left as a Python list
  (`x.tolist()`) was a line listing the shape of each of its 12 x 7 numbers."""
  import jax
  import jax.numpy as jnp
  import optax

  import jaxcoll

  def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

  rng = np.random.default_rng(0)
  x = rng.normal(size=(12, 7)).astype(np.float32)
  y = rng.normal(size=(12, 3)).astype(np.float32)
  n = 6 if len(jax.devices()) >= 6 else 1
  for strategy in (jaxcoll.DataParallel(), jaxcoll.ZeRO(stage=3)):
    trainer = jaxcoll.Trainer(loss_fn, optax.adam(1e-2), jaxcoll.devices.flat_mesh(n), strategy)
    state = trainer.init({"w": np.zeros((7, 3), np.float32)})
    ids = np.array([f"row{i}" for i in range(12)])
    for step in (trainer.step, trainer.eval):
      with pytest.raises(ValueError, match=r"^`batch` leaf \['sample_id'\] holds <U5 values "
                         r"\(text or objects\), which JAX cannot hold: a batch holds numbers "
                         r"only. Drop it before the step \(e.g. `\{k: v for k, v in "
                         r"batch.items\(\) if k != 'sample_id'\}`\), or encode it as integers"):
        step(state, {"x": x, "y": y, "sample_id": ids})
    with pytest.raises(ValueError) as e:
      trainer.step(state, {"x": x.tolist(), "y": y})
    assert str(e.value) == (
        "Every `batch` leaf must have the same leading (batch) dimension; got ['x'][0][0]: (), "
        "['x'][0][1]: (), ['x'][0][2]: (), ['x'][0][3]: (), ... (85 leaves); ['x'] is a list "
        "(a pytree of one leaf per item to JAX): pass numpy arrays, np.asarray(...).")
    # The state was left as it was: the same batch without its ids trains.
    state, metrics = trainer.step(state, {"x": x, "y": y})
    assert np.isclose(float(metrics["loss"]), float(np.mean(y ** 2)), rtol=1e-5)


def test_eval_only_of_a_hybrid_run_on_fewer_devices_fits_the_mesh_and_says_so(tmp_path):
  """`python -m experiments.eval` "restores onto this job's devices ... (another device
  count)": a hybrid ZeRO-3 run (`mesh_shape=2,4`, `replica_axis=node`) evaluated on 6
  devices was refused, "`config.mesh_shape` (2, 4) has 8 devices but 6 are available",
  and `--config.mesh_shape=` alone then failed on the replica axis. The saved mesh is now
  fitted: its last axis refilled (2,3), or one flat axis where that cannot be (3 devices),
  in one line; the figures are the 8-device run's (up to float order)."""
  import json

  import jax
  import jobs

  from jaxcoll.run import config as run_config
  from jaxcoll.run import eval_only, loop

  if len(jax.devices()) != 8:
    pytest.skip("needs the 8 emulated devices of the test session")
  c = run_config.RunConfig(model_overrides={"widths": (8,), "input_dim": 4}, steps=2,
                           global_batch_size=24, checkpoint_every=2, eval_every=2, log_every=2,
                           tensorboard=False, strategy="zero3", mesh_shape="2,4",
                           replica_axis="node", algorithm="hierarchical",
                           data=run_config.DataConfig(eval_examples=48))
  loop.train_and_evaluate(c, str(tmp_path / "w"))
  trained = eval_only.evaluate_checkpoint(str(tmp_path / "w"))["eval_loss"]

  fit = eval_only._fit_saved_mesh  # noqa: SLF001
  saved = run_config.parse(c)
  assert fit(saved, {}, 8) is saved
  assert (fit(saved, {}, 6).mesh_shape, fit(saved, {}, 6).replica_axis) == ("2,3", "node")
  flat = fit(saved, {}, 3)
  assert (flat.mesh_shape, flat.replica_axis, flat.algorithm) == ("", "", "auto")
  assert fit(saved, {"mesh_shape": "1,3"}, 3) is saved  # the user's own: as given

  for devices, line in ((6, "evaluating on 2,3"), (3, "evaluating on one axis of 3")):
    out = jobs.forked([sys.executable, "-m", "experiments.eval", f"--workdir={tmp_path / 'w'}",
                       f"--out_dir={tmp_path / str(devices)}"], devices=devices)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (f"mesh: the run's mesh_shape=2,4 does not fit this job's {devices} devices; "
            f"{line} (--config.mesh_shape sets it)") in out.stderr
    row = json.loads((tmp_path / str(devices) / "evals.jsonl").read_text())
    assert row["num_devices"] == devices and row["step"] == 2
    assert np.isclose(row["eval_loss"], trained, rtol=1e-5)


def test_a_saved_mesh_shape_that_no_longer_fits_gives_one_that_does(tmp_path):
  """A hybrid 2,4 run resumed on 6 devices: "choose a shape whose product is 6", without
  one; the line now gives the one that keeps the other axes (2,3), which, pasted, resumes."""
  import jobs

  first = jobs.train("--config=configs/hybrid_2x4.py:smoke", f"--workdir={tmp_path}")
  assert first.returncode == 0, first.stderr[-2000:]
  flags = ["--config=configs/hybrid_2x4.py:smoke", "--config.steps=8",
           "--config.global_batch_size=24", f"--workdir={tmp_path}"]
  line = jobs.one_line(jobs.train_forked(*flags, devices=6), prefix="train: error: ")
  assert line.startswith("train: error: `config.mesh_shape` (2, 4) has 8 devices but 6 are "
                         "available; choose a shape whose product is 6 (e.g. 2,3); "), line
  out = jobs.train(*flags, "--config.mesh_shape=2,3", devices=6)
  assert out.returncode == 0, out.stderr[-2000:]
  assert jobs.summary(tmp_path)["steps"] == 8


def test_from_nnx_trains_lora_params_as_params_like_nnx_and_one_device():
  """`nnx.LoRALinear` keeps its adapters in `nnx.LoRAParam`, a subclass of `nnx.Param`:
  `from_nnx` listed them as a state collection 'lo_r_a_param' (empty: nnx's `nnx.Param`
  filter had taken them into `params`), so `state_collections` named model state the
  model does not have. They are params, trained as nnx's own optimizer trains them."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  import jaxcoll

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.LoRALinear(4, 8, lora_rank=2, rngs=rngs)
      self.l2 = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
      return self.l2(jax.nn.relu(self.l1(x)))[:, 0]

  def loss(y, b):
    return jnp.mean((y - b["y"]) ** 2)

  rng = np.random.default_rng(0)
  batches = [{"inputs": rng.normal(size=(24, 4)).astype(np.float32),
              "y": rng.normal(size=(24,)).astype(np.float32)} for _ in range(3)]
  model = Net(nnx.Rngs(0))  # nnx's own training, on one device
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  for b in batches:
    opt.update(model, nnx.grad(lambda m, b=b: loss(m(b["inputs"]), b))(model))

  w = jaxcoll.models.from_nnx(Net(nnx.Rngs(0)), loss)
  assert w.state_collections == ()
  params = w.init_params(0)
  assert sorted(params) == ["params"]
  assert set(params["params"]["l1"]["lora"]) == {"lora_a", "lora_b"}
  n = 6 if len(jax.devices()) >= 6 else 1
  trainer = jaxcoll.Trainer(w.loss_fn, optax.adam(1e-2), jaxcoll.devices.flat_mesh(n),
                            jaxcoll.ZeRO(stage=3), has_aux=True, merge_aux=w.merge_aux)
  state = trainer.init(params)
  for b in batches:
    state, _ = trainer.step(state, b)
  trained = Net(nnx.Rngs(0))
  nnx.update(trained, *trainer.params(state).values())
  for got, want in ((trained.l1.lora.lora_b, model.l1.lora.lora_b),
                    (trained.l1.kernel, model.l1.kernel), (trained.l2.kernel, model.l2.kernel)):
    np.testing.assert_allclose(np.asarray(got[...]), np.asarray(want[...]), rtol=1e-4,
                               atol=1e-6)
  assert np.abs(np.asarray(trained.l1.lora.lora_b[...])).max() > 0  # the adapters moved


def test_a_config_file_that_sets_model_to_the_function_says_to_name_it(tmp_path):
  """`c.model = my_model.make` in a config file built from base_config() (the natural
  Python): "cannot load `--config`: TypeError: Could not override field 'model'
  (reference). <function make at 0x...> is of original type <class 'function'> and cannot
  be casted to type <class 'str'>", without the fix. The line now says it."""
  import jobs

  (tmp_path / "mine.py").write_text(textwrap.dedent('''
      from configs import base

      def make(**overrides):
        raise AssertionError("never called")

      def get_config():
        c = base.base_config()
        c.model = make
        return c
  '''))
  line = jobs.one_line(jobs.train_forked(f"--config={tmp_path / 'mine.py'}",
                                         f"--workdir={tmp_path / 'w'}"), prefix="train: error: ")
  assert line.startswith(f"train: error: cannot load `--config`: {tmp_path / 'mine.py'}'s "
                         "get_config() sets 'model' to <function make at "), line
  assert line.endswith("(a function), but the field takes a str (configs.base.base_config()'s "
                       "default); name your model function by its import path, a string: "
                       "c.model = 'my_model:make' (module:function)."), line
  assert not (tmp_path / "w").exists()


def test_a_workdir_given_with_a_tilde_is_under_the_home_directory(tmp_path):
  """`--workdir=~/runs/a`: the shell does not expand a `~` after `=`, and the run was
  written to a directory named `~` in the current one (the data globs already took `~` as
  the home directory). A later `rm -rf ~` to clean that up removes the home directory.
  `--config=~/mine.py` was "no such file, nor a shipped config"."""
  import jobs

  home, here = tmp_path / "home", tmp_path / "here"
  home.mkdir()
  here.mkdir()
  out = jobs.train("--config=minimal:smoke", "--workdir=~/runs/a", cwd=str(here),
                   HOME=str(home), PYTHONPATH=jobs.REPO)
  assert out.returncode == 0, out.stderr[-2000:]
  assert not (here / "~").exists()
  assert jobs.summary(home / "runs" / "a")["steps"] == 4
  out = jobs.run([sys.executable, "-m", "experiments.report", "--workdir=~/runs/a",
                  "--out_dir=~/report"], cwd=str(here), HOME=str(home), PYTHONPATH=jobs.REPO)
  assert out.returncode == 0, out.stderr[-2000:]
  assert (home / "report" / "report.txt").exists() and not (here / "~").exists()
  # --config=~/mine.py too: it was "no such file, nor a shipped config".
  (home / "mine.py").write_text("from configs import minimal\n\n"
                                "def get_config():\n  return minimal.get_config('smoke')\n")
  out = jobs.train("--config=~/mine.py", "--config.steps=6", "--workdir=~/runs/a",
                   cwd=str(here), HOME=str(home), PYTHONPATH=jobs.REPO)
  assert out.returncode == 0, out.stderr[-2000:]
  assert jobs.summary(home / "runs" / "a")["steps"] == 6


def test_from_flax_of_a_maxtext_style_enable_dropout_model_evaluates_without_dropout():
  """MaxText's models switch dropout with `enable_dropout`; from_flax knew only `train`,
  `training`, `is_training` and `deterministic`, so it evaluated such a model with its
  dropout on, and without a key that was "model 'Net' draws random numbers in training
  ... the trainer has no key: pass jaxcoll.Trainer(..., rng=SEED) (experiments.train
  does)": said of training, by the runner that passes one. `enable_dropout` (and
  `is_train`) now switch it; a keyword still unknown is named as evaluation's."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  import jaxcoll

  def make(flag):  # `def __call__(self, x, <flag>: bool = True)`, as users write it
    scope = {"nn": nn}
    exec(textwrap.dedent(f"""
        class Net(nn.Module):
          @nn.compact
          def __call__(self, x, {flag}: bool = True):
            h = nn.relu(nn.Dense(32)(x))
            return nn.Dense(2)(nn.Dropout(0.5, deterministic=not {flag})(h))
    """), scope)
    return scope["Net"]()

  def loss(logits, batch):
    return jnp.mean((logits[:, 0] - batch["y"]) ** 2)

  x = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
  batch = {"features": x, "y": x[:, 0]}
  for flag in ("enable_dropout", "is_train"):
    module = make(flag)
    w = jaxcoll.models.from_flax(module, loss, inputs=("features",),
                                 sample_batch={"features": x[:1]})
    params = w.init_params(0)
    evaluated = float(w.loss_fn(params, batch, None)[0])
    plain = float(loss(module.apply(params, x, **{flag: False}), batch))
    assert evaluated == plain
    trained = float(w.loss_fn(params, batch, jax.random.key(1))[0])
    assert trained != plain  # dropout in training

  w = jaxcoll.models.from_flax(make("use_dropout"), loss, inputs=("features",),
                               sample_batch={"features": x[:1]})
  with pytest.raises(ValueError, match=r"^model 'Net' draws random numbers in evaluation "
                     r"\(Dropout_0 needs PRNG for \"dropout\"\), where from_flax passes no key: "
                     r"its __call__ takes none of the keywords that switch it \(train, training, "
                     r"is_training, is_train, enable_dropout, deterministic\)"):
    w.loss_fn(w.init_params(0), batch, None)


def test_init_of_shapes_from_eval_shape_is_one_line_giving_init_from(tmp_path):
  """`trainer.init(jax.eval_shape(model.init, key, x))` (shapes, as for the memory
  planner): DP raised JAX's "TypeError: Argument ... of type <class
  'jax.ShapeDtypeStruct'> is not a valid JAX type", ZeRO-3 "float() argument must be a
  string or a real number, not 'ShapeDtypeStruct'". One line now, whose fixes work."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import optax

  import jaxcoll

  model = nn.Dense(3)
  x = np.ones((6, 4), np.float32)

  def loss_fn(params, batch):
    return jnp.mean((model.apply(params, batch["x"]) - batch["y"]) ** 2)

  batch = {"x": x, "y": np.ones((6, 3), np.float32)}
  shapes = jax.eval_shape(model.init, jax.random.key(0), x[:1])
  n = 6 if len(jax.devices()) >= 6 else 1
  for strategy in (jaxcoll.DataParallel(), jaxcoll.ZeRO(stage=3)):
    trainer = jaxcoll.Trainer(loss_fn, optax.adam(1e-2), jaxcoll.devices.flat_mesh(n), strategy)
    with pytest.raises(ValueError, match=r"^`params` leaf \['params'\]\['bias'\] is a "
                       r"jax.ShapeDtypeStruct \(a shape without values, as jax.eval_shape "
                       r"gives\): `init` takes the values. Build them sharded with "
                       r"`trainer.init_from\(init_fn, \*args\)`"):
      trainer.init(shapes)
    state = trainer.init_from(model.init, jax.random.key(0), x[:1])  # the fix it gives
    state, _ = trainer.step(state, batch)
    with jaxcoll.checkpoint.Checkpointer(str(tmp_path / strategy.kind.name),
                                         async_save=False) as ckpt:
      ckpt.save(1, trainer, state, data_position=1)
      again = jaxcoll.Trainer(loss_fn, optax.adam(1e-2), jaxcoll.devices.flat_mesh(n),
                              strategy)
      again.abstract_state(shapes)  # the other fix: shapes, then restore
      restored, position, _ = ckpt.restore(again)
    assert position == 1
    np.testing.assert_array_equal(np.asarray(again.params(restored)["params"]["kernel"]),
                                  np.asarray(trainer.params(state)["params"]["kernel"]))


_REUSED_STATE = textwrap.dedent('''
    import jax.numpy as jnp, numpy as np, optax, jaxcoll

    def loss_fn(params, batch):
      return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    batch = {"x": np.ones((12, 7), np.float32), "y": np.zeros((12, 3), np.float32)}
    for strategy in (jaxcoll.DataParallel(), jaxcoll.ZeRO(stage=3)):
      trainer = jaxcoll.Trainer(loss_fn, optax.adam(1e-2), jaxcoll.devices.flat_mesh(6),
                                strategy)
      state = trainer.init({"w": np.ones((7, 3), np.float32)})
      new_state, _ = trainer.step(state, batch)
      for use in (lambda: trainer.step(state, batch), lambda: trainer.eval(state, batch),
                  lambda: trainer.params(state), lambda: trainer.export_state(state)):
        try:
          use()
        except ValueError as e:
          print(strategy.kind.name, e)
      new_state, metrics = trainer.step(new_state, batch)  # the returned state goes on
      print(strategy.kind.name, "ok", float(metrics["loss"]) > 0)

    from jaxcoll.train.baselines import GspmdTrainer  # the GSPMD baseline donates too
    gspmd = GspmdTrainer(loss_fn, optax.adam(1e-2), jaxcoll.devices.flat_mesh(6))
    state = gspmd.init({"w": np.ones((7, 3), np.float32)})
    new_state, _ = gspmd.step(state, batch)
    try:
      gspmd.step(state, batch)
    except ValueError as e:
      print("GSPMD", e)
''')


def test_a_state_reused_after_step_is_one_line_not_a_segfault():
  """`trainer.step` donates its state. Giving that state again (a notebook cell run twice,
  `new, m = trainer.step(state, b)` then `trainer.step(state, b)`) killed the process with
  a segmentation fault on a multi-device mesh (XLA:CPU ran the program on deleted
  buffers); `eval` / `params` said "RuntimeError: Array has been deleted". One line now."""
  import jobs

  out = jobs.forked([sys.executable, "-c", _REUSED_STATE], devices=6)
  assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
  said = ("`state` was already given to `trainer.step`, which donates it (its buffers hold the "
          "new state now): use the state that step returned, `state, metrics = "
          "trainer.step(state, batch)`; to keep a copy, save it first (export_state, "
          "Checkpointer.save).")
  assert out.stdout.splitlines() == [f"{kind} {line}" for kind in ("DP", "ZeRO-3")
                                     for line in [said] * 4 + ["ok True"]] + [f"GSPMD {said}"]


def test_a_host_batch_in_bfloat16_float8_or_int4_trains():
  """The text-ids check refused every numpy dtype of kind 'V', which ml_dtypes' bfloat16,
  float8 and int4 are: a loader that casts its features to bfloat16 on the host (half the
  transfer) could not train. They are numbers: step and eval take them, and a structured
  (record) dtype is still one line."""
  import jax
  import jax.numpy as jnp
  import ml_dtypes
  import optax

  import jaxcoll

  def loss_fn(params, batch):
    x = batch["x"].astype(jnp.float32) + batch["q"].astype(jnp.float32).sum(-1, keepdims=True)
    return jnp.mean((x @ params["w"] - batch["y"].astype(jnp.float32)) ** 2)

  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(12, 7)).astype(ml_dtypes.bfloat16),
           "q": np.zeros((12, 2), ml_dtypes.int4),
           "y": rng.normal(size=(12, 3)).astype(ml_dtypes.float8_e4m3fn)}
  n = 6 if len(jax.devices()) >= 6 else 1
  trainer = jaxcoll.Trainer(loss_fn, optax.adam(1e-2), jaxcoll.devices.flat_mesh(n),
                            jaxcoll.DataParallel())
  state = trainer.init({"w": np.zeros((7, 3), np.float32)})
  state, metrics = trainer.step(state, batch)
  y = batch["y"].astype(np.float32)
  assert np.isclose(float(metrics["loss"]), float(np.mean(y ** 2)), rtol=1e-5)
  assert np.isfinite(float(trainer.eval(state, batch)["loss"]))
  records = np.zeros(12, dtype=[("a", np.float32), ("b", np.int32)])
  with pytest.raises(ValueError, match=r"^`batch` leaf \['r'\] holds .* \(text or objects\)"):
    trainer.step(state, {**batch, "r": records})
