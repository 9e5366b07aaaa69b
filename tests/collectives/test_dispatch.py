"""Bad input raises ValueError naming the valid choices; the CPU mode guard."""

import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxcoll
from jaxcoll.runtime.devices import flat_mesh, make_mesh


def _trace(fn, x, mesh=None, spec=None):
  mesh = mesh or flat_mesh(8)
  spec = P("data") if spec is None else spec
  jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec)).lower(x)


X = jnp.zeros((16,), jnp.float32)


@pytest.mark.parametrize(
    "fn,match",
    [
        (lambda v: jaxcoll.all_reduce(v, "data", algorithm="rign"), "valid choices: native, ring"),
        (lambda v: jaxcoll.all_reduce(v, "data", op="prod"), "`op` must be one of sum, mean"),
        (lambda v: jaxcoll.all_reduce(v, "model"), "`axis_name` 'model' is not an axis"),
        (lambda v: jaxcoll.all_reduce(v, "data", algorithm="hierarchical"), "tuple of >= 2 axes"),
        (lambda v: jaxcoll.all_reduce(v.astype(jnp.int32), "data", op="mean"), "needs a floating"),
        (lambda v: jaxcoll.all_reduce(v > 0, "data"), "on a bool array: lax.psum would count"),
        (lambda v: jaxcoll.all_reduce(v.astype(jnp.complex64), "data", op="max"),
         "`op`='max' has no order on complex64"),
        (lambda v: jaxcoll.all_reduce(v.astype(jnp.int4), "data"), "Widen 4-bit integers"),
        (lambda v: jaxcoll.all_reduce(v, ("data", "data")), "repeats an axis"),
        (lambda v: jaxcoll.reduce_scatter(v[:3], "data"), "not divisible by the group size 8"),
        (lambda v: jaxcoll.reduce_scatter(v, "data", scatter_dimension=2), "`scatter_dimension`"),
        (lambda v: jaxcoll.all_to_all(v[:3], "data", 0, 0), "not divisible by the group size 8"),
        (lambda v: jaxcoll.all_gather(v[0], "data"), "scalar"),
        (lambda v: jaxcoll.all_gather(v, "data", axis=1), "`axis` must be an axis"),
        (lambda v: jaxcoll.broadcast(v, "data", root=8), r"`root` must be a rank in 0..7"),
        (lambda v: jaxcoll.reduce(v, "data", root=-1), r"`root` must be a rank in 0..7"),
        (lambda v: jaxcoll.broadcast(v, "data", algorithm="ring"), "binomial_tree"),
        (lambda v: jaxcoll.all_reduce(v, "data", algorithm=3), "must be a name"),
        # An integer axis_name (the array dimension, meant as `axis`) was lax's "axis 0 is
        # out of bounds for array of dimension 0", naming neither the argument nor the fix.
        (lambda v: jaxcoll.all_gather(v, 0), r"`axis_name` 0 is an integer; a collective runs "
         r"over named mesh axes \(bound here: \['data'\]\): pass a name such as 'data'"),
        (lambda v: jaxcoll.all_reduce(v, ("data", np.int64(1))),
         r"`axis_name` np.int64\(1\) is an integer"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_input_raises_value_error(fn, match):
  with pytest.raises(ValueError, match=match):
    _trace(fn, X)


def test_an_axis_the_shard_map_leaves_to_the_compiler_is_named_so():
  # shard_map(axis_names={"node"}) on a (node, local) mesh: "local" is an axis of the mesh,
  # but not a manual one. It was "'local' is not an axis of the current mesh".
  mesh = make_mesh((2, 4), ("node", "local"))
  f = jax.shard_map(lambda v: jaxcoll.all_reduce(v, "local", algorithm="ring"), mesh=mesh,
                    in_specs=P("node"), out_specs=P("node"), axis_names={"node"})
  with pytest.raises(ValueError, match=r"'local' is an axis of the mesh that this shard_map "
                     r"leaves to the compiler \(its manual axes: \['node'\]\).*add 'local' to"):
    jax.jit(f).lower(X)


def test_bad_hierarchical_level():
  mesh = make_mesh((2, 4), ("node", "local"))
  spec = jaxcoll.Hierarchical(inner="tree")  # tree is not a reduce_scatter algorithm
  with pytest.raises(ValueError, match=r"Hierarchical `inner`='tree' is not valid for all_reduce "
                     r"\(the inner level runs reduce_scatter and all_gather\); valid: native, "
                     r"ring, auto\."):
    _trace(
        lambda v: jaxcoll.all_reduce(v, ("node", "local"), algorithm=spec),
        X,
        mesh,
        P(("node", "local")),
    )


def test_unknown_collective_in_algorithms():
  with pytest.raises(ValueError, match="valid collectives"):
    jaxcoll.algorithms("gather")


def test_simulate_cpu_devices_too_late_says_how_to_fix():
  with pytest.raises(RuntimeError, match="already started with 8 CPU device"):
    jaxcoll.devices.simulate_cpu_devices(4)
  jaxcoll.devices.simulate_cpu_devices(8)  # the current count is fine
  with pytest.raises(ValueError, match="positive integer"):
    jaxcoll.devices.simulate_cpu_devices(0)


def test_environment_variable_sets_device_count():
  code = "import jaxcoll, jax; print(len(jax.devices()))"
  out = subprocess.run(
      [sys.executable, "-c", code],
      env={"JAXCOLL_CPU_DEVICES": "3", "PATH": "/usr/bin:/bin"},
      capture_output=True,
      text=True,
      check=True,
      timeout=120,
  )
  assert out.stdout.strip() == "3"
  bad = subprocess.run(
      [sys.executable, "-c", "import jaxcoll"],
      env={"JAXCOLL_CPU_DEVICES": "many", "PATH": "/usr/bin:/bin"},
      capture_output=True,
      text=True,
      timeout=120,
      check=False,
  )
  assert bad.returncode != 0 and "JAXCOLL_CPU_DEVICES" in bad.stderr


def test_mesh_helpers(monkeypatch):
  mesh = jaxcoll.devices.node_local_mesh(2, 4)
  assert mesh.axis_names == ("node", "local") and mesh.devices.shape == (2, 4)
  assert jaxcoll.devices.make_mesh((-1, 2), ("a", "b")).devices.shape == (4, 2)
  # A -1 the other sizes leave no whole number for names the sizes that fit (it said only
  # "8 devices do not divide by 3").
  with pytest.raises(ValueError, match=r"do not divide by 3; .* one of \[1, 2, 4, 8\]"):
    jaxcoll.devices.make_mesh((-1, 3), ("a", "b"))
  with pytest.raises(ValueError, match="product is 8"):
    jaxcoll.devices.make_mesh((3, 2), ("a", "b"))
  with pytest.raises(ValueError, match="`num_devices` must be in 1..8"):
    flat_mesh(9)
  np.testing.assert_array_equal(
      [d.id for d in flat_mesh(3).devices.ravel()], [0, 1, 2]
  )
  # Both sizes given: the first nodes x local devices, as flat_mesh's first num_devices (it
  # was "`mesh_shape` (2, 3) has 6 devices but 8 are available").
  np.testing.assert_array_equal(
      [d.id for d in jaxcoll.devices.node_local_mesh(2, 3).devices.ravel()], range(6))
  with pytest.raises(ValueError, match="product is 8"):
    jaxcoll.devices.node_local_mesh(3, 3)
  # Not over the first ones: devices given (their order is the caller's), nor in a job of
  # several processes (a "node" of the first 6 of 2 x 4 would straddle two hosts).
  with pytest.raises(ValueError, match=r"\(2, 3\) has 6 devices but 8 are available"):
    jaxcoll.devices.node_local_mesh(2, 3, devices=jax.devices()[::-1])
  hosts = [types.SimpleNamespace(id=i, process_index=i // 4) for i in range(8)]
  with monkeypatch.context() as patch:
    patch.setattr(jax, "devices", lambda: hosts)
    with pytest.raises(ValueError, match=r"\(2, 3\) has 6 devices but 8 are available"):
      jaxcoll.devices.node_local_mesh(2, 3)
  text = jaxcoll.devices.mesh_from_text
  assert text(None, None).axis_names == ("data",) and text("", None).devices.shape == (8,)
  assert text("2,4", None).axis_names == ("node", "local")
  assert text("4,-1", "a,b").devices.shape == (4, 2)
  with pytest.raises(ValueError, match="`--s`='2x4' is not a comma-separated list"):
    text("2x4", None, shape_name="--s")
  with pytest.raises(ValueError, match="`mesh_axes`='node' must be 2 distinct names"):
    text("2,4", "node")
  with pytest.raises(ValueError, match="`mesh_axes`='a,b' needs a `mesh_shape`"):
    text(None, "a,b")


def test_numpy_integer_axes_are_axes_as_in_lax():
  # `axis=np.int64(1)` (e.g. computed from a numpy shape) was refused: "`axis` must be an axis
  # of the input, in [-2, 2); got np.int64(1)". lax takes numpy integers; so do these now.
  x = jnp.arange(8 * 8 * 2.0).reshape(8 * 8, 2)
  mesh = flat_mesh(8)

  def run(fn):
    return np.asarray(jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("data"),
                                            out_specs=P("data")))(x))

  one = np.int64(1)
  for ours, theirs in [
      (lambda v: jaxcoll.all_gather(v, "data", axis=one, algorithm="ring"),
       lambda v: jax.lax.all_gather(v, "data", axis=1, tiled=True)),
      (lambda v: jaxcoll.reduce_scatter(v, "data", scatter_dimension=np.int32(0),
                                        algorithm="ring"),
       lambda v: jax.lax.psum_scatter(v, "data", scatter_dimension=0, tiled=True)),
      (lambda v: jaxcoll.all_to_all(v, "data", np.int64(0), one, algorithm="pairwise"),
       lambda v: jax.lax.all_to_all(v, "data", 0, 1, tiled=True)),
  ]:
    np.testing.assert_array_equal(run(ours), run(theirs))
  with pytest.raises(ValueError, match=r"`axis` must be an axis of the input, in \[-2, 2\); "
                     r"got True"):
    _trace(lambda v: jaxcoll.all_gather(v, "data", axis=True), x)
