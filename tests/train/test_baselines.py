"""The GSPMD baselines: FSDP shards params, grads and optimizer state alike; same training."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcoll import models
from jaxcoll.observe import analysis
from jaxcoll.runtime import devices
from jaxcoll.train.baselines import GspmdTrainer

# Scanned: params["layers"] leaves have a leading layer axis of 3.
SCANNED = dict(num_layers=3, d_model=32, num_heads=2, seq_len=16, vocab_size=72,
               scan_layers=True)


def _workload():
  return models.make_workload("transformer", **SCANNED)


def _mlp():  # scanned: params["layers"]["Dense_0"]["kernel"] is (3, 16, 16); compiles fast
  return models.make_workload("mlp", depth=4, width=16, input_dim=8, scan_layers=True)


def test_fsdp_shards_adam_state_like_the_params():
  w = _workload()
  trainer = GspmdTrainer(w.loss_fn, optax.adam(1e-3), devices.flat_mesh(8), fsdp=True,
                         has_aux=True)
  params, (adam, *_) = trainer.init(w.init_params(0))
  specs = jax.tree.map(lambda x: x.sharding.spec, params)
  assert jax.tree.map(lambda x: x.sharding.spec, adam.mu) == specs
  assert jax.tree.map(lambda x: x.sharding.spec, adam.nu) == specs
  assert adam.count.sharding.spec == P()
  p = specs["params"]
  # Largest divisible dim: vocab 72 = 9 x 8 rows of the embedding.
  assert p["token_embed"]["embedding"] == P("data", None)
  # Stacked leaves (3, 32, 128): the layer axis stays whole, 128 is cut.
  assert p["layers"]["Dense_0"]["kernel"] == P(None, None, "data")
  assert p["layers"]["Dense_0"]["bias"] == P(None, "data")
  assert p["position_embed"] == P(None, "data")  # 16 x 32: the larger dim
  # Each device holds 1/8 of mu and nu (plus the few replicated leaves).
  full = sum(x.size for x in jax.tree.leaves(adam.mu)) * 4
  held = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(adam.mu))
  assert held < full / 8 * 1.1


def test_dp_replicates_everything():
  w = _workload()
  trainer = GspmdTrainer(w.loss_fn, optax.adam(1e-3), devices.flat_mesh(8), has_aux=True)
  params, (adam, *_) = trainer.init(w.init_params(0))
  assert {x.sharding.spec for x in jax.tree.leaves((params, adam))} == {P()}


def _zero_outside(x, like) -> bool:
  """Whether the entries of ``x`` beyond ``like``'s shape (its padding) are all exactly zero."""
  rest = np.array(x, copy=True)
  rest[tuple(slice(0, s) for s in np.shape(like))] = 0
  return not rest.any()


# The width-16 MLP (8 -> 16, 3 x (16 -> 16), 16 -> 10): on 6 devices no dimension of any
# leaf divides, so every leaf is padded; on 5 all but the output layer's.
@pytest.mark.parametrize("fsdp,n", [(False, 8), (True, 8), (True, 6), (True, 5)],
                         ids=["dp", "fsdp", "fsdp-6-padded", "fsdp-5-padded"])
def test_gspmd_training_matches_one_device(fsdp, n):
  w = _mlp()
  tx = optax.adam(1e-3)
  params0 = w.init_params(0)
  trainer = GspmdTrainer(w.loss_fn, tx, devices.flat_mesh(n), fsdp=fsdp, has_aux=True)
  state = trainer.init(params0)

  @jax.jit
  def one_device(params, opt_state, batch):
    grads = jax.grad(lambda p: w.loss_fn(p, batch)[0])(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  ref, opt_state = jax.tree.map(jnp.asarray, params0), tx.init(params0)
  for step in range(5):
    batch = w.make_batch(step, 4 * n)
    state, metrics = trainer.step(state, batch)
    ref, opt_state = one_device(ref, opt_state, batch)
  assert np.isfinite(metrics["loss"])
  got = jax.tree.map(np.asarray, trainer.params(state))  # the model's shapes
  assert jax.tree.map(np.shape, got) == jax.tree.map(np.shape, params0)
  moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), got, params0)
  assert min(jax.tree.leaves(moved)) > 1e-4, moved
  # Relative to each leaf's largest entry: Adam amplifies float-order noise in tiny gradients.
  errs = jax.tree.map(lambda a, b: float(np.abs(a - b).max() / np.abs(b).max()), got, ref)
  assert max(jax.tree.leaves(errs)) < 1e-4, errs
  if n in (5, 6):
    layout = trainer.layout(params0)
    assert len(layout.padded) == (6 if n == 6 else 4) and not layout.replicated
    adam = state[1][0]
    for tree in (state[0], adam.mu, adam.nu):  # every leaf sharded, the padding exactly zero
      assert all(x.sharding.spec != P() for x in jax.tree.leaves(tree))
      assert all(jax.tree.leaves(jax.tree.map(_zero_outside, tree, params0)))
    assert any(x.shape != y.shape for x, y in zip(jax.tree.leaves(state[0]),
                                                  jax.tree.leaves(params0)))


def test_layout_says_what_is_padded_and_what_stays_replicated():
  w = _mlp()
  mesh = devices.flat_mesh(6)
  make = lambda **kw: GspmdTrainer(w.loss_fn, optax.adam(1e-3), mesh, has_aux=True, **kw)  # noqa: E731
  padded = make(fsdp=True).layout(w.param_shapes)
  assert padded.padded["params/layers/Dense_0/kernel"] == ((3, 16, 16), (3, 18, 16))
  assert padded.padded["params/Dense_1/bias"] == ((10,), (12,))
  assert padded.summary() == ("GSPMD FSDP on 6 devices: 6 leaves padded to shard (+142 zeros, "
                              "12.6% of the parameters); 0 leaves replicated (0 elements, 0.0%).")
  # pad=False is MaxText's rule: what does not divide stays whole on every device.
  unpadded = make(fsdp=True, pad=False)
  assert unpadded.layout(w.param_shapes).summary() == (
    "GSPMD FSDP (pad=False) on 6 devices: 0 leaves padded to shard (+0 zeros, 0.0% of the "
    "parameters); 6 leaves replicated (1,130 elements, 100.0%): params/Dense_0/bias, "
    "params/Dense_0/kernel, params/Dense_1/bias, params/Dense_1/kernel, ....")
  assert {unpadded.param_spec(x.shape) for x in jax.tree.leaves(w.param_shapes)} == {P()}
  assert make().layout(w.param_shapes).replicated_elements == w.num_params  # GSPMD DP
  on8 = GspmdTrainer(w.loss_fn, optax.adam(1e-3), devices.flat_mesh(8), fsdp=True, pad=False)
  assert on8.layout(w.param_shapes).replicated == ("params/Dense_1/bias",)  # 10 on 8


@pytest.mark.parametrize("n", [6, 8])
def test_fsdp_baseline_shards_a_width_that_does_not_divide(n):
  # Width 64 on 6 devices: no dimension divides, and the baseline used to keep
  # every leaf replicated (the memory of GSPMD DP) without saying so.
  w = models.make_workload("mlp", depth=5, width=64, scan_layers=True)
  mesh = devices.flat_mesh(n)
  batch = w.make_batch(0, 4 * n)
  stats = {}
  kinds = {"dp": {}, "fsdp": {"fsdp": True}, "no pad": {"fsdp": True, "pad": False}}
  for name, kw in kinds.items():
    t = GspmdTrainer(w.loss_fn, optax.adam(1e-3), mesh, has_aux=True, **kw)
    stats[name] = t.compile_step(t.abstract_state(w.param_shapes), batch).memory_analysis()
  args = {k: v.argument_size_in_bytes for k, v in stats.items()}
  state_bytes = 3 * 4 * w.num_params  # params, mu, nu
  assert args["dp"] > state_bytes
  # A 1/n share of the state (plus the padding, the batch and Adam's count).
  assert args["fsdp"] < args["dp"] - state_bytes * (1 - 1.1 / n), args
  if n == 6:  # without padding: the memory of GSPMD DP
    assert args["no pad"] == args["dp"], args
  else:  # everything but the (10,) output bias divides by 8
    assert args["no pad"] < args["dp"] - state_bytes * (1 - 1.1 / n), args



def test_a_padded_leaf_costs_what_an_evenly_divided_one_does():
  # (63, 1001) on 8 devices: 1001 is padded to 1008 and sharded there. The slice back
  # to 1001 lost the sharding: the step gathered the whole weight and all-reduced its
  # whole gradient (temp 517 KB, 674 KB sent a device vs 80 KB, 7 KB for (63, 1000)).
  def loss(p, b):
    return jnp.mean((b["x"] @ p["w"] + p["b"]) ** 2)

  batch = {"x": jax.ShapeDtypeStruct((32, 63), jnp.float32)}
  mesh, stats = devices.flat_mesh(8), {}
  for width in (1000, 1001):
    params = {"w": jax.ShapeDtypeStruct((63, width), jnp.float32),
              "b": jax.ShapeDtypeStruct((width,), jnp.float32)}
    t = GspmdTrainer(loss, optax.adam(1e-3), mesh, fsdp=True)
    compiled = t.compile_step(t.abstract_state(params), batch)
    sent = analysis.report_from_hlo(compiled.as_text()).total_bytes_sent_per_device
    stats[width] = compiled.memory_analysis().temp_size_in_bytes, sent
  assert t.layout(params).padded == {"w": ((63, 1001), (63, 1008)), "b": ((1001,), (1008,))}
  (temp, sent), (padded_temp, padded_sent) = stats[1000], stats[1001]
  assert padded_sent <= 1.1 * sent, stats
  assert padded_temp <= 1.1 * temp, stats

def test_a_state_at_the_models_shapes_is_one_line():
  w = _mlp()
  trainer = GspmdTrainer(w.loss_fn, optax.adam(1e-3), devices.flat_mesh(6), fsdp=True,
                         has_aux=True)
  abstract = trainer.abstract_state(w.param_shapes)
  opt = abstract[1]
  with pytest.raises(ValueError, match="at the model's shapes, not the padded ones") as e:
    trainer.lower_step((w.param_shapes, opt), w.make_batch(0, 12))
  assert "\n" not in str(e.value)
  # A fresh trainer cannot tell the model from a state that needs padding: it says so.
  fresh = GspmdTrainer(w.loss_fn, optax.adam(1e-3), devices.flat_mesh(6), fsdp=True,
                       has_aux=True)
  with pytest.raises(ValueError, match="would need padding"):
    fresh.params((w.param_shapes, opt))
  with pytest.raises(ValueError, match="Global batch size 16 is not divisible by data-parallel "
                                       "size 6"):  # was jax's IndivisibleError
    trainer.step(trainer.init(w.init_params(0)), w.make_batch(0, 16))
  # The abstract state's params() are the model's shapes.
  assert jax.tree.map(np.shape, trainer.params(abstract)) == jax.tree.map(np.shape, w.param_shapes)


def test_a_model_whose_shapes_are_anothers_padded_ones_is_built_for_itself():
  # (16, 4) is held as (18, 4) on 6 devices; a model of (18, 4) is another model, not
  # that state: init builds for it (it was taken for the first model's state and
  # sliced to (16, 4): rows 16 and 17 never trained, silently).
  loss_fn = lambda p, batch: jnp.mean((p["w"] - batch["y"]) ** 2)  # noqa: E731
  trainer = GspmdTrainer(loss_fn, optax.sgd(0.5), devices.flat_mesh(6), fsdp=True)
  trainer.init({"w": np.ones((16, 4), np.float32)})
  state = trainer.init({"w": np.ones((18, 4), np.float32)})
  state, _ = trainer.step(state, {"y": np.zeros((6, 1, 1), np.float32)})
  w = np.asarray(trainer.params(state)["w"])
  assert w.shape == (18, 4) and np.allclose(w, 1 - 0.5 * 2 / 72), w  # the mean over 72


@pytest.mark.parametrize("n", [8, 6])
def test_abstract_state_compiles_the_same_step(n):
  w = _mlp()
  trainer = GspmdTrainer(w.loss_fn, optax.adam(1e-3), devices.flat_mesh(n), fsdp=True,
                         has_aux=True)
  batch = w.make_batch(0, 2 * n)
  abstract_state = trainer.abstract_state(w.param_shapes)
  abstract = trainer.compile_step(abstract_state, batch)
  state = trainer.init(w.init_params(0))
  real = trainer.compile_step(state, batch)
  a, r = abstract.memory_analysis(), real.memory_analysis()
  assert a.argument_size_in_bytes == r.argument_size_in_bytes > 0
  assert a.temp_size_in_bytes == r.temp_size_in_bytes
  for x, y in zip(jax.tree.leaves(abstract_state), jax.tree.leaves(state)):
    assert x.shape == y.shape and x.sharding.is_equivalent_to(y.sharding, y.ndim)
  specs = jax.tree.map(lambda x: x.sharding.spec, abstract_state[0])
  assert specs["params"]["layers"]["Dense_0"]["kernel"] == P(None, "data", None)
  if n == 6:  # held padded: (3, 16, 16) as (3, 18, 16)
    assert abstract_state[0]["params"]["layers"]["Dense_0"]["kernel"].shape == (3, 18, 16)
  assert jnp.dtype(jax.tree.leaves(trainer.abstract_state(w.param_shapes))[0].dtype) == jnp.float32


@pytest.mark.parametrize("name", ["reduce_on_plateau", "polyak_sgd"])
def test_an_optimizer_that_reads_the_loss_gets_the_global_batch_loss(name):
  # update(..., value=loss) as optax's own loop calls it: the baseline called update
  # without value=, a TypeError traceback ("missing 1 required keyword-only argument").
  tx = {"reduce_on_plateau": optax.chain(optax.adam(0.5), optax.contrib.reduce_on_plateau(
            patience=1, factor=0.5, accumulation_size=1)),
        "polyak_sgd": optax.polyak_sgd(max_learning_rate=0.5)}[name]
  rng = np.random.default_rng(0)
  params0 = {"w": rng.normal(size=(7, 3)).astype(np.float32), "b": np.zeros(3, np.float32)}
  batches = [{"x": rng.normal(size=(12, 7)).astype(np.float32),
              "y": rng.normal(size=(12, 3)).astype(np.float32)} for _ in range(5)]

  def loss_fn(p, b):
    return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)

  @jax.jit
  def one_device(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params, value=value)
    return optax.apply_updates(params, updates), opt_state

  trainer = GspmdTrainer(loss_fn, tx, devices.flat_mesh(6), fsdp=True)  # (7, 3) padded
  state, ref, opt_state = trainer.init(params0), params0, tx.init(params0)
  for batch in batches:
    state, _ = trainer.step(state, batch)
    ref, opt_state = one_device(ref, opt_state, batch)
  if name == "reduce_on_plateau":  # it lowered the rate, as on one device
    assert float(opt_state[1].scale) < 1
  jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6),
               trainer.params(state), ref)


@pytest.mark.parametrize("name", ["multi_transform", "masked", "adafactor"])
def test_masked_multi_transform_and_adafactor_state_is_sharded_and_trains(name):
  # optax.tree_map_params met optax.masked's / multi_transform's MaskedNode where the
  # parameter's sharding was (a pytree structure error at init, under DP too) and gave
  # adafactor's (1,) placeholder of a bias the bias's P('data') (IndivisibleError).
  labels = lambda p: jax.tree.map(lambda x: "adam" if x.ndim > 1 else "sgd", p)  # noqa: E731
  tx = {"multi_transform": optax.multi_transform(
            {"adam": optax.adam(1e-2), "sgd": optax.sgd(0.1, momentum=0.9)}, labels),
        "masked": optax.chain(optax.masked(optax.adam(1e-2), lambda p: jax.tree.map(
            lambda x: x.ndim > 1, p)), optax.scale(0.1)),
        "adafactor": optax.adafactor(1e-2, min_dim_size_to_factor=4)}[name]
  rng = np.random.default_rng(0)
  params0 = {"w": rng.normal(size=(12, 6)).astype(np.float32),  # nothing padded
             "b": np.full(6, 0.5, np.float32)}
  batches = [{"x": rng.normal(size=(12, 12)).astype(np.float32)} for _ in range(3)]

  def loss_fn(p, b):
    return jnp.mean((b["x"] @ p["w"] + p["b"]) ** 2)

  @jax.jit
  def one_device(params, opt_state, batch):
    updates, opt_state = tx.update(jax.grad(loss_fn)(params, batch), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  ref, opt_state = params0, tx.init(params0)
  for batch in batches:
    ref, opt_state = one_device(ref, opt_state, batch)
  for fsdp in (True, False):
    trainer = GspmdTrainer(loss_fn, tx, devices.flat_mesh(6), fsdp=fsdp)
    state = trainer.init(params0)
    for batch in batches:
      state, _ = trainer.step(state, batch)
    jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6),
                 trainer.params(state), ref)
    # Under FSDP the kernel's moments are sharded as the kernel (adafactor factors them).
    specs = {x.sharding.spec for x in jax.tree.leaves(state[1]) if x.shape == (12, 6)}
    assert specs == ({P("data", None)} if fsdp and name != "adafactor" else
                     {P()} if name != "adafactor" else set())
