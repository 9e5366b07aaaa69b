"""Cases an ML engineer brought to the trainers that no other test had tried (engineer
trial16): a second trainer handed the first's state, a mesh that is not a Mesh. Each test
of a fix fails without it."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcoll
from jaxcoll.train.baselines import GspmdTrainer

PARAMS = {"w": np.ones((6, 2), np.float32)}
BATCH = {"x": np.ones((8, 6), np.float32)}


def _loss(p, b):
  return jnp.mean((b["x"] @ p["w"]) ** 2)


@pytest.mark.parametrize("call", ["step", "eval"])
def test_step_or_eval_of_a_trainer_never_initialized_is_one_line(call):
  """A user builds a second trainer (another learning rate) and passes it the first's
  state: `step` / `eval` raised AttributeError: 'Trainer' object has no attribute '_step'.
  Now it is `_require_built`'s ValueError line, which gives import_state as the fix for a
  state of another trainer (and that fix works on the never-initialized trainer)."""
  mesh = jaxcoll.devices.flat_mesh(4)
  first = jaxcoll.Trainer(_loss, optax.sgd(1.0), mesh, jaxcoll.ZeRO(stage=3))
  state = first.init(PARAMS)
  second = jaxcoll.Trainer(_loss, optax.sgd(0.1), mesh, jaxcoll.DataParallel())
  with pytest.raises(ValueError, match=r"^Call `trainer.init\(params\)` before step/eval"
                     r".*trainer.import_state\(other.export_state\(state\)\)") as e:
    getattr(second, call)(state, BATCH)
  assert "\n" not in str(e.value)
  state = second.import_state(first.export_state(state))
  _, metrics = second.step(state, BATCH)
  np.testing.assert_allclose(float(metrics["loss"]), 36.0)


@pytest.mark.parametrize("mesh", [None, "devices"])
def test_a_mesh_that_is_not_a_mesh_is_one_line(mesh):
  """`Trainer(loss_fn, opt, jax.devices(), strategy)` (or `None`) raised AttributeError:
  'list' object has no attribute 'axis_names' from strategies.py. Now one ValueError
  line naming `mesh`, what it got and how to make one; the GSPMD baseline too."""
  import jax  # noqa: PLC0415

  mesh = jax.devices() if mesh == "devices" else mesh
  for make in (lambda: jaxcoll.Trainer(_loss, optax.sgd(1.0), mesh, jaxcoll.ZeRO(stage=3)),
               lambda: GspmdTrainer(_loss, optax.sgd(1.0), mesh)):
    with pytest.raises(ValueError, match=r"^`mesh` must be a jax.sharding.Mesh; got "
                       f"{type(mesh).__name__}. Make one with jaxcoll.devices.flat_mesh"):
      make()
