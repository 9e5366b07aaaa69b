"""Cases a user brought that no other test had tried (engineer trial9): their own
models through the README's public paths, checked by value against one device. Each
test of a fix fails without it."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcoll


class _BatchNormCNN(nn.Module):
  axis: object = "data"

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = nn.Conv(4, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=not train, axis_name=self.axis, momentum=0.8)(x)
    return nn.Dense(3)(nn.relu(x).mean((1, 2)))


def _ce(logits, batch):
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def _bn_batches(steps):
  rng = np.random.default_rng(0)
  return [{"image": (rng.normal(size=(8, 6, 6, 2)) + 2).astype(np.float32),
           "label": rng.integers(0, 3, 8).astype(np.int32)} for _ in range(steps)]


def _plain_flax(optimizer, batches):
  """The user's one-device flax loop: gradients of params, batch_stats from mutable."""
  model = _BatchNormCNN(axis=None)
  variables = model.init(jax.random.key(0), batches[0]["image"][:1])
  params, stats = variables["params"], variables["batch_stats"]
  opt_state = optimizer.init(params)

  def loss(p, stats, b):
    out, new = model.apply({"params": p, "batch_stats": stats}, b["image"], train=True,
                           mutable=["batch_stats"])
    return _ce(out, b), new["batch_stats"]

  grad = jax.jit(jax.grad(loss, has_aux=True))
  for b in batches:
    grads, stats = grad(params, stats, b)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  variables = {"params": params, "batch_stats": stats}
  return variables, _ce(model.apply(variables, batches[0]["image"]), batches[0])


@pytest.mark.parametrize("strategy", [jaxcoll.DataParallel(), jaxcoll.ZeRO(stage=3)],
                         ids=["dp", "zero3"])
def test_batchnorm_of_from_flax_trains_without_a_trainer_rng(strategy):
  # A from_flax model ran in training mode only when the trainer passed a key
  # (rng=): the README's BatchNorm CNN without dropout, under Trainer(...) without
  # rng, trained on the running averages (mean 0, var 1) and never updated them,
  # silently (batch_stats 1.06 off a plain flax loop after 4 steps, equal on every
  # strategy). Now two arguments train, rng=None (Trainer.eval, eval_fn) evaluates.
  optimizer, batches = optax.sgd(0.1, momentum=0.9), _bn_batches(3)
  expected, expected_eval = _plain_flax(optimizer, batches)
  w = jaxcoll.models.from_flax(_BatchNormCNN(), _ce, inputs=("image",),
                               sample_batch={"image": batches[0]["image"][:1]})
  trainer = jaxcoll.Trainer(w.loss_fn, optimizer, jaxcoll.devices.flat_mesh(4), strategy,
                            has_aux=True, merge_aux=w.merge_aux)
  state = trainer.init(w.init_params(0))
  for b in batches:
    state, _ = trainer.step(state, b)
  got = trainer.params(state)
  assert float(jnp.abs(got["batch_stats"]["BatchNorm_0"]["mean"]).max()) > 0.1  # moved
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  # Evaluation reads the running averages (the plain loop's train=False).
  np.testing.assert_allclose(float(trainer.eval(state, batches[0])["loss"]),
                             float(expected_eval), rtol=1e-5)
  np.testing.assert_allclose(float(w.eval_fn(got, batches[0])["loss"]),
                             float(expected_eval), rtol=1e-5)


def test_a_from_flax_dropout_model_without_a_trainer_rng_is_one_line():
  class Drop(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
      return nn.Dense(2)(nn.Dropout(0.5, deterministic=not train)(x))

  w = jaxcoll.models.from_flax(Drop(), lambda y, b: jnp.mean(y ** 2), inputs=("x",),
                               sample_batch={"x": np.ones((1, 3), np.float32)})
  trainer = jaxcoll.Trainer(w.loss_fn, optax.sgd(0.1), jaxcoll.devices.flat_mesh(2),
                            jaxcoll.DataParallel(), has_aux=True)
  state = trainer.init(w.init_params(0))
  with pytest.raises(ValueError, match=r"^model 'Drop' draws random numbers in training "
                                       r".*Trainer\(\.\.\., rng=SEED\)"):
    trainer.step(state, {"x": np.ones((4, 3), np.float32)})
  # The memory planner's and benchmarks' form: one fixed key, training mode.
  loss = jaxcoll.models.fixed_key(w.loss_fn)
  assert float(loss(w.init_params(0), {"x": np.ones((4, 3), np.float32)})[0]) > 0


def test_batchnorm_of_from_nnx_trains_without_a_trainer_rng():
  # from_nnx ran the model in eval() mode whenever the trainer had no rng=: a
  # BatchNorm model without dropout trained on its running averages and never
  # updated them. Two arguments train now; 2 devices equal one plain nnx loop.
  from flax import nnx  # noqa: PLC0415

  class Net(nnx.Module):
    def __init__(self, rngs, axis_name="data"):
      self.l1 = nnx.Linear(3, 8, rngs=rngs)
      self.bn = nnx.BatchNorm(8, axis_name=axis_name, momentum=0.8, rngs=rngs)
      self.l2 = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
      return self.l2(jax.nn.relu(self.bn(self.l1(x))))

  mse = lambda y, b: jnp.mean((y[:, 0] - b["y"]) ** 2)  # noqa: E731
  rng = np.random.default_rng(0)
  batches = [{"inputs": (rng.normal(size=(8, 3)) + 1).astype(np.float32),
              "y": rng.normal(size=8).astype(np.float32)} for _ in range(2)]
  ref = Net(nnx.Rngs(0), axis_name=None)
  opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)
  for b in batches:
    grads = nnx.grad(lambda m, b=b: mse(m(b["inputs"]), b))(ref)
    opt.update(ref, grads)
  w = jaxcoll.models.from_nnx(Net(nnx.Rngs(0)), mse)
  trainer = jaxcoll.Trainer(w.loss_fn, optax.sgd(0.1), jaxcoll.devices.flat_mesh(2),
                            jaxcoll.DataParallel(), has_aux=True, merge_aux=w.merge_aux)
  state = trainer.init(w.init_params(0))
  for b in batches:
    state, _ = trainer.step(state, b)
  got = trainer.params(state)
  want = {"params": nnx.state(ref, nnx.Param), "batch_stats": nnx.state(ref, nnx.BatchStat)}
  assert float(jnp.abs(got["batch_stats"]["bn"]["mean"][...]).max()) > 0.1
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  ref.eval()
  np.testing.assert_allclose(float(trainer.eval(state, batches[0])["loss"]),
                             float(mse(ref(batches[0]["inputs"]), batches[0])), rtol=1e-5)


def _mlp_loss(p, b):
  return jnp.mean((jnp.tanh(b["x"] @ p["w"]) @ p["v"] + p["c"] - b["y"]) ** 2)


def _mlp():
  rng = np.random.default_rng(3)
  params = {"w": (0.4 * rng.normal(size=(6, 8))).astype(np.float32),
            "v": (0.4 * rng.normal(size=(8, 2))).astype(np.float32),
            "c": np.zeros(2, np.float32)}
  batches = [{"x": rng.normal(size=(8, 6)).astype(np.float32),
              "y": rng.normal(size=(8, 2)).astype(np.float32)} for _ in range(3)]
  return params, batches


@pytest.mark.parametrize("stage", [1, 3])
def test_a_learning_rate_set_by_hand_between_steps_trains_under_zero(stage):
  # optax.inject_hyperparams: the user sets state.opt_state.hyperparams[...] between
  # steps, as on one device. Under ZeRO the scalars of the optimizer state are kept
  # one per device, and the step's shard_map refused the rank-0 value ("in_specs ...
  # P('data',) ... has rank 0", a traceback); DP took it. Now it is laid out as kept.
  params, batches = _mlp()
  optimizer = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2)
  p, opt_state = jax.tree.map(jnp.asarray, params), optimizer.init(params)
  for i, b in enumerate(batches):
    if i == 1:
      opt_state.hyperparams["learning_rate"] = jnp.asarray(5e-2)
    updates, opt_state = optimizer.update(jax.grad(_mlp_loss)(p, b), opt_state, p)
    p = optax.apply_updates(p, updates)
  trainer = jaxcoll.Trainer(_mlp_loss, optimizer, jaxcoll.devices.flat_mesh(4),
                            jaxcoll.ZeRO(stage=stage))
  state = trainer.init(params)
  for i, b in enumerate(batches):
    if i == 1:
      state.opt_state.hyperparams["learning_rate"] = 5e-2  # a Python float, too
    state, _ = trainer.step(state, b)
  got = trainer.params(state)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(p)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  exported = trainer.export_state(state)
  assert float(exported["opt_state"].hyperparams["learning_rate"]) == np.float32(5e-2)


@pytest.mark.parametrize("strategy", [jaxcoll.DataParallel(), jaxcoll.ZeRO(stage=3)],
                         ids=["dp", "zero3"])
def test_a_learning_rate_set_by_hand_is_saved_restored_and_evaluated(strategy, tmp_path):
  # Set by hand and saved before the next step: ZeRO's export / eval_sums /
  # check_fingerprints met the rank-0 leaf in shard_map (a traceback); DP's save a
  # Python float ("'float' object has no attribute 'shape'").
  params, batches = _mlp()
  optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
  trainer = jaxcoll.Trainer(_mlp_loss, optimizer, jaxcoll.devices.flat_mesh(4), strategy)
  state, _ = trainer.step(trainer.init(params), batches[0])
  state.opt_state.hyperparams["learning_rate"] = 0.25
  assert trainer.check_fingerprints(state) == []
  sums = trainer.eval_sums(lambda p, b: jnp.sum(b["y"]), state, batches[0])
  np.testing.assert_allclose(float(sums), batches[0]["y"].sum(), rtol=1e-5)
  with jaxcoll.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, trainer, state, data_position=1)
    restored, _, _ = ckpt.restore(trainer)
  assert float(trainer.export_state(restored)["opt_state"].hyperparams["learning_rate"]) == 0.25


@pytest.mark.parametrize("strategy", [jaxcoll.DataParallel(), jaxcoll.ZeRO(stage=3)],
                         ids=["dp", "zero3"])
def test_params_boxed_by_with_partitioning_train_like_one_device(strategy, tmp_path):
  # model.init of a linen model with nn.with_partitioning(init, ("embed", "mlp"))
  # gives nn.Partitioned boxes; flax's apply unboxes them with a sharding constraint
  # whenever a mesh is defined, which inside the trainer's shard_map it is: "Resource
  # axis: embed of P('embed', 'mlp') is not found in mesh: ('data',)". The trainer
  # now hands loss_fn the values (the strategy lays them out); the boxes stay.
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      init = nn.initializers.lecun_normal()
      h = nn.Dense(8, kernel_init=nn.with_partitioning(init, ("embed", "mlp")))(x)
      return nn.Dense(2, kernel_init=nn.with_logical_partitioning(init, ("mlp", None)))(
          jnp.tanh(h))

  model = Net()
  params = model.init(jax.random.key(0), np.ones((1, 6), np.float32))
  loss = lambda p, b: jnp.mean((model.apply(p, b["x"]) - b["y"]) ** 2)  # noqa: E731
  _, batches = _mlp()
  optimizer = optax.adam(1e-2)
  p, opt_state = params, optimizer.init(params)
  for b in batches:
    updates, opt_state = optimizer.update(jax.grad(loss)(p, b), opt_state, p)
    p = optax.apply_updates(p, updates)
  trainer = jaxcoll.Trainer(loss, optimizer, jaxcoll.devices.flat_mesh(4), strategy)
  state = trainer.init(params)
  for b in batches:
    state, _ = trainer.step(state, b)
  with jaxcoll.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(3, trainer, state, data_position=3)
    state, _, _ = ckpt.restore(trainer)
  got = trainer.params(state)
  assert jax.tree.structure(got) == jax.tree.structure(p)  # still boxed
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(p)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(trainer.eval(state, batches[0])["loss"]),
                             float(loss(p, batches[0])), rtol=1e-5)


def test_the_planner_and_gspmd_baseline_take_a_batchnorm_model_in_training_mode():
  # With from_flax training without rng= (above), the planner's one-device activation
  # compile and the GSPMD baseline (plain jit) traced BatchNorm(axis_name="data")
  # outside any shard_map: "unbound axis name: data". The planner binds the mesh's
  # axes (size 1), the baseline binds them around its global batch: the loss equals
  # the trainer's, whose statistics are over the same global batch.
  from jaxcoll.train import baselines  # noqa: PLC0415

  batch = _bn_batches(1)[0]
  w = jaxcoll.models.from_flax(_BatchNormCNN(), _ce, inputs=("image",),
                               sample_batch={"image": batch["image"][:1]})
  mesh = jaxcoll.devices.flat_mesh(4)
  trainer = jaxcoll.Trainer(w.loss_fn, optax.sgd(0.1), mesh, jaxcoll.ZeRO(stage=3),
                            has_aux=True, merge_aux=w.merge_aux)
  assert jaxcoll.memory.predict_peak(trainer, w.param_shapes, batch).activation_bytes > 0
  gspmd = baselines.GspmdTrainer(w.loss_fn, optax.sgd(0.1), mesh, has_aux=True)
  _, got = gspmd.step(gspmd.init(w.init_params(0)), batch)
  _, want = trainer.step(trainer.init(w.init_params(0)), batch)
  np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-5)
  np.testing.assert_allclose(got["aux"]["batch_stats"]["BatchNorm_0"]["mean"],
                             want["aux"]["batch_stats"]["BatchNorm_0"]["mean"], rtol=1e-5)


@pytest.mark.slow
def test_bench_trainer_of_a_files_model_runs_the_scanned_transformer_on_its_own_data(tmp_path):
  # `bench_trainer --model=M --data=GLOB` fed the files' records to the scanned
  # transformer it runs beside M too: KeyError 'tokens', a traceback, exit 1.
  import os  # noqa: PLC0415
  import sys  # noqa: PLC0415

  import jobs  # noqa: PLC0415
  from test_user_trials import _FILES_ONLY_MODEL  # noqa: PLC0415

  from jaxcoll.data import sources  # noqa: PLC0415

  (tmp_path / "files_only_model.py").write_text(_FILES_ONLY_MODEL)
  sources.write_shards({"features": np.ones((8, 4), np.float32),
                        "label": np.zeros(8, np.int32)}, str(tmp_path))
  cmd = [sys.executable, "-m", "experiments.bench_trainer", "--model=files_only_model:make",
         f"--data={tmp_path}/*.parquet", "--devices=2", "--batch_size=4", "--steps=1",
         "--warmup=0", "--scanned_layers=1", "--scanned_d_model=8"]
  env = {"PYTHONPATH": os.pathsep.join([jobs.REPO, str(tmp_path)])}
  out = jobs.run(cmd, devices=2, **env)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "transformer (scanned)" in out.stdout and "Dense" in out.stdout


@pytest.mark.parametrize("strategy", [jaxcoll.DataParallel(), jaxcoll.ZeRO(stage=1),
                                      jaxcoll.ZeRO(stage=3)], ids=["dp", "zero1", "zero3"])
def test_the_scalar_check_looks_at_the_scalars_only_until_one_is_set_by_hand(
    strategy, monkeypatch):
  # The check for a scalar set by hand runs before every step: it reads the scalar
  # leaves where they are and flattens the optimizer state only when one was set.
  params, batches = _mlp()
  optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
  trainer = jaxcoll.Trainer(_mlp_loss, optimizer, jaxcoll.devices.flat_mesh(4), strategy)
  state, _ = trainer.step(trainer.init(params), batches[0])
  flatten, flattened = jax.tree.flatten, []
  monkeypatch.setattr(jax.tree, "flatten",
                      lambda *a, **k: flattened.append(1) or flatten(*a, **k))
  trainer._with_scalars_placed(state)  # the first call finds the scalars' places
  flattened.clear()
  assert trainer._with_scalars_placed(state) is state
  assert flattened == []
  for value in (0.25, jnp.asarray(0.25)):  # a Python float, a fresh one-device scalar
    state.opt_state.hyperparams["learning_rate"] = value
    placed = trainer._with_scalars_placed(state)
    lr = placed.opt_state.hyperparams["learning_rate"]
    want = trainer._abstract_state().opt_state.hyperparams["learning_rate"]
    if isinstance(value, float) or isinstance(strategy, jaxcoll.ZeRO):
      assert lr.shape == want.shape and lr.sharding.is_equivalent_to(want.sharding, lr.ndim)
    np.testing.assert_allclose(np.asarray(lr), 0.25)
  assert flattened  # the look that placed them
  monkeypatch.undo()
  state.opt_state.hyperparams["learning_rate"] = 0.25
  state, _ = trainer.step(state, batches[1])
  assert float(trainer.export_state(state)["opt_state"].hyperparams["learning_rate"]) == 0.25
