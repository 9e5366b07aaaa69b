"""Cases a user brought that no other test had tried (engineer trial3): each test fails
without its fix, and each is cheap (shapes, tiny models)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcoll
from jaxcoll.train import mixing

_ROWS = {"w": jax.ShapeDtypeStruct((1, 6), jnp.float32),
         "b": jax.ShapeDtypeStruct((3,), jnp.float32),
         "s": jax.ShapeDtypeStruct((), jnp.float32)}
_SCHEDULE = optax.join_schedules(  # constant boundaries reduced over: not the parameters
    [optax.linear_schedule(0.0, 1e-2, 3), optax.cosine_decay_schedule(1e-2, 10)], [3])

_ELEMENTWISE = {
  "adam": optax.adam(1e-2),
  "adamw_ndim_mask": optax.adamw(1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
  "schedule": optax.adam(_SCHEDULE),
  "piecewise": optax.sgd(optax.piecewise_constant_schedule(1e-2, {3: 0.5}), momentum=0.9),
  "multisteps": optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
  "inject_hyperparams": optax.inject_hyperparams(optax.adamw)(learning_rate=_SCHEDULE),
  "frozen": optax.multi_transform({"a": optax.adam(1e-2), "f": optax.set_to_zero()},
                                  {"w": "f", "b": "a", "s": "a"}),
  "zero_nans": optax.chain(optax.zero_nans(), optax.adam(1e-2)),  # its flag: state only
  "clip_values": optax.chain(optax.clip(1.0), optax.sgd(0.1)),
  "lion": optax.lion(1e-3),
}
_MIXING = {
  "clip_by_global_norm": optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
  "lamb": optax.lamb(1e-2),
  "lars": optax.lars(1e-2),
  "adafactor": optax.adafactor(1e-2),
  "apply_if_finite": optax.apply_if_finite(optax.adam(1e-2), 3),
}


@pytest.mark.parametrize("name", [*_ELEMENTWISE, *_MIXING])
def test_an_update_that_reduces_across_elements_is_found_on_shapes(name):
  """Under ZeRO each device updates its own rows: an optimizer that reduces across
  elements trains something else than one device (clip_by_global_norm in the chain:
  8.7e-3 off after 4 steps of a 5-leaf model), and nothing said so."""
  optimizer = _ELEMENTWISE.get(name) or _MIXING[name]
  found = mixing.first_mixing_op(optimizer, _ROWS)
  assert (found is None) == (name in _ELEMENTWISE), found


def _loss(p, b):
  return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


def test_zero_with_clip_by_global_norm_in_the_chain_is_exact_and_silent():
  """It used to warn (NotElementwiseWarning) and train each shard clipped by its own norm;
  the update now runs on the full leaves (tests/train/test_zero_exact.py): no warning,
  and the chain equals Trainer(clip_global_norm=...) and one device."""
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(7, 3)).astype(np.float32), "b": np.zeros(3, np.float32)}
  batch = {"x": rng.normal(size=(8, 7)).astype(np.float32),
           "y": rng.normal(size=(8, 3)).astype(np.float32)}
  mesh = jaxcoll.devices.flat_mesh(2)
  chained = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2))
  with warnings.catch_warnings():
    warnings.simplefilter("error", mixing.NotElementwiseWarning)
    zero = jaxcoll.Trainer(_loss, chained, mesh, jaxcoll.ZeRO(stage=3))
    state, _ = zero.step(zero.init(params), batch)
    fixed = jaxcoll.Trainer(_loss, optax.adam(1e-2), mesh, jaxcoll.ZeRO(stage=3),
                            clip_global_norm=0.1)
    fixed_state, _ = fixed.step(fixed.init(params), batch)
  one = jax.tree.map(jnp.asarray, params)  # the chain on one device
  updates, _ = chained.update(jax.grad(_loss)(one, batch), chained.init(one), one)
  want = optax.apply_updates(one, updates)
  for k in params:
    np.testing.assert_allclose(zero.params(state)[k], want[k], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(fixed.params(fixed_state)[k], want[k], rtol=1e-6, atol=1e-7)


def _dense_workload():
  import flax.linen as nn  # noqa: PLC0415

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(2)(nn.relu(nn.Dense(4)(x.reshape(x.shape[0], -1))))

  def loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

  return jaxcoll.models.from_flax(Net(), loss, inputs=("features",),
                                  sample_batch={"features": np.zeros((1, 8), np.float32)})


@pytest.mark.parametrize("row_shape", [(7,), (3, 3)], ids=["7_for_8", "3x3_for_8"])
def test_a_column_of_another_row_shape_than_the_models_sample_is_one_line(row_shape):
  """Files whose input column has another per-row shape than from_flax's sample_batch
  passed the column check and failed in the first step with flax's
  ScopeParamShapeError traceback (exit 1), after the workdir was made."""
  from jaxcoll.errors import ConfigError  # noqa: PLC0415
  from jaxcoll.run import inputs  # noqa: PLC0415

  w = _dense_workload()
  assert w.input_shapes == {"features": (8,)}
  sample = {"features": np.zeros((1, *row_shape), np.float32), "label": np.zeros(1, np.int32)}
  with pytest.raises(ConfigError, match=(
      rf"`config.data.train`='x/\*.parquet': column 'features' has per-row shape "
      rf"\[{', '.join(map(str, row_shape))}\], but the model was built for \[8\] .*"
      r"ScopeParamShapeError.*write the column with per-row shape \[8\]")):
    inputs.check_columns(w, sample, "data.train", "x/*.parquet")
  # Another shape the loss takes (the same 8 values per row, reshaped) is not refused.
  inputs.check_columns(w, {**sample, "features": np.zeros((1, 2, 4), np.float32)},
                       "data.train", "x/*.parquet")


def make_counter_model():
  """A flax model with an int32 counter in a state collection ("counters")."""
  import flax.linen as nn  # noqa: PLC0415

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
      seen = self.variable("counters", "seen", lambda: jnp.zeros((), jnp.int32))
      if train:
        seen.value = seen.value + x.shape[0]
      return nn.Dense(2)(x)

  def loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

  return jaxcoll.models.from_flax(Net(), loss, inputs=("features",),
                                  sample_batch={"features": np.zeros((1, 4), np.float32)})


def test_a_model_with_an_int_variable_is_one_line_before_the_workdir_is_made(tmp_path):
  """An int32 counter in a flax state collection reached Trainer.init: a ValueError
  traceback (exit 1), with the workdir and its checkpoints/ already made."""
  import jobs  # noqa: PLC0415

  from jaxcoll.data import sources  # noqa: PLC0415

  sources.write_shards({"features": np.ones((16, 4), np.float32),
                        "label": np.zeros(16, np.int32)}, str(tmp_path))
  workdir = tmp_path / "run"
  line = jobs.one_line(jobs.train_forked(
      "--config=configs/minimal.py:smoke", "--config.model=test_user_trials3:make_counter_model",
      "--config.model_overrides={}", f"--config.data.train={tmp_path}/*.parquet",
      f"--workdir={workdir}"))
  assert ("`config.model`='test_user_trials3:make_counter_model': its variable "
          "['counters']['seen'] is int32 (['counters'] is model state") in line, line
  assert "declare it float32" in line and not workdir.exists()
