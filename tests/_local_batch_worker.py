"""Worker of tests/data/test_sources.py::test_process_local_rows_*: one process of 2.

Each process holds its own 16 rows (process p: values 16p .. 16p + 15). The
loss is mean((x - w)^2) with w = 0, so the right loss is the mean of x^2 over
all 32 rows. Prints ``RESULT {json}`` with the loss through
``jaxcoll.data.from_process_local`` and the error for the raw local numpy batch.
"""

import json

import jax.numpy as jnp
import numpy as np
import optax

import jaxcoll
from jaxcoll.runtime import distributed

import jobs


def main():
  distributed.initialize()
  import jax  # noqa: PLC0415

  mesh = jaxcoll.devices.flat_mesh()
  trainer = jaxcoll.Trainer(lambda p, b: jnp.mean((b["x"] - p["w"]) ** 2), optax.sgd(0.0),
                            mesh, jaxcoll.DataParallel(algorithm="ring"))
  state = trainer.init({"w": jnp.zeros(())})
  p = jax.process_index()
  local = {"x": np.arange(16 * p, 16 * p + 16, dtype=np.float32)}
  state, metrics = trainer.step(state, jaxcoll.data.from_process_local(local, mesh))
  try:
    trainer.step(state, local)
    error = ""
  except ValueError as e:
    error = str(e)
  jobs.say_result(json.dumps({"loss": float(metrics["loss"]), "error": error}))


if __name__ == "__main__":
  main()
