"""Topology: the levels of a machine with their latency and bandwidth.

A :class:`Topology` lists the levels of a cluster from the outermost (slowest,
e.g. ``node``: InfiniBand between hosts) to the innermost (e.g. ``local``:
NVLink inside a host). Device ranks are row-major over the levels, as in a
``("node", "local")`` mesh. :mod:`jaxcoll.cost` predicts collective times on
it with the alpha-beta-gamma model: a message of ``b`` bytes over level ``L``
costs ``L.latency_s + b / L.bandwidth_Bps``, and reducing ``b`` bytes costs
``b / L.reduce_Bps``.

Presets (``Topology.preset``) describe real machines; every figure is cited
in :meth:`Topology.preset`. Fitted figures (``jaxcoll.tuning``) replace them
through :meth:`Topology.with_level`, ``dataclasses.replace`` or
:meth:`Topology.from_dict`.

Example:
  >>> topo = Topology.preset("dgx-h100", nodes=4)
  >>> topo.sizes, topo.num_devices
  ((4, 8), 32)
  >>> topo.with_level("node", bandwidth_Bps=40e9).level("node").bandwidth_Bps
  40000000000.0
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jaxcoll import checks


@dataclasses.dataclass(frozen=True)
class Level:
  """One level of a topology: ``size`` devices (or groups) and their links.

  Attributes:
    name: the level's name, e.g. ``"node"`` or ``"local"`` (a mesh axis name
      when built by :meth:`Topology.from_mesh`).
    size: number of members at this level (nodes, devices per node, ...).
    latency_s: alpha, seconds per message between two members of this level.
    bandwidth_Bps: beta's inverse, bytes/s that one device sends (and, at the
      same time, receives) over this level: per device, per direction. This is
      an *effective* figure (what a ring reaches in practice), not the line
      rate; ``math.inf`` means transfers are free.
    reduce_Bps: gamma's inverse, bytes/s of reduction one device performs
      (``math.inf``: free).
    in_network_reduction: the switches of this level reduce in the network
      (NVLink SHARP / NVLS, InfiniBand SHARP): a native reduction sends half
      the data over this level and does no reduction arithmetic on devices.
    torus: the level is a ring of direct links with wraparound (one TPU ICI
      axis): each device has one link to each neighbour, each of
      ``bandwidth_Bps`` per direction, so traffic split between both
      neighbours moves twice as fast. ``False`` for switched fabrics (NVSwitch,
      InfiniBand), where ``bandwidth_Bps`` is the device's whole injection
      bandwidth whatever the destination.
  """

  name: str
  size: int
  latency_s: float
  bandwidth_Bps: float
  reduce_Bps: float = math.inf
  in_network_reduction: bool = False
  torus: bool = False

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"Level `name` must be a non-empty string; got {self.name!r}.")
    try:
      object.__setattr__(self, "size", checks.positive_int(self.size, "size"))
    except ValueError as e:
      raise ValueError(f"Level {self.name!r}: {e}") from None
    _check_number(self.name, "latency_s", self.latency_s, allow_zero=True, allow_inf=False)
    _check_number(self.name, "bandwidth_Bps", self.bandwidth_Bps)
    _check_number(self.name, "reduce_Bps", self.reduce_Bps)
    for field in ("latency_s", "bandwidth_Bps", "reduce_Bps"):  # numpy scalars: JSON-ready
      object.__setattr__(self, field, float(getattr(self, field)))
    for flag in ("in_network_reduction", "torus"):
      if not isinstance(getattr(self, flag), bool):
        raise ValueError(
            f"Level {self.name!r}: `{flag}` must be True or False; "
            f"got {getattr(self, flag)!r}."
        )


def _check_number(
    where: str, what: str, value: Any, *, allow_zero: bool = False, allow_inf: bool = True
) -> None:
  ok = checks.is_real(value)
  if ok:
    ok = (value >= 0 if allow_zero else value > 0) and (allow_inf or math.isfinite(value))
  if not ok:
    bound = ">= 0" if allow_zero else "> 0"
    inf = " (math.inf allowed)" if allow_inf else ", finite"
    raise ValueError(f"Level {where!r}: `{what}` must be a number {bound}{inf}; got {value!r}.")


# --------------------------------------------------------------------------
# Presets. Each entry: the figures of one device's links inside a node
# ("local") and between nodes ("node"), the devices per node, and the
# per-operation launch cost. Sources are given in Topology.preset's docstring;
# the short comment next to each figure names its source.


@dataclasses.dataclass(frozen=True)
class _LinkFigures:
  latency_s: float
  bandwidth_Bps: float
  reduce_Bps: float
  supports_in_network_reduction: bool = False
  torus: bool = False

  def level(self, name: str, size: int, in_network_reduction: bool) -> Level:
    return Level(
        name=name,
        size=size,
        latency_s=self.latency_s,
        bandwidth_Bps=self.bandwidth_Bps,
        reduce_Bps=self.reduce_Bps,
        in_network_reduction=in_network_reduction and self.supports_in_network_reduction,
        torus=self.torus,
    )


@dataclasses.dataclass(frozen=True)
class _Preset:
  local_name: str
  node_name: str
  local: _LinkFigures
  node: _LinkFigures
  local_size: int
  launch_s: float
  summary: str


_H100_HBM_BPS = 3.35e12  # H100 SXM5 HBM3 bandwidth (NVIDIA H100 datasheet)
_A100_HBM_BPS = 2.039e12  # A100 80GB SXM HBM2e bandwidth (NVIDIA A100 datasheet)
_V5E_HBM_BPS = 8.19e11  # TPU v5e HBM2 bandwidth, 819 GB/s (Cloud TPU v5e docs)

_PRESETS: dict[str, _Preset] = {
    "dgx-h100": _Preset(
        local_name="local",
        node_name="node",
        local=_LinkFigures(
            latency_s=0.6e-6,  # NCCL tuning.cc hwLat NVLink, Ring/LL
            bandwidth_Bps=370e9,  # nccl-tests all_reduce busbw plateau (line: 450e9)
            reduce_Bps=_H100_HBM_BPS,
            supports_in_network_reduction=True,  # NVLS (NVSwitch gen 3)
        ),
        node=_LinkFigures(
            latency_s=2.7e-6,  # NCCL tuning.cc hwLat NET, Ring/LL
            bandwidth_Bps=47e9,  # measured NDR busbw 46-48 GB/s (line: 50e9)
            reduce_Bps=_H100_HBM_BPS,
            supports_in_network_reduction=True,  # SHARPv3 (Quantum-2 switches)
        ),
        local_size=8,
        launch_s=6.6e-6,  # NCCL tuning.cc baseLat, Ring/LL
        summary="DGX H100: 8 x H100 SXM5 per node, NVLink 4 + NVSwitch, 8 x NDR 400 Gb/s",
    ),
    "dgx-a100": _Preset(
        local_name="local",
        node_name="node",
        local=_LinkFigures(
            latency_s=0.6e-6,  # NCCL tuning.cc hwLat NVLink, Ring/LL
            bandwidth_Bps=230e9,  # nccl-tests busbw ~230 GB/s (line: 300e9)
            reduce_Bps=_A100_HBM_BPS,
        ),
        node=_LinkFigures(
            latency_s=2.7e-6,  # NCCL tuning.cc hwLat NET, Ring/LL
            bandwidth_Bps=23.5e9,  # measured HDR busbw 23-24 GB/s (line: 25e9)
            reduce_Bps=_A100_HBM_BPS,
            supports_in_network_reduction=True,  # SHARPv2 (Quantum HDR switches)
        ),
        local_size=8,
        launch_s=6.6e-6,  # NCCL tuning.cc baseLat, Ring/LL
        summary="DGX A100: 8 x A100 SXM4 80GB per node, NVLink 3 + NVSwitch, 8 x HDR 200 Gb/s",
    ),
    "tpu-v5e": _Preset(
        local_name="ici",
        node_name="dcn",
        local=_LinkFigures(
            latency_s=1e-6,  # assumed per ICI hop (no published figure)
            bandwidth_Bps=4.5e10,  # one ICI link, one direction (scaling book)
            reduce_Bps=_V5E_HBM_BPS,
            torus=True,
        ),
        node=_LinkFigures(
            latency_s=10e-6,  # assumed data-center network latency
            bandwidth_Bps=3.125e9,  # 6.4 Tb/s DCN per 256-chip pod / 256 chips
            reduce_Bps=_V5E_HBM_BPS,
        ),
        local_size=256,
        launch_s=1e-6,  # assumed: collectives are compiled into the TPU program
        summary="TPU v5e: one 16x16 pod slice (256 chips, 2-D torus ICI) per node; DCN between",
    ),
    "cpu-sim": _Preset(
        local_name="local",
        node_name="node",
        local=_LinkFigures(
            latency_s=50e-6,  # rough: XLA CPU collective-permute rendezvous
            bandwidth_Bps=3e8,  # rough: 8 emulated devices sharing 2 cores
            reduce_Bps=2e9,  # rough: one core's share of an elementwise add
        ),
        node=_LinkFigures(
            latency_s=200e-6,  # rough: gloo over loopback TCP
            bandwidth_Bps=1e8,  # rough: gloo over loopback TCP
            reduce_Bps=2e9,
        ),
        local_size=8,
        launch_s=200e-6,  # rough: dispatch of one collective in an XLA CPU program
        summary="CPU simulation mode: 8 emulated XLA CPU devices per process (gloo between)",
    ),
}

# -- Clusters of published data-parallel scaling results (jaxcoll.step_model
# validates against them). Line rates are published; the effective fractions
# of them are assumptions, stated at each figure (fit them with
# jaxcoll.tuning where you have the machine). Inter-node figures are per
# GPU: one NIC per server shared by its GPUs (NIC rate / GPUs per server).
_P100_HBM_BPS = 7.32e11  # Tesla P100 HBM2, 732 GB/s (NVIDIA P100 datasheet)
_V100_HBM_BPS = 9.0e11  # Tesla V100 SXM2 HBM2, 900 GB/s (NVIDIA V100 datasheet)
_PCIE3_X16 = _LinkFigures(
    latency_s=1.0e-6,  # NCCL tuning.cc hwLat PCI, Ring/LL
    bandwidth_Bps=10e9,  # assumed ~65% of PCIe 3.0 x16's 15.75 GB/s line rate
    reduce_Bps=_P100_HBM_BPS,
)


def _shared_nic(gbit: float, gpus: int, efficiency: float, latency_s: float, hbm: float):
  """Per-GPU figures of one ``gbit`` Gbit/s NIC shared by ``gpus`` GPUs at ``efficiency``."""
  return _LinkFigures(latency_s, gbit / 8 * 1e9 * efficiency / gpus, hbm)


_PRESETS.update({
    "pascal-pcie-25gbe-roce": _Preset(
        local_name="local",
        node_name="node",
        local=_PCIE3_X16,
        # 25 Gbit/s RoCE (Horovod README benchmark); assumed 90% of line rate,
        # NCCL tuning.cc hwLat NET.
        node=_shared_nic(25, 4, 0.90, 2.7e-6, _P100_HBM_BPS),
        local_size=4,  # "128 servers with 4 Pascal GPUs each" (Horovod README)
        launch_s=6.6e-6,  # NCCL tuning.cc baseLat, Ring/LL
        summary="4 x Pascal P100 (PCIe) per server, one 25 Gbit/s RoCE NIC (Horovod README)",
    ),
    "pascal-pcie-25gbe-tcp": _Preset(
        local_name="local",
        node_name="node",
        local=_PCIE3_X16,
        # 25 GbE with TCP (Sergeev & Del Balso 2018); assumed 75% of line rate
        # and 20 us per message through the kernel's socket stack.
        node=_shared_nic(25, 4, 0.75, 20e-6, _P100_HBM_BPS),
        local_size=4,  # 4 Pascal GPUs per server (Sergeev & Del Balso 2018)
        launch_s=6.6e-6,  # NCCL tuning.cc baseLat, Ring/LL
        summary="4 x Pascal P100 (PCIe) per server, 25 GbE over TCP (Horovod paper)",
    ),
    "pascal-nvlink-50gbe": _Preset(
        local_name="local",
        node_name="node",
        local=_LinkFigures(
            latency_s=0.6e-6,  # NCCL tuning.cc hwLat NVLink, Ring/LL
            bandwidth_Bps=20e9,  # assumed: one NVLink 1 link, 20 GB/s per direction
            reduce_Bps=_P100_HBM_BPS,
        ),
        # 50 Gbit Ethernet, Mellanox ConnectX-4 per server (Goyal et al. 2017,
        # sec. 5); assumed 90% of line rate; gloo over TCP, assumed 20 us.
        node=_shared_nic(50, 8, 0.90, 20e-6, _P100_HBM_BPS),
        local_size=8,  # Big Basin: 8 x P100 SXM2 with NVLink (Goyal et al. 2017)
        launch_s=6.6e-6,  # NCCL tuning.cc baseLat, Ring/LL
        summary="Big Basin: 8 x P100 SXM2 (NVLink) per server, 50 Gbit Ethernet (Goyal et al.)",
    ),
    "volta-nvlink-100gb-ib": _Preset(
        local_name="local",
        node_name="node",
        local=_LinkFigures(
            latency_s=0.6e-6,  # NCCL tuning.cc hwLat NVLink, Ring/LL
            bandwidth_Bps=120e9,  # assumed 80% of NVLink 2: 6 x 25 GB/s per direction
            reduce_Bps=_V100_HBM_BPS,
        ),
        # 100 Gbit/s InfiniBand per server (Li et al. 2020, sec. 5, as we read
        # it); assumed 90% of line rate, NCCL tuning.cc hwLat NET.
        node=_shared_nic(100, 8, 0.90, 2.7e-6, _V100_HBM_BPS),
        local_size=8,  # 8 x V100 per server (Li et al. 2020)
        launch_s=6.6e-6,  # NCCL tuning.cc baseLat, Ring/LL
        summary="8 x V100 SXM2 (NVLink 2) per server, 100 Gbit/s InfiniBand (PyTorch DDP paper)",
    ),
})

PRESETS: tuple[str, ...] = tuple(_PRESETS)


def _check_preset(name: str) -> _Preset:
  if name not in _PRESETS:
    raise ValueError(
        f"Unknown topology `preset` {name!r}; valid presets: {', '.join(PRESETS)}."
    )
  return _PRESETS[name]


_LEVEL_FIELDS = tuple(f.name for f in dataclasses.fields(Level))


@dataclasses.dataclass(frozen=True)
class Topology:
  """Levels of a machine, from the outermost (slowest) to the innermost.

  Attributes:
    levels: the levels, outer to inner; device ranks are row-major over them.
    name: a label (the preset's name, or ``"custom"``).
    launch_s: fixed cost of issuing one collective operation (kernel launch
      and synchronisation). A native collective pays it once; an algorithm
      built from ``ppermute`` steps pays it at every step.
    node_link: for a topology of ONE node, the figures of its links to other
      nodes (a ``Level`` whose size is ignored), so :meth:`resized` can grow
      it; :meth:`from_hardware` sets it. Not used by any cost formula.
    node_size: for a topology of PART of one node (:meth:`resized` below a
      node's device count), the devices of a whole node, so that resizing
      it again builds whole nodes of that size. Not used by any cost formula.
  """

  levels: tuple[Level, ...]
  name: str = "custom"
  launch_s: float = 0.0
  node_link: Level | None = dataclasses.field(default=None, compare=False)
  node_size: int | None = dataclasses.field(default=None, compare=False)

  def __post_init__(self):
    levels = tuple(self.levels)
    if not levels or not all(isinstance(level, Level) for level in levels):
      raise ValueError(
          f"`levels` must be a non-empty sequence of jaxcoll.topology.Level; got {self.levels!r}."
      )
    names = [level.name for level in levels]
    if len(set(names)) != len(names):
      raise ValueError(f"`levels` names must be unique; got {names}.")
    _check_number(self.name, "launch_s", self.launch_s, allow_zero=True, allow_inf=False)
    if self.node_link is not None and not isinstance(self.node_link, Level):
      raise ValueError(f"`node_link` must be a jaxcoll.topology.Level or None; got "
                       f"{self.node_link!r}.")
    if self.node_size is not None:
      checks.positive_int(self.node_size, "node_size")
    object.__setattr__(self, "levels", levels)

  # ------------------------------------------------------------ properties

  @property
  def num_devices(self) -> int:
    """Total number of devices: the product of the level sizes."""
    return math.prod(level.size for level in self.levels)

  @property
  def sizes(self) -> tuple[int, ...]:
    return tuple(level.size for level in self.levels)

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(level.name for level in self.levels)

  @property
  def strides(self) -> tuple[int, ...]:
    """Rank distance between neighbours of each level (1 for the innermost)."""
    sizes = self.sizes
    return tuple(math.prod(sizes[i + 1 :]) for i in range(len(sizes)))

  def level(self, name: str) -> Level:
    """The level called ``name``."""
    for level in self.levels:
      if level.name == name:
        return level
    raise ValueError(
        f"Unknown level {name!r}; this topology has levels: {', '.join(self.names)}."
    )

  def __str__(self) -> str:
    shape = " x ".join(f"{level.size} {level.name}" for level in self.levels)
    return f"{self.name}: {shape} ({self.num_devices} devices)"

  # ------------------------------------------------------------ builders

  @classmethod
  def preset(
      cls,
      name: str,
      *,
      nodes: int = 1,
      local: int | None = None,
      in_network_reduction: bool = False,
  ) -> Topology:
    """A real machine: ``nodes`` nodes of ``local`` devices each.

    One node gives a one-level topology (the node's inner links); more give
    two levels, ``(node, local)``.

    Bandwidths are *effective* figures: the bus bandwidth that nccl-tests'
    ring all-reduce reaches on the machine, not the link's line rate (protocol
    headers, flow control and the copy kernels take the rest). With them,
    :func:`jaxcoll.cost.estimate` predicts a 1 GiB ring all-reduce within a few
    percent of the measured busbw (it adds the latency and reduction terms).
    Latencies and the launch cost come from NCCL's own tuning model
    (``src/graph/tuning.cc``: ``baseLat`` is the fixed cost of one call,
    ``hwLat`` the latency of one hop; we take the LL protocol's figures, the
    one NCCL picks for small, latency-bound messages). Reductions stream at
    the device's memory bandwidth (NCCL's fused reduce-copy adds one read of
    the local operand per reduced byte).

    * ``dgx-h100`` (8 H100 SXM5 per node). Inside a node: NVLink 4, 18 links
      x 25 GB/s = 450 GB/s per direction (900 GB/s bidirectional; NVIDIA H100
      datasheet); effective 370e9 B/s, the all_reduce busbw plateau
      nccl-tests reports on DGX H100 (about 360-370 GB/s). Between nodes: one
      ConnectX-7 NDR 400 Gb/s NIC per GPU = 50 GB/s line rate per direction;
      effective 47e9 B/s (46-48 GB/s measured per rail). Latency 0.6 us per
      NVLink hop, 2.7 us per network hop, launch 6.6 us (tuning.cc ``hwLat``
      NVLink and NET, ``baseLat``, Ring/LL). Reduction: HBM3, 3.35e12 B/s.
      In-network reduction: NVLS (NVSwitch gen 3) inside the node, SHARPv3
      (Quantum-2) between nodes.
    * ``dgx-a100`` (8 A100 SXM4 80GB per node). NVLink 3: 12 links x 25 GB/s
      = 300 GB/s per direction; effective 230e9 B/s (nccl-tests busbw about
      230 GB/s; tuning.cc itself caps A100 bus bandwidth at 235 GB/s). Between
      nodes: 8 x HDR 200 Gb/s = 25 GB/s line rate per GPU; effective 23.5e9
      B/s (23-24 GB/s measured). Latencies as dgx-h100. Reduction: HBM2e,
      2.039e12 B/s. In-network reduction: SHARPv2 between nodes only
      (NVSwitch gen 2 does not reduce).
    * ``tpu-v5e``: a node is one 16x16 pod slice (256 chips, 2-D torus, Cloud
      TPU v5e docs), modelled as ONE ring level ``ici`` of 256 chips with
      wraparound (``torus=True``): 4.5e10 B/s per ICI link per direction
      ("How to Scale Your Model", TPU chapter; 4 links of 400 Gb/s per chip,
      1,600 Gb/s per chip in the Cloud TPU v5e docs). A ring uses one link of
      a chip, a bidirectional ring or native both directions (9e10); XLA's
      2-D algorithm over both torus axes at once (up to 4 links) is not
      modelled, so large native collectives are pessimistic by up to 2x.
      Between slices (``nodes`` > 1): DCN, 6.4 Tb/s per 256-chip pod (Cloud
      TPU v5e docs) = 3.125e9 B/s per chip. Reduction: HBM2, 8.19e11 B/s.
      The ICI hop latency (1 us), DCN latency (10 us) and launch cost (1 us)
      are assumed orders of magnitude, not published figures: fit them.
    * ``cpu-sim``: emulated XLA CPU devices (8 per process) and gloo between
      processes. Rough defaults measured once on a 2-core machine (a
      ``ppermute`` step of 8 devices: about 0.5 ms; 16 MiB per device: about
      50 ms); ``jaxcoll.tuning`` fits alpha, beta and gamma on the machine at
      hand and overrides them with :meth:`with_level`.
    * Published scaling-result clusters (the figures and their sources are
      next to each entry in this module): ``pascal-pcie-25gbe-roce`` (Horovod
      README: 4 Pascal GPUs per server, RoCE 25 Gbit/s), ``pascal-pcie-25gbe-tcp``
      (Horovod paper: 25 GbE TCP), ``pascal-nvlink-50gbe`` (Goyal et al. 2017:
      8 P100 NVLink, 50 Gbit Ethernet), ``volta-nvlink-100gb-ib`` (PyTorch DDP
      paper: 8 V100 NVLink, 100 Gbit/s InfiniBand). Line rates are published;
      the fraction of them reached is an assumption (90% RoCE / IB / 50 GbE,
      75% TCP, 65% PCIe) stated at each figure. P100 HBM2 732 GB/s, V100 900 GB/s.

    Args:
      name: one of :data:`PRESETS`.
      nodes: number of nodes (>= 1).
      local: devices per node (default: the machine's, 8 or 256).
      in_network_reduction: turn on in-network reduction on the levels whose
        hardware supports it (see above); the others are unchanged.

    Returns:
      The topology, named after the preset.

    Raises:
      ValueError: unknown preset, or ``nodes``/``local`` not integers >= 1.
    """
    spec = _check_preset(name)
    nodes = checks.positive_int(nodes, "nodes")
    local = spec.local_size if local is None else checks.positive_int(local, "local")
    inner = spec.local.level(spec.local_name, local, in_network_reduction)
    between = spec.node.level(spec.node_name, nodes, in_network_reduction)
    if nodes == 1:  # one node of `local` devices: it keeps its links to other nodes (resized)
      return cls((inner,), name=name, launch_s=spec.launch_s,
                 node_link=dataclasses.replace(between, size=1))
    return cls((between, inner), name=name, launch_s=spec.launch_s)

  @classmethod
  def cluster(
      cls, preset: str, num_devices: int, *, in_network_reduction: bool = False,
      what: str | None = None,
  ) -> Topology:
    """The preset's machine with ``num_devices`` devices.

    Whole nodes when ``num_devices`` is at least one node's worth, else part
    of one node (a single level).

    Args:
      what: how the message of a count that is not whole nodes names it
        (default ``"`num_devices`=N"``): a caller whose own argument gave the
        count names that one (``"`baseline`=12"``).

    Raises:
      ValueError: unknown preset, or ``num_devices`` more than one node but
        not a multiple of the devices per node.
    """
    spec = _check_preset(preset)
    num_devices = checks.positive_int(num_devices, "num_devices")
    per_node = spec.local_size
    if num_devices <= per_node:  # part of one node: it remembers the node's size (resized)
      part = cls.preset(
          preset, nodes=1, local=num_devices, in_network_reduction=in_network_reduction
      )
      return part if num_devices == per_node else dataclasses.replace(part, node_size=per_node)
    if num_devices % per_node:
      raise ValueError(
          f"{what or f'`num_devices`={num_devices}'} is not a whole number of {preset} nodes "
          f"of {per_node} devices; use a multiple of {per_node} (or <= {per_node})."
      )
    return cls.preset(
        preset,
        nodes=num_devices // per_node,
        in_network_reduction=in_network_reduction,
    )

  @classmethod
  def from_hardware(
      cls,
      *,
      nodes: int,
      gpus_per_node: int,
      intra_links: int,
      intra_link_GBps: float,
      inter_links: int = 0,
      inter_link_Gbps: float = 0.0,
      hbm_Bps: float = math.inf,
      bus_fraction: float = 1.0,
      name: str = "custom",
  ) -> Topology:
    """A cluster from its parts: ``nodes`` x ``gpus_per_node`` GPUs and their links.

    Levels (outer to inner): ``node`` (between nodes) when ``nodes > 1``,
    then ``local`` (inside a node). What each level's ``bandwidth_Bps`` means:

    * ``local``: one GPU's links inside the node, per direction:
      ``intra_links x intra_link_GBps x bus_fraction`` (e.g. 12 NVLink 3
      links of 25 GB/s on an A100; 1 PCIe 3.0 x16 link of 15.75 GB/s).
    * ``node``: one GPU's *share* of the node's NICs, per direction:
      ``inter_links x inter_link_Gbps / 8 x bus_fraction / gpus_per_node``
      (NCCL spreads its rings over every NIC of a node, so a collective
      across nodes sees all of them: :mod:`jaxcoll.cost` multiplies the share
      back by the GPUs per node).

    ``bus_fraction`` is the part of the line rate that NCCL's bus bandwidth
    reaches (protocol headers, flow control, copy kernels). The default, 1.0,
    is the value the step model holds it at (:data:`jaxcoll.scale.step_model.
    DEFAULT_PARAMS`; an earlier fit on published scaling results ran to this
    bound); where you have nccl-tests figures, pass busbw / line rate
    (typically 0.8-0.95). Latencies and the launch cost are NCCL's own
    (``src/graph/tuning.cc``: ``hwLat`` NVLink 0.6 us, PCI 1.0 us, NET 2.7 us,
    ``baseLat`` 6.6 us; LL protocol). ``hbm_Bps`` is the device's memory
    bandwidth (the reduction and optimizer rate). Resize with :meth:`resized`.

    Raises:
      ValueError: a count that is not a whole number >= 1, a rate <= 0, a
        ``bus_fraction`` outside (0, 1], or ``nodes > 1`` without inter-node
        links.

    Example:
      >>> t = Topology.from_hardware(nodes=4, gpus_per_node=8, intra_links=12,
      ...                            intra_link_GBps=25, inter_links=8, inter_link_Gbps=200)
      >>> t.sizes, t.resized(8).sizes, t.resized(64).sizes
      ((4, 8), (8,), (8, 8))
    """
    nodes = checks.positive_int(nodes, "nodes")
    per_node = checks.positive_int(gpus_per_node, "gpus_per_node")
    # A node of ONE GPU (a cloud VM with one GPU and its NIC) has no links inside it to give:
    # intra_links=0 / intra_link_GBps=0 are accepted there, and its inner level moves nothing.
    alone = per_node == 1 and intra_links == 0 and intra_link_GBps == 0
    if not alone:
      intra_links = checks.positive_int(intra_links, "intra_links")
    def rate(what: str, value: Any, example: str, *, inf: bool = False) -> None:
      ok = checks.is_real(value) and value > 0
      if not ok or not (inf or math.isfinite(value)):
        raise ValueError(f"`{what}` must be a finite number > 0; got {value!r} ({example}).")

    if not alone:
      rate("intra_link_GBps", intra_link_GBps,
           "e.g. 25 for one NVLink 3 link, 15.75 for PCIe 3 x16; 0 with intra_links=0 for "
           "nodes of one GPU")
    rate("hbm_Bps", hbm_Bps, "e.g. 2.039e12 for an A100 80GB; math.inf for free", inf=True)
    rate("bus_fraction", bus_fraction, "e.g. 0.9: nccl-tests busbw / line rate")
    if bus_fraction > 1:
      raise ValueError(f"`bus_fraction` must be in (0, 1]; got {bus_fraction!r} (e.g. 0.9).")
    if nodes > 1 or inter_links:
      inter_links = checks.positive_int(inter_links, "inter_links")
      rate("inter_link_Gbps", inter_link_Gbps, "e.g. 200 for HDR InfiniBand, 400 for NDR")
    # Python floats (a numpy float32 rate would compute the levels in float32).
    intra_link_GBps, inter_link_Gbps = float(intra_link_GBps), float(inter_link_Gbps)
    hbm_Bps, bus_fraction = float(hbm_Bps), float(bus_fraction)
    latency = 1.0e-6 if intra_links == 1 and intra_link_GBps < 20 else 0.6e-6  # PCI / NVLink
    local = Level("local", per_node, latency,
                  math.inf if alone else intra_links * intra_link_GBps * 1e9 * bus_fraction,
                  hbm_Bps)
    levels = [local]
    if nodes > 1:
      share = inter_links * inter_link_Gbps / 8 * 1e9 * bus_fraction / per_node
      levels.insert(0, Level("node", nodes, 2.7e-6, share, hbm_Bps))
    spare = None
    if nodes == 1 and inter_links:
      spare = Level("node", 1, 2.7e-6,
                    inter_links * inter_link_Gbps / 8 * 1e9 * bus_fraction / per_node, hbm_Bps)
    return cls(tuple(levels), name=name, launch_s=6.6e-6, node_link=spare)

  def resized(self, num_devices: int, *, what: str | None = None) -> Topology:
    """This cluster with ``num_devices`` devices: whole nodes, or part of one.

    The innermost level is a node (its size the devices per node); the
    outermost level's figures are the links between nodes. A count up to one
    node gives one level (which remembers the node's size, ``node_size``, so
    resizing it again builds whole nodes of that size); more must be a whole
    number of nodes. A topology of one node can grow only when it knows its
    inter-node links (built by :meth:`from_hardware` with ``inter_links``, or a
    preset's ``cluster``; :meth:`to_dict` / :meth:`from_dict` keep them).
    ``what``: how the message of a count that is not whole nodes names it,
    as for :meth:`cluster`.

    Raises:
      ValueError: a count that is not a whole number of nodes, or growing a
        one-node topology whose links between nodes are unknown.
    """
    num_devices = checks.positive_int(num_devices, "num_devices")
    inner = self.levels[-1]
    if len(self.levels) > 2:
      raise ValueError(
          f"`resized` needs a topology of one or two levels (node, local); {self.name!r} has "
          f"{len(self.levels)}. Build the levels you want with Topology(levels=...)."
      )
    per_node = inner.size
    if len(self.levels) == 1 and self.node_size is not None:
      per_node = self.node_size  # part of a node: its whole nodes keep their size
    if len(self.levels) == 1 and self.node_link is None and self.name in _PRESETS:
      # A one-level preset without its links (a JSON written before presets kept them):
      # part of one of the preset's nodes.
      per_node = _PRESETS[self.name].local_size
      if num_devices > per_node:
        return Topology.cluster(self.name, num_devices, what=what)
    link = self.levels[0] if len(self.levels) == 2 else self.node_link
    if num_devices <= per_node:
      return dataclasses.replace(
          self, levels=(dataclasses.replace(inner, size=num_devices),), node_link=link,
          node_size=per_node if num_devices < per_node else None)
    if num_devices % per_node:
      raise ValueError(
          f"{what or f'`num_devices`={num_devices}'} is not a whole number of nodes of "
          f"{per_node} devices; use a multiple of {per_node} (or <= {per_node})."
      )
    outer = self.levels[0] if len(self.levels) == 2 else self.node_link
    if outer is None:
      raise ValueError(
          f"Cannot grow the one-node topology {self.name!r} to {num_devices} devices: its "
          "links between nodes are unknown. Build it with Topology.from_hardware(..., "
          "inter_links=..., inter_link_Gbps=...) or give it a 'node' level."
      )
    node = dataclasses.replace(outer, size=num_devices // per_node)
    return dataclasses.replace(self, levels=(node, dataclasses.replace(inner, size=per_node)),
                               node_link=None, node_size=None)

  @classmethod
  def from_mesh(
      cls, mesh: Any, *, preset: str | Topology, axes: Sequence[str] | None = None
  ) -> Topology:
    """Maps the axes of ``mesh`` to levels with the figures of ``preset``.

    The last axis is the innermost level: it gets the preset's inner (e.g.
    NVLink) figures when it fits in one node, else the slowest level's; every
    other axis crosses nodes and gets the slowest level's figures. So a 1-axis
    mesh gives one level of that size, and a ``("node", "local")`` mesh gives
    two. Levels are named after the axes.

    Args:
      mesh: a ``jax.sharding.Mesh`` (anything with a ``shape`` mapping from
        axis name to size).
      preset: a preset name, or a :class:`Topology` (e.g. a fitted one) whose
        innermost level gives the inner figures and devices per node, and whose
        slowest level gives the outer figures.
      axes: the mesh axes to include, outer to inner (default: all of them).

    Raises:
      ValueError: unknown preset, or an axis not in the mesh.

    Example:
      >>> mesh = jaxcoll.devices.node_local_mesh(2, 4)  # doctest: +SKIP
      >>> Topology.from_mesh(mesh, preset="cpu-sim").sizes  # doctest: +SKIP
      (2, 4)
    """
    shape = dict(mesh.shape)
    axes = tuple(shape) if axes is None else tuple(axes)
    missing = [a for a in axes if a not in shape]
    if not axes or missing:
      raise ValueError(
          f"`axes` {axes!r} must name axes of the mesh; the mesh has {tuple(shape)}."
      )
    return cls._from_axes(axes, tuple(int(shape[a]) for a in axes), preset)

  @classmethod
  def _from_axes(
      cls, names: Sequence[str], sizes: Sequence[int], preset: str | Topology
  ) -> Topology:
    if isinstance(preset, Topology):
      inner, slow = preset.levels[-1], min(preset.levels, key=lambda lv: lv.bandwidth_Bps)
      per_node, label, launch = inner.size, preset.name, preset.launch_s
    else:
      spec = _check_preset(preset)
      inner = spec.local.level("local", 1, False)
      slow = spec.node.level("node", 1, False)
      per_node, label, launch = spec.local_size, preset, spec.launch_s
    levels = []
    for i, (name, size) in enumerate(zip(names, sizes)):
      fits = i == len(names) - 1 and size <= per_node
      levels.append(dataclasses.replace(inner if fits else slow, name=str(name), size=size))
    return cls(tuple(levels), name=label, launch_s=launch)

  def for_axes(self, names: Sequence[str], sizes: Sequence[int]) -> Topology:
    """The topology a group over mesh axes ``names`` of ``sizes`` sees.

    If every name is a level of this topology, those levels (in the given
    order, with the given sizes); otherwise the group is mapped as
    :meth:`from_mesh` maps a mesh, with this topology as the preset.
    """
    if all(n in self.names for n in names):
      levels = [
          dataclasses.replace(self.level(n), size=int(s)) for n, s in zip(names, sizes)
      ]
      return dataclasses.replace(self, levels=tuple(levels))
    return self._from_axes(tuple(names), tuple(sizes), self)

  def with_level(self, name: str, **changes: Any) -> Topology:
    """A copy with level ``name``'s fields changed (e.g. fitted figures).

    Raises:
      ValueError: unknown level or field name, or an invalid value.
    """
    bad = [k for k in changes if k not in _LEVEL_FIELDS]
    if bad:
      raise ValueError(
          f"Unknown Level field(s) {bad}; valid fields: {', '.join(_LEVEL_FIELDS)}."
      )
    target = self.level(name)
    levels = tuple(
        dataclasses.replace(level, **changes) if level is target else level
        for level in self.levels
    )
    return dataclasses.replace(self, levels=levels)

  # ------------------------------------------------------------ JSON

  def to_dict(self) -> dict[str, Any]:
    """A JSON-ready dict (``json.dumps`` writes ``math.inf`` as ``Infinity``).

    ``node_link`` and ``node_size`` are written when set, so a one-node or
    part-of-a-node topology read back by :meth:`from_dict` can still be
    :meth:`resized` to more nodes.
    """
    out: dict[str, Any] = {
        "name": self.name,
        "launch_s": self.launch_s,
        "levels": [dataclasses.asdict(level) for level in self.levels],
    }
    if self.node_link is not None:
      out["node_link"] = dataclasses.asdict(self.node_link)
    if self.node_size is not None:
      out["node_size"] = self.node_size
    return out

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> Topology:
    """Inverse of :meth:`to_dict`.

    Raises:
      ValueError: missing or unknown keys, or invalid values.
    """
    if not isinstance(data, Mapping) or "levels" not in data:
      raise ValueError(
          "`data` must be a mapping with a 'levels' list (and optional 'name', "
          f"'launch_s', 'node_link', 'node_size'), as Topology.to_dict() writes; got {data!r}."
      )
    unknown = sorted(set(data) - {"name", "launch_s", "levels", "node_link", "node_size"})
    if unknown:
      raise ValueError(f"Unknown topology key(s) {unknown}; valid: name, launch_s, levels, "
                       "node_link, node_size.")

    def level(entry: Any) -> Level:
      if not isinstance(entry, Mapping):
        raise ValueError(f"A level must be a mapping of {', '.join(_LEVEL_FIELDS)}; got "
                         f"{entry!r}.")
      bad = sorted(set(entry) - set(_LEVEL_FIELDS))
      if bad:
        raise ValueError(
            f"Unknown level key(s) {bad}; valid: {', '.join(_LEVEL_FIELDS)}."
        )
      try:
        return Level(**entry)
      except TypeError as e:
        raise ValueError(
            f"Level {entry!r} is missing fields ({e}); required: name, size, "
            "latency_s, bandwidth_Bps."
        ) from None

    link = data.get("node_link")
    return cls(
        tuple(level(entry) for entry in data["levels"]),
        name=data.get("name", "custom"),
        launch_s=data.get("launch_s", 0.0),
        node_link=None if link is None else level(link),
        node_size=data.get("node_size"),
    )
