"""``with_axes_bound``: the mesh's axes bound at size 1 around a loss traced outside
the trainer's shard_map (the planner's one-device compile, the GSPMD baseline)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll.runtime import devices
from jaxcoll.scale import memory
from jaxcoll.train.axes_bound import make_jaxpr_bound_if_needed, with_axes_bound
from jaxcoll.train.baselines import GspmdTrainer


def test_reductions_over_bound_axes_are_the_identity_and_grads_flow():
  def f(x, scale):
    return {"mean": lax.pmean(x * scale, ("node", "local")), "sum": lax.psum(x, "node"),
            "size": lax.axis_size("local") * lax.axis_size("node")}

  x = jnp.arange(6.0).reshape(2, 3)
  got = with_axes_bound(f, ("node", "local"))(x, 2.0)
  np.testing.assert_array_equal(got["mean"], 2 * x)  # no axis added to the outputs
  np.testing.assert_array_equal(got["sum"], x)
  assert int(got["size"]) == 1
  grad = jax.grad(lambda x: with_axes_bound(f, ("node", "local"))(x, 3.0)["mean"].sum())(x)
  np.testing.assert_array_equal(grad, np.full((2, 3), 3.0))
  assert with_axes_bound(f, ()) is f


def test_binds_inside_a_jit_of_arrays_sharded_over_eight_devices():
  # The GSPMD baseline's case: a one-device shard_map could not run here.
  mesh = devices.flat_mesh(8)
  x = jax.device_put(np.arange(16.0), NamedSharding(mesh, P("data")))
  fn = jax.jit(with_axes_bound(lambda v: lax.pmean(v - v.mean(), "data"), mesh.axis_names))
  out = fn(x)
  np.testing.assert_allclose(out, np.arange(16.0) - 7.5)
  assert out.sharding.spec == P("data")  # the partitioning is GSPMD's, as without binding


def test_make_jaxpr_binds_only_where_needed_in_one_trace():
  traces = []

  def plain(x):
    traces.append(1)
    return x.mean()

  x = jax.ShapeDtypeStruct((4,), jnp.float32)
  closed = make_jaxpr_bound_if_needed(plain, ("data",), x)
  assert len(traces) == 1  # not an eval_shape and then the jaxpr's own trace
  assert float(jax.core.eval_jaxpr(closed.jaxpr, closed.consts, jnp.arange(4.0))[0]) == 1.5
  closed = make_jaxpr_bound_if_needed(lambda v: lax.pmean(v.mean(), "data"), ("data",), x)
  assert float(jax.core.eval_jaxpr(closed.jaxpr, closed.consts, jnp.arange(4.0))[0]) == 1.5


def _mlp_loss(p, batch):
  h = jnp.tanh(batch["x"] @ p["w1"])
  return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)


def test_planner_figures_of_a_model_without_axis_reductions_do_not_change():
  params = {"w1": jax.ShapeDtypeStruct((16, 64), jnp.float32),
            "w2": jax.ShapeDtypeStruct((64, 8), jnp.float32)}
  batch = {"x": jax.ShapeDtypeStruct((4, 16), jnp.float32),
           "y": jax.ShapeDtypeStruct((4, 8), jnp.float32)}
  plain = memory.activation_bytes(_mlp_loss, params, batch)
  assert plain[0] > 0
  for axes in (("data",), ("node", "local")):
    assert memory.activation_bytes(_mlp_loss, params, batch, axis_names=axes) == plain


class _Norm(nn.Module):
  axis_name: str | None = "data"

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(4)(x)
    return nn.BatchNorm(use_running_average=False, axis_name=self.axis_name, momentum=0.5)(x)


def test_gspmd_baseline_normalizes_over_the_global_batch_like_one_device():
  # Bound once: the loss that reduces over "data" equals its one-device
  # value on the whole batch (statistics over all 16 rows, not per device).
  model, one_device = _Norm(), _Norm(axis_name=None)
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(16, 3)).astype(np.float32) + 1,
           "y": rng.normal(size=(16, 4)).astype(np.float32)}
  variables = model.init(jax.random.key(0), batch["x"][:1])

  def loss_of(m):
    def loss_fn(v, b):
      out, updates = m.apply(v, b["x"], mutable=["batch_stats"])
      return jnp.mean((out - b["y"]) ** 2), updates
    return loss_fn

  calls = []

  def counted(v, b):
    calls.append(1)
    return loss_of(model)(v, b)

  gspmd = GspmdTrainer(counted, optax.sgd(0.1), devices.flat_mesh(8), fsdp=True,
                       has_aux=True)
  _, metrics = gspmd.step(gspmd.init(variables), batch)
  want, aux = loss_of(one_device)(variables, batch)
  np.testing.assert_allclose(float(metrics["loss"]), float(want), rtol=1e-6)
  np.testing.assert_allclose(metrics["aux"]["batch_stats"]["BatchNorm_0"]["mean"],
                             aux["batch_stats"]["BatchNorm_0"]["mean"], rtol=1e-6)
  # One abstract trace decides (it raises "unbound axis name", so the axes are
  # bound), then the step traces the bound loss once.
  assert len(calls) == 2


def _loss_with_its_own_shard_map(mesh):
  """mean((x @ w) ** 2), computed by a shard_map of the user's over the mesh's "data"."""

  def loss_fn(p, b):
    h = b["x"] @ p["w"]
    return jax.shard_map(lambda v: lax.pmean(jnp.mean(v ** 2), "data"), mesh=mesh,
                         in_specs=P("data"), out_specs=P())(h)

  return loss_fn


def test_gspmd_baseline_leaves_a_loss_with_its_own_shard_map_unbound():
  # A loss that runs its own shard_map over the mesh (a custom collective, an MoE
  # all_to_all) worked under plain jit; a vmap named after the mesh's axes around it
  # broke it ("Unrecognized reducer: psum_invariant").
  mesh = devices.flat_mesh(8)
  loss_fn = _loss_with_its_own_shard_map(mesh)

  gspmd = GspmdTrainer(loss_fn, optax.sgd(0.1), mesh)
  params = {"w": np.full((4, 4), 0.1, np.float32)}
  x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
  _, metrics = gspmd.step(gspmd.init(params), {"x": x})
  want = jnp.mean((x @ params["w"]) ** 2)
  np.testing.assert_allclose(float(metrics["loss"]), float(want), rtol=1e-6)
  grad = jax.grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(params)
  np.testing.assert_allclose(float(metrics["grad_norm"]), float(optax.tree.norm(grad)),
                             rtol=1e-5)


def test_planner_leaves_a_loss_with_its_own_shard_map_unbound():
  # The planner's one-device compile bound the mesh's axes always, so the same loss
  # failed there ("Unrecognized reducer: psum_invariant"); it decides as the baseline.
  mesh = devices.flat_mesh(8)
  loss_fn = _loss_with_its_own_shard_map(mesh)

  params = {"w": jax.ShapeDtypeStruct((4, 64), jnp.float32)}
  batch = {"x": jax.ShapeDtypeStruct((16, 4), jnp.float32)}
  plain = memory.activation_bytes(loss_fn, params, batch)
  assert plain[0] > 0
  assert memory.activation_bytes(loss_fn, params, batch, axis_names=mesh.axis_names) == plain
