"""Your own model and data through the CLI: a model defined in this file
(`test_workload:make`) trains on Parquet files by its module:function path;
bad input is one line on stderr, exit 2, and an untouched workdir."""

import os
import sys

import flax.linen as nn
import jax.numpy as jnp
import jobs
import numpy as np
import optax
import pytest

from jaxcoll.data import sources as data_sources
from jaxcoll import models

TESTS = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(jobs.REPO, "configs", "minimal.py") + ":smoke"


class TwoLayer(nn.Module):
  widths: tuple[int, ...] = (16,)

  @nn.compact
  def __call__(self, x):
    for width in self.widths:
      x = nn.relu(nn.Dense(width)(x))
    return nn.Dense(3)(x)


def _loss(logits, batch):
  labels = batch["label"]
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  return ce, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


def make(widths=(16,)) -> models.Workload:
  """The user's model: `--config.model=test_workload:make`."""
  return models.from_flax(TwoLayer(tuple(widths)), _loss, inputs=("features",),
                          sample_batch={"features": np.zeros((1, 4), np.float32)})


def not_a_workload(**overrides):
  return "a string"


def _write(directory, n=64, **extra):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 4)).astype(np.float32)
  columns = {"features": x, "label": (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 1), **extra}
  data_sources.write_shards(columns, str(directory), num_shards=2, prefix="train")
  return str(directory / "train-*.parquet")


def _train(*flags, workdir, real=False):
  """``python -m experiments.train`` from tests/; forked from a warm Python (~2.5 CPU-s less)
  but where ``real`` (the user model trained through the command line)."""
  return (jobs.train if real else jobs.train_forked)(f"--config={CONFIG}", *flags,
                                                     f"--workdir={workdir}", cwd=TESTS)


def test_workload_from_flax_is_made_by_path():
  w = models.make_workload("test_workload:make", widths=(8,))
  assert w.num_params == 4 * 8 + 8 + 8 * 3 + 3
  assert w.dataset is None


def test_user_model_trains_through_the_cli(tmp_path):
  train = _write(tmp_path / "data")
  out = _train("--config.model=test_workload:make", "--config.model_overrides.widths=(8,)",
               f"--config.data.train={train}", f"--config.data.eval={train}",
               "--config.eval_every=4", "--config.steps=8", "--config.learning_rate=0.05",
               workdir=tmp_path / "run", real=True)
  assert out.returncode == 0, out.stderr[-2000:]
  summary = jobs.summary(tmp_path / "run")
  assert summary["steps"] == 8 and summary["eval_examples"] == 64
  assert summary["eval_accuracy"] > 0.5  # learnt something from the files
  assert summary["config"]["model"] == "test_workload:make"


def _mixed(tmp_path):
  _write(tmp_path / "data")
  # A column the model needs, in some files only (float64 for float32 reads as one dtype).
  data_sources.write_shards({"feats": np.zeros((4, 4), np.float32),
                             "label": np.zeros(4, np.int32)}, str(tmp_path / "data"),
                            prefix="train-extra")
  return [f"--config.data.train={tmp_path / 'data'}/train-*.parquet",
          "--config.model=test_workload:make"]


BAD = {
    "no_file": (lambda t: ["--config.model=test_workload:make",
                           f"--config.data.train={t}/none-*.parquet"], "matches no file"),
    "missing_column": (lambda t: ["--config.model=mlp",
                                  f"--config.data.train={_write(t / 'data')}"],
                       "needs column 'inputs', which the files lack"),
    "mixed_schemas": (_mixed, "mixes schemas"),
    "no_import": (lambda t: ["--config.model=no_such_module_xyz:make"], "does not import"),
    "not_workload": (lambda t: ["--config.model=test_workload:not_a_workload"],
                     "returned str, not a jaxcoll.models.Workload"),
    "schedule": (lambda t: ["--config.schedule=exponential"], "valid schedules: constant"),
    "optimizer": (lambda t: ["--config.optimizer=rmsprop"], "valid optimizers: adam"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_exit_2_workdir_untouched(case, tmp_path):
  flags, message = BAD[case]
  workdir = tmp_path / "run"
  out = _train(*flags(tmp_path), workdir=workdir)
  assert out.returncode == 2, out.stderr[-2000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("train: error: "), out.stderr
  assert message in lines[0]
  assert not os.path.exists(workdir) or not os.listdir(workdir)


def test_make_shards_from_npz_round_trips(tmp_path):
  x = np.arange(30, dtype=np.float32).reshape(10, 3)
  np.savez(tmp_path / "in.npz", features=x, label=np.arange(10))
  out = jobs.run([sys.executable, "-m", "experiments.make_shards", f"--input={tmp_path}/in.npz",
                  "--format=array_record", "--num_shards=3", f"--out={tmp_path / 'out'}"],
                 devices=1)
  assert out.returncode == 0, out.stderr[-2000:]
  source = data_sources.open_source(str(tmp_path / "out" / "*.array_record"))
  rows = source.read_rows(np.arange(10))
  np.testing.assert_array_equal(rows["features"], x)
  np.testing.assert_array_equal(rows["label"], np.arange(10))



def test_eval_fn_is_filled_from_the_loss_in_one_place():
  # mlp, recommender, transformer and from_flax no longer write their own copy of the
  # evaluator's fallback: Workload fills eval_fn from loss_fn ({"loss": loss, **aux}).
  import dataclasses  # noqa: PLC0415

  import jax  # noqa: PLC0415

  from jaxcoll.models import workload as workload_lib  # noqa: PLC0415
  from jaxcoll.run import evaluate  # noqa: PLC0415

  for name in ("mlp", "recommender", "transformer"):
    assert isinstance(models.make_workload(name).eval_fn, workload_lib._LossMetrics), name
  # resnet keeps its own (inference-mode BatchNorm).
  assert not isinstance(models.make_workload("resnet").eval_fn, workload_lib._LossMetrics)
  w = models.make_workload("mlp", task="classification")
  params = jax.tree.map(lambda s: np.full(s.shape, 0.1, s.dtype), w.param_shapes)
  batch = w.make_batch(0, 4)
  (loss, aux), got = jax.jit(lambda p, b: (w.loss_fn(p, b), w.eval_fn(p, b)))(params, batch)
  assert set(got) == {"loss", "accuracy"} == {"loss", *aux}
  np.testing.assert_array_equal(got["loss"], loss)
  np.testing.assert_array_equal(got["accuracy"], aux["accuracy"])
  # A replaced loss refills it; a given eval_fn stays.
  doubled = dataclasses.replace(w, loss_fn=lambda p, b: (2 * w.loss_fn(p, b)[0], {}))
  np.testing.assert_allclose(jax.jit(doubled.eval_fn)(params, batch)["loss"], 2 * loss,
                             rtol=1e-6)
  mine = dataclasses.replace(w, eval_fn=lambda p, b: {"loss": jnp.float32(7)})
  assert float(mine.eval_fn(params, batch)["loss"]) == 7
  # A loss taking an rng gets None (no dropout), as the evaluator's fallback did.
  seen = []
  rng_loss = lambda p, b, rng: (seen.append(rng) or jnp.float32(1), {})  # noqa: E731
  w3 = workload_lib.Workload(name="x", init_params=w.init_params, loss_fn=rng_loss)
  assert float(w3.eval_fn(params, batch)["loss"]) == 1 and seen == [None]
  # The evaluator's per-example metrics are the filled eval_fn's.
  example = jax.tree.map(lambda x: x[:1], batch)
  one = jax.jit(evaluate._per_example_metrics(w))(params, jax.tree.map(lambda x: x[0], example))
  np.testing.assert_allclose(one["loss"], jax.jit(w.eval_fn)(params, example)["loss"], rtol=1e-6)
