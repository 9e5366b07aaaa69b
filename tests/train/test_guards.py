"""nan_policy (skip / raise) and the fingerprint desync check."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcoll
from jaxcoll.train import DataParallel, Trainer, ZeRO, guards
from jaxcoll.train.state import perturb_replica


def loss_fn(params, batch):
  pred = batch["x"] @ params["w"] + params["b"]
  return jnp.mean((pred - batch["y"]) ** 2)


def _params():
  return {"w": jnp.ones((3, 2)) * 0.1, "b": jnp.zeros((2,))}


def _batch(poison=False, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(16, 3)).astype(np.float32)
  if poison:
    x[5, 1] = np.nan  # one example on device 2 of 8
  return {"x": x, "y": rng.normal(size=(16, 2)).astype(np.float32)}


@pytest.mark.parametrize("strategy", [DataParallel(), ZeRO(stage=2), ZeRO(stage=3)],
                         ids=["dp", "zero2", "zero3"])
def test_skip_leaves_state_unchanged_on_every_device(strategy):
  trainer = Trainer(loss_fn, optax.adam(0.1), jaxcoll.devices.flat_mesh(8), strategy,
                    nan_policy="skip")
  state = trainer.init(_params())
  state, m1 = trainer.step(state, _batch(seed=1))
  before = jax.tree.map(np.asarray, trainer.export_state(state))
  state, m2 = trainer.step(state, _batch(poison=True))
  after = jax.tree.map(np.asarray, trainer.export_state(state))
  assert int(m1["skipped"]) == 0 and int(m2["skipped"]) == 1
  jax.tree.map(np.testing.assert_array_equal, after, before)  # step count included
  state, m3 = trainer.step(state, _batch(seed=2))  # training goes on
  assert int(m3["skipped"]) == 0 and int(state.step) == 2
  assert trainer.check_fingerprints(state) == []


def test_raise_names_the_step():
  trainer = Trainer(loss_fn, optax.sgd(0.1), jaxcoll.devices.flat_mesh(8), DataParallel(),
                    nan_policy="raise")
  state = trainer.init(_params())
  state, _ = trainer.step(state, _batch())
  state, _ = trainer.step(state, _batch(seed=3))
  before = jax.tree.map(np.asarray, trainer.export_state(state))
  with pytest.raises(FloatingPointError, match="Non-finite gradients at step 3") as info:
    trainer.step(state, _batch(poison=True))  # donates `state`
  error = info.value
  assert isinstance(error, jaxcoll.train.NonFiniteGradientsError) and error.step == 3
  # The error carries the unchanged state: save it or train on from it.
  after = jax.tree.map(np.asarray, trainer.export_state(error.state))
  jax.tree.map(np.testing.assert_array_equal, after, before)
  state, metrics = trainer.step(error.state, _batch(seed=4))
  assert int(state.step) == 3 and int(metrics["skipped"]) == 0


def test_bad_nan_policy():
  with pytest.raises(ValueError, match="`nan_policy` must be one of none, skip, raise"):
    Trainer(loss_fn, optax.sgd(0.1), jaxcoll.devices.flat_mesh(8), DataParallel(),
            nan_policy="ignore")


@pytest.mark.parametrize("strategy", [DataParallel(), ZeRO(stage=1)], ids=["dp", "zero1"])
def test_fingerprint_finds_the_diverged_leaf_and_device(strategy):
  trainer = Trainer(loss_fn, optax.adam(0.1), jaxcoll.devices.flat_mesh(8), strategy)
  state = trainer.init(_params())
  state, _ = trainer.step(state, _batch())
  assert trainer.check_fingerprints(state) == []
  bad = state._replace(params={**state.params, "b": perturb_replica(state.params["b"], 5)})
  problems = trainer.check_fingerprints(bad, raise_on_mismatch=False)
  assert problems == ["['params']['b']: devices [5] differ from device 0"]
  with pytest.raises(RuntimeError, match=r"Replicas diverged at step 1: \['params'\]\['b'\]"):
    trainer.check_fingerprints(bad)


def test_fingerprint_sees_swaps_and_sign_flips():
  x = jnp.arange(1.0, 9.0)
  base = guards.fingerprint({"x": x})
  assert guards.fingerprint({"x": x[::-1]})[0] != base[0]
  assert guards.fingerprint({"x": x.at[3].set(-x[3])})[0] != base[0]
  assert guards.fingerprint({"x": x.astype(jnp.bfloat16)}).dtype == jnp.uint32


def test_fingerprint_of_bool_and_complex_leaves():
  flags = jnp.array([True, False, True])
  base = guards.fingerprint({"flags": flags})
  assert base.dtype == jnp.uint32
  assert guards.fingerprint({"flags": flags.at[1].set(True)})[0] != base[0]
  z = jnp.array([1 + 2j, 3 - 1j], jnp.complex64)
  assert guards.fingerprint({"z": z})[0] != guards.fingerprint({"z": z.at[1].set(3 + 1j)})[0]


def test_fingerprints_with_bool_optimizer_state():
  """optax.apply_if_finite keeps a bool (and int) leaves in its state."""
  optimizer = optax.apply_if_finite(optax.adam(0.1), max_consecutive_errors=3)
  trainer = Trainer(loss_fn, optimizer, jaxcoll.devices.flat_mesh(8), DataParallel())
  state, _ = trainer.step(trainer.init(_params()), _batch())
  assert trainer.check_fingerprints(state) == []
  leaves = jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
  path, flag = next((p, x) for p, x in leaves if x.dtype == jnp.bool_)
  copies = [np.asarray(s.data) for s in flag.addressable_shards]
  copies[2] = ~copies[2]  # device 2's copy of the flag flips
  flipped = jax.make_array_from_single_device_arrays(
    flag.shape, flag.sharding,
    [jax.device_put(c, s.device) for c, s in zip(copies, flag.addressable_shards)],
  )
  bad = jax.tree_util.tree_map_with_path(
    lambda p, x: flipped if p == path else x, state.opt_state
  )
  problems = trainer.check_fingerprints(state._replace(opt_state=bad), raise_on_mismatch=False)
  assert len(problems) == 1 and "devices [2] differ" in problems[0]
