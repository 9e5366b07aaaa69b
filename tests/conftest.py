"""Test set-up: 8 emulated CPU devices before JAX starts, shared helpers."""

import os
import shutil
import signal
import tempfile

os.environ.setdefault("JAXCOLL_CPU_DEVICES", "8")
os.environ.setdefault("XLA_FLAGS", "")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcoll  # noqa: E402, F401  (turns the simulation mode on)
from jaxcoll import checks  # noqa: E402

# The collectives sweep (tests/collectives/test_collectives.py: hundreds of programs, each
# run once on a few small arrays) is compile-bound: without LLVM's optimizations (XLA's
# backend level 0) each compiles in ~17% less CPU; the program, its HLO and the numpy
# reference it is checked against are the same (the trainers' tests run the collectives
# compiled as users do).
SWEEP_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


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
  out = f.lower(stacked).compile(SWEEP_COMPILER_OPTIONS)(stacked)
  return jax.tree.map(lambda v: list(np.asarray(v)), out)


# One XLA persistent compilation cache per test run, shared by the xdist workers and the
# subprocesses of tests/jobs.py: dozens of tests compile the same programs again (a new
# Trainer, a new jit of the same function, the CLI on the smoke config), in either worker;
# a hit loads the very executable a compile would make, so every result is the same. The
# process that starts the run makes the directory (before the workers start: they inherit
# its name) and removes it when the run ends; a clean run starts cold. JAX writes an entry
# without a lock: a reader that meets an entry another worker is still writing warns and
# compiles (the same program), and the last writer's whole entry stays. Set before any test
# compiles (JAX reads the setting at its first compile); the directory's name is part of
# XLA's compile options, so the workers share hits only through one name. tests/train with
# -n 2: 528 -> 482 s of CPU (one cache per worker -> one per run).
_SHARED = "_JAXCOLL_TESTS_XLA_CACHE"
_OWN_CACHE = _SHARED not in os.environ
if _OWN_CACHE:
  os.environ[_SHARED] = tempfile.mkdtemp(prefix="jaxcoll-test-xla-cache-")
_XLA_CACHE = os.environ[_SHARED]
jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # the small ones too


def pytest_configure(config):
  import jobs  # noqa: PLC0415

  jobs.XLA_CACHE = _XLA_CACHE


def pytest_unconfigure(config):
  import jobs  # noqa: PLC0415

  jobs.close_fork_server()
  jobs.XLA_CACHE = None
  if _OWN_CACHE:
    shutil.rmtree(_XLA_CACHE, ignore_errors=True)


@pytest.fixture
def fresh(monkeypatch):
  """A clean environment (no JAXCOLL_*, SLURM_*, OMPI_* but the device count) and no
  remembered ClusterInfo: ``jaxcoll.distributed`` starts as in a new process."""
  from jaxcoll.runtime import distributed  # noqa: PLC0415

  for name in list(os.environ):
    if name.startswith(("JAXCOLL_", "SLURM_", "OMPI_")) and name != "JAXCOLL_CPU_DEVICES":
      monkeypatch.delenv(name)
  monkeypatch.setattr(distributed, "_info", None)
  return monkeypatch


@pytest.fixture(scope="session")
def devices():
  devs = jax.devices()
  assert len(devs) == 8, "tests expect 8 emulated CPU devices"
  return devs


@pytest.fixture
def sigint_as_from_a_terminal():
  """Ctrl-C as a run started from a terminal gets it. A suite started as a background job of
  a script (`( make test & )`) ignores SIGINT, its children inherit that, and the run keeps an
  ignored SIGINT ignored on purpose (the README's `cmd &`): the Ctrl-C tests then timed out."""
  previous = signal.getsignal(signal.SIGINT)
  if previous is signal.SIG_IGN:  # a handler of ours: the child starts with SIGINT's default
    signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, previous)
