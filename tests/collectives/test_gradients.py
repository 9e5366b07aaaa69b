"""Gradient checks of every differentiable collective and algorithm.

``jax.test_util.check_grads`` to order 2 (forward and reverse) on 4 devices,
of ``sin(collective(x))`` so that the second derivative is not zero. Every
algorithm is a composition of ``ppermute``, slicing and adds, so its
derivatives must equal the numerical ones of the same program.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jaxcoll
from jaxcoll.runtime import devices

FLAT, TWO_LEVEL = ("data",), ("node", "local")
CALLS = {
    "all_reduce": lambda x, ax, a: jaxcoll.all_reduce(x, ax, algorithm=a),
    "reduce_scatter": lambda x, ax, a: jaxcoll.reduce_scatter(x, ax, algorithm=a),
    "all_gather": lambda x, ax, a: jaxcoll.all_gather(x, ax, algorithm=a),
    "broadcast": lambda x, ax, a: jaxcoll.broadcast(x, ax, root=1, algorithm=a),
    "reduce": lambda x, ax, a: jaxcoll.reduce(x, ax, root=1, algorithm=a),
    "all_to_all": lambda x, ax, a: jaxcoll.all_to_all(x, ax, 0, 0, algorithm=a),
}
CASES = [
    (c, a) for c in CALLS for a in jaxcoll.algorithms(c) if a != "auto"
]


def _mesh(axes):
  devs = jax.devices()[:4]
  if axes == FLAT:
    return devices.flat_mesh(4, devices=devs)
  return devices.make_mesh((2, 2), axes, devs)


def _program(collective, algorithm, axes):
  spec = P(axes if len(axes) > 1 else axes[0])
  ax = axes if len(axes) > 1 else axes[0]

  def body(x):
    return jnp.sin(CALLS[collective](x, ax, algorithm))

  return jax.jit(jax.shard_map(body, mesh=_mesh(axes), in_specs=spec, out_specs=spec))


@pytest.mark.parametrize("collective,algorithm", CASES, ids=[f"{c}-{a}" for c, a in CASES])
def test_check_grads_order_2(collective, algorithm):
  axes = TWO_LEVEL if algorithm == "hierarchical" else FLAT
  f = _program(collective, algorithm, axes)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(4 * 4,)), jnp.float32)
  check_grads(f, (x,), order=2, modes=("rev",), atol=5e-2, rtol=5e-2, eps=1e-2)


def test_jitted_collective_traces_once_for_new_values():
  calls = chex.assert_max_traces(lambda x: jaxcoll.all_reduce(x, "data"), n=1)
  f = jax.jit(jax.shard_map(calls, mesh=_mesh(FLAT), in_specs=P("data"), out_specs=P("data")))
  for value in (1.0, 2.0, 3.0):
    out = f(jnp.full((8,), value))
    chex.assert_trees_all_close(out, jnp.full((8,), 4 * value))
