"""The small MLP regression task the trainer and checkpoint tests share.

Leaf sizes 20, 5, 35, 7, 21, 3: none divides by 8, so every sharded layout
pads.
"""

import jax
import jax.numpy as jnp
import numpy as np

WIDTHS = (4, 5, 7, 3)
GLOBAL_BATCH = 32


def init_mlp(seed=0, widths=WIDTHS):
  key = jax.random.key(seed)
  params = {}
  for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
    key, k1, k2 = jax.random.split(key, 3)
    params[f"layer{i}"] = {
      "w": jax.random.normal(k1, (a, b)) / np.sqrt(a),
      "b": 0.1 * jax.random.normal(k2, (b,)),
    }
  return params


def mlp(params, x):
  n = len(params)
  for i in range(n):
    x = x @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"]
    if i < n - 1:
      x = jnp.tanh(x)
  return x


def mse(params, batch):
  return jnp.mean(jnp.square(mlp(params, batch["x"]) - batch["y"]))
