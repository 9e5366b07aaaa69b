"""From one device to data parallel: the lines that change are marked (*).

    python examples/minimal.py

Trains the same MLP twice on the same batches: a plain single-device optax
loop, and jaxcoll's DataParallel on 8 (emulated) devices, and shows that both
end with the same parameters.
"""

import os

os.environ.setdefault("JAXCOLL_CPU_DEVICES", "8")  # (*) emulate 8 devices on a CPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxcoll  # noqa: E402  (*)


def loss_fn(params, batch):  # mean loss over the (local) batch, as usual
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def data(steps=20, batch=64, seed=0):
  rng = np.random.default_rng(seed)
  teacher = rng.normal(size=(16, 1)).astype(np.float32)
  for _ in range(steps):
    x = rng.normal(size=(batch, 16)).astype(np.float32)
    yield {"x": x, "y": np.sin(x @ teacher)}


def init_params(seed=0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"w1": jax.random.normal(k1, (16, 32)) / 4, "b1": jnp.zeros(32),
          "w2": jax.random.normal(k2, (32, 1)) / 6}


def single_device(optimizer):
  params = init_params()
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  for batch in data():
    params, opt_state, loss = step(params, opt_state, batch)
  return params, loss


def data_parallel(optimizer):
  mesh = jaxcoll.devices.flat_mesh()  # (*) all devices on axis "data"
  trainer = jaxcoll.Trainer(loss_fn, optimizer, mesh, jaxcoll.DataParallel())  # (*)
  state = trainer.init(init_params())  # (*) replaces optimizer.init
  for batch in data():
    state, metrics = trainer.step(state, batch)  # (*) replaces the jitted step
  return trainer.params(state), metrics["loss"]  # (*) full params back


if __name__ == "__main__":
  optimizer = optax.adam(1e-2)
  p1, loss1 = single_device(optimizer)
  p8, loss8 = data_parallel(optimizer)
  diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(p1),
                                                             jax.tree.leaves(p8)))
  print(f"1 device: loss {float(loss1):.5f}; {len(jax.devices())} devices: loss "
        f"{float(loss8):.5f}; largest param difference {diff:.2e}")
