"""The GSPMD baselines: FSDP shards params, grads and optimizer state alike; same training."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcoll.runtime import devices
from jaxcoll import models
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


@pytest.mark.parametrize("fsdp", [False, True], ids=["dp", "fsdp"])
def test_gspmd_training_matches_one_device(fsdp):
  w = _mlp()
  tx = optax.adam(1e-3)
  params0 = w.init_params(0)
  trainer = GspmdTrainer(w.loss_fn, tx, devices.flat_mesh(8), fsdp=fsdp, has_aux=True)
  state = trainer.init(params0)

  @jax.jit
  def one_device(params, opt_state, batch):
    grads = jax.grad(lambda p: w.loss_fn(p, batch)[0])(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  ref, opt_state = jax.tree.map(jnp.asarray, params0), tx.init(params0)
  for step in range(5):
    batch = w.make_batch(step, 16)
    state, metrics = trainer.step(state, batch)
    ref, opt_state = one_device(ref, opt_state, batch)
  assert np.isfinite(metrics["loss"])
  got = jax.tree.map(np.asarray, trainer.params(state))
  moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), got, params0)
  assert min(jax.tree.leaves(moved)) > 1e-4, moved
  # Relative to each leaf's largest entry: Adam amplifies float-order noise in tiny gradients.
  errs = jax.tree.map(lambda a, b: float(np.abs(a - b).max() / np.abs(b).max()), got, ref)
  assert max(jax.tree.leaves(errs)) < 1e-4, errs


def test_abstract_state_compiles_the_same_step():
  w = _mlp()
  trainer = GspmdTrainer(w.loss_fn, optax.adam(1e-3), devices.flat_mesh(8), fsdp=True,
                         has_aux=True)
  batch = w.make_batch(0, 16)
  abstract = trainer.compile_step(trainer.abstract_state(w.param_shapes), batch)
  real = trainer.compile_step(trainer.init(w.init_params(0)), batch)
  a, r = abstract.memory_analysis(), real.memory_analysis()
  assert a.argument_size_in_bytes == r.argument_size_in_bytes > 0
  assert a.temp_size_in_bytes == r.temp_size_in_bytes
  specs = jax.tree.map(lambda x: x.sharding.spec, trainer.abstract_state(w.param_shapes)[0])
  assert specs["params"]["layers"]["Dense_0"]["kernel"] == P(None, "data", None)
  assert jnp.dtype(jax.tree.leaves(trainer.abstract_state(w.param_shapes))[0].dtype) == jnp.float32
