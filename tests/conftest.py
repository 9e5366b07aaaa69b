"""Test set-up: 8 emulated CPU devices before JAX starts, shared helpers."""

import os

os.environ.setdefault("JAXCOLL_CPU_DEVICES", "8")
os.environ.setdefault("XLA_FLAGS", "")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcoll  # noqa: E402, F401  (turns the simulation mode on)
from jaxcoll import checks  # noqa: E402


def run_per_rank(fn, per_rank_inputs, mesh, axes):
  """Runs ``fn(x) -> y`` on every device of ``mesh`` over ``axes``.

  ``per_rank_inputs`` is a pytree whose leaves are lists with one numpy
  array per rank (rank order of the flattened ``axes``); returns the same
  structure of lists of per-rank numpy outputs. Axes of the mesh not named in
  ``axes`` must have size 1.
  """
  spec = P(checks.axis_spec(axes))
  is_list = lambda v: isinstance(v, list)  # noqa: E731
  stacked = jax.tree.map(np.stack, per_rank_inputs, is_leaf=is_list)

  def body(tree):
    local = jax.tree.map(lambda v: v[0], tree)
    return jax.tree.map(lambda v: v[None], fn(local))

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
  out = f(stacked)
  return jax.tree.map(lambda v: list(np.asarray(v)), out)


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache_for_subprocesses(tmp_path_factory):
  """``tests/jobs.py``'s subprocesses share one XLA compilation cache per
  worker, in this run's temporary directory (pytest removes it with the run's
  other temporary files): a clean run starts cold. This process's own tests
  compile as they always did."""
  import jobs  # noqa: PLC0415

  jobs.XLA_CACHE = str(tmp_path_factory.getbasetemp() / "xla-cache")
  yield
  jobs.XLA_CACHE = None


@pytest.fixture(scope="session")
def devices():
  devs = jax.devices()
  assert len(devs) == 8, "tests expect 8 emulated CPU devices"
  return devs
