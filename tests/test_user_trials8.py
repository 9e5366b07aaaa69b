"""Cases a user brought that no other test had tried (engineer trial8): their own model
and optimizer under DP / ZeRO, checked by value against one device. Each test of a fix
fails without it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcoll
from jaxcoll.train import mixing


def _params():
  rng = np.random.default_rng(0)
  return {"w1": (0.3 * rng.normal(size=(16, 24))).astype(np.float32),
          "b1": np.zeros(24, np.float32),
          "w2": (0.3 * rng.normal(size=(24, 4))).astype(np.float32),
          "b2": np.zeros(4, np.float32)}


def _loss(p, b):
  h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
  return jnp.mean((h @ p["w2"] + p["b2"] - b["y"]) ** 2)


def _batches(steps=2):
  rng = np.random.default_rng(1)
  return [{"x": rng.normal(size=(32, 16)).astype(np.float32),
           "y": rng.normal(size=(32, 4)).astype(np.float32)} for _ in range(steps)]


def _one_device(optimizer, batches, params=None, loss=_loss):
  """Plain optax on one device, one jitted step (op by op, each optimizer's update compiled
  dozens of one-op programs)."""
  @jax.jit
  def step(params, state, batch):
    updates, state = optimizer.update(jax.grad(loss)(params, batch), state, params)
    return optax.apply_updates(params, updates), state

  params = jax.tree.map(jnp.asarray, _params() if params is None else params)
  state = optimizer.init(params)
  for batch in batches:
    params, state = step(params, state, batch)
  return params


def _assert_matches_one_device(optimizer, strategy, mesh=None, steps=2):
  batches = _batches(steps)
  trainer = jaxcoll.Trainer(_loss, optimizer, mesh or jaxcoll.devices.flat_mesh(8), strategy)
  state = trainer.init(_params())
  for batch in batches:
    state, _ = trainer.step(state, batch)
  want = _one_device(optimizer, batches)
  got = trainer.params(state)
  for k in want:
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6,
                               err_msg=k)
  return trainer


def _by_size(p):
  return jax.tree.map(lambda x: x.size > 50, p)  # decay on the matrices, by their size


_ROW_UNSAFE = {  # elementwise per element, but not on ZeRO's rows
  "adamw_mask_on_size": optax.adamw(1e-2, weight_decay=0.5, mask=_by_size),
  "add_noise": optax.chain(optax.add_noise(0.01, 0.55, 0), optax.sgd(0.1)),
}


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("name", list(_ROW_UNSAFE))
def test_masks_on_exact_sizes_and_gradient_noise_match_one_device_under_zero(name, stage):
  """A mask on x.size saw the rows' sizes (no weight decay on a (16, 24) matrix whose row
  is (2, 24)); add_noise drew the same noise on every device for its own rows: both
  trained something else than one device (1.7e-2 and 6.2e-2 off after 3 steps), silently.
  The update now runs on the full leaves, as for a reduction."""
  trainer = _assert_matches_one_device(_ROW_UNSAFE[name], jaxcoll.ZeRO(stage=stage))
  assert trainer._plan.updates_globally  # noqa: SLF001


def test_what_is_row_unsafe_is_found_on_shapes_and_elementwise_ones_stay_on_rows():
  rows = {"w": jax.ShapeDtypeStruct((2, 24), jnp.float32),
          "e": jax.ShapeDtypeStruct((1, 1), jnp.float32),  # a zero-size leaf's padded row
          "s": jax.ShapeDtypeStruct((), jnp.float32)}
  full = {"w": jax.ShapeDtypeStruct((16, 24), jnp.float32),
          "e": jax.ShapeDtypeStruct((0, 4), jnp.float32),
          "s": jax.ShapeDtypeStruct((), jnp.float32)}
  assert "exact shapes" in mixing.first_mixing_op(_ROW_UNSAFE["adamw_mask_on_size"], rows, full)
  assert "random" in mixing.first_mixing_op(_ROW_UNSAFE["add_noise"], rows, full)
  assert "random" in mixing.first_mixing_op(optax.noisy_sgd(1e-2, key=0), rows, full)
  for elementwise in (optax.adam(1e-2), optax.adagrad(1e-2), optax.radam(1e-2),
                      optax.MultiSteps(optax.adam(1e-2), 2),
                      optax.chain(optax.zero_nans(), optax.adam(1e-2)),
                      optax.adamw(1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))):
    assert mixing.first_mixing_op(elementwise, rows, full) is None


def _scale_by_previous_norm():
  """A user's transformation: divide by the gradient norm of the step before (state)."""

  def init(params):
    del params
    return jnp.ones((), jnp.float32)

  def update(updates, previous_norm, params=None):
    del params
    return (jax.tree.map(lambda g: 0.1 * g / previous_norm, updates),
            optax.tree.norm(updates))

  return optax.GradientTransformation(init, update)


_STATE_CARRIED = {"sm3": optax.sm3(1e-1), "previous_norm": _scale_by_previous_norm()}


@pytest.mark.parametrize("name", list(_STATE_CARRIED))
def test_a_reduction_that_only_the_next_step_reads_matches_one_device_under_zero(name):
  """SM3 keeps per-dimension maxima in its state, a user's transformation the last step's
  norm: the first step's updates do not read the reduction, so the update (traced for
  one step from init) looked elementwise, ran on the rows and went 2e-2 off one device
  from the second step on. The state is now followed from step to step."""
  trainer = _assert_matches_one_device(_STATE_CARRIED[name], jaxcoll.ZeRO(stage=2))
  assert "reduce_max" in trainer._plan.mixing_op or "reduce_sum" in trainer._plan.mixing_op  # noqa: SLF001
