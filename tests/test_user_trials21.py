"""Cases a user brought that no other test had tried (engineer trial21): jaxcoll's
collectives called from their own `jax.shard_map` code on their own 2-D meshes, on
pytrees with empty leaves, under jax.grad / vmap / scan, and the benchmark CLI with their
own device counts. Each test of a fix fails without it."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcoll


def _mesh(shape, names):
  return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def test_hierarchical_all_gather_of_an_empty_leaf_is_empty_as_every_other_algorithm():
  # A pytree with a (rows, 0) leaf: every all_gather algorithm returned the empty gather,
  # hierarchical stopped in reshape with "ZeroDivisionError: integer modulo by zero".
  mesh = _mesh((2, 4), ("a", "b"))
  spec = P(("a", "b"))
  tree = {"w": np.arange(16.0, dtype=np.float32).reshape(16, 1), "e": np.zeros((16, 0))}
  f = jax.jit(jax.shard_map(
      lambda t: jaxcoll.all_gather(t, ("a", "b"), algorithm="hierarchical"),
      mesh=mesh, in_specs=spec, out_specs=spec))
  out = f(tree)
  assert out["e"].shape == (128, 0)
  np.testing.assert_array_equal(out["w"][:16], tree["w"])
