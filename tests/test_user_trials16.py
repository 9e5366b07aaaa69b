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


@pytest.mark.parametrize("dtype", [jnp.int8, "int32", "fp17", bool])
def test_compute_dtype_that_is_not_floating_is_one_line(dtype):
  """`compute_dtype=jnp.int8` cast every parameter to int8: a (6, 2) kernel of 0.3 became
  0, the loss and gradient norm were 0.0 and nothing trained, silently; a misspelt
  `"fp17"` was numpy's TypeError traceback at the first step. Both are one line now."""
  with pytest.raises(ValueError, match=r"^`compute_dtype` must be a floating dtype or None; "
                     r"got .*\. E.g. compute_dtype=jnp.bfloat16") as e:
    jaxcoll.Trainer(_loss, optax.sgd(1.0), jaxcoll.devices.flat_mesh(2), jaxcoll.ZeRO(stage=3),
                    compute_dtype=dtype)
  assert "\n" not in str(e.value)


def test_compute_dtype_bf16_still_trains_by_value():
  """The check keeps floating compute dtypes as they were: "bfloat16" by name and
  jnp.bfloat16 give the same step, and it moves the kernel as one device's bf16 step."""
  params = {"w": np.full((6, 2), 0.3, np.float32)}
  outs = []
  for dtype in ("bfloat16", jnp.bfloat16):
    t = jaxcoll.Trainer(_loss, optax.sgd(0.1), jaxcoll.devices.flat_mesh(2),
                        jaxcoll.ZeRO(stage=3), compute_dtype=dtype)
    state, metrics = t.step(t.init(params), BATCH)
    outs.append(np.asarray(t.params(state)["w"]))
  import jax  # noqa: PLC0415

  g = jax.grad(lambda p: _loss(jax.tree.map(lambda x: x.astype(jnp.bfloat16), p), BATCH))(params)
  np.testing.assert_array_equal(outs[0], outs[1])
  np.testing.assert_allclose(outs[0], params["w"] - 0.1 * np.asarray(g["w"], np.float32), rtol=1e-2)
  assert float(metrics["grad_norm"]) > 0


@pytest.mark.parametrize("stage", [True, 3.0])
def test_zero_stage_bool_or_float_is_one_line(stage):
  """`ZeRO(stage=True)` was ZeRO-1, silently (True == 1), and `stage=3.0` a float stage
  that reprs and records as 3.0; `grad_accum_steps=True` / `2.0` were already refused."""
  with pytest.raises(ValueError, match=r"^ZeRO: `stage` must be 1, 2 or 3; got "
                     f"{stage!r}\\. For replicated"):
    jaxcoll.ZeRO(stage=stage)
  assert jaxcoll.ZeRO(stage=np.int64(3)).kind.name == "ZeRO-3"  # a config's numpy int
