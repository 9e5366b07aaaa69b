"""The collective simulator: predicted time and bandwidth of every algorithm.

:func:`simulate` sweeps device counts and sizes on a preset's cluster
(``Topology.cluster``) with :mod:`jaxcoll.cost`'s model and marks the
fastest algorithm of each point; ``python -m experiments.simulate`` prints
and plots it. One level up, :mod:`jaxcoll.step_model` predicts whole
training steps from the same estimates. ``jaxcoll.cost.simulate`` and
``jaxcoll.cost.SimRow`` remain aliases of the names here.

Example:
  >>> rows = simulate("dgx-h100", device_counts=[32], sizes=[1 << 30])
  >>> next(r.algorithm for r in rows if r.best)
  'native'
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from jaxcoll.collectives import check_collective
from jaxcoll.comm_model.cost import bus_bandwidth_factor, time_table
from jaxcoll.comm_model.topology import Topology


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
