"""Pytrees through the explicit algorithms: leaves of one dtype packed into one buffer.

Leaf by leaf, a ring all-reduce of a 100-leaf tree was 100 rings (8.6 s to compile on 8 CPU
devices, 0.2 s for native, which XLA combines itself) and 100 latency-bound collectives per
call. Packed (jaxcoll.collectives.packing), it is one ring per dtype and bucket. Each test
checks every leaf against the numpy reference: mixed dtypes, shapes, scalars and zero-size
leaves, on a group of 6 (not a power of two), the sub-axis groups of a 2-D mesh and the
hierarchical algorithms over its two axes.
"""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import SWEEP_COMPILER_OPTIONS
from jax.sharding import PartitionSpec as P

import jaxcoll
from jaxcoll.collectives import reference as ref
from jaxcoll.runtime.devices import flat_mesh, make_mesh

BF16 = ml_dtypes.bfloat16


def _flat_algorithms(collective):
  return [a for a in jaxcoll.algorithms(collective) if a not in ("native", "hierarchical")]


def _values(rng, dtype, shape):
  if dtype == np.bool_:
    return rng.random(shape) > 0.5
  if np.issubdtype(dtype, np.integer):
    return rng.integers(-100, 100, size=shape).astype(dtype)
  if np.issubdtype(dtype, np.complexfloating):
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
  return rng.standard_normal(shape).astype(dtype)


def _inputs(specs, devices, seed):
  """{name: [one array per device]} of the given (dtype, shape) specs."""
  rng = np.random.default_rng(seed)
  return {k: [_values(rng, dt, shape) for _ in range(devices)] for k, (dt, shape) in specs.items()}


def _run(fn, inputs, mesh, axes):
  """``fn`` on every device of ``mesh``; ``inputs``: a pytree of lists of one array per device
  (in the row-major order of ``axes``). Returns fn's structure of lists of numpy outputs."""
  spec = P(axes)
  is_list = lambda v: isinstance(v, list)  # noqa: E731
  stacked = jax.tree.map(np.stack, inputs, is_leaf=is_list)

  def body(tree):
    return jax.tree.map(lambda v: v[None], fn(jax.tree.map(lambda v: v[0], tree)))

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
  out = f.lower(stacked).compile(SWEEP_COMPILER_OPTIONS)(stacked)
  return jax.tree.map(lambda v: list(np.asarray(v)), out)


def _check(got, want, what):
  assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape,
                                                               got.dtype, want.dtype)
  if got.dtype == np.bool_ or np.issubdtype(got.dtype, np.integer):
    np.testing.assert_array_equal(got, want, err_msg=what)
    return
  eps = 2.0**-7 if got.dtype == BF16 else 1e-5
  wide = np.complex128 if np.iscomplexobj(want) else np.float64
  w = np.asarray(want, wide)
  scale = max(1.0, float(np.max(np.abs(w)))) if w.size else 1.0
  np.testing.assert_allclose(np.asarray(got, wide), w, rtol=eps, atol=8 * eps * scale,
                             err_msg=what)


# Shape-free collectives: f32 of several shapes (a scalar, a zero-size leaf), bf16, int32,
# complex64; bool rides along on op='max'.
ELEMENTWISE = {"w": (np.float32, (5, 3)), "b": (np.float32, (3,)), "s": (np.float32, ()),
               "e": (np.float32, (0, 4)), "h": (BF16, (7,)), "i": (np.int32, (2, 3)),
               "i1": (np.int32, ()), "c": (np.complex64, (4,)), "w2": (np.float32, (2, 2, 2))}
FLOATS = {k: v for k, v in ELEMENTWISE.items() if k not in ("i", "i1")}  # op='mean'
ORDERED = {**{k: v for k, v in ELEMENTWISE.items() if k != "c"},  # op='max': no complex
           "f": (np.bool_, (6,))}


def _groups(mesh, axes, group_axes):
  """The device indices (in the order of ``axes``) of each group over ``group_axes``."""
  shape = [mesh.shape[a] for a in axes]
  index = np.arange(int(np.prod(shape))).reshape(shape)
  kept = [i for i, a in enumerate(axes) if a not in group_axes]
  moved = np.moveaxis(index, kept + [axes.index(a) for a in group_axes],
                      list(range(len(axes))))
  return moved.reshape(-1, int(np.prod([mesh.shape[a] for a in group_axes]))).tolist()


def _compare(got, inputs, want_of, mesh, *, axes, group_axes, what):
  for members in _groups(mesh, axes, group_axes):
    for name, xs in inputs.items():
      want = want_of(name, [xs[d] for d in members])
      for rank, device in enumerate(members):
        _check(got[name][device], want[rank], f"{what} leaf {name} rank {rank}")


# (mesh shape, mesh axes, the group's axes): a flat group of 6; each axis of a 2x3 mesh.
GROUPS = [
    pytest.param((6,), ("data",), ("data",), id="n6"),
    pytest.param((2, 3), ("node", "local"), ("local",), id="2x3-local"),
    pytest.param((2, 3), ("node", "local"), ("node",), id="2x3-node"),
]


def _mesh(shape, axes):
  n = int(np.prod(shape))
  return flat_mesh(n) if len(shape) == 1 else make_mesh(shape, axes, jax.devices()[:n])


def _group_name(group_axes):
  return group_axes[0] if len(group_axes) == 1 else group_axes


def _sweep(collective, shape, axes, group_axes, cases, *, call, want_of, algos=None):
  """Every algorithm of ``collective`` (and auto) on every case, in one program.

  ``cases``: {case: {leaf name: (dtype, shape)}}; ``call(tree, group, case, algorithm)``;
  ``want_of(case, leaf name, group's inputs) -> per-rank expected``.
  """
  mesh = _mesh(shape, axes)
  devices = int(np.prod(shape))
  group = _group_name(group_axes)
  inputs = {c: _inputs(specs, devices, seed) for seed, (c, specs) in enumerate(cases.items())}
  algos = algos or _flat_algorithms(collective) + ["auto"]

  def fn(tree):
    return {str(a): {c: call(tree[c], group, c, a) for c in cases} for a in algos}

  got = _run(fn, inputs, mesh, axes)
  for a in algos:
    for c in cases:
      _compare(got[str(a)][c], inputs[c], lambda k, xs, c=c: want_of(c, k, xs), mesh,
               axes=axes, group_axes=group_axes, what=f"{collective} {a} {c}")


def _size(shape, group_axes):
  mesh_axes = ("data",) if len(shape) == 1 else ("node", "local")
  return int(np.prod([shape[mesh_axes.index(a)] for a in group_axes]))


@pytest.mark.parametrize("shape,axes,group_axes", GROUPS)
def test_all_reduce_of_a_mixed_pytree_matches_the_reference(shape, axes, group_axes):
  _sweep("all_reduce", shape, axes, group_axes, {"sum": ELEMENTWISE, "mean": FLOATS,
                                                 "max": ORDERED},
         call=lambda t, g, op, a: jaxcoll.all_reduce(t, g, op=op, algorithm=a),
         want_of=lambda op, k, xs: ref.all_reduce(xs, op))


@pytest.mark.parametrize("shape,axes,group_axes", GROUPS)
def test_broadcast_of_a_mixed_pytree_matches_the_reference(shape, axes, group_axes):
  n = _size(shape, group_axes)
  roots = {"first": 0, "last": n - 1}
  _sweep("broadcast", shape, axes, group_axes, {c: ORDERED | {"c": ELEMENTWISE["c"]}
                                                for c in roots},
         call=lambda t, g, c, a: jaxcoll.broadcast(t, g, root=roots[c], algorithm=a),
         want_of=lambda c, k, xs: ref.broadcast(xs, roots[c]))


@pytest.mark.parametrize("shape,axes,group_axes", GROUPS)
def test_reduce_of_a_mixed_pytree_matches_the_reference(shape, axes, group_axes):
  n = _size(shape, group_axes)
  plan = {"sum": ("sum", 1, ELEMENTWISE), "mean": ("mean", 0, FLOATS),
          "max": ("max", n - 1, ORDERED)}
  _sweep("reduce", shape, axes, group_axes, {c: specs for c, (_, _, specs) in plan.items()},
         call=lambda t, g, c, a: jaxcoll.reduce(t, g, root=plan[c][1], op=plan[c][0], algorithm=a),
         want_of=lambda c, k, xs: ref.reduce(xs, plan[c][1], plan[c][0]))


def _scatter_specs(n):
  """Leaves whose scatter dimension (0, and 1 for "dim1") divides by the group size ``n``."""
  dim0 = {"w": (np.float32, (2 * n, 3)), "b": (np.float32, (n,)), "h": (BF16, (3 * n,)),
          "i": (np.int32, (n, 2, 2)), "e": (np.float32, (0, 2)), "c": (np.complex64, (n,)),
          "w2": (np.float32, (n, 1))}
  dim1 = {"w": (np.float32, (3, 2 * n)), "b": (np.float32, (1, n)), "h": (BF16, (2, n)),
          "e": (np.float32, (0, n)), "i": (np.int32, (2, n, 2))}
  flags = {k: v for k, v in dim0.items() if k != "c"} | {"f": (np.bool_, (n, 2))}
  return {"sum": dim0, "mean": {k: v for k, v in dim0.items() if k != "i"}, "max": flags,
          "dim1": dim1}


@pytest.mark.parametrize("shape,axes,group_axes", GROUPS)
def test_reduce_scatter_of_a_mixed_pytree_matches_the_reference(shape, axes, group_axes):
  n = _size(shape, group_axes)
  op = {"sum": "sum", "mean": "mean", "max": "max", "dim1": "sum"}
  dim = {"dim1": 1}
  _sweep("reduce_scatter", shape, axes, group_axes, _scatter_specs(n),
         call=lambda t, g, c, a: jaxcoll.reduce_scatter(t, g, op=op[c],
                                                   scatter_dimension=dim.get(c, 0), algorithm=a),
         want_of=lambda c, k, xs: ref.reduce_scatter(xs, op[c], dim.get(c, 0)))


GATHER = {
    "axis0": {"w": (np.float32, (2, 3)), "b": (np.float32, (1,)), "h": (BF16, (4,)),
              "i": (np.int32, (2, 2, 2)), "e": (np.float32, (0,)), "c": (np.complex64, (3,)),
              "f": (np.bool_, (5,)), "w2": (np.float32, (3, 1))},
    "axis1": {"w": (np.float32, (2, 3)), "b": (np.float32, (1, 2)), "h": (BF16, (2, 2)),
              "e": (np.float32, (3, 0)), "i": (np.int32, (1, 3, 2))},
}


@pytest.mark.parametrize("shape,axes,group_axes", GROUPS)
def test_all_gather_of_a_mixed_pytree_matches_the_reference(shape, axes, group_axes):
  axis = {"axis0": 0, "axis1": 1}
  _sweep("all_gather", shape, axes, group_axes, GATHER,
         call=lambda t, g, c, a: jaxcoll.all_gather(t, g, axis=axis[c], algorithm=a),
         want_of=lambda c, k, xs: ref.all_gather(xs, axis[c]))


TWO_LEVEL = ((2, 3), ("node", "local"), ("node", "local"))
SPECS = [jaxcoll.Hierarchical(), jaxcoll.Hierarchical(inner="ring", outer="tree")]


def test_hierarchical_on_a_mixed_pytree_matches_the_reference():
  _sweep("all_reduce", *TWO_LEVEL, {"sum": ELEMENTWISE, "mean": FLOATS},
         call=lambda t, g, op, a: jaxcoll.all_reduce(t, g, op=op, algorithm=a),
         want_of=lambda op, k, xs: ref.all_reduce(xs, op), algos=SPECS)
  _sweep("reduce_scatter", *TWO_LEVEL, {"sum": _scatter_specs(6)["sum"]},
         call=lambda t, g, op, a: jaxcoll.reduce_scatter(t, g, algorithm=jaxcoll.Hierarchical()),
         want_of=lambda op, k, xs: ref.reduce_scatter(xs), algos=["hierarchical"])
  _sweep("all_gather", *TWO_LEVEL, GATHER,
         call=lambda t, g, c, a: jaxcoll.all_gather(t, g, axis=int(c[-1]), algorithm=a),
         want_of=lambda c, k, xs: ref.all_gather(xs, int(c[-1])), algos=["hierarchical"])


# -- the HLO: one ring per dtype and bucket, whatever the number of leaves -------------


def _permutes(tree, algorithm="ring", **kwargs):
  mesh = flat_mesh(8)
  f = jax.jit(jax.shard_map(lambda t: jaxcoll.all_reduce(t, "data", algorithm=algorithm,
                                                         **kwargs),
                            mesh=mesh, in_specs=P("data"), out_specs=P("data")))
  text = f.lower(tree).as_text()
  return len(re.findall(r"collective_permute", text))


def _leaves(count, dtype=jnp.float32):
  return {f"leaf{i:02d}": jnp.ones((8, 3 + i % 5), dtype) for i in range(count)}


def test_a_ring_all_reduce_of_50_leaves_is_one_ring():
  # 8 devices: a ring all-reduce is 2 * (8 - 1) = 14 collective-permutes. Leaf by leaf, 50
  # leaves were 700 of them (and 50 times the compile time).
  one_leaf = _permutes(_leaves(1))
  assert one_leaf == 14
  assert _permutes(_leaves(50)) == one_leaf
  assert _permutes(_leaves(5)) == one_leaf
  # Each dtype is its own buffer; bucket_bytes=0 goes back to one ring per leaf.
  assert _permutes({**_leaves(20), "h": _leaves(20, jnp.bfloat16)}) == 2 * one_leaf
  assert _permutes(_leaves(50), bucket_bytes=0) == 50 * one_leaf


def test_bucket_bytes_caps_each_buffer():
  # 12 leaves of 32 float32 (128 bytes) per device: 512-byte buckets hold 4 leaves each.
  tree = {f"leaf{i:02d}": jnp.ones((8, 32), jnp.float32) for i in range(12)}
  assert _permutes(tree, bucket_bytes=512) == 3 * 14
  # A leaf larger than the cap is a buffer of its own.
  assert _permutes(tree, bucket_bytes=100) == 12 * 14
  # native is left to XLA (it combines the all-reduces itself).
  assert _permutes(tree, algorithm="native") == 0


@pytest.mark.parametrize("choice,permutes", [("ring", 14), ("native", 0)])
def test_auto_chooses_once_on_the_packed_buffer(choice, permutes):
  # As NCCL sees a fused buffer: one choice on the buffer's bytes, not one per leaf. Where the
  # choice is native, the leaves run natively leaf by leaf (XLA combines them) and no buffer is
  # made: no concatenation to copy the tree into.
  tree = _leaves(50)
  total = sum(v.size // 8 * 4 for v in tree.values())  # float32 bytes per device
  calls = []

  def chooser(collective, nbytes, group, dtype):
    calls.append((collective, nbytes, group.size, np.dtype(dtype).name))
    return choice

  jaxcoll.collectives.set_auto_chooser(chooser)
  try:
    mesh = flat_mesh(8)
    f = jax.jit(jax.shard_map(lambda t: jaxcoll.all_reduce(t, "data"), mesh=mesh,
                              in_specs=P("data"), out_specs=P("data")))
    text = f.lower(tree).as_text()
  finally:
    jaxcoll.collectives.reset_auto_chooser()
  assert calls == [("all_reduce", total, 8, "float32")]
  assert len(re.findall(r"collective_permute", text)) == permutes
  assert ("concatenate" in text) == (choice != "native")


def test_packed_results_equal_leaf_by_leaf_exactly_for_integers_and_data_movement():
  mesh = flat_mesh(6)
  inputs = _inputs({**ORDERED, "c": ELEMENTWISE["c"]}, 6, seed=11)
  ints = [k for k, v in inputs.items() if v[0].dtype in (np.int32, np.bool_)]

  def fn(tree):
    out = {}
    for b in (0, jaxcoll.collectives.DEFAULT_BUCKET_BYTES):
      out[f"bcast{b}"] = jaxcoll.broadcast(tree, "data", root=4, algorithm="binomial_tree",
                                           bucket_bytes=b)
      out[f"max{b}"] = jaxcoll.all_reduce({k: tree[k] for k in ints}, "data", op="max",
                                          algorithm="tree", bucket_bytes=b)
    return out

  got = _run(fn, inputs, mesh, "data")
  packed = jaxcoll.collectives.DEFAULT_BUCKET_BYTES
  for what in ("bcast", "max"):
    for k, per_leaf in got[f"{what}0"].items():
      for rank, (a, b) in enumerate(zip(per_leaf, got[f"{what}{packed}"][k])):
        np.testing.assert_array_equal(a, b, err_msg=f"{what} {k} rank {rank}")


def test_a_bad_leaf_is_still_named_before_anything_is_packed():
  import optax  # noqa: PLC0415

  mesh = flat_mesh(8)
  state = optax.adam(1e-3).init({"dense": {"w": jnp.ones((2, 2))}})
  f = jax.shard_map(lambda s: jaxcoll.all_reduce(s, "data", op="mean", algorithm="ring"),
                    mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
  with pytest.raises(ValueError, match=r"^leaf \[0\]\.count of `x`: `op`='mean' needs a "):
    jax.eval_shape(f, state)
  g = jax.shard_map(lambda t: jaxcoll.reduce_scatter(t, "data", algorithm="ring"), mesh=mesh,
                    in_specs=P(), out_specs=P(), check_vma=False)
  with pytest.raises(ValueError, match=r"^leaf \['b'\] of `x`: reduce_scatter: dimension "):
    jax.eval_shape(g, {"a": jnp.ones(8), "b": jnp.ones(5)})


@pytest.mark.parametrize("bad", [-1, 2.5, True, "25MB", None])
def test_a_bad_bucket_bytes_is_one_line(bad):
  mesh = flat_mesh(2)
  f = jax.shard_map(lambda t: jaxcoll.all_reduce(t, "data", algorithm="ring", bucket_bytes=bad),
                    mesh=mesh, in_specs=P("data"), out_specs=P("data"))
  with pytest.raises(ValueError, match=r"^`bucket_bytes` must be an int >= 0: .* got "):
    jax.eval_shape(f, {"a": jnp.ones(4), "b": jnp.ones(2)})


def test_gradients_through_a_packed_all_reduce_match_native():
  mesh = flat_mesh(4)
  tree = {"w": jnp.arange(8.0).reshape(4, 2), "b": jnp.arange(4.0) + 1}

  def loss(t, algorithm):
    def body(v):
      out = jaxcoll.all_reduce(v, "data", op="mean", algorithm=algorithm)
      return jax.tree.map(lambda x: (x * x).sum()[None], out)
    per = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(t)
    return sum(v.sum() for v in jax.tree.leaves(per))

  want = jax.grad(loss)(tree, "native")
  for algorithm in ("ring", "tree"):
    got = jax.grad(loss)(tree, algorithm)
    for k in tree:
      np.testing.assert_allclose(got[k], want[k], rtol=1e-5, err_msg=f"{algorithm} {k}")
