"""Every (collective, algorithm) against the numpy reference.

Sweep: group sizes 1..8 (one-axis sub-meshes of the 8 emulated devices; 4, 6
and 7 only with ``-m slow``) and
two-level meshes (2,4), (4,2), (2,3) over the tuple of axes ((4,2) for the
hierarchical and auto algorithms only, the others with ``-m slow``); float32,
bfloat16 and int32; shapes including (1,), odd lengths and 3-D arrays; every
op; every root (reduce and broadcast: every root and every case in the default
run, their whole root x case product with ``-m slow``). Each (collective,
algorithm, group) is one compiled program whose pytree input holds all the
cases, to keep compile time bounded.
"""


import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import run_per_rank
from jax.sharding import PartitionSpec as P

import jaxcoll
from jaxcoll.collectives import reference as ref
from jaxcoll.runtime.devices import flat_mesh, make_mesh

FLAT_SIZES = [1, 2, 3, 4, 5, 6, 7, 8]
TWO_LEVEL = [(2, 4), (4, 2), (2, 3)]
FLOAT_OPS = ("sum", "mean", "max", "min")
INT_OPS = ("sum", "max", "min")
# (dtype, shape) of the inputs of shape-free collectives.
CASES = [
    (np.float32, (1,)),
    (np.float32, (13,)),
    (np.float32, (3, 5, 2)),
    (ml_dtypes.bfloat16, (11,)),
    (np.int32, (1,)),
    (np.int32, (7, 3)),
]


# Group sizes 4, 6 and 7 run with `-m slow` (make test-all): 3 and 5 cover odd and
# non-power-of-two groups, the (2, 3) mesh a group of 6, 2 and 8 powers of two (and the
# (2, 4) mesh a level of 4), in the default run.
SLOW_FLAT_SIZES = (4, 6, 7)


def _groups():
  for n in FLAT_SIZES:
    yield f"n{n}", n, None
  for shape in TWO_LEVEL:
    yield f"mesh{shape[0]}x{shape[1]}", shape, ("node", "local")


def _mesh(shape, axes):
  if axes is None:
    return flat_mesh(shape), "data", shape
  n = int(np.prod(shape))
  return make_mesh(shape, axes, jax.devices()[:n]), axes, n


def _algorithms(collective, axes):
  names = [a for a in jaxcoll.algorithms(collective)]
  if axes is None:
    names = [a for a in names if a != "hierarchical"]
  return names


# The (4, 2) mesh runs hierarchical and auto (whose levels differ from (2, 4)'s)
# in the default run; every other algorithm treats the tuple of axes as one
# group of 8, which (2, 4) covers in the default run, as it does a tuple of
# axes in any order (test_tuple_of_axes_in_any_order_matches_lax, every collective
# but reduce): the rest of
# (4, 2) runs with `-m slow` (about 1/6 of this file's compile time).
SLOW_MESH_ALGORITHMS = ((4, 2), ("hierarchical", "auto"))


def _slow(shape, axes, algo):
  if axes is None:
    return shape in SLOW_FLAT_SIZES
  mesh, fast_algorithms = SLOW_MESH_ALGORITHMS
  return shape == mesh and algo not in fast_algorithms


def _params(collectives):
  for collective in collectives:
    for gid, shape, axes in _groups():
      for algo in _algorithms(collective, axes):
        marks = pytest.mark.slow if _slow(shape, axes, algo) else ()
        yield pytest.param(collective, algo, shape, axes, id=f"{collective}-{algo}-{gid}",
                           marks=marks)


# Rooted collectives: the default run checks every root with the cases whose path
# depends on it (reduce's float32 sum and mean: mean divides on the root only;
# broadcast's float32 carrying -0.0 and NaN, and its int32), and every case at the
# first, a middle and the last root. The rest of the root x case product (part
# "rest", about a quarter of these programs, groups of 4 or more) runs with `-m slow`.
def _rooted_params(collective):
  for p in _params([collective]):
    shape = p.values[2]
    yield pytest.param(*p.values, "default", id=p.id, marks=p.marks)
    if int(np.prod(shape)) > 3:  # groups of 1-3: the few roots are every root
      yield pytest.param(*p.values, "rest", id=f"{p.id}-rest", marks=pytest.mark.slow)


def _few_roots(n):
  return sorted({0, n // 2, n - 1})


def _split(plan, part):
  """``plan``: (case, default roots, every root it is checked at); returns the
  (case, root) pairs of ``part``: the default roots, or the others ("rest")."""
  if part == "default":
    return [(c, r) for c, default, _ in plan for r in default]
  return [(c, r) for c, default, every in plan for r in every if r not in default]


def _values(rng, dtype, shape, n):
  if np.issubdtype(dtype, np.integer):
    return [rng.integers(-100, 100, size=shape).astype(dtype) for _ in range(n)]
  return [rng.standard_normal(shape).astype(dtype) for _ in range(n)]


def _assert_matches(got, want, dtype, n, what):
  for rank, (g, w) in enumerate(zip(got, want)):
    assert g.shape == w.shape and g.dtype == w.dtype, (what, rank, g.shape, w.shape)
    if np.issubdtype(dtype, np.integer):
      np.testing.assert_array_equal(g, w, err_msg=f"{what} rank {rank}")
    else:
      eps = 1e-5 if dtype == np.float32 else 2.0**-7
      scale = max(1.0, float(np.max(np.abs(np.asarray(w, np.float64)))))
      np.testing.assert_allclose(
          np.asarray(g, np.float64),
          np.asarray(w, np.float64),
          rtol=eps,
          atol=eps * n * scale,
          err_msg=f"{what} rank {rank}",
      )


def _ops(dtype):
  return FLOAT_OPS if np.issubdtype(dtype, np.floating) or dtype == ml_dtypes.bfloat16 else INT_OPS


def _is_float(dtype):
  return not np.issubdtype(dtype, np.integer)


@pytest.mark.parametrize("collective,algo,shape,axes", list(_params(["all_reduce"])))
def test_all_reduce(collective, algo, shape, axes):
  mesh, axis_name, n = _mesh(shape, axes)
  rng = np.random.default_rng(n)
  inputs = {f"c{i}": _values(rng, dt, shp, n) for i, (dt, shp) in enumerate(CASES)}

  def fn(tree):
    out = {}
    for i, (dt, _) in enumerate(CASES):
      for op in _ops(dt):
        out[f"c{i}-{op}"] = jaxcoll.all_reduce(tree[f"c{i}"], axis_name, op=op, algorithm=algo)
    return out

  got = run_per_rank(fn, inputs, mesh, axis_name)
  for i, (dt, _) in enumerate(CASES):
    for op in _ops(dt):
      key = f"c{i}-{op}"
      _assert_matches(got[key], ref.all_reduce(inputs[f"c{i}"], op), dt, n, key)
      # Every device holds the same bits (what keeps DP replicas identical).
      for g in got[key][1:]:
        np.testing.assert_array_equal(g, got[key][0], err_msg=f"{key} differs across ranks")


@pytest.mark.parametrize("collective,algo,shape,axes", list(_params(["reduce_scatter"])))
def test_reduce_scatter(collective, algo, shape, axes):
  mesh, axis_name, n = _mesh(shape, axes)
  rng = np.random.default_rng(100 + n)
  # (dtype, shape, scatter_dimension)
  cases = [
      (np.float32, (n,), 0),
      (np.float32, (3 * n, 5), 0),
      (np.float32, (3, 2 * n), 1),
      (ml_dtypes.bfloat16, (n * 5,), 0),
      (np.int32, (2, 3, n), -1),
  ]
  inputs = {f"c{i}": _values(rng, dt, shp, n) for i, (dt, shp, _) in enumerate(cases)}

  def fn(tree):
    return {
        f"c{i}-{op}": jaxcoll.reduce_scatter(
            tree[f"c{i}"], axis_name, op=op, scatter_dimension=d, algorithm=algo
        )
        for i, (dt, _, d) in enumerate(cases)
        for op in _ops(dt)
    }

  got = run_per_rank(fn, inputs, mesh, axis_name)
  for i, (dt, _, d) in enumerate(cases):
    for op in _ops(dt):
      key = f"c{i}-{op}"
      want = ref.reduce_scatter(inputs[f"c{i}"], op, scatter_dimension=d)
      _assert_matches(got[key], want, dt, n, key)


@pytest.mark.parametrize("collective,algo,shape,axes", list(_params(["all_gather"])))
def test_all_gather(collective, algo, shape, axes):
  mesh, axis_name, n = _mesh(shape, axes)
  rng = np.random.default_rng(200 + n)
  cases = [
      (np.float32, (1,), 0),
      (np.float32, (3, 5), 1),
      (ml_dtypes.bfloat16, (7,), 0),
      (np.int32, (2, 3, 2), -1),
  ]
  inputs = {f"c{i}": _values(rng, dt, shp, n) for i, (dt, shp, _) in enumerate(cases)}

  def fn(tree):
    return {
        f"c{i}": jaxcoll.all_gather(tree[f"c{i}"], axis_name, axis=a, algorithm=algo)
        for i, (_, _, a) in enumerate(cases)
    }

  got = run_per_rank(fn, inputs, mesh, axis_name)
  for i, (_, _, a) in enumerate(cases):
    want = ref.all_gather(inputs[f"c{i}"], axis=a)
    for g, w in zip(got[f"c{i}"], want):  # pure data movement: exact
      np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("collective,algo,shape,axes,part",
                         list(_rooted_params("broadcast")))
def test_broadcast_every_root(collective, algo, shape, axes, part):
  mesh, axis_name, n = _mesh(shape, axes)
  rng = np.random.default_rng(300 + n)
  sel = [CASES[1], CASES[2], CASES[3], CASES[5]]
  inputs = {f"c{i}": _values(rng, dt, shp, n) for i, (dt, shp) in enumerate(sel)}
  # -0.0 and NaN must travel bit for bit.
  inputs["c0"][0][0] = -0.0
  inputs["c0"][-1][-1] = np.nan
  # Every root: c0 (float32, -0.0 and NaN) and c3 (int32); c1, c2 at _few_roots (and at
  # every other root in part "rest").
  pairs = _split([(i, range(n) if i in (0, 3) else _few_roots(n), range(n))
                  for i in range(len(sel))], part)

  def fn(tree):
    return {
        f"c{i}-r{root}": jaxcoll.broadcast(tree[f"c{i}"], axis_name, root=root, algorithm=algo)
        for i, root in pairs
    }

  got = run_per_rank(fn, inputs, mesh, axis_name)
  assert sorted(got) == sorted(f"c{i}-r{root}" for i, root in pairs)
  for i, root in pairs:
    want = ref.broadcast(inputs[f"c{i}"], root)
    for g, w in zip(got[f"c{i}-r{root}"], want):
      assert g.tobytes() == w.tobytes(), (i, root)


@pytest.mark.parametrize("collective,algo,shape,axes,part", list(_rooted_params("reduce")))
def test_reduce_every_root(collective, algo, shape, axes, part):
  mesh, axis_name, n = _mesh(shape, axes)
  rng = np.random.default_rng(400 + n)
  sel = [(np.float32, (13,)), (ml_dtypes.bfloat16, (5,)), (np.int32, (3, 3))]
  inputs = {f"c{i}": _values(rng, dt, shp, n) for i, (dt, shp) in enumerate(sel)}
  # float32: every op at every root (sum and mean in the default run, max and min at
  # _few_roots there and at the other roots in part "rest"); the other dtypes (their
  # casts do not depend on the root) sum and max at _few_roots.
  few, every = _few_roots(n), range(n)
  split = _split([((0, op), every if op in ("sum", "mean") else few, every) for op in FLOAT_OPS]
                 + [((i, op), few, few) for i in (1, 2) for op in ("sum", "max")], part)

  def fn(tree):
    return {
        f"c{i}-{op}-r{root}": jaxcoll.reduce(
            tree[f"c{i}"], axis_name, root=root, op=op, algorithm=algo
        )
        for (i, op), root in split
    }

  got = run_per_rank(fn, inputs, mesh, axis_name)
  assert sorted(got) == sorted(f"c{i}-{op}-r{root}" for (i, op), root in split)
  for key, outs in got.items():
    i, op, root = key.split("-")
    dt = sel[int(i[1:])][0]
    want = ref.reduce(inputs[i], int(root[1:]), op)
    _assert_matches(outs, want, dt, n, key)


@pytest.mark.parametrize("collective,algo,shape,axes", list(_params(["all_to_all"])))
def test_all_to_all(collective, algo, shape, axes):
  mesh, axis_name, n = _mesh(shape, axes)
  rng = np.random.default_rng(500 + n)
  cases = [
      (np.float32, (n,), 0, 0),
      (np.float32, (2 * n, 3), 0, 1),
      (np.int32, (3, n, 2), 1, 0),
      (ml_dtypes.bfloat16, (2, 3 * n), 1, 1),
  ]
  inputs = {f"c{i}": _values(rng, c[0], c[1], n) for i, c in enumerate(cases)}

  def fn(tree):
    return {
        f"c{i}": jaxcoll.all_to_all(tree[f"c{i}"], axis_name, s, c, algorithm=algo)
        for i, (_, _, s, c) in enumerate(cases)
    }

  got = run_per_rank(fn, inputs, mesh, axis_name)
  for i, (_, _, s, c) in enumerate(cases):
    for g, w in zip(got[f"c{i}"], ref.all_to_all(inputs[f"c{i}"], s, c)):
      np.testing.assert_array_equal(g, w)


_COMPLEX_AND_BOOL = {  # collective -> (call, reference) for complex64 and bool inputs
    "all_reduce": (lambda v, ax, a, op: jaxcoll.all_reduce(v, ax, op=op, algorithm=a),
                   lambda xs, op: ref.all_reduce(xs, op=op)),
    "reduce_scatter": (lambda v, ax, a, op: jaxcoll.reduce_scatter(v, ax, op=op, algorithm=a),
                       lambda xs, op: ref.reduce_scatter(xs, op=op)),
    "all_gather": (lambda v, ax, a, op: jaxcoll.all_gather(v, ax, algorithm=a),
                   lambda xs, op: ref.all_gather(xs)),
    "broadcast": (lambda v, ax, a, op: jaxcoll.broadcast(v, ax, root=1, algorithm=a),
                  lambda xs, op: ref.broadcast(xs, root=1)),
    "reduce": (lambda v, ax, a, op: jaxcoll.reduce(v, ax, root=2, op=op, algorithm=a),
               lambda xs, op: ref.reduce(xs, root=2, op=op)),
    "all_to_all": (lambda v, ax, a, op: jaxcoll.all_to_all(v, ax, 0, 1, algorithm=a),
                   lambda xs, op: ref.all_to_all(xs, 0, 1)),
}


@pytest.mark.parametrize("collective", list(_COMPLEX_AND_BOOL))
def test_complex_and_bool_inputs_match_the_reference(collective):
  # complex64 and bool were refused ("split complex values into real and imaginary parts",
  # "cast booleans to int32") although lax.psum / all_gather take them: complex runs as its
  # (real, imaginary) parts, bool as uint8 (max = any, min = all), on every algorithm.
  call, want_of = _COMPLEX_AND_BOOL[collective]
  rng = np.random.default_rng(7)
  n = 3  # odd: every algorithm's non-power-of-two path
  shape = (6, 2) if collective in ("reduce_scatter", "all_to_all") else (5,)
  cplx = [(rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(np.complex64)
          for _ in range(n)]
  flags = [rng.random(shape) > 0.5 for _ in range(n)]
  reduces = collective in ("all_reduce", "reduce_scatter", "reduce")
  cases = {"c": (cplx, "mean" if reduces else None), "b": (flags, "max" if reduces else None),
           "b_min": (flags, "min" if reduces else None)}
  cases = {k: v for k, v in cases.items() if reduces or k != "b_min"}
  mesh = flat_mesh(n)
  for algo in _algorithms(collective, None):
    got = run_per_rank(
        lambda t, a=algo: {k: call(t[k], "data", a, cases[k][1] or "sum") for k in t},
        {k: xs for k, (xs, _) in cases.items()}, mesh, "data")
    for k, (xs, op) in cases.items():
      want = want_of(xs, op or "sum")
      for rank in range(n):
        assert got[k][rank].dtype == xs[0].dtype, (algo, k)
        np.testing.assert_allclose(got[k][rank], want[rank], rtol=1e-5, atol=1e-5,
                                   err_msg=f"{collective} {algo} {k} rank {rank}")


@pytest.mark.parametrize("inner,outer", [("native", "recursive_doubling"), ("ring", "tree")])
def test_hierarchical_level_choice(inner, outer):
  axes = ("node", "local")
  mesh = make_mesh((2, 4), axes)
  rng = np.random.default_rng(7)
  xs = [rng.standard_normal(37).astype(np.float32) for _ in range(8)]
  spec = jaxcoll.Hierarchical(inner=inner, outer=outer)
  got = run_per_rank(lambda v: jaxcoll.all_reduce(v, axes, algorithm=spec), xs, mesh, axes)
  _assert_matches(got, ref.all_reduce(xs), np.float32, 8, "hierarchical")


def test_pmap_and_pytree():
  """Collectives work under jax.pmap and on pytrees, as lax does."""
  n = 4
  xs = np.arange(n * 6, dtype=np.float32).reshape(n, 6)
  tree = {"a": xs, "b": xs[:, :1] * 2}
  f = jax.pmap(
      lambda t: jaxcoll.all_reduce(t, "i", algorithm="ring"),
      axis_name="i",
      devices=jax.devices()[:n],
  )
  out = f(tree)
  np.testing.assert_allclose(out["a"], np.broadcast_to(xs.sum(0), xs.shape))
  np.testing.assert_allclose(out["b"], np.broadcast_to(2 * xs[:, :1].sum(0), (n, 1)))
  g = jax.pmap(
      lambda v: jaxcoll.all_gather(v, "i", algorithm="recursive_doubling"),
      axis_name="i",
      devices=jax.devices()[:n],
  )
  np.testing.assert_array_equal(g(xs)[2], xs.reshape(-1))


# Over a jax.vmap(axis_name=...) axis, as lax.psum runs there (one device, no mesh): every
# algorithm but native failed, with "pvary should be called under jax.shard_map" (native,
# auto) or AssertionError "Permutation doesn't match the axis size!" (the trees and
# recursive algorithms, whose steps move part of the group: vmap's ppermute takes whole
# permutations only).
_VMAP_CALLS = {
    "all_reduce": (lambda v, a: jaxcoll.all_reduce(v, "i", op="max", algorithm=a),
                   lambda xs: ref.all_reduce(xs, "max")),
    "reduce_scatter": (lambda v, a: jaxcoll.reduce_scatter(v, "i", algorithm=a),
                       lambda xs: ref.reduce_scatter(xs)),
    "all_gather": (lambda v, a: jaxcoll.all_gather(v, "i", algorithm=a),
                   lambda xs: ref.all_gather(xs)),
    "broadcast": (lambda v, a: jaxcoll.broadcast(v, "i", root=3, algorithm=a),
                  lambda xs: ref.broadcast(xs, root=3)),
    "reduce": (lambda v, a: jaxcoll.reduce(v, "i", root=4, op="min", algorithm=a),
               lambda xs: ref.reduce(xs, root=4, op="min")),
    "all_to_all": (lambda v, a: jaxcoll.all_to_all(v, "i", 0, 0, algorithm=a),
                   lambda xs: ref.all_to_all(xs, 0, 0)),
}


@pytest.mark.parametrize("collective", list(_VMAP_CALLS))
def test_every_algorithm_over_a_vmap_axis_matches_the_reference(collective):
  call, want_of = _VMAP_CALLS[collective]
  n = 5  # odd: the trees' and recursive algorithms' partial steps
  rng = np.random.default_rng(3)
  xs = [rng.integers(-50, 50, size=(10,)).astype(np.int32) for _ in range(n)]
  want = np.stack(want_of(xs))
  algos = _algorithms(collective, None)
  outs = jax.jit(jax.vmap(lambda v: [call(v, a) for a in algos], axis_name="i"))(np.stack(xs))
  for algo, got in zip(algos, outs, strict=True):
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=algo)


def test_a_sub_group_of_a_vmap_axis_is_still_a_vmap_group():
  # Group.sub dropped `vmapped`: an algorithm on the sub-group would have used vmap's
  # ppermute with a partial permutation (its batching rule refuses) and pcast a vmap axis.
  from jaxcoll.collectives._group import Group  # noqa: PLC0415

  group = Group(("i",), (5,), vmapped=True)
  assert group.sub(("i",)) == group and group.sub(("i",)).vmapped
  assert not Group(("a", "b"), (2, 3)).sub(("b",)).vmapped


def test_a_group_mixing_a_vmap_axis_with_mesh_axes_is_one_line():
  mesh = flat_mesh(2)
  f = jax.shard_map(
      jax.vmap(lambda v: jaxcoll.all_reduce(v, ("data", "i"), algorithm="ring"), axis_name="i"),
      mesh=mesh, in_specs=P("data"), out_specs=P("data"))
  with pytest.raises(ValueError, match="mixes the jax.vmap axis 'i' with other axes"):
    f(jnp.ones((4, 3)))


def test_algorithms_lists_registry():
  assert jaxcoll.algorithms("all_reduce") == (
      "native",
      "ring",
      "bidirectional_ring",
      "tree",
      "recursive_doubling",
      "halving_doubling",
      "hierarchical",
      "auto",
  )
  assert set(jaxcoll.algorithms("all_to_all")) == {"native", "pairwise", "auto"}
  with pytest.raises(ValueError, match="valid collectives: all_reduce"):
    jaxcoll.algorithms("allreduce")





# Tuples of axes not in mesh order: ranks follow the tuple (as lax.axis_index
# and lax.all_gather do), while lax.ppermute numbers devices in mesh order.
_UNORDERED = [((2, 4), ("a", "b"), ("b", "a")), ((2, 2, 2), ("a", "b", "c"), ("c", "a", "b"))]


@pytest.mark.parametrize(
    "collective", ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all"]
)
@pytest.mark.parametrize("shape,names,axes", _UNORDERED, ids=["b,a", "c,a,b"])
def test_tuple_of_axes_in_any_order_matches_lax(collective, shape, names, axes):
  mesh = make_mesh(shape, names)
  lax_twin = {
      "all_reduce": lambda x: jax.lax.psum(x, axes),
      "reduce_scatter": lambda x: jax.lax.psum_scatter(x, axes, tiled=True),
      "all_gather": lambda x: jax.lax.all_gather(x, axes, tiled=True),
      "broadcast": lambda x: jax.lax.all_gather(x, axes)[3],
      "all_to_all": lambda x: jax.lax.all_to_all(x, axes, 0, 0, tiled=True),
  }[collective]
  args = (0, 0) if collective == "all_to_all" else ()
  kwargs = {"root": 3} if collective == "broadcast" else {}
  algos = [a for a in jaxcoll.algorithms(collective) if a != "auto"]

  def body(v):
    x = v[0]
    ours = [getattr(jaxcoll, collective)(x, axes, *args, algorithm=a, **kwargs) for a in algos]
    return jnp.stack([lax_twin(x), *ours])[None]

  x = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16)
  out = np.asarray(jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=P(names), out_specs=P(names), check_vma=False))(x))
  for i, algo in enumerate(algos, start=1):
    np.testing.assert_array_equal(out[:, i], out[:, 0], err_msg=algo)


@pytest.mark.slow  # tests/collectives/test_gradients.py checks every algorithm's derivatives (check_grads) by default
def test_gradients_match_lax():
  """Reverse mode through every algorithm: the transposes of the collectives."""
  mesh = flat_mesh(4)
  x = jnp.arange(1.0, 13.0)
  scale = jnp.arange(1.0, 4.0)

  def loss(op):
    f = jax.shard_map(lambda v: op(v * scale) ** 2, mesh=mesh, in_specs=P("data"),
                      out_specs=P("data"))
    return lambda v: jnp.sum(f(v))

  cases = {
      "all_reduce": (lambda a: lambda v: jaxcoll.all_reduce(v, "data", algorithm=a),
                     lambda v: jax.lax.psum(v, "data")),
      "broadcast": (lambda a: lambda v: jaxcoll.broadcast(v, "data", root=2, algorithm=a),
                    lambda v: jax.lax.all_gather(v, "data")[2]),
      "all_gather": (lambda a: lambda v: jaxcoll.all_gather(v, "data", algorithm=a)[:3],
                     lambda v: jax.lax.all_gather(v, "data", tiled=True)[:3]),
  }
  for name, (ours, twin) in cases.items():
    want = jax.grad(loss(twin))(x)
    for algo in jaxcoll.algorithms(name):
      if algo != "hierarchical":
        got = jax.grad(loss(ours(algo)))(x)
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"{name} {algo}")
