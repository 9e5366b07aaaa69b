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
  with pytest.raises(FloatingPointError, match="Non-finite gradients at step 3"):
    trainer.step(state, _batch(poison=True))


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
