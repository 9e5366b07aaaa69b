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


def _token_workload(pair_in_aux: bool):
  """Per-token losses ``tokens`` where ``mask`` is 1; the loss (a mean over the batch's
  tokens) also reports ``(sum, count)``: from ``eval_fn``, or in the loss's aux."""

  def parts(p, b):
    ce = b["tokens"] + p["params"]["w"]
    return jnp.sum(ce * b["mask"]), jnp.sum(b["mask"])

  def loss_fn(p, b):
    total, count = parts(p, b)
    aux = {"loss": (total, count), "example_mean": total / count} if pair_in_aux else {}
    return total / count, aux

  def eval_fn(p, b):
    total, count = parts(p, b)
    return {"loss": (total, count), "example_mean": total / count}

  return models.Workload(name="tokens", init_params=lambda rng: {"params": {"w": jnp.zeros(())}},
                         loss_fn=loss_fn, eval_fn=None if pair_in_aux else eval_fn)


@pytest.mark.parametrize("pair_in_aux", [False, True], ids=["eval_fn", "loss_aux"])
def test_a_sum_count_metric_is_the_token_weighted_mean(pair_in_aux):
  """Eval is per example (a scalar metric is the mean of the examples' values); a metric
  given as (sum, count) is sum of sums / sum of counts over the whole set, by hand."""
  rng = np.random.default_rng(0)
  n, t = 13, 6
  tokens = rng.normal(size=(n, t)).astype(np.float32)
  mask = np.zeros((n, t), np.float32)
  for i in range(n):  # 1..6 real tokens per example
    mask[i, : 1 + i % t] = 1

  def read_rows(index):
    return {"tokens": tokens[index], "mask": mask[index]}

  mesh = devices.flat_mesh(8)
  ev = evaluate.Evaluator(_token_workload(pair_in_aux), mesh, "data", read_rows,
                          num_examples=n, global_batch_size=8)
  params = {"params": {"w": jnp.asarray(0.5)}}
  weighted = float(np.sum((tokens + 0.5) * mask, dtype=np.float64) / mask.sum())
  per_example = float(np.mean(np.sum((tokens + 0.5) * mask, 1) / mask.sum(1)))
  assert abs(weighted - per_example) > 1e-2  # the two means differ for this data
  out = ev(params)
  assert out["eval_loss"] == pytest.approx(weighted, rel=1e-6)
  assert out["eval_example_mean"] == pytest.approx(per_example, rel=1e-6)
  assert out["eval_examples"] == n
  import jaxcoll  # noqa: PLC0415

  w = _token_workload(pair_in_aux)
  for strategy in (jaxcoll.DataParallel(), jaxcoll.ZeRO(stage=3)):  # the runner's path
    trainer = jaxcoll.Trainer(w.loss_fn, optax.sgd(0.1), mesh, strategy, has_aux=True)
    state = trainer.init(params)
    again = ev(trainer=trainer, state=state)
    _, step_metrics = trainer.step(state, read_rows(np.arange(8)))  # a (sum, count) in aux trains
    assert np.isfinite(float(step_metrics["loss"]))
    assert again["eval_loss"] == pytest.approx(weighted, rel=1e-6)
    assert again["eval_example_mean"] == pytest.approx(per_example, rel=1e-6)
