"""Alpha-beta-gamma cost of every (collective, algorithm) on a Topology.

The model (Hockney's alpha-beta, with Thakur, Rabenseifner & Gropp's gamma
for reductions, IJHPCA 2005): a message of ``b`` bytes over level ``L`` costs
``alpha_L + b * beta_L``; reducing ``b`` bytes costs ``b * gamma_L``, where
``alpha = Level.latency_s``, ``beta = 1 / Level.bandwidth_Bps`` and
``gamma = 1 / Level.reduce_Bps``.

Sizes are nccl-tests' ``size``: the largest buffer (the all-gather output, the
reduce-scatter input, the whole all-to-all buffer). ``S`` below is that size
and ``n`` the number of devices.

* jaxcoll's own algorithms are lockstep sequences of ``ppermute`` steps. Each
  step pays ``Topology.launch_s + alpha`` and moves its bytes at the speed of
  the slowest level any pair of that step crosses: ring steps always cross the
  outermost level (some pair of a ring straddles two nodes), while the steps
  of recursive and tree algorithms between near ranks stay inside a node and
  the far ones cross it. Step counts and bytes follow the implementations,
  fold steps for non-powers of two included.
* ``native`` is modelled as NCCL models itself (``src/graph/tuning.cc``,
  ``ncclTopoTuneModel``): one launch, per-hop latencies split between intra-
  and inter-node hops, bus bandwidth = channels x per-channel speed (NCCL
  spreads its rings over every NIC of a node), and for all-reduce the faster
  of ring and tree.
* ``hierarchical`` is composed level by level from the other estimates.
* In-network reduction (NVLS, SHARP) on a level halves the data a native
  reduction sends over it and removes the device's reduction work.

Limits, on purpose: one protocol (each figure from the protocol that governs
it: LL latencies, Simple bandwidths), no congestion between concurrent flows
and no multi-hop routing on torus levels (a partner k hops away costs one
hop, so recursive and tree algorithms look optimistic on ``tpu-v5e``), and
the halving rule for in-network reduction is the ideal: measured NVLS
all-reduce on DGX H100 is about 1.3x ring, not 2x.

Example:
  >>> topo = Topology.preset("dgx-h100", nodes=4)
  >>> t = estimate("all_reduce", 1 << 30, topo, "ring")
  >>> round((1 << 30) / t * bus_bandwidth_factor("all_reduce", 32) / 1e9)
  46
  >>> choose("all_reduce", 1 << 30, topo)
  'native'
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxcoll import checks
from jaxcoll.collectives import Hierarchical, algorithms, check_collective, specs
from jaxcoll.comm_model.topology import Topology

_REDUCTIONS = ("all_reduce", "reduce_scatter", "reduce")


# ------------------------------------------------------------------ checks


def _check_nbytes(nbytes: Any) -> float:
  ok = isinstance(nbytes, (int, float, np.integer, np.floating)) and not isinstance(nbytes, bool)
  if not ok or not math.isfinite(nbytes) or nbytes < 0:
    raise ValueError(f"`nbytes` must be a finite number of bytes >= 0; got {nbytes!r}.")
  return float(nbytes)


def _check_topology(topology: Any) -> Topology:
  if not isinstance(topology, Topology):
    raise ValueError(
        "`topology` must be a jaxcoll.topology.Topology, e.g. "
        f"Topology.preset('dgx-h100'); got {topology!r}."
    )
  return topology


def modelled_algorithms(collective: str) -> tuple[str, ...]:
  """The registered algorithms of ``collective`` that have a cost formula.

  Every built-in algorithm has one; an algorithm registered later with
  ``jaxcoll.collectives.register`` has none until a formula is added here.
  """
  check_collective(collective)
  known = set(_SCHEDULES[collective]) | {"native", "hierarchical"}
  return tuple(a for a in algorithms(collective) if a != "auto" and a in known)


def bus_bandwidth_factor(collective: str, n: int) -> float:
  """nccl-tests' busbw / algbw ratio (nccl-tests doc/PERFORMANCE.md).

  ``all_reduce``: ``2(n-1)/n``; ``reduce_scatter``, ``all_gather``,
  ``all_to_all``: ``(n-1)/n``; ``broadcast``, ``reduce``: 1. Bus bandwidth
  = ``size / time * factor`` is comparable to the link speed whatever ``n``.

  Raises:
    ValueError: unknown collective, or ``n`` not an integer >= 1.
  """
  check_collective(collective)
  checks.positive_int(n, "n")
  return specs.SPECS[collective].busbw_factor(n)


# ------------------------------------------------------------------ ppermute phases


@dataclasses.dataclass(frozen=True)
class _Phase:
  """``steps`` lockstep ppermute steps over level ``level``.

  ``send`` and ``reduce`` are the bytes one device sends / reduces per step,
  as a fraction of ``S``; ``lanes`` is how many neighbours a step's bytes
  are split between (2 for the bidirectional ring: twice as fast on a torus).
  """

  steps: int
  level: int
  send: float
  reduce: float = 0.0
  lanes: int = 1


def _step_time(topo: Topology, level, sent: float, reduced: float, lanes: int = 1) -> float:
  """One ppermute step over ``level``: launch + alpha + bytes * beta + reduced * gamma."""
  bandwidth = level.bandwidth_Bps * (lanes if level.torus else 1)
  return topo.launch_s + level.latency_s + sent / bandwidth + reduced / level.reduce_Bps


def _phases_time(phases: Sequence[_Phase], nbytes: float, topo: Topology) -> float:
  total = 0.0
  for p in phases:
    level = topo.levels[p.level]
    total += p.steps * _step_time(topo, level, p.send * nbytes, p.reduce * nbytes, p.lanes)
  return total


def ppermute_step_seconds(
    nbytes: float, topology: Topology, pairs: Sequence[tuple[int, int]] | None = None
) -> float:
  """One ``lax.ppermute`` step of ``nbytes`` per device.

  What every step of the ppermute-built algorithms pays (``launch_s + alpha
  + nbytes * beta``): the price of one HLO collective-permute. On the
  outermost level one of ``pairs`` (source, target ranks of ``topology``, row-major
  over its levels) crosses, as the algorithms' steps are priced; on the slowest
  level without ``pairs``; 0 when no pair crosses a level (as a schedule's step
  that moves nothing is left out).
  """
  topology = _check_topology(topology)
  if pairs is None:
    level = min(topology.levels, key=lambda lv: lv.bandwidth_Bps)
  else:
    pairs = np.asarray(list(pairs), np.int64).reshape(-1, 2)
    crossed = _crossed_level(topology, pairs[:, 0], pairs[:, 1])
    if crossed is None:
      return 0.0
    level = topology.levels[crossed]
  return _step_time(topology, level, nbytes, 0.0)


def _crossed_level(topo: Topology, src, dst) -> int | None:
  """Index of the outermost level that some (src, dst) pair crosses."""
  src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
  if src.size == 0:
    return None
  for i, (size, stride) in enumerate(zip(topo.sizes, topo.strides)):
    if size > 1 and np.any(src // stride != dst // stride):
      return i
  return None


def _ring_level(topo: Topology) -> int:
  r = np.arange(topo.num_devices)
  return _crossed_level(topo, r, (r + 1) % topo.num_devices)


def _distances(p: int) -> list[int]:
  return [1 << k for k in range(p.bit_length() - 1)]


def _core(n: int) -> tuple[int, int, np.ndarray]:
  """Power-of-two core of ``n`` ranks (recursive.py's ``_Core``)."""
  p = 1 << (n.bit_length() - 1)
  rem = n - p
  members = np.array([2 * i + 1 for i in range(rem)] + list(range(2 * rem, n)), np.int64)
  return p, rem, members


def _xor_step(topo, members, d, send, reduce=0.0) -> _Phase:
  j = np.arange(len(members))
  return _Phase(1, _crossed_level(topo, members, members[j ^ d]), send, reduce)


def _fold(topo, rem, *, into_core: bool) -> list[_Phase]:
  """The non-power-of-two fold: even ranks < 2 rem hand S to the next odd."""
  if not rem:
    return []
  even = np.arange(rem) * 2
  level = _crossed_level(topo, even, even + 1)
  return [_Phase(1, level, 1.0, 1.0 if into_core else 0.0)]


def _binomial_steps(n: int) -> list[int]:
  return [1 << k for k in range(max(n - 1, 0).bit_length())]


def _up_pairs(n: int, d: int) -> tuple[np.ndarray, np.ndarray]:
  src = np.arange(d, n, 2 * d)
  return src, src - d


def _down_pairs(n: int, d: int) -> tuple[np.ndarray, np.ndarray]:
  src = np.arange(0, n, 2 * d)
  src = src[src + d < n]
  return src, src + d


# Thakur, Rabenseifner & Gropp 2005, sec. 4.1; Patarasuk & Yuan 2009:
# ring all-reduce = ring reduce-scatter + ring all-gather:
#   2(n-1) alpha + 2(n-1)/n S beta + (n-1)/n S gamma.
def _ring_all_reduce(t: Topology) -> list[_Phase]:
  n, level = t.num_devices, _ring_level(t)
  return [_Phase(n - 1, level, 1 / n, 1 / n), _Phase(n - 1, level, 1 / n)]


# Same volume as the ring, each chunk split between both directions: per
# link S/(2n) a step, so twice as fast where the level is a torus.
def _bidirectional_ring_all_reduce(t: Topology) -> list[_Phase]:
  n, level = t.num_devices, _ring_level(t)
  return [_Phase(n - 1, level, 1 / n, 1 / n, lanes=2), _Phase(n - 1, level, 1 / n, lanes=2)]


# Double binary (here binomial) tree, Sanders, Speck & Traeff 2009, as
# tree.py runs it (not pipelined): ceil(log2 n) reduce steps then as many
# broadcast steps, each moving S/2 per tree:
#   2 ceil(log2 n) alpha + ceil(log2 n) S beta + ceil(log2 n)/2 S gamma
# (a rank interior to both trees at one step, possible for n not a power of
# two, moves S that step: counted).
def _double_tree_all_reduce(t: Topology) -> list[_Phase]:
  n, phases = t.num_devices, []
  for pairs, d_seq, reduce in ((_up_pairs, _binomial_steps(n), True),
                               (_down_pairs, _binomial_steps(n)[::-1], False)):
    for d in d_seq:
      src, dst = pairs(n, d)
      src2, dst2 = np.concatenate([src, n - 1 - src]), np.concatenate([dst, n - 1 - dst])
      sends, recvs = np.bincount(src2, minlength=n).max(), np.bincount(dst2, minlength=n).max()
      phases.append(_Phase(
          1, _crossed_level(t, src2, dst2), 0.5 * max(sends, recvs), 0.5 * recvs if reduce else 0.0
      ))
  return phases


# Thakur et al. 2005, sec. 4.1: recursive doubling, log2 n alpha + log2 n S
# (beta + gamma); for n not a power of two, one fold-in step (S, reduced) and
# one fold-out step (S) around the power-of-two core: floor(log2 n) + 2 steps.
def _recursive_doubling_all_reduce(t: Topology) -> list[_Phase]:
  p, rem, members = _core(t.num_devices)
  core = [_xor_step(t, members, d, 1.0, 1.0) for d in _distances(p)]
  return _fold(t, rem, into_core=True) + core + _fold(t, rem, into_core=False)


# Thakur et al. 2005, sec. 4.1 (Rabenseifner's algorithm): recursive-halving
# reduce-scatter + recursive-doubling all-gather on the core of p ranks:
#   2 log2 p alpha + 2(p-1)/p S beta + (p-1)/p S gamma, plus the two fold steps.
def _halving_doubling_all_reduce(t: Topology) -> list[_Phase]:
  p, rem, members = _core(t.num_devices)
  halving = [_xor_step(t, members, d, d / p, d / p) for d in reversed(_distances(p))]
  doubling = [_xor_step(t, members, d, d / p) for d in _distances(p)]
  return _fold(t, rem, into_core=True) + halving + doubling + _fold(t, rem, into_core=False)


# Thakur et al. 2005, sec. 4.3: ring reduce-scatter, (n-1) alpha + (n-1)/n S
# (beta + gamma).
def _ring_reduce_scatter(t: Topology) -> list[_Phase]:
  n = t.num_devices
  return [_Phase(n - 1, _ring_level(t), 1 / n, 1 / n)]


# Thakur et al. 2005, sec. 4.3: pairwise exchange, n-1 steps of S/n (step s
# sends to rank + s): (n-1) alpha + (n-1)/n S (beta + gamma).
def _pairwise_reduce_scatter(t: Topology) -> list[_Phase]:
  n = t.num_devices
  return [_Phase(n - 1, _ring_level(t), 1 / n, 1 / n)]


# Thakur et al. 2005, sec. 4.3: recursive halving, log2 n alpha + (n-1)/n S
# (beta + gamma); for n not a power of two its named fallback, pairwise.
def _recursive_halving_reduce_scatter(t: Topology) -> list[_Phase]:
  n = t.num_devices
  if n & (n - 1):
    return _pairwise_reduce_scatter(t)
  members = np.arange(n)
  return [_xor_step(t, members, d, d / n, d / n) for d in reversed(_distances(n))]


# Thakur et al. 2005, sec. 4.2: ring all-gather, (n-1) alpha + (n-1)/n S beta.
def _ring_all_gather(t: Topology) -> list[_Phase]:
  n = t.num_devices
  return [_Phase(n - 1, _ring_level(t), 1 / n)]


# Bruck et al. 1997: ceil(log2 n) steps, step d receives min(d, n-d) blocks
# from rank + d: ceil(log2 n) alpha + (n-1)/n S beta, for any n.
def _bruck_all_gather(t: Topology) -> list[_Phase]:
  n = t.num_devices
  r = np.arange(n)
  return [
      _Phase(1, _crossed_level(t, (r + d) % n, r), min(d, n - d) / n)
      for d in _binomial_steps(n)
  ]


# Thakur et al. 2005, sec. 4.2: recursive doubling, log2 n alpha + (n-1)/n S
# beta; for n not a power of two its named fallback, bruck.
def _recursive_doubling_all_gather(t: Topology) -> list[_Phase]:
  n = t.num_devices
  if n & (n - 1):
    return _bruck_all_gather(t)
  members = np.arange(n)
  return [_xor_step(t, members, d, d / n) for d in _distances(n)]


# Thakur et al. 2005, sec. 4.1 (short messages): binomial tree,
# ceil(log2 n) (alpha + S beta) for broadcast, + S gamma per step for reduce.
def _binomial_tree_broadcast(t: Topology) -> list[_Phase]:
  n = t.num_devices
  return [_Phase(1, _crossed_level(t, *_down_pairs(n, d)), 1.0) for d in _binomial_steps(n)[::-1]]


def _binomial_tree_reduce(t: Topology) -> list[_Phase]:
  n = t.num_devices
  return [_Phase(1, _crossed_level(t, *_up_pairs(n, d)), 1.0, 1.0) for d in _binomial_steps(n)]


# Thakur et al. 2005, sec. 4.1 (long messages, van de Geijn): binomial
# scatter (step d moves d blocks of S/n) + ring all-gather:
#   (ceil(log2 n) + n - 1) alpha + 2(n-1)/n S beta (powers of two).
def _scatter_allgather_broadcast(t: Topology) -> list[_Phase]:
  n = t.num_devices
  scatter = [
      _Phase(1, _crossed_level(t, *_down_pairs(n, d)), d / n) for d in _binomial_steps(n)[::-1]
  ]
  return scatter + _ring_all_gather(t)


# Rabenseifner's reduce (Thakur et al. 2005, sec. 4.4): ring reduce-scatter +
# binomial gather (step d moves d blocks of S/n):
#   (n - 1 + ceil(log2 n)) alpha + 2(n-1)/n S beta + (n-1)/n S gamma.
def _reduce_scatter_gather_reduce(t: Topology) -> list[_Phase]:
  n = t.num_devices
  gather = [_Phase(1, _crossed_level(t, *_up_pairs(n, d)), d / n) for d in _binomial_steps(n)]
  return _ring_reduce_scatter(t) + gather


# Thakur et al. 2005, sec. 4.5: pairwise exchange, (n-1) alpha + (n-1)/n S beta.
def _pairwise_all_to_all(t: Topology) -> list[_Phase]:
  n = t.num_devices
  return [_Phase(n - 1, _ring_level(t), 1 / n)]


_SCHEDULES: dict[str, dict[str, Callable[[Topology], list[_Phase]]]] = {
    "all_reduce": {
        "ring": _ring_all_reduce,
        "bidirectional_ring": _bidirectional_ring_all_reduce,
        "tree": _double_tree_all_reduce,
        "recursive_doubling": _recursive_doubling_all_reduce,
        "halving_doubling": _halving_doubling_all_reduce,
    },
    "reduce_scatter": {
        "ring": _ring_reduce_scatter,
        "recursive_halving": _recursive_halving_reduce_scatter,
        "pairwise": _pairwise_reduce_scatter,
    },
    "all_gather": {
        "ring": _ring_all_gather,
        "recursive_doubling": _recursive_doubling_all_gather,
        "bruck": _bruck_all_gather,
    },
    "broadcast": {
        "binomial_tree": _binomial_tree_broadcast,
        "scatter_allgather": _scatter_allgather_broadcast,
    },
    "reduce": {
        "binomial_tree": _binomial_tree_reduce,
        "reduce_scatter_gather": _reduce_scatter_gather_reduce,
    },
    "all_to_all": {"pairwise": _pairwise_all_to_all},
}


@functools.lru_cache(maxsize=4096)
def _phases(collective: str, algorithm: str, topo: Topology) -> tuple[_Phase, ...]:
  return tuple(p for p in _SCHEDULES[collective][algorithm](topo) if p.level is not None)


# ------------------------------------------------------------------ native (NCCL)

# tuning.cc: `if (a == NCCL_ALGO_TREE) busBw = std::min(busBw*.9, maxTreeBw)`.
_NCCL_TREE_BW_FACTOR = 0.9


def _nccl_seconds_per_byte(t: Topology, reduction: bool) -> float:
  """Inverse bus bandwidth of NCCL's rings on ``t``.

  tuning.cc: ``busBw = nChannels * speed``. NCCL runs one ring channel per
  NIC, so the bytes a ring carries across a level are spread over every
  device below it (``stride`` rails); the slowest level bounds the ring. On a
  torus level NCCL-like collectives use both directions. In-network reduction
  halves the bytes a reduction sends over the level.
  """
  worst = 0.0
  for level, rails in zip(t.levels, t.strides):
    if level.size == 1:
      continue
    bandwidth = level.bandwidth_Bps * rails * (2 if level.torus else 1)
    share = 0.5 if reduction and level.in_network_reduction else 1.0
    worst = max(worst, share / bandwidth)
  return worst


def _device_reduce_seconds_per_byte(t: Topology) -> float:
  """gamma of the levels that reduce on devices (0 if all reduce in network)."""
  rates = [lv.reduce_Bps for lv in t.levels if lv.size > 1 and not lv.in_network_reduction]
  return 1.0 / min(rates) if rates else 0.0


def _nccl_ring_latency(t: Topology, passes: int) -> float:
  """tuning.cc: ``(nsteps - nInterSteps) * intraLat + nInterSteps * interLat``.

  Of the ``n - 1`` hops of one pass around the ring, ``blocks_i -
  blocks_(i-1)`` enter a new block of level ``i`` (``nNodes - 1`` cross
  nodes); all-reduce makes two passes.
  """
  latency, previous = 0.0, 1
  for level, blocks in zip(t.levels, itertools.accumulate(t.sizes, operator.mul)):
    latency += passes * (blocks - previous) * level.latency_s
    previous = blocks
  return latency


def _nccl_tree_latency(t: Topology) -> float:
  """tuning.cc: ``2 * ((nRanks/nNodes - 1) * intraLat + log2i(nNodes) * interLat)``.

  A chain inside the node, a binary tree of depth log2 across each outer level.
  """
  *outer, inner = t.levels
  depth = sum(math.ceil(math.log2(lv.size)) * lv.latency_s for lv in outer if lv.size > 1)
  return 2 * ((inner.size - 1) * inner.latency_s + depth)


def _native(collective: str, nbytes: float, t: Topology) -> float:
  n = t.num_devices
  if collective == "all_to_all":
    # NCCL runs all-to-all as grouped point-to-point sends to every peer at
    # once (nccl-tests alltoall.cu): each device sends (s_i - 1) * stride_i
    # blocks of S/n over level i, all levels concurrently.
    latency = bandwidth_time = 0.0
    for level, stride in zip(t.levels, t.strides):
      peers = (level.size - 1) * stride
      latency += peers * level.latency_s
      bandwidth_time = max(bandwidth_time, peers / n * nbytes / level.bandwidth_Bps)
    return t.launch_s + latency + bandwidth_time
  reduction = collective in _REDUCTIONS
  per_byte = _nccl_seconds_per_byte(t, reduction)
  gamma = _device_reduce_seconds_per_byte(t) if reduction else 0.0
  # tuning.cc: ring algBw = busBw * nRanks / nsteps, i.e. the bus factor.
  data = bus_bandwidth_factor(collective, n)
  reduced = specs.SPECS[collective].reduce_factor(n)
  passes = 2 if collective == "all_reduce" else 1
  ring = (
      t.launch_s
      + _nccl_ring_latency(t, passes)
      + data * nbytes * per_byte
      + reduced * nbytes * gamma
  )
  if collective != "all_reduce":
    return ring
  # tuning.cc: tree algBw = busBw * 0.9 * 0.5 (pipelined reduce up, broadcast down).
  tree = (
      t.launch_s
      + _nccl_tree_latency(t)
      + 2 * nbytes * per_byte / _NCCL_TREE_BW_FACTOR
      + nbytes * gamma
  )
  return min(ring, tree)


# ------------------------------------------------------------------ hierarchical


def _hierarchical(collective: str, nbytes: float, t: Topology, spec: Hierarchical) -> float:
  """hierarchical.py, level by level: the inner level is the last one.

  all_reduce = inner reduce-scatter (S) + outer all-reduce (S/l) + inner
  all-gather (S); reduce_scatter = inner (S) + outer (S/l); all_gather =
  outer (S/l) + inner (S). Only S/l crosses the outer levels.
  """
  outer = dataclasses.replace(t, levels=t.levels[:-1])
  inner = dataclasses.replace(t, levels=t.levels[-1:])
  shard = nbytes / inner.num_devices

  def cost(kind: str, size: float, topo: Topology, name: str) -> float:
    if name == "auto":
      name = choose(kind, size, topo)
    return estimate(kind, size, topo, name)

  if collective == "all_reduce":
    return (
        cost("reduce_scatter", nbytes, inner, spec.inner)
        + cost("all_reduce", shard, outer, spec.outer)
        + cost("all_gather", nbytes, inner, spec.inner)
    )
  if collective == "reduce_scatter":
    return cost("reduce_scatter", nbytes, inner, spec.inner) + cost(
        "reduce_scatter", shard, outer, spec.outer
    )
  return cost("all_gather", shard, outer, spec.outer) + cost(
      "all_gather", nbytes, inner, spec.inner
  )


# ------------------------------------------------------------------ public API


def estimate(
    collective: str, nbytes: float, topology: Topology, algorithm: str | Hierarchical
) -> float:
  """Predicted seconds of one ``collective`` of ``nbytes`` on ``topology``.

  Args:
    collective: one of ``jaxcoll.collectives.COLLECTIVES``.
    nbytes: nccl-tests' ``size``: the largest buffer (the all-gather output,
      the reduce-scatter input).
    topology: the machine (``Topology.preset``, ``Topology.from_mesh``, ...);
      the group is all of its devices.
    algorithm: a name from ``jaxcoll.algorithms(collective)`` other than
      ``"auto"``, or a ``jaxcoll.Hierarchical``.

  Returns:
    Seconds (0 for a single device).

  Raises:
    ValueError: unknown collective or algorithm, ``"auto"``, a hierarchical
      algorithm on a one-level topology, or a bad ``nbytes``.

  Example:
    >>> topo = Topology.preset("dgx-h100")
    >>> estimate("all_reduce", 1 << 30, topo, "ring") > estimate(
    ...     "all_reduce", 1 << 20, topo, "ring")
    True
  """
  check_collective(collective)
  nbytes = _check_nbytes(nbytes)
  topology = _check_topology(topology)
  if isinstance(algorithm, Hierarchical):
    name, spec = "hierarchical", algorithm
  elif isinstance(algorithm, str):
    name, spec = algorithm, Hierarchical()
  else:
    raise ValueError(
        f"`algorithm` must be a name or jaxcoll.Hierarchical(...); got {algorithm!r}."
    )
  valid = [a for a in algorithms(collective) if a != "auto"]
  if name == "auto":
    raise ValueError(
        "`algorithm`='auto' has no cost of its own; call jaxcoll.cost.choose() for "
        f"the algorithm it would pick, or pass one of: {', '.join(valid)}."
    )
  if name not in valid:
    raise ValueError(
        f"Unknown {collective} `algorithm` {name!r}; valid choices: {', '.join(valid)}."
    )
  if name not in modelled_algorithms(collective):
    raise ValueError(
        f"{collective} `algorithm` {name!r} has no cost formula in jaxcoll.cost; "
        f"modelled: {', '.join(modelled_algorithms(collective))}."
    )
  if name == "hierarchical" and len(topology.levels) < 2:
    raise ValueError(
        "`algorithm`='hierarchical' needs a topology of >= 2 levels (outer..., "
        f"inner); got {topology}. Use Topology.preset(..., nodes=2) or a 2-axis mesh."
    )
  if topology.num_devices == 1:
    return 0.0
  if name == "hierarchical":
    return _hierarchical(collective, nbytes, topology, spec)
  if name == "native":
    return _native(collective, nbytes, topology)
  return _phases_time(_phases(collective, name, topology), nbytes, topology)


def choose(
    collective: str,
    nbytes: float,
    topology: Topology,
    *,
    candidates: Sequence[str] | None = None,
) -> str:
  """The algorithm with the least predicted time (never ``"auto"``).

  ``hierarchical`` is a candidate only on topologies of >= 2 levels. Ties go
  to the earlier algorithm in registry order.

  Args:
    collective, nbytes, topology: as :func:`estimate`.
    candidates: algorithm names to choose from (default: every modelled one).

  Raises:
    ValueError: as :func:`estimate`, or an empty ``candidates``.
  """
  _check_topology(topology)
  names = list(modelled_algorithms(collective) if candidates is None else candidates)
  if len(topology.levels) < 2 and "hierarchical" in names:
    names.remove("hierarchical")
  if not names:
    raise ValueError(
        f"`candidates` leaves nothing to choose for {collective} on {topology}; "
        f"valid: {', '.join(modelled_algorithms(collective))}."
    )
  return min(names, key=lambda a: estimate(collective, nbytes, topology, a))


def time_table(
    collective: str,
    topology: Topology,
    sizes: Sequence[int],
    candidates: Sequence[str] | None = None,
) -> dict[str, list[float]]:
  """``{algorithm: [seconds at each size]}`` for the modelled algorithms."""
  names = modelled_algorithms(collective) if candidates is None else tuple(candidates)
  if len(topology.levels) < 2:
    names = tuple(a for a in names if a != "hierarchical")
  return {a: [estimate(collective, s, topology, a) for s in sizes] for a in names}


@dataclasses.dataclass(frozen=True)
class Crossover:
  """At ``nbytes`` the best algorithm changes from ``below`` to ``above``."""

  nbytes: int
  below: str
  above: str


def crossovers(
    collective: str,
    topology: Topology,
    min_bytes: int = 1,
    max_bytes: int = 1 << 32,
    *,
    candidates: Sequence[str] | None = None,
) -> list[Crossover]:
  """Sizes in ``[min_bytes, max_bytes]`` where :func:`choose` changes its pick.

  Scans sizes by factors of two, then bisects to the exact byte.
  """
  if not 1 <= min_bytes <= max_bytes:
    raise ValueError(
        f"Need 1 <= `min_bytes` <= `max_bytes`; got {min_bytes} and {max_bytes}."
    )

  def pick(size: int) -> str:
    return choose(collective, size, topology, candidates=candidates)

  grid = [min_bytes]
  while grid[-1] < max_bytes:
    grid.append(min(grid[-1] * 2, max_bytes))
  found, start, before = [], grid[0], pick(grid[0])
  for size in grid[1:]:
    while pick(size) != before:
      lo, hi = start, size
      while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if pick(mid) == before else (lo, mid)
      after = pick(hi)
      found.append(Crossover(hi, before, after))
      before, start = after, hi
    start = size
  return found


def auto_chooser(topology: Topology) -> Callable[..., str]:
  """A chooser for ``jaxcoll.collectives.set_auto_chooser``.

  ``auto`` then picks, at trace time, the flat algorithm this model predicts
  fastest for the group: the group's axes are looked up among the topology's
  level names (``Topology.from_mesh`` names levels after mesh axes), or
  mapped as :meth:`Topology.from_mesh` maps a mesh.
  """
  _check_topology(topology)

  def chooser(collective: str, nbytes: int, group: Any, dtype: Any = None) -> str:
    del dtype
    sub = topology.for_axes(group.axes, group.sizes)
    flat = [a for a in modelled_algorithms(collective) if a != "hierarchical"]
    return choose(collective, nbytes, sub, candidates=flat)

  return chooser


# ------------------------------------------------------------------ sweep
# The collective simulator's sweep (``jaxcoll.comm_model.collective_sim``
# re-exports it, beside the training-step model one layer up).


@dataclasses.dataclass(frozen=True)
class SimRow:
  """One prediction of :func:`simulate` (bandwidths in bytes/s)."""

  collective: str
  algorithm: str
  num_devices: int
  nodes: int
  nbytes: int
  time_s: float
  algbw_Bps: float
  busbw_Bps: float
  best: bool


def simulate(
    preset: str,
    *,
    collectives: Sequence[str] = ("all_reduce",),
    device_counts: Sequence[int] = tuple(8 << k for k in range(12)),
    sizes: Sequence[int] = tuple(1024 << (2 * k) for k in range(12)),
    in_network_reduction: bool = False,
) -> list[SimRow]:
  """Predicted time and bandwidth of every modelled algorithm.

  For each collective, device count (``Topology.cluster(preset, n)``) and size,
  one row per algorithm; ``best`` marks :func:`choose`'s pick.

  Raises:
    ValueError: unknown preset or collective, a device count that is not a
      whole number of nodes, or a bad size.
  """
  rows = []
  for collective in collectives:
    check_collective(collective)
    for n in device_counts:
      topo = Topology.cluster(preset, n, in_network_reduction=in_network_reduction)
      nodes = topo.sizes[0] if len(topo.levels) > 1 else 1
      for size in sizes:
        times = time_table(collective, topo, [size])
        best = min(times, key=lambda a: times[a][0])
        factor = bus_bandwidth_factor(collective, n)
        for name, (t,) in times.items():
          algbw = size / t if t > 0 else math.inf
          rows.append(SimRow(
              collective, name, n, nodes, int(size), t, algbw, algbw * factor, name == best
          ))
  return rows
