"""Cases a user brought that no other test had tried (engineer trial13): their own
models and optimizers through the README's public paths, checked by value against
one device. Each test of a fix fails without it."""

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcoll


class _BatchNormNet(nn.Module):
  axis: object = "data"

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = nn.Dense(4)(x)
    x = nn.BatchNorm(use_running_average=not train, axis_name=self.axis, momentum=0.8)(x)
    return nn.Dense(3)(nn.relu(x))


def _ce(logits, batch):
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def _bn_batches(steps, rows=16):
  rng = np.random.default_rng(0)  # rows of growing scale: microbatches' statistics differ
  return [{"x": (rng.normal(size=(rows, 5)) * (1 + np.arange(rows)[:, None] / 4)).astype(
               np.float32), "label": rng.integers(0, 3, rows).astype(np.int32)}
          for _ in range(steps)]


def _plain_accumulating(optimizer, batches, accum):
  """One device, flax, `accum` microbatches of consecutive rows per step."""
  model = _BatchNormNet(axis=None)
  variables = model.init(jax.random.key(0), batches[0]["x"][:1])
  params, stats = variables["params"], variables["batch_stats"]
  opt_state = optimizer.init(params)

  def loss(p, s, b):
    out, new = model.apply({"params": p, "batch_stats": s}, b["x"], train=True,
                           mutable=["batch_stats"])
    return _ce(out, b), new["batch_stats"]

  grad = jax.jit(jax.grad(loss, has_aux=True))
  for b in batches:
    rows = len(b["x"]) // accum
    parts = [grad(params, stats, jax.tree.map(lambda x, i=i, n=rows: x[i * n:(i + 1) * n], b))
             for i in range(accum)]
    grads = jax.tree.map(lambda *g: sum(g) / accum, *[g for g, _ in parts])
    stats = jax.tree.map(lambda *s: sum(s) / accum, *[s for _, s in parts])
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return {"params": params, "batch_stats": stats}


def _train_bn(devices, accum, batches, strategy=None):
  w = jaxcoll.models.from_flax(_BatchNormNet(), _ce, inputs=("x",),
                               sample_batch={"x": batches[0]["x"][:1]})
  trainer = jaxcoll.Trainer(w.loss_fn, optax.sgd(0.1), jaxcoll.devices.flat_mesh(devices),
                            strategy or jaxcoll.ZeRO(stage=3), has_aux=True,
                            merge_aux=w.merge_aux, grad_accum_steps=accum)
  state = trainer.init(w.init_params(0))
  for b in batches:
    state, _ = trainer.step(state, b)
  return trainer.params(state)


def _max_diff(a, b):
  return max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("strategy", [jaxcoll.DataParallel(), jaxcoll.ZeRO(stage=3)],
                         ids=["dp", "zero3"])
def test_batchnorm_with_grad_accum_on_several_devices_warns(strategy):
  # BatchNorm(axis_name="data") with grad_accum_steps=2 on 4 devices took each
  # microbatch's statistics over chunk i of every device's rows: neither the
  # global batch's nor one accumulating device's (var 0.88 off it after 3 steps),
  # silently. It still trains so (PyTorch SyncBN + accumulation does the same),
  # now with one warning line that says over which rows and how to get the whole batch.
  batches = _bn_batches(3)
  expected = _plain_accumulating(optax.sgd(0.1), batches, accum=2)
  with pytest.warns(UserWarning, match=r"^`loss_fn` reduces over the data axis 'data' \(psum"
                    r".* `grad_accum_steps` is 2: microbatch i is the i-th 2 of each device's "
                    r"4 rows.* over 8 rows .* of 16.* Use grad_accum_steps=1"):
    got = _train_bn(4, 2, batches, strategy)
  assert _max_diff(got, expected) > 0.1  # what the warning says: it differs


def test_batchnorm_with_grad_accum_on_one_device_matches_and_is_silent():
  # On one device the trainer's microbatches are one device's: the same as a plain
  # accumulating flax loop, by value, and nothing to warn about; nor for a loss
  # without collectives on 4 devices.
  batches = _bn_batches(3)
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message=".*reduces over the data axis")
    got = _train_bn(1, 2, batches)
    loss = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)  # noqa: E731
    trainer = jaxcoll.Trainer(loss, optax.sgd(0.1), jaxcoll.devices.flat_mesh(4),
                              jaxcoll.ZeRO(stage=3), grad_accum_steps=2)
    trainer.step(trainer.init({"w": np.ones((5, 2), np.float32)}), batches[0])
  assert _max_diff(got, _plain_accumulating(optax.sgd(0.1), batches, accum=2)) < 1e-5


def test_a_data_axis_reduction_only_in_aux_does_not_warn_about_grad_accum():
  # A loss logging a global mean in aux (lax.pmean of a stop_gradient) with
  # grad_accum_steps=2 on 8 devices warned that its microbatches couple: the
  # search covered aux too, not only what the loss value depends on.
  def loss(p, b):
    value = jnp.mean((b["x"] @ p["w"]) ** 2)
    return value, {"global_loss": jax.lax.pmean(jax.lax.stop_gradient(value), "data")}

  trainer = jaxcoll.Trainer(loss, optax.sgd(0.1), jaxcoll.devices.flat_mesh(8),
                            jaxcoll.DataParallel(), grad_accum_steps=2, has_aux=True)
  x = np.random.default_rng(0).normal(size=(64, 5)).astype(np.float32)
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message=".*reduces over the data axis")
    _, metrics = trainer.step(trainer.init({"w": np.ones((5, 2), np.float32)}), {"x": x})
  want = float(np.mean((x @ np.ones((5, 2), np.float32)) ** 2))
  np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-5)
  np.testing.assert_allclose(float(metrics["aux"]["global_loss"]), want, rtol=1e-5)


def test_grad_accum_on_one_device_does_not_trace_the_loss_for_the_warning(monkeypatch):
  # On one device there is nothing to warn about: the search is not run at all.
  def search(*args):
    raise AssertionError("searched on one device")

  monkeypatch.setattr("jaxcoll.train.grads.reduces_over", search)
  trainer = jaxcoll.Trainer(_linear, optax.sgd(0.1), jaxcoll.devices.flat_mesh(1),
                            jaxcoll.DataParallel(), grad_accum_steps=2)
  trainer.step(trainer.init({"w": np.ones((5, 2), np.float32)}), _LINEAR_BATCH)


def _linear(p, b):
  return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


_LINEAR_BATCH = {"x": np.ones((16, 5), np.float32), "y": np.zeros((16, 2), np.float32)}


@pytest.mark.parametrize("has_aux,loss_fn,message", [
    (False, lambda p, b: (_linear(p, b), {"mse": _linear(p, b)}),
     r"^`loss_fn` returned a tuple of 2, not a scalar loss; pass `has_aux=True`"),
    (False, lambda p, b: {"loss": _linear(p, b)},
     r"^`loss_fn` returned a dict with keys \['loss'\], not a scalar loss; pass `has_aux=True`"),
    (True, _linear, r"^`has_aux=True` but `loss_fn` returned an array of shape \(\); return "
     r"`\(loss, aux\)`"),
    (False, lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2, axis=1),
     r"^`loss_fn`'s loss is an array of shape \(2,\) on this device's batch of 2 rows, not a "
     r"scalar; return the mean"),
], ids=["aux-without-has_aux", "dict", "has_aux-without-aux", "per-example"])
@pytest.mark.parametrize("strategy", [jaxcoll.DataParallel(), jaxcoll.ZeRO(stage=3)],
                         ids=["dp", "zero3"])
def test_a_loss_fn_return_that_does_not_fit_is_one_line(strategy, has_aux, loss_fn, message):
  # Each was a TypeError traceback from inside the step: "float() argument must be a
  # string or a real number, not 'dict'", "iteration over a 0-d array", "Gradient only
  # defined for scalar-output functions. Output had shape: (2,)" (the local batch's
  # size, not the 16 rows the user passed).
  trainer = jaxcoll.Trainer(loss_fn, optax.sgd(0.1), jaxcoll.devices.flat_mesh(8), strategy,
                            has_aux=has_aux)
  state = trainer.init({"w": np.ones((5, 2), np.float32)})
  with pytest.raises(ValueError, match=message):
    trainer.step(state, _LINEAR_BATCH)
  with pytest.raises(ValueError, match=message):
    trainer.eval(state, _LINEAR_BATCH)


def _with_one_copy_changed(leaf, device_id):
  """``leaf`` with the copy on device ``device_id`` changed in one element."""
  shards = leaf.addressable_shards
  copies = [np.asarray(s.data).copy() for s in shards]
  k = [s.device.id for s in shards].index(device_id)
  copies[k].reshape(-1)[0] += 1.0
  return jax.make_array_from_single_device_arrays(
      leaf.shape, leaf.sharding, [jax.device_put(c, s.device) for c, s in zip(copies, shards)])


def _hybrid_with_one_copy_changed(stage, device_id):
  """A hybrid ZeRO trainer on a 2x4 mesh, its state after one step, and that state with
  one copy of `w` (ZeRO-3's params, else Adam's first moment) changed on `device_id`."""
  mesh = jaxcoll.devices.node_local_mesh(2, 4)
  trainer = jaxcoll.Trainer(_linear, optax.adam(1e-2), mesh,
                            jaxcoll.ZeRO(stage=stage, axis="local", replica_axis="node"))
  state, _ = trainer.step(trainer.init({"w": np.ones((8, 2), np.float32)}),
                          {"x": np.ones((8, 8), np.float32), "y": np.zeros((8, 2), np.float32)})
  tree = state.params if stage == 3 else state.opt_state[0].mu
  leaf = _with_one_copy_changed(tree["w"], device_id)
  if stage == 3:
    return trainer, state, state._replace(params={"w": leaf})
  adam = state.opt_state[0]._replace(mu={"w": leaf})
  return trainer, state, state._replace(opt_state=(adam,) + tuple(state.opt_state[1:]))


@pytest.mark.parametrize("stage", [1, 3])
def test_check_replicas_compares_the_replica_groups_of_hybrid_zero(stage):
  # Hybrid ZeRO (axis="local", replica_axis="node") keeps every row twice on a 2x4
  # mesh: device 5 holds what device 1 holds. check_replicas looked only at fully
  # replicated leaves, so a diverged replica group (ZeRO-3's params, ZeRO-1's Adam
  # moments) was never reported: [] for a state whose copies differ.
  trainer, state, diverged = _hybrid_with_one_copy_changed(stage, 5)
  assert trainer.check_replicas(state) == []
  problems = trainer.check_replicas(diverged, raise_on_mismatch=False)
  assert len(problems) == 1 and "'w'" in problems[0], problems
  assert problems[0].endswith("[2:4, 0:2]: devices [5] differ from device 1"), problems


def test_check_replicas_compares_hybrid_replicas_across_processes():
  # 2 processes x 4 devices, replica_axis="node" across the processes: each process
  # holds one copy of every row, so only the cross-process comparison can see a
  # replica group that diverged (it compared fully replicated leaves only); the
  # fingerprints compare device 5's rows with device 1's, on every process.
  import json  # noqa: PLC0415

  import jobs  # noqa: PLC0415

  out = jobs.launch(jobs.sys.executable, "tests/_replica_worker.py", timeout=240)
  assert out.returncode == 0, out.stderr[-2000:]
  results = [json.loads(line.split("RESULT ", 1)[1]) for line in out.stdout.splitlines()
             if "RESULT " in line]
  assert len(results) == 2, out.stdout[-2000:]
  for r in results:
    assert r["before"] == []
    assert r["after"] == [".params['w'] [2:4, 0:2]: processes [1] differ from process 0"], r
    assert r["fingerprints"] == [[], ["['params']['w']: devices [5] differ from device 1"]], r


@pytest.mark.parametrize("stage", [1, 3])
def test_check_fingerprints_compares_the_replica_groups_of_hybrid_zero(stage):
  # The cheap check (the runner's check_every, exit 4) fingerprinted only what every
  # device holds: under hybrid ZeRO-3 nothing, under ZeRO-1 the params, never the
  # rows a replica group holds twice. A diverged copy was [] here too.
  trainer, state, diverged = _hybrid_with_one_copy_changed(stage, 6)
  assert trainer.check_fingerprints(state) == []
  name = "['params']['w']" if stage == 3 else "['opt_state'][0].mu['w']"
  assert trainer.check_fingerprints(diverged, raise_on_mismatch=False) == [
      f"{name}: devices [6] differ from device 2"]
  with pytest.raises(RuntimeError, match=r"Replicas diverged at step 1: .*devices \[6\]"):
    trainer.check_fingerprints(diverged)


def _plain_with_value(optimizer, params, batches, loss_fn):
  """optax's own loop for an optimizer that reads the loss: update(..., value=loss)."""
  opt_state = optimizer.init(params)

  @jax.jit
  def step(p, s, b):
    loss, grads = jax.value_and_grad(loss_fn)(p, b)
    updates, s = optimizer.update(grads, s, p, value=loss)
    return optax.apply_updates(p, updates), s

  for b in batches:
    params, opt_state = step(params, opt_state, b)
  return params, opt_state


def _token_loss(p, b):
  out = p["emb"][b["tok"]] @ p["w"] + p["b"]
  return optax.softmax_cross_entropy_with_integer_labels(out, b["label"]).mean()


@pytest.mark.parametrize("strategy,mesh", [
    (jaxcoll.DataParallel(), (8,)), (jaxcoll.ZeRO(stage=1), (6,)), (jaxcoll.ZeRO(stage=3), (8,)),
    (jaxcoll.ZeRO(stage=3, axis="local", replica_axis="node"), (2, 4))],
    ids=["dp", "zero1-6", "zero3", "hybrid-zero3"])
@pytest.mark.parametrize("name", ["reduce_on_plateau", "polyak_sgd"])
def test_an_optimizer_that_reads_the_loss_gets_the_step_loss(name, strategy, mesh):
  # optax.contrib.reduce_on_plateau and optax.polyak_sgd need update(..., value=loss):
  # the trainer called update without it, a TypeError traceback ("missing 1 required
  # keyword-only argument: 'value'") under every strategy. Now it passes the step's
  # global mean loss; polyak_sgd reduces across elements (ZeRO's global update path).
  optimizer = {
      "reduce_on_plateau": optax.chain(optax.adam(0.5), optax.contrib.reduce_on_plateau(
          patience=1, factor=0.5, accumulation_size=1)),
      "polyak_sgd": optax.polyak_sgd(max_learning_rate=0.5)}[name]
  rng = np.random.default_rng(1)
  params = {"emb": rng.normal(size=(11, 4)).astype(np.float32),
            "w": rng.normal(size=(4, 3)).astype(np.float32), "b": np.zeros(3, np.float32)}
  batches = [{"tok": rng.integers(0, 11, 24).astype(np.int32),
              "label": rng.integers(0, 3, 24).astype(np.int32)} for _ in range(6)]
  expected, expected_state = _plain_with_value(optimizer, params, batches, _token_loss)
  devices = (jaxcoll.devices.flat_mesh(mesh[0]) if len(mesh) == 1
             else jaxcoll.devices.node_local_mesh(*mesh))
  trainer = jaxcoll.Trainer(_token_loss, optimizer, devices, strategy)
  state = trainer.init(params)
  for b in batches:
    state, _ = trainer.step(state, b)
  if name == "reduce_on_plateau":  # it did lower the rate, as on one device
    assert float(expected_state[1].scale) == 0.125
  jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6),
               trainer.params(state), expected)


@pytest.mark.parametrize("name", ["lbfgs", "chained-linesearch"])
def test_a_line_search_optimizer_is_one_value_error_line(name):
  # optax.lbfgs under the Trainer: a TypeError traceback from inside the step
  # ("missing 1 required keyword-only argument: 'value_fn'", after value= was
  # passed). Its update re-evaluates the loss at trial parameters, which a step
  # does not do: one ValueError line at init naming the optimizer and why.
  optimizer = {"lbfgs": optax.lbfgs(),
               "chained-linesearch": optax.chain(
                   optax.sgd(0.1), optax.scale_by_backtracking_linesearch(5))}[name]
  trainer = jaxcoll.Trainer(_token_loss, optimizer, jaxcoll.devices.flat_mesh(8),
                            jaxcoll.DataParallel())
  params = {"emb": np.zeros((11, 4), np.float32), "w": np.zeros((4, 3), np.float32),
            "b": np.zeros(3, np.float32)}
  with pytest.raises(ValueError) as info:
    trainer.init(params)
  message = str(info.value)
  assert "\n" not in message and message.startswith("`optimizer` is a line search (scale_by_")
  assert "value_fn=" in message and "re-evaluates the loss" in message


def test_whether_the_optimizer_reads_the_loss_is_probed_on_one_leaf():
  # Every optax.chain / adam is a GradientTransformationExtraArgs: the probe traced
  # init + update over the whole param tree at each build (0.29 s for adam, 0.64 s
  # for a chain with reduce_on_plateau, on 400 (64, 64) leaves). One (2, 2) leaf
  # decides it; a tree-shaped optimizer (multi_transform's label tree) that fails
  # on it is probed on the model's tree.
  from jaxcoll.train import extra_args
  seen = []

  def recording(opt):
    def init(params):
      seen.append(len(jax.tree.leaves(params)))
      return opt.init(params)
    return optax.GradientTransformationExtraArgs(init, opt.update)

  like = {f"l{i}": jax.ShapeDtypeStruct((8, 8), jnp.float32) for i in range(50)}
  plateau = optax.chain(optax.adam(0.1), optax.contrib.reduce_on_plateau())
  assert extra_args.needs_value(recording(plateau), like)
  assert not extra_args.needs_value(recording(optax.adam(0.1)), like)
  assert seen and max(seen) == 1
  labels = {k: "plateau" if k == "l0" else "adam" for k in like}
  split = optax.multi_transform({"plateau": plateau, "adam": optax.adam(0.1)}, labels)
  assert extra_args.needs_value(split, like)
  assert not extra_args.needs_value(
      optax.multi_transform({"sgd": optax.sgd(0.1), "adam": optax.adam(0.1)},
                            {k: "sgd" if k == "l0" else "adam" for k in like}), like)


def test_a_strategy_axis_the_mesh_lacks_names_every_axis_as_the_fix():
  # DataParallel() (axis "data") on node_local_mesh(2, 4): the line said "Pass e.g.
  # axis='node'", which trains on 2 of the 8 devices' worth of batch shards, the other
  # axis repeating the work; every device is axis=('node', 'local').
  with pytest.raises(ValueError, match=r"^`axis` 'data' names \['data'\], which the mesh does "
                     r"not have; mesh axes: \('node', 'local'\)\. Pass axis=\('node', 'local'\) "
                     r"for every device of it\.$"):
    jaxcoll.Trainer(_linear, optax.sgd(0.1), jaxcoll.devices.node_local_mesh(2, 4),
                    jaxcoll.DataParallel())


@pytest.mark.parametrize("mesh_axes,axis,fix", [
    (("data", "model"), "batch", "axis='data'"),
    (("data", "model"), "modle", "axis='model'"),
    (("node", "local"), ("node", "locl"), "axis=('node', 'local')")])
def test_a_strategy_axis_the_mesh_lacks_suggests_its_data_axis_or_the_near_name(
    mesh_axes, axis, fix):
  # DataParallel(axis="batch") on a ('data', 'model') mesh suggested
  # axis=('data', 'model'): data parallelism spread over the model axis too.
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), mesh_axes)
  with pytest.raises(ValueError, match=rf"mesh axes: {re.escape(repr(mesh_axes))}\. "
                     rf"Pass {re.escape(fix)}\.$"):
    jaxcoll.Trainer(_linear, optax.sgd(0.1), mesh, jaxcoll.DataParallel(axis=axis))


def test_a_state_in_other_containers_names_the_first_that_differs():
  # adam's state into an adamw trainer: the same leaves, another tuple around them;
  # the line said "extra none, missing none".
  mesh, params = jaxcoll.devices.flat_mesh(8), {"w": np.ones((5, 2), np.float32)}
  batch = {"x": np.ones((8, 5), np.float32), "y": np.zeros((8, 2), np.float32)}
  first = jaxcoll.Trainer(_linear, optax.adam(1e-2), mesh, jaxcoll.DataParallel())
  trainer = jaxcoll.Trainer(_linear, optax.adamw(1e-2), mesh, jaxcoll.DataParallel())
  trainer.init(params)
  with pytest.raises(ValueError, match=r"^`state` is not a state of this trainer \(DP on 8 "
                     r"devices and its optimizer\): its containers differ \(tuple of 2 where "
                     r"this trainer keeps tuple of 3; the same 5 leaves: another optimizer or "
                     r"model\); pass a state this trainer made"):
    trainer.step(first.init(params), batch)


@pytest.mark.parametrize("case", ["other-optimizer", "other-strategy"])
def test_a_state_of_another_trainer_is_one_line(case):
  # A state made by another trainer: of Adam into an SGD trainer ("pytree structure
  # error: different types at key path ... ScaleByAdamState"), of DP into ZeRO-3
  # (shard_map's "axis sizes that are not evenly divisible" traceback).
  mesh, params = jaxcoll.devices.flat_mesh(8), {"w": np.ones((5, 2), np.float32)}
  batch = {"x": np.ones((8, 5), np.float32), "y": np.zeros((8, 2), np.float32)}
  first = jaxcoll.Trainer(_linear, optax.adam(1e-2), mesh,
                          jaxcoll.ZeRO(stage=3) if case == "other-optimizer" else
                          jaxcoll.DataParallel())
  trainer = jaxcoll.Trainer(_linear, optax.sgd(1e-2) if case == "other-optimizer" else
                            optax.adam(1e-2), mesh, jaxcoll.ZeRO(stage=3))
  trainer.init(params)
  message = {"other-optimizer": r"its tree differs \(extra \['.opt_state\[0\].count', "
                                r"\".opt_state\[0\].mu\['w'\]\"\], missing none, 5 leaves, "
                                r"this trainer's 2: another model or optimizer\); pass a state "
                                r"this trainer made \(`init`, `init_from`, `import_state`\)\.$",
             "other-strategy": r"leaf .params\['w'\] is float32\[5, 2\], this trainer keeps "
                               r"float32\[8, 2\].*trainer\.import_state\(other\.export_state"
                               r"\(state\)\)`\.$"}[case]
  # eval reads only the params: an Adam state evaluates under an SGD trainer.
  for call in (trainer.step,) + ((trainer.eval,) if case == "other-strategy" else ()):
    with pytest.raises(ValueError, match=r"^`state` is not a state of this trainer \(ZeRO-3 on "
                       r"8 devices and its optimizer\): " + message):
      call(first.init(params), batch)
  if case == "other-strategy":  # the remedy the line gives trains on
    state = trainer.import_state(first.export_state(first.init(params)))
    assert np.isfinite(float(trainer.step(state, batch)[1]["loss"]))
