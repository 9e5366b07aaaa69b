"""Cases a user brought that no other test had tried (engineer trial27): an ML engineer's own
pytrees, meshes and jitted functions through the collectives and the measurement tools
(bench_pytree, tune, compile_time, comm_report). Each test of a fix fails without it."""

import sys

import jax
import jax.numpy as jnp
import jobs
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxcoll
from experiments import _cli


@pytest.mark.parametrize("module,flag", [
    ("bench_pytree", "--leaves"),
    ("compile_time", "--devices"),
    ("tune", "--group_sizes"),
], ids=["bench_pytree", "compile_time", "tune"])
def test_a_count_written_with_a_superscript_digit_is_one_line_naming_the_flag(module, flag):
  # str.isdigit takes '²' and int() refuses it: bench_pytree --leaves=² and compile_time
  # --devices=² were a ValueError traceback (exit 1), tune --group_sizes=² the line
  # "invalid literal for int() with base 10: '²'", which named no flag.
  out = jobs.forked([sys.executable, "-m", f"experiments.{module}", f"{flag}=4,²",
                     "--out=/tmp/never-written.json"] if module == "tune" else
                    [sys.executable, "-m", f"experiments.{module}", f"{flag}=4,²"], devices=6)
  line = jobs.one_line(out, prefix=f"{module}: error: `{flag}`")
  assert "²'" in line and "invalid literal" not in line, line


def test_whole_number_reads_ascii_counts_only():
  assert [_cli.whole_number(t) for t in ("8", " 12 ", "0", "²", "", "-3", "1e3", "٣")] == [
      8, 12, 0, None, None, None, None, None]


@pytest.mark.parametrize("mbytes,says", [
    ("inf", "`--mbytes`=inf: give the tree's size in MB, > 0."),  # was an OverflowError
    # 10 TB a device: XLA's RESOURCE_EXHAUSTED traceback after tracing (a smaller excess gets
    # the process killed by the host instead).
    ("1e7", "`--mbytes`=1e+07: a tree of 9.54 TiB a device needs at least 229 TiB for the "
            "tree, its result and the packed buffers of each device, in this host's memory"),
], ids=["inf", "1e7"])
def test_bench_pytree_refuses_a_tree_it_cannot_build_in_one_line(mbytes, says):
  out = jobs.forked([sys.executable, "-m", "experiments.bench_pytree", f"--mbytes={mbytes}",
                     "--leaves=3", "--algorithms=native"])
  line = jobs.one_line(out, prefix="bench_pytree: error: ")
  assert says in line, line
  if mbytes != "inf":  # the largest that fits depends on this host's memory
    assert "; use --mbytes of at most " in line, line


def test_bench_pytree_memory_check_names_the_largest_tree_that_fits():
  from jaxcoll.observe import bench  # noqa: PLC0415  (bench_pytree defines --json, as memory_plan)

  # 8 CPU devices share 24 GiB: 3 trees a device, so 1 GiB a device fits, 1.1 does not.
  bench.check_tree_memory(2**30, 8, host_bytes=24 * 2**30)
  with pytest.raises(ValueError, match=r"needs at least 26.4 GiB .* but there are 24 GiB; "
                     r"use --mbytes of at most 1024\.$"):
    bench.check_tree_memory(int(1.1 * 2**30), 8, host_bytes=24 * 2**30)


def _key_bits(tree):

  is_key = lambda v: jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key)  # noqa: E731
  return jax.tree.map(lambda v: np.asarray(jax.random.key_data(v) if is_key(v) else v), tree)


@pytest.mark.parametrize("collective,algorithm,kwargs", [
    ("broadcast", "binomial_tree", {"root": 2}),
    ("broadcast", "native", {"root": 1}),
    ("all_gather", "ring", {"axis": -1}),
    ("all_to_all", "pairwise", {"split_axis": 1, "concat_axis": 0}),
], ids=["broadcast-binomial_tree", "broadcast-native", "all_gather-ring", "all_to_all-pairwise"])
def test_prng_keys_in_a_pytree_move_as_lax_moves_them(collective, algorithm, kwargs):
  # A train state with its dropout key (jax.random.key: dtype key<fry>) broadcast from one
  # device raised numpy's TypeError "Cannot interpret 'key<fry>' as a data type", for every
  # algorithm, naming neither the leaf nor a fix; lax.all_gather / all_to_all move keys.


  mesh = jaxcoll.devices.flat_mesh(4)
  state = {"w": jnp.arange(16.0).reshape(4, 4),
           "rng": jax.random.split(jax.random.key(0), 16).reshape(4, 4),
           "rbg": jax.random.split(jax.random.key(1, impl="rbg"), 16).reshape(4, 4)}

  def ours(t):
    if collective == "broadcast":
      out = jaxcoll.broadcast(jax.tree.map(lambda v: v[0], t), "data", algorithm=algorithm,
                              **kwargs)
      return jax.tree.map(lambda v: v[None], out)
    return getattr(jaxcoll, collective)(t, "data", algorithm=algorithm, **kwargs)

  def lax(t):
    if collective == "broadcast":
      return jax.tree.map(lambda v: jnp.broadcast_to(v[kwargs["root"]], (1, *v.shape[1:])),
                          jax.lax.all_gather(t, "data", tiled=True))
    if collective == "all_gather":
      return jax.lax.all_gather(t, "data", axis=1, tiled=True)
    return jax.lax.all_to_all(t, "data", 1, 0, tiled=True)

  run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"),  # noqa: E731
                                        out_specs=P("data")))(state)
  got, want = run(ours), run(lax)
  assert (str(got["rng"].dtype), str(got["rbg"].dtype)) == ("key<fry>", "key<rbg>")
  jax.tree.map(np.testing.assert_array_equal, _key_bits(got), _key_bits(want))


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "reduce"])
def test_a_reduction_of_prng_keys_is_one_line_naming_the_leaf(collective):


  mesh = jaxcoll.devices.flat_mesh(4)
  state = {"w": jnp.ones((16, 4)), "z_rng": jax.random.split(jax.random.key(0), 16)}
  f = jax.jit(jax.shard_map(lambda t: getattr(jaxcoll, collective)(t, "data", op="max"),
                            mesh=mesh, in_specs=P("data"), out_specs=P("data")))
  with pytest.raises(ValueError, match=r"^leaf \['z_rng'\] of `x`: a PRNG key array \(key<fry>\) "
                     r"has no sum, mean, max or min: move keys with broadcast, all_gather or "
                     r"all_to_all, or reduce their bits, jax.random.key_data\(x\)\.\n"):
    f(state)


def test_an_nnx_model_state_with_its_rngs_broadcasts_and_updates_the_model():
  # nnx.state(model) of a model with Dropout holds its nnx.Rngs' key arrays (key<fry>): the
  # broadcast of a whole nnx state failed on them (numpy's "Cannot interpret 'key<fry>'").


  class Net(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(3, 4, rngs=rngs)
      self.dropout = nnx.Dropout(0.1, rngs=rngs)

  model = Net(nnx.Rngs(0, dropout=1))
  state = nnx.state(model)
  kernel = jnp.array(model.linear.kernel[...])
  key_bits = jax.random.key_data(model.dropout.rngs.key[...])

  def body(s):  # each device's own weights; device 1's win
    s = jax.tree.map(lambda v: v * (jax.lax.axis_index("data") + 1)
                     if jnp.issubdtype(v.dtype, jnp.floating) else v, s)
    return jaxcoll.broadcast(s, "data", root=1, algorithm="binomial_tree")

  out = jax.jit(jax.shard_map(body, mesh=jaxcoll.devices.flat_mesh(4), in_specs=(P(),),
                              out_specs=P(), check_vma=False))(state)
  nnx.update(model, out)
  assert (model.linear.kernel[...] == 2 * kernel).all()
  assert str(model.dropout.rngs.key[...].dtype) == "key<fry>"
  assert (jax.random.key_data(model.dropout.rngs.key[...]) == key_bits).all()


def test_bench_pytree_keeps_its_columns_in_line_for_long_algorithm_names():
  # '{algorithm:<10}': bidirectional_ring and halving_doubling pushed every column of their
  # rows 6-8 characters right of the header's.
  out = jobs.forked([sys.executable, "-m", "experiments.bench_pytree", "--leaves=2",
                     "--mbytes=0.001", "--iters=1", "--algorithms=bidirectional_ring,ring"],
                    devices=3, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.splitlines()
  assert lines[0].startswith("3 CPU devices; ")
  header, rows = lines[1], lines[2:]
  assert len(rows) == 4
  mode_at, permutes_end = header.index("mode"), header.index("permutes") + len("permutes")
  for row in rows:
    leaves, algorithm, mode, permutes = row.split()[:4]
    assert row.index(mode, len(leaves) + 2 + len(algorithm)) == mode_at, (header, row)
    assert row[:permutes_end].endswith(f" {permutes}"), (header, row)
