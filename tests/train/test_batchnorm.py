"""Synchronized BatchNorm of the ResNet workload: global statistics on any mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxcoll.runtime import devices
from jaxcoll.models import resnet

BATCH = P(("node", "local"))


def _model(bn_axis_name):
  return resnet.ResNet(num_classes=3, width=2, stage_sizes=(1,), bn_axis_name=bn_axis_name)


def _images():
  return jnp.asarray(np.random.default_rng(0).normal(size=(16, 8, 8, 3)), jnp.float32)


def _stats(model, variables, images, mesh=None):
  def apply(x):
    _, updates = model.apply(variables, x, train=True, mutable=["batch_stats"])
    return updates["batch_stats"]

  if mesh is None:
    return jax.jit(apply)(images)
  return jax.jit(jax.shard_map(apply, mesh=mesh, in_specs=BATCH, out_specs=P()))(images)


def test_default_averages_over_every_axis_of_a_two_level_mesh():
  images = _images()
  variables = _model("*").init(jax.random.key(0), images[:1], train=False)
  whole = _stats(_model("*"), variables, images)  # plain jit: the batch is whole
  mesh = devices.make_mesh((2, 4), ("node", "local"))
  sharded = _stats(_model("*"), variables, images, mesh)
  explicit = _stats(_model(("node", "local")), variables, images, mesh)
  for got in (sharded, explicit):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, whole)


def test_an_unbound_axis_raises_and_names_the_mesh():
  images = _images()
  variables = _model(None).init(jax.random.key(0), images[:1], train=False)
  mesh = devices.make_mesh((2, 4), ("node", "local"))
  with pytest.raises(ValueError, match=r"`bn_axis_name`='data': axis 'data' is not bound here; "
                     r"the mesh axes bound by shard_map / pmap are \('node', 'local'\)"):
    _stats(_model("data"), variables, images, mesh)
