"""The one spec table per collective, and the modules that read it."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxcoll
from jaxcoll import collectives
from jaxcoll.collectives import _dispatch, specs
from jaxcoll.comm_model import cost
from jaxcoll.comm_model.topology import Topology
from jaxcoll.observe import analysis, bench

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_one_entry_per_collective_in_order():
  assert tuple(specs.SPECS) == collectives.COLLECTIVES == (
      "all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all")
  assert all(s.name == name for name, s in specs.SPECS.items())
  assert analysis.KINDS == specs.HLO_KINDS
  assert {k: s.name for k, s in specs.BY_HLO_KIND.items()} == {
      "all-reduce": "all_reduce", "reduce-scatter": "reduce_scatter",
      "all-gather": "all_gather", "collective-broadcast": "broadcast",
      "all-to-all": "all_to_all"}


@pytest.mark.parametrize("n", [1, 2, 8, 6])
def test_busbw_factors_are_nccl_tests(n):
  want = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
          "all_gather": (n - 1) / n, "all_to_all": (n - 1) / n, "broadcast": 1.0, "reduce": 1.0}
  for name, factor in want.items():
    assert specs.SPECS[name].busbw_factor(n) == factor
    assert cost.bus_bandwidth_factor(name, n) == factor  # cost reads the table


def test_sizes_the_dispatcher_and_the_bench_read():
  group = _dispatch.Group(("data",), (8,))
  x = jnp.zeros((3, 4), jnp.float32)
  assert _dispatch.nccl_size_bytes("all_gather", x, group) == 8 * 12 * 4
  assert _dispatch.nccl_size_bytes("reduce_scatter", x, group) == 12 * 4
  assert bench.SPECS["all_gather"].input_count(64, 8) == 8
  assert bench.SPECS["all_reduce"].input_count(64, 8) == 64
  for name, harness in bench.SPECS.items():
    assert harness.spec is specs.SPECS[name]
    assert (harness.reduces, harness.rooted, harness.divisible) == (
        specs.SPECS[name].reduces, specs.SPECS[name].rooted, specs.SPECS[name].divisible)


def test_reference_of_the_table():
  xs = [np.arange(4, dtype=np.int32) + 10 * r for r in range(4)]
  (out,) = {tuple(y) for y in specs.SPECS["all_reduce"].reference(xs, "sum", 0)}
  assert out == (60, 64, 68, 72)
  outs = specs.SPECS["broadcast"].reference(xs, None, 2)
  assert [list(y) for y in outs] == [[20, 21, 22, 23]] * 4


@pytest.mark.parametrize("name", ["all_reduce", "reduce_scatter", "all_gather", "all_to_all"])
def test_hlo_kind_and_bytes_of_each_native_collective(name):
  mesh = jaxcoll.devices.flat_mesh(8)
  run = bench.SPECS[name].run
  f = jax.jit(jax.shard_map(lambda v: run(v, "data", "native", "sum", 0), mesh=mesh,
                            in_specs=P("data"), out_specs=P("data"), check_vma=False))
  per_rank = 64
  report = analysis.comm_report(f, jnp.zeros(8 * per_rank, jnp.float32))
  (op,) = report.ops
  spec = specs.SPECS[name]
  assert op.kind == spec.hlo_kind
  size = spec.size_count(per_rank, 8) * 4
  assert op.size_bytes == size
  assert op.bytes_sent_per_device == spec.busbw_factor(8) * size


def test_a_ppermute_step_costs_what_a_ring_step_costs():
  topo = Topology.preset("cpu-sim")
  (level,) = topo.levels
  assert cost.ppermute_step_seconds(4000, topo) == (
      topo.launch_s + level.latency_s + 4000 / level.bandwidth_Bps)
  s = 1 << 20
  assert cost.estimate("all_gather", s, topo, "ring") == pytest.approx(
      (topo.num_devices - 1) * cost.ppermute_step_seconds(s / topo.num_devices, topo), rel=1e-12)


def test_busbw_factors_are_written_once():
  """No module but the spec table restates a busbw factor."""
  found = []
  for path in sorted((REPO / "jaxcoll").rglob("*.py")):
    if path.name == "specs.py":
      continue
    for number, line in enumerate(path.read_text().splitlines(), 1):
      code = line.split("#")[0]
      if "(n - 1) / n" in code and not code.strip().startswith(("``", "*", "all-")):
        found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
  assert not found, found
