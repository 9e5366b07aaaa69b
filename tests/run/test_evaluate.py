"""Evaluation counts every example once (partial last batch masked), and the
eval metrics reach metrics.jsonl and summary.json; schedules and optimizers."""

import json
import sys

import jax.numpy as jnp
import jobs
import ml_collections
import numpy as np
import optax
import pytest

from jaxcoll.runtime import devices
from jaxcoll import models
from jaxcoll.run import evaluate, optim


def _label_workload():
  """eval ``loss`` = the example's label, ``hit`` = 1: the means have a known answer."""
  return models.Workload(
      name="labels",
      init_params=lambda rng: {"params": {"w": jnp.zeros(())}},
      loss_fn=lambda p, b: (jnp.mean(b["labels"]) + p["params"]["w"], {}),
      eval_fn=lambda p, b: {"loss": jnp.mean(b["labels"]) + p["params"]["w"],
                            "hit": jnp.mean(jnp.ones_like(b["labels"]))},
  )


@pytest.mark.parametrize("num_examples", [13, 16, 1])
def test_every_eval_example_counts_once(num_examples):
  labels = np.arange(num_examples, dtype=np.float32) ** 2

  def read_rows(index):
    return {"labels": labels[index]}

  ev = evaluate.Evaluator(_label_workload(), devices.flat_mesh(8), "data", read_rows,
                          num_examples=num_examples, global_batch_size=8)
  out = ev({"params": {"w": jnp.zeros(())}})
  assert out["eval_examples"] == num_examples
  assert out["eval_loss"] == pytest.approx(labels.mean(), rel=1e-6)  # not the padded mean
  assert out["eval_hit"] == pytest.approx(1.0)


def test_schedules_follow_optax():
  c = ml_collections.ConfigDict(dict(learning_rate=2.0, schedule="linear", warmup_steps=2,
                                     steps=6, optimizer="lion", weight_decay=0.0))
  s = optim.build_schedule(c)
  assert [float(s(i)) for i in range(7)] == pytest.approx([0, 1, 2, 1.5, 1, 0.5, 0])
  c.schedule = "constant"
  assert float(optim.build_schedule(c)(1)) == pytest.approx(1.0)
  assert float(optim.build_schedule(c)(5)) == pytest.approx(2.0)
  params = {"w": jnp.ones(3)}
  for name, want in (("lion", -2.0), ("adafactor", None)):
    c.optimizer = name
    opt = optim.build_optimizer(c, optax.constant_schedule(1.0))
    update, _ = opt.update({"w": jnp.ones(3)}, opt.init(params), params)
    if want is not None:  # lion: -lr * sign(g)
      np.testing.assert_allclose(np.asarray(update["w"]), -1.0)
    assert np.all(np.asarray(update["w"]) < 0)


def test_eval_every_writes_metrics_and_summary(tmp_path):
  shards = tmp_path / "shards"
  made = jobs.forked([sys.executable, "-m", "experiments.make_shards",
                      "--config=configs/default.py:smoke", "--split=eval", "--examples=37",
                      "--num_shards=2", f"--out={shards}"], devices=1)
  assert made.returncode == 0, made.stderr[-2000:]
  out = jobs.train_forked("--config=configs/default.py:smoke", "--config.eval_every=3",
                          f"--config.data.eval={shards}/eval-*.parquet",
                          "--config.schedule=cosine", "--config.warmup_steps=2",
                          f"--workdir={tmp_path / 'run'}")
  assert out.returncode == 0, out.stderr[-2000:]
  rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  evals = [r for r in rows if "eval_loss" in r]
  assert [r["step"] for r in evals] == [3, 6]
  assert all(r["eval_examples"] == 37 and 0 <= r["eval_accuracy"] <= 1 for r in evals)
  steps = [r for r in rows if "loss" in r]
  lr = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 2, decay_steps=6)
  assert [r["learning_rate"] for r in steps] == pytest.approx(
      [float(lr(r["step"] - 1)) for r in steps])
  summary = jobs.summary(tmp_path / "run")
  assert summary["eval_loss"] == evals[-1]["eval_loss"]


@pytest.mark.parametrize("procs", [1, 2, 4])
def test_eval_positions_cover_every_example_once_across_processes(procs):
  from jaxcoll.data import files as data_files  # noqa: PLC0415

  seen = []
  for b in range(-(-13 // 8)):
    for p in range(procs):
      index, mask = data_files.eval_positions(13, 8, b, p, procs)
      assert len(index) == 8 // procs
      seen += list(index[mask == 1])
  assert sorted(seen) == list(range(13))
