"""Cost model and topology: formulas with symbolic alpha/beta/gamma, presets."""

import json
import math

import pytest

from jaxcoll.comm_model import cost
from jaxcoll.collectives import COLLECTIVES, Hierarchical, algorithms
from jaxcoll.collectives._group import Group
from jaxcoll.comm_model.topology import PRESETS, Level, Topology

S = 1 << 20  # bytes
INF = math.inf


def flat(n, *, alpha=0.0, bw=INF, gamma=INF, torus=False, launch=0.0):
  return Topology((Level("x", n, alpha, bw, gamma, torus=torus),), launch_s=launch)


def two_level(m, l, *, outer=(0.0, INF, INF), inner=(0.0, INF, INF), inr=(False, False)):
  return Topology((
      Level("node", m, *outer, in_network_reduction=inr[0]),
      Level("local", l, *inner, in_network_reduction=inr[1]),
  ))


def log2c(n):
  return math.ceil(math.log2(n))


def fold(n):
  """(p, extra fold steps) of the recursive algorithms."""
  p = 1 << (n.bit_length() - 1)
  return p, (2 if n != p else 0)


# --------------------------------------------------------------- step counts

STEPS = {
    ("all_reduce", "ring"): lambda n: 2 * (n - 1),
    ("all_reduce", "bidirectional_ring"): lambda n: 2 * (n - 1),
    ("all_reduce", "tree"): lambda n: 2 * log2c(n),
    ("all_reduce", "recursive_doubling"): lambda n: int(math.log2(fold(n)[0])) + fold(n)[1],
    ("all_reduce", "halving_doubling"): lambda n: 2 * int(math.log2(fold(n)[0])) + fold(n)[1],
    ("reduce_scatter", "ring"): lambda n: n - 1,
    ("reduce_scatter", "recursive_halving"): lambda n: int(math.log2(n)) if n & (n - 1) == 0
    else n - 1,
    ("reduce_scatter", "pairwise"): lambda n: n - 1,
    ("all_gather", "ring"): lambda n: n - 1,
    ("all_gather", "recursive_doubling"): log2c,
    ("all_gather", "bruck"): log2c,
    ("broadcast", "binomial_tree"): log2c,
    ("broadcast", "scatter_allgather"): lambda n: log2c(n) + n - 1,
    ("reduce", "binomial_tree"): log2c,
    ("reduce", "reduce_scatter_gather"): lambda n: n - 1 + log2c(n),
    ("all_to_all", "pairwise"): lambda n: n - 1,
}

# Bytes one device sends, as a multiple of S.
BYTES = {
    ("all_reduce", "ring"): lambda n: 2 * (n - 1) / n,
    ("all_reduce", "bidirectional_ring"): lambda n: 2 * (n - 1) / n,
    ("all_reduce", "tree"): lambda n: log2c(n) if n & (n - 1) == 0 else None,
    ("all_reduce", "recursive_doubling"): lambda n: math.log2(fold(n)[0]) + fold(n)[1],
    ("all_reduce", "halving_doubling"): lambda n: 2 * (fold(n)[0] - 1) / fold(n)[0] + fold(n)[1],
    ("reduce_scatter", "ring"): lambda n: (n - 1) / n,
    ("reduce_scatter", "recursive_halving"): lambda n: (n - 1) / n,
    ("reduce_scatter", "pairwise"): lambda n: (n - 1) / n,
    ("all_gather", "ring"): lambda n: (n - 1) / n,
    ("all_gather", "recursive_doubling"): lambda n: (n - 1) / n,  # Bruck too
    ("all_gather", "bruck"): lambda n: (n - 1) / n,
    ("broadcast", "binomial_tree"): log2c,
    ("broadcast", "scatter_allgather"): lambda n: 2 * (n - 1) / n if n & (n - 1) == 0 else None,
    ("reduce", "binomial_tree"): log2c,
    ("reduce", "reduce_scatter_gather"): lambda n: 2 * (n - 1) / n if n & (n - 1) == 0 else None,
    ("all_to_all", "pairwise"): lambda n: (n - 1) / n,
}

# Bytes one device reduces, as a multiple of S (powers of two).
REDUCED = {
    ("all_reduce", "ring"): lambda n: (n - 1) / n,
    ("all_reduce", "tree"): lambda n: math.log2(n) / 2,
    ("all_reduce", "recursive_doubling"): math.log2,
    ("all_reduce", "halving_doubling"): lambda n: (n - 1) / n,
    ("reduce_scatter", "ring"): lambda n: (n - 1) / n,
    ("reduce_scatter", "recursive_halving"): lambda n: (n - 1) / n,
    ("reduce_scatter", "pairwise"): lambda n: (n - 1) / n,
    ("all_gather", "ring"): lambda n: 0.0,
    ("broadcast", "binomial_tree"): lambda n: 0.0,
    ("reduce", "binomial_tree"): math.log2,
    ("reduce", "reduce_scatter_gather"): lambda n: (n - 1) / n,
}

SIZES = [2, 3, 5, 6, 8, 12, 16]


def test_every_registered_algorithm_has_a_formula():
  for c in COLLECTIVES:
    registered = {a for a in algorithms(c) if a != "auto"}
    assert set(cost.modelled_algorithms(c)) == registered, c
    flat_ones = registered - {"native", "hierarchical"}
    assert flat_ones == {a for (cc, a) in STEPS if cc == c}, c


@pytest.mark.parametrize("key", sorted(STEPS), ids="/".join)
@pytest.mark.parametrize("n", SIZES)
def test_step_count(key, n):
  collective, algo = key
  t = cost.estimate(collective, S, flat(n, alpha=1.0), algo)
  assert t == pytest.approx(STEPS[key](n))


# Some closed forms are given for powers of two only (BYTES[key](n) is None).
_BYTES_CASES = [(k, n) for k in sorted(BYTES) for n in SIZES if BYTES[k](n) is not None]


@pytest.mark.parametrize("key,n", _BYTES_CASES, ids=[f"{'/'.join(k)}-{n}" for k, n in _BYTES_CASES])
def test_bytes_sent(key, n):
  collective, algo = key
  expected = BYTES[key](n)
  t = cost.estimate(collective, S, flat(n, bw=1.0), algo)
  assert t == pytest.approx(expected * S)


@pytest.mark.parametrize("key", sorted(REDUCED), ids="/".join)
@pytest.mark.parametrize("n", [2, 4, 8, 32])
def test_bytes_reduced(key, n):
  collective, algo = key
  t = cost.estimate(collective, S, flat(n, gamma=1.0), algo)
  assert t == pytest.approx(REDUCED[key](n) * S)


def test_launch_cost_is_paid_per_ppermute_step_and_once_by_native():
  topo = flat(8, launch=1.0)
  assert cost.estimate("all_reduce", S, topo, "ring") == 14
  assert cost.estimate("all_reduce", S, topo, "recursive_doubling") == 3
  assert cost.estimate("all_reduce", S, topo, "native") == 1


def test_bidirectional_ring_is_twice_as_fast_only_on_a_torus():
  for torus, ratio in ((False, 1.0), (True, 0.5)):
    topo = flat(8, bw=1.0, torus=torus)
    bi = cost.estimate("all_reduce", S, topo, "bidirectional_ring")
    assert bi == pytest.approx(ratio * cost.estimate("all_reduce", S, topo, "ring"))


def test_single_device_costs_nothing():
  for c in COLLECTIVES:
    for a in cost.modelled_algorithms(c):
      if a != "hierarchical":
        assert cost.estimate(c, S, flat(1, alpha=1.0, bw=1.0), a) == 0.0


# --------------------------------------------------------------- multi-level


def test_flat_ring_over_two_levels_moves_everything_at_the_slow_speed():
  topo = two_level(4, 8, outer=(0.0, 1.0, INF))  # inner links free
  n = 32
  assert cost.estimate("all_reduce", S, topo, "ring") == pytest.approx(2 * (n - 1) / n * S)
  assert cost.estimate("all_gather", S, topo, "ring") == pytest.approx((n - 1) / n * S)


def test_ring_steps_pay_the_slow_latency():
  topo = two_level(4, 8, outer=(10.0, INF, INF), inner=(1.0, INF, INF))
  assert cost.estimate("all_reduce", S, topo, "ring") == pytest.approx(2 * 31 * 10.0)


def test_recursive_algorithms_cross_the_slow_level_only_on_far_steps():
  topo = two_level(2, 4, outer=(10.0, 1.0, INF), inner=(1.0, INF, INF))
  # distances 1, 2 inside the node, 4 across: one slow step of S.
  assert cost.estimate("all_reduce", S, topo, "recursive_doubling") == pytest.approx(
      2 * 1.0 + 10.0 + S
  )
  # halving: d=4 sends S/2 across first; doubling: d=4 sends S/2 across last.
  assert cost.estimate("all_reduce", S, topo, "halving_doubling") == pytest.approx(
      4 * 1.0 + 2 * 10.0 + S
  )


def test_hierarchical_sends_only_a_shard_across_nodes():
  m, l = 4, 8
  topo = two_level(m, l, outer=(0.0, 1.0, INF))
  expected = 2 * (m - 1) / m * S / l
  assert cost.estimate("all_reduce", S, topo, "hierarchical") == pytest.approx(expected)
  assert cost.estimate("reduce_scatter", S, topo, "hierarchical") == pytest.approx(
      (m - 1) / m * S / l
  )
  assert cost.estimate("all_gather", S, topo, "hierarchical") == pytest.approx(
      (m - 1) / m * S / l
  )


def test_hierarchical_is_the_sum_of_its_levels():
  topo = Topology.preset("dgx-h100", nodes=4)
  outer = Topology(topo.levels[:1], launch_s=topo.launch_s)
  inner = Topology(topo.levels[1:], launch_s=topo.launch_s)
  spec = Hierarchical(inner="ring", outer="halving_doubling")
  expected = (
      cost.estimate("reduce_scatter", S, inner, "ring")
      + cost.estimate("all_reduce", S / 8, outer, "halving_doubling")
      + cost.estimate("all_gather", S, inner, "ring")
  )
  assert cost.estimate("all_reduce", S, topo, spec) == pytest.approx(expected)
  assert cost.estimate("all_reduce", S, topo, "hierarchical") == pytest.approx(
      cost.estimate("all_reduce", S, topo, Hierarchical())
  )


def test_hierarchical_needs_two_levels():
  with pytest.raises(ValueError, match=">= 2 levels"):
    cost.estimate("all_reduce", S, flat(8), "hierarchical")


# --------------------------------------------------------------- native (NCCL model)


def test_native_latency_follows_nccl_ring_and_tree():
  m, l = 4, 8
  topo = two_level(m, l, outer=(10.0, INF, INF), inner=(1.0, INF, INF))
  ring = 2 * (m * l - m) * 1.0 + 2 * (m - 1) * 10.0  # tuning.cc nsteps / nInterSteps
  tree = 2 * ((l - 1) * 1.0 + math.log2(m) * 10.0)
  assert cost.estimate("all_reduce", 0, topo, "native") == pytest.approx(min(ring, tree))
  assert cost.estimate("reduce_scatter", 0, topo, "native") == pytest.approx(ring / 2)


def test_native_rings_use_every_nic_of_a_node():
  # 8 rails of 10 B/s (80) are slower than the 100 B/s inner links.
  topo = two_level(4, 8, outer=(0.0, 10.0, INF), inner=(0.0, 100.0, INF))
  assert cost.estimate("all_gather", S, topo, "native") == pytest.approx(31 / 32 * S / 80)


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "reduce"])
def test_in_network_reduction_halves_native_data_and_removes_gamma(collective):
  off = two_level(2, 4, outer=(0.0, 1.0, 1.0), inner=(0.0, INF, INF))
  on = two_level(2, 4, outer=(0.0, 1.0, 1.0), inner=(0.0, INF, INF), inr=(True, True))
  n = 8
  data = cost.bus_bandwidth_factor(collective, n) * S / 4  # 4 rails
  t_on = cost.estimate(collective, S, on, "native")
  assert t_on == pytest.approx(data / 2)
  assert cost.estimate(collective, S, off, "native") > 2 * t_on - 1e-9
  # ppermute algorithms cannot use it.
  assert cost.estimate(collective, S, on, "ring" if collective != "reduce" else
                       "binomial_tree") == cost.estimate(
      collective, S, off, "ring" if collective != "reduce" else "binomial_tree")


# --------------------------------------------------------------- bus factors


@pytest.mark.parametrize(
    "collective,n,factor",
    [
        ("all_reduce", 8, 2 * 7 / 8),
        ("all_reduce", 1, 0.0),
        ("reduce_scatter", 8, 7 / 8),
        ("all_gather", 4, 3 / 4),
        ("all_to_all", 16, 15 / 16),
        ("broadcast", 8, 1.0),
        ("reduce", 8, 1.0),
    ],
)
def test_bus_bandwidth_factor(collective, n, factor):
  assert cost.bus_bandwidth_factor(collective, n) == pytest.approx(factor)


def test_bus_bandwidth_factor_rejects_bad_n():
  with pytest.raises(ValueError, match="`n`"):
    cost.bus_bandwidth_factor("all_reduce", 0)


# --------------------------------------------------------------- presets, choices


def busbw(collective, nbytes, topo, algo):
  t = cost.estimate(collective, nbytes, topo, algo)
  return nbytes / t * cost.bus_bandwidth_factor(collective, topo.num_devices)


def test_dgx_h100_ring_all_reduce_matches_nccl_tests():
  one = busbw("all_reduce", 1 << 30, Topology.preset("dgx-h100"), "ring")
  four = busbw("all_reduce", 1 << 30, Topology.preset("dgx-h100", nodes=4), "ring")
  assert one == pytest.approx(370e9, rel=0.15)
  assert four == pytest.approx(47e9, rel=0.15)


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("nodes", [1, 4])
def test_time_grows_with_size(collective, nodes):
  topo = Topology.preset("dgx-h100", nodes=nodes)
  sizes = [0, 1 << 10, 1 << 16, 1 << 20, 1 << 26, 1 << 30]
  for algo, times in cost.time_table(collective, topo, sizes).items():
    assert all(a < b for a, b in zip(times, times[1:])), (algo, times)


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
def test_tiny_messages_on_1024_gpus_never_pick_a_ring(collective):
  topo = Topology.cluster("dgx-h100", 1024)
  for size in (8, 1 << 10, 16 << 10):
    assert cost.choose(collective, size, topo) not in ("ring", "bidirectional_ring")
    ppermute = [a for a in cost.modelled_algorithms(collective) if a != "native"]
    assert "ring" not in cost.choose(collective, size, topo, candidates=ppermute)


def test_huge_messages_on_8_gpus_pick_a_bandwidth_optimal_algorithm():
  topo = Topology.preset("dgx-h100")
  optimal = {"native", "ring", "bidirectional_ring", "halving_doubling"}
  assert cost.choose("all_reduce", 4 << 30, topo) in optimal
  ppermute = ["ring", "bidirectional_ring", "tree", "recursive_doubling", "halving_doubling"]
  assert cost.choose("all_reduce", 4 << 30, topo, candidates=ppermute) in optimal
  assert cost.choose("all_reduce", 1 << 10, topo, candidates=ppermute) == "recursive_doubling"


def test_choose_never_auto_and_hierarchical_only_on_two_levels():
  for c in COLLECTIVES:
    for size in (1, 1 << 20, 1 << 32):
      assert cost.choose(c, size, Topology.preset("dgx-h100")) not in ("auto", "hierarchical")
  names = ["ring", "hierarchical"]
  assert cost.choose("all_reduce", 1 << 30, Topology.preset("dgx-h100"), candidates=names) == (
      "ring"
  )
  assert cost.choose("all_reduce", 1 << 30, Topology.preset("dgx-h100", nodes=4),
                     candidates=names) == "hierarchical"


def test_crossovers_are_exact():
  topo = Topology.preset("dgx-h100", nodes=4)
  cands = ["recursive_doubling", "halving_doubling", "hierarchical"]
  found = cost.crossovers("all_reduce", topo, 1, 1 << 32, candidates=cands)
  assert [c.above for c in found] == ["halving_doubling", "hierarchical"]
  for c in found:
    assert cost.choose("all_reduce", c.nbytes - 1, topo, candidates=cands) == c.below
    assert cost.choose("all_reduce", c.nbytes, topo, candidates=cands) == c.above


def test_simulate_rows():
  rows = cost.simulate("dgx-h100", device_counts=[8, 32], sizes=[1 << 10, 1 << 30])
  assert len(rows) == 2 * 6 + 2 * 7  # hierarchical only across nodes
  for n, size in ((8, 1 << 10), (32, 1 << 30)):
    group = [r for r in rows if r.num_devices == n and r.nbytes == size]
    (best,) = [r for r in group if r.best]
    assert best.time_s == min(r.time_s for r in group)
  ring = next(r for r in rows if r.algorithm == "ring" and r.num_devices == 32
              and r.nbytes == 1 << 30)
  assert ring.nodes == 4
  assert ring.busbw_Bps == pytest.approx(ring.algbw_Bps * 2 * 31 / 32)


def test_auto_chooser_maps_groups_to_levels():
  topo = Topology.preset("dgx-h100", nodes=4)
  chooser = cost.auto_chooser(topo)
  two = Group(("node", "local"), (4, 8))
  assert chooser("all_reduce", 1 << 30, two, None) == cost.choose(
      "all_reduce", 1 << 30, topo, candidates=[a for a in cost.modelled_algorithms(
          "all_reduce") if a != "hierarchical"])
  assert chooser("all_reduce", 1 << 10, Group(("data",), (8,)), None) != "hierarchical"


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: cost.estimate("all_sum", S, flat(4), "ring"), "valid collectives: all_reduce"),
        (lambda: cost.estimate("all_reduce", S, flat(4), "rings"), "valid choices: native"),
        (lambda: cost.estimate("all_reduce", S, flat(4), "auto"), "choose"),
        (lambda: cost.estimate("all_reduce", -1, flat(4), "ring"), "`nbytes`"),
        (lambda: cost.estimate("all_reduce", S, "dgx-h100", "ring"), "`topology`"),
        (lambda: cost.choose("all_reduce", S, flat(4), candidates=["hierarchical"]),
         "`candidates`"),
        (lambda: cost.estimate("all_reduce", S, Topology.preset("dgx-h100", nodes=2),
                               Hierarchical(outer="pairwise")), "valid choices"),
    ],
)
def test_cost_errors(call, match):
  with pytest.raises(ValueError, match=match):
    call()


# --------------------------------------------------------------- topology


def test_presets_shapes():
  for name in PRESETS:
    one = Topology.preset(name)
    assert len(one.levels) == 1
    two = Topology.preset(name, nodes=3)
    assert two.sizes == (3, one.num_devices)
    assert two.num_devices == 3 * one.num_devices
  assert Topology.preset("dgx-h100", nodes=4).names == ("node", "local")
  assert Topology.cluster("dgx-h100", 4).sizes == (4,)
  assert Topology.cluster("dgx-h100", 64).sizes == (8, 8)
  assert Topology.cluster("tpu-v5e", 512).sizes == (2, 256)


def test_in_network_reduction_only_where_the_hardware_has_it():
  h100 = Topology.preset("dgx-h100", nodes=2, in_network_reduction=True)
  assert [lv.in_network_reduction for lv in h100.levels] == [True, True]
  a100 = Topology.preset("dgx-a100", nodes=2, in_network_reduction=True)
  assert [lv.in_network_reduction for lv in a100.levels] == [True, False]
  assert not any(lv.in_network_reduction for lv in Topology.preset("dgx-h100", nodes=2).levels)


class FakeMesh:
  def __init__(self, **shape):
    self.shape = shape


def test_from_mesh():
  h100 = Topology.preset("dgx-h100", nodes=2)
  node, local = h100.levels
  one = Topology.from_mesh(FakeMesh(data=8), preset="dgx-h100")
  assert one.sizes == (8,) and one.names == ("data",)
  assert one.levels[0].bandwidth_Bps == local.bandwidth_Bps
  wide = Topology.from_mesh(FakeMesh(data=32), preset="dgx-h100")
  assert wide.levels[0].bandwidth_Bps == node.bandwidth_Bps
  two = Topology.from_mesh(FakeMesh(node=4, local=8), preset="dgx-h100")
  assert two.sizes == (4, 8)
  assert [lv.bandwidth_Bps for lv in two.levels] == [node.bandwidth_Bps, local.bandwidth_Bps]
  sub = Topology.from_mesh(FakeMesh(node=4, local=8), preset=two, axes=["local"])
  assert sub.sizes == (8,) and sub.levels[0].bandwidth_Bps == local.bandwidth_Bps


def test_from_real_mesh():
  import jaxcoll

  mesh = jaxcoll.devices.node_local_mesh(2, 4)
  topo = Topology.from_mesh(mesh, preset="cpu-sim")
  assert topo.sizes == (2, 4) and topo.names == ("node", "local")


def test_dict_round_trip_through_json():
  topo = Topology.preset("dgx-h100", nodes=2).with_level("local", reduce_Bps=INF)
  back = Topology.from_dict(json.loads(json.dumps(topo.to_dict())))
  assert back == topo


def test_with_level_overrides_fitted_figures():
  topo = Topology.preset("cpu-sim").with_level("local", latency_s=1e-4, bandwidth_Bps=1e9)
  assert topo.level("local").latency_s == 1e-4
  assert topo.level("local").bandwidth_Bps == 1e9


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: Topology.preset("dgx-h200"), "valid presets: dgx-h100, dgx-a100"),
        (lambda: Topology.preset("dgx-h100", nodes=0), "`nodes`"),
        (lambda: Topology.cluster("dgx-h100", 12), "multiple of 8"),
        (lambda: Level("x", 0, 0.0, 1.0), "`size`"),
        (lambda: Level("x", 2, -1.0, 1.0), "`latency_s`"),
        (lambda: Level("x", 2, 0.0, 0.0), "`bandwidth_Bps`"),
        (lambda: Topology(()), "`levels`"),
        (lambda: Topology((Level("x", 2, 0, 1), Level("x", 2, 0, 1))), "unique"),
        (lambda: Topology.preset("cpu-sim").with_level("local", speed=1), "valid fields"),
        (lambda: Topology.preset("cpu-sim").with_level("node", size=2), "has levels: local"),
        (lambda: Topology.from_dict({"levels": [{"name": "x", "size": 2}]}), "required"),
        (lambda: Topology.from_dict({"levels": [], "nodes": 2}), "valid: name"),
        (lambda: Topology.from_mesh(FakeMesh(data=8), preset="cpu-sim", axes=["model"]),
         "`axes`"),
    ],
)
def test_topology_errors(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_ppermute_step_on_the_level_its_pairs_cross():
  topo = Topology.preset("dgx-h100", nodes=2, local=4)  # ranks 0-3 node 0, 4-7 node 1
  node, local = topo.level("node"), topo.level("local")
  nbytes = 1 << 20

  def step(level):
    return topo.launch_s + level.latency_s + nbytes / level.bandwidth_Bps

  assert cost.ppermute_step_seconds(nbytes, topo) == pytest.approx(step(node))  # the slowest
  inside = [(r, 4 * (r // 4) + (r + 1) % 4) for r in range(8)]
  assert cost.ppermute_step_seconds(nbytes, topo, inside) == pytest.approx(step(local))
  assert cost.ppermute_step_seconds(nbytes, topo, inside + [(3, 4)]) == pytest.approx(step(node))
  assert cost.ppermute_step_seconds(nbytes, topo, [(2, 2)]) == 0.0  # moves nothing
