"""Cases a user brought that no other test had tried (engineer trial21): jaxcoll's
collectives called from their own `jax.shard_map` code on their own meshes (2-D, 3-D, under
jax.set_mesh), on pytrees (empty leaves, an optax state), under jax.grad (a vocab-sharded
log-sum-exp through op="max"), and the benchmark CLI with their own sizes. Each test of a
fix fails without it."""

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


def _sharded_logsumexp(algorithm):
  # A vocab-sharded log-sum-exp, as a user writes it for a softmax over a sharded vocabulary.
  mesh = _mesh((2, 4), ("a", "b"))

  def local(z):
    m = jaxcoll.all_reduce(z.max(-1, keepdims=True), ("a", "b"), op="max", algorithm=algorithm)
    s = jaxcoll.all_reduce(jnp.exp(z - m).sum(-1, keepdims=True), ("a", "b"),
                           algorithm=algorithm)
    return m + jnp.log(s)

  f = jax.shard_map(local, mesh=mesh, in_specs=P(None, ("a", "b")),
                    out_specs=P(None, ("a", "b")))
  return lambda z: f(z)[:, 0].sum()


def test_grad_through_a_max_all_reduce_is_defined_for_native_and_auto_too():
  # jax.grad through all_reduce(op="max") worked with every ppermute algorithm but stopped
  # with "NotImplementedError: Differentiation rule for 'pmax' not implemented" for native,
  # and for the default auto at the sizes where it picks native (this one).
  logits = np.random.default_rng(0).normal(size=(3, 16)).astype(np.float32)
  want = jax.grad(lambda z: jax.nn.logsumexp(z, axis=-1).sum())(logits)
  for algorithm in ("native", "auto"):
    got = jax.jit(jax.grad(_sharded_logsumexp(algorithm)))(logits)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=algorithm)


def test_native_min_gradient_is_jnp_min_s_ties_shared_equally():
  mesh = _mesh((8,), ("d",))
  x = np.array([[2.0, 1.0], [1.0, 3.0], [1.0, 0.0], [5.0, 0.0],
                [4.0, 2.0], [1.0, 6.0], [3.0, 2.0], [2.0, 7.0]], np.float32)
  f = jax.shard_map(lambda u: jaxcoll.all_reduce(u, "d", op="min", algorithm="native"),
                    mesh=mesh, in_specs=P("d"), out_specs=P("d"))
  got = jax.jit(jax.grad(lambda v: (f(v)[0] * jnp.array([1.0, 10.0])).sum()))(x)
  want = jax.grad(lambda v: (jnp.min(v, axis=0) * jnp.array([1.0, 10.0])).sum())(x)
  np.testing.assert_allclose(got, want)  # column 0: three ties of 1/3; column 1: two of 5


def test_bench_collective_all_below_reduce_scatter_s_smallest_size_runs_the_others(tmp_path):
  # `jaxcoll bench --collective=all -b 8 -e 64` (a latency sweep): every size was below
  # 128 B, the smallest reduce_scatter on 8 ranks, so the whole run was exit 2 with no row,
  # though all_reduce / broadcast / reduce run at 8 B. Now those run, and the left-out line
  # names the others, as it names a sweep's too-small sizes.
  import json  # noqa: PLC0415
  import sys  # noqa: PLC0415

  import jobs  # noqa: PLC0415

  run = jobs.forked([sys.executable, "-m", "experiments.bench_collectives", "-b", "8", "-e",
                     "64", "-f", "8", "-n", "1", "-w", "0", "--collective=all",
                     "--algorithms=native", "--noin_place", f"--json={tmp_path}/a.json"],
                    timeout=180)
  assert run.returncode == 0, run.stderr
  rows = json.loads((tmp_path / "a.json").read_text())
  assert [(r["collective"], r["size_bytes"], r["wrong"]) for r in rows] == [
      (c, s, 0) for c in ("all_reduce", "broadcast", "reduce") for s in (8, 64)]
  assert ("(it prints them as size 0): reduce_scatter, all_gather, all_to_all (float32) "
          "8..64 B, runs from 128 B\n" in run.stdout)
  # Named alone, a collective none of whose sizes runs is still one line, exit 2.
  alone = jobs.forked([sys.executable, "-m", "experiments.bench_collectives", "-b", "8",
                       "-e", "64", "--collective=all_gather"], timeout=60)
  assert alone.returncode == 2 and "the smallest all_gather" in alone.stderr


def test_nested_hierarchical_on_two_axes_names_the_axes_the_user_passed():
  # Hierarchical(outer="hierarchical") over ("x", "z") said "needs a tuple of >= 2 axes ...;
  # got axis_name='x'": a one-axis name the user never passed (the outer level's own check).
  import pytest  # noqa: PLC0415

  mesh = _mesh((2, 2, 2), ("x", "y", "z"))
  algo = jaxcoll.Hierarchical(inner="native", outer="hierarchical")
  f = jax.shard_map(lambda v: jaxcoll.all_reduce(v, ("x", "z"), algorithm=algo), mesh=mesh,
                    in_specs=P(("x", "y", "z")), out_specs=P(("x", "y", "z")))
  with pytest.raises(ValueError, match=r"^Hierarchical `outer`='hierarchical' .* >= 3 axes; "
                     r"axis_name=\('x', 'z'\) has one outer axis 'x': choose a flat `outer`"):
    jax.eval_shape(f, jax.ShapeDtypeStruct((8,), jnp.float32))


def test_a_bad_leaf_of_a_pytree_is_named_in_the_one_line_error():
  # Averaging an optax state across devices (all_reduce(state, "d", op="mean")) said
  # "`op`='mean' needs a floating dtype, got int32" without naming the int32 leaf: adam's
  # step `count`, one of dozens of leaves. (lax.pmean silently made it float32.)
  import optax  # noqa: PLC0415
  import pytest  # noqa: PLC0415

  mesh = _mesh((8,), ("d",))
  state = optax.adam(1e-3).init({"dense": {"w": jnp.ones((2, 2))}})
  f = jax.shard_map(lambda s: jaxcoll.all_reduce(s, "d", op="mean"), mesh=mesh,
                    in_specs=P(), out_specs=P(), check_vma=False)
  with pytest.raises(ValueError, match=r"^leaf \[0\]\.count of `x`: `op`='mean' needs a "
                     r"floating dtype, got int32; use op='sum'"):
    jax.eval_shape(f, state)
  g = jax.shard_map(lambda t: jaxcoll.all_gather(t, "d"), mesh=mesh, in_specs=P(),
                    out_specs=P(), check_vma=False)
  with pytest.raises(ValueError, match=r"^leaf \['scale'\] of `x`: all_gather \(tiled\) "):
    jax.eval_shape(g, {"w": jnp.ones(2), "scale": jnp.float32(1.0)})


def test_a_root_given_as_a_jax_array_is_one_line_saying_to_pass_an_int():
  # broadcast(x, "d", root=lax.axis_index(...) or jnp.int32(2)) said "`root` must be a rank
  # in 0..7 of the group of 8; got JitTracer(int32[])" (or "got Array(2, dtype=int32)":
  # a rank in range); now it says root is fixed at trace time and what to pass instead.
  import pytest  # noqa: PLC0415

  mesh = _mesh((8,), ("d",))
  for root in (jnp.int32(2), None):
    f = jax.shard_map(
        lambda v, root=root: jaxcoll.broadcast(
            v, "d", root=lax.axis_index("d") if root is None else root),
        mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    with pytest.raises(ValueError, match=r"^`root` must be a Python int, a rank in 0\.\.7 "
                       r"fixed at trace time .*got a jax array \(int32, shape \(\)\): pass "
                       r"int\(root\)"):
      jax.eval_shape(f, jax.ShapeDtypeStruct((8,), jnp.float32))


def test_a_collective_under_jax_set_mesh_without_shard_map_says_to_add_one():
  # Under jax.set_mesh(mesh) (explicit sharding), jax.jit(lambda v: all_reduce(v, "a")) with
  # no shard_map said "'a' is an axis of the mesh that this shard_map leaves to the compiler
  # (its manual axes: [])": there was no shard_map to add 'a' to.
  import pytest  # noqa: PLC0415

  mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match=r"^`axis_name` 'a' is an axis of the mesh set here "
                       r"\(jax.set_mesh / use_mesh\), but no jax.shard_map .* call it inside "
                       r"jax.shard_map\(f, mesh=\.\.\., in_specs=\.\.\., out_specs=\.\.\.\) "
                       r"over 'a'\."):
      jax.eval_shape(lambda v: jaxcoll.all_reduce(v, "a"), jax.ShapeDtypeStruct((8,), jnp.float32))


def test_bench_collective_all_hierarchical_on_one_axis_says_it_needs_two():
  # `jaxcoll bench --collective=all --algorithms=hierarchical` on the default 1-axis mesh said
  # "Unknown `--algorithms` hierarchical for this mesh" (an algorithm the README lists); the
  # same with one collective named says what it needs: a mesh of >= 2 axes.
  import sys  # noqa: PLC0415

  import jobs  # noqa: PLC0415

  run = jobs.forked([sys.executable, "-m", "experiments.bench_collectives", "-b", "256",
                     "--collective=all", "--algorithms=hierarchical"], timeout=60)
  assert run.returncode == 2
  assert run.stderr == ("bench_collectives: error: `algorithm`='hierarchical' needs a mesh of "
                        ">= 2 axes, e.g. --mesh_shape=2,4 --mesh_axes=node,local; the mesh "
                        "has one axis.\n")
