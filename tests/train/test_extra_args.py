"""jaxcoll.train.extra_args: optimizers whose update needs more than the gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcoll
from jaxcoll.train.baselines import GspmdTrainer

PARAMS = {"w": np.ones((6, 2), np.float32), "b": np.zeros(2, np.float32)}


def _loss(p, b):
  return jnp.mean((b["x"] @ p["w"] + p["b"]) ** 2)


@pytest.mark.parametrize("name,argument", [
    ("sophia", "obj_fn=, optax.contrib.sophia's Hessian estimate"),
    ("sam-opaque", "grad_fn=, optax.contrib.sam with opaque_mode=True"),
], ids=["sophia", "sam-opaque"])
def test_an_optimizer_that_evaluates_the_loss_itself_is_one_line_at_init(name, argument):
  # optax.contrib.sophia (its update calls obj_fn= for a Hessian estimate) and
  # optax.contrib.sam(opaque_mode=True) (grad_fn=) initialized, then the first step was a
  # traceback from inside optax: "ValueError: obj_fn must be provided to hutchinson update
  # function." Now one line at init, as a line search's (value_fn=) is, naming the argument.
  optimizer = {"sophia": optax.contrib.sophia(1e-2),
               "sam-opaque": optax.contrib.sam(optax.sgd(0.1), optax.sgd(0.05),
                                               opaque_mode=True)}[name]
  mesh = jaxcoll.devices.flat_mesh(4)
  for make in (lambda: jaxcoll.Trainer(_loss, optimizer, mesh, jaxcoll.ZeRO(stage=3)),
               lambda: GspmdTrainer(_loss, optimizer, mesh, fsdp=True)):
    with pytest.raises(ValueError) as info:
      make().init(PARAMS)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        f"`optimizer` evaluates the loss itself (its update needs {argument})")
    assert "re-evaluates the loss at other parameters" in message


def test_sam_in_its_default_mode_trains_like_one_device():
  # opaque_mode=False: the adversarial step is a step of its own, as the fix above says.
  optimizer = optax.contrib.sam(optax.sgd(0.1), optax.sgd(0.05), sync_period=2)
  rng = np.random.default_rng(0)
  batches = [{"x": rng.normal(size=(8, 6)).astype(np.float32)} for _ in range(4)]
  trainer = jaxcoll.Trainer(_loss, optimizer, jaxcoll.devices.flat_mesh(4),
                            jaxcoll.ZeRO(stage=3))
  state = trainer.init(PARAMS)
  params, opt_state = PARAMS, optimizer.init(PARAMS)
  for batch in batches:
    state, _ = trainer.step(state, batch)
    grads = jax.grad(_loss)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  for got, want in zip(jax.tree.leaves(trainer.params(state)), jax.tree.leaves(params)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
