"""Published data-parallel scaling results, and the step model checked against them.

:func:`validate` predicts each row of :data:`VALIDATION` with
:mod:`jaxcoll.step_model`; :func:`fit_interference` fits the model's one free
parameter (the overlap interference ``kappa``) on ONE row,
:data:`FIT_ROW`, so every other row is a prediction.

Figures this module relies on, with their sources:

* Scaling results. Horovod README (docs/benchmarks.rst): "128 servers with 4
  Pascal GPUs each connected by a RoCE-capable 25 Gbit/s network. Horovod
  achieves 90% scaling efficiency for both Inception V3 and ResNet-101, and
  68% scaling efficiency for VGG-16"; the reproduction command uses
  ``tf_cnn_benchmarks --batch_size 64`` (per GPU; we assume 64 for all three
  models). Sergeev & Del Balso 2018 (arXiv:1802.05799): 88% efficiency at 128
  GPUs over 25 GbE TCP for Inception V3 and ResNet-101. Goyal et al. 2017
  (arXiv:1706.02677): ResNet-50 "~90% scaling efficiency when moving from 8 to
  256 GPUs", 32 images per GPU, Big Basin servers of 8 P100 and 50 Gbit
  Ethernet, gradients aggregated layer by layer during backprop with
  recursive halving-doubling between servers.
* Single-GPU speed (TensorFlow's performance benchmarks page, 2017: DGX-1
  with Tesla P100, synthetic ImageNet, batch 64 per GPU): Inception V3 142
  images/s, ResNet-50 219, ResNet-152 91.8, VGG-16 154. ResNet-101 is not
  listed: we interpolate linearly in FLOPs between ResNet-50 (3.8 GFLOPs)
  and ResNet-152 (11.3 GFLOPs; He et al. 2016, Table 1) to 7.6 GFLOPs: 129
  images/s (an assumption). The Horovod servers' Pascal GPUs are taken to
  run as fast as DGX-1's P100s (an assumption); Goyal et al.'s Caffe2 is
  taken to run ResNet-50 at TensorFlow's 219 images/s (an assumption: the
  paper gives no single-GPU figure).
* Parameters and per-layer compute: VGG-16 (Simonyan & Zisserman 2015,
  configuration D, 138,357,544 parameters) and ResNet-50/101 (He et al.
  2016, Table 1, bottleneck blocks with batch norm: 25,557,032 and
  44,549,160 parameters) are built layer by layer below, compute in
  proportion to each layer's multiply-adds. Inception V3 (Szegedy et al.
  2016; 23,851,784 parameters in Keras Applications) is modelled as its
  2,049,000-parameter classifier (negligible compute) after 94 equal
  convolution layers (an assumption: no per-layer table).
* Horovod fuses gradients into 64 MiB buffers (Tensor Fusion,
  ``HOROVOD_FUSION_THRESHOLD``'s default), and uses NCCL's ring; optimizer:
  ``tf_cnn_benchmarks``' default plain SGD (12 bytes of memory traffic per
  parameter, no state).
* The PyTorch DDP paper (Li et al., VLDB 2020) shows the bucket-size effect
  on ResNet-50 and BERT as plots; we do not have their values in a form we
  can cite, so there is no numeric row for it: :func:`bucket_sweep` gives the
  model's own curve on the paper's cluster (``volta-nvlink-100gb-ib``) and the
  tests check its shape (tiny buckets and one giant bucket are both slower
  than DDP's default 25 MiB), not a published number.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxcoll.collectives.hierarchical import Hierarchical
from jaxcoll.scale.step_model import Strategy, WorkloadSpec, efficiency, step_time
from jaxcoll.comm_model.topology import Topology

# ------------------------------------------------------------------ layer tables


def _conv(k: int, cin: int, cout: int, out_hw: int, bias: bool) -> tuple[float, float]:
  """(parameters, multiply-adds) of a k x k convolution, plus bias or batch norm."""
  params = k * k * cin * cout + (cout if bias else 2 * cout)
  return float(params), float(k * k * cin * cout * out_hw * out_hw)


def vgg16_layers() -> list[tuple[float, float]]:
  """(params, MACs) of VGG-16's 13 convolutions and 3 dense layers, in forward order."""
  layers, cin, hw = [], 3, 224
  for width, repeat in ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3)):
    for _ in range(repeat):
      layers.append(_conv(3, cin, width, hw, bias=True))
      cin = width
    hw //= 2
  for fan_in, fan_out in ((512 * 7 * 7, 4096), (4096, 4096), (4096, 1000)):
    layers.append((float(fan_in * fan_out + fan_out), float(fan_in * fan_out)))
  return layers


def resnet_layers(blocks: Sequence[int]) -> list[tuple[float, float]]:
  """(params, MACs) of a bottleneck ResNet (50: 3,4,6,3; 101: 3,4,23,3), forward order."""
  layers = [_conv(7, 3, 64, 112, bias=False)]
  cin, hw = 64, 56
  for stage, (width, count) in enumerate(zip((64, 128, 256, 512), blocks)):
    if stage:
      hw //= 2
    for b in range(count):
      layers.append(_conv(1, cin, width, hw, bias=False))
      layers.append(_conv(3, width, width, hw, bias=False))
      layers.append(_conv(1, width, 4 * width, hw, bias=False))
      if b == 0:
        layers.append(_conv(1, cin, 4 * width, hw, bias=False))  # projection shortcut
      cin = 4 * width
  layers.append((float(2048 * 1000 + 1000), float(2048 * 1000)))
  return layers


def _from_layers(name, layers, images_per_s, **fields) -> WorkloadSpec:
  params, macs = zip(*layers)
  return WorkloadSpec(name, params, 1.0 / images_per_s, layer_compute=macs, **fields)


_SGD = dict(optimizer_state_bytes_per_param=0, optimizer_traffic_bytes_per_param=12)
_INCEPTION_PARAMS, _INCEPTION_FC = 23_851_784, 2_049_000

WORKLOADS: dict[str, WorkloadSpec] = {
    "inception_v3": WorkloadSpec(
        "Inception V3",
        ((_INCEPTION_PARAMS - _INCEPTION_FC) / 94,) * 94 + (_INCEPTION_FC,),
        1 / 142,
        layer_compute=(1.0,) * 94 + (0.0,),
        source="TF benchmarks P100 142 img/s; 23.85M params (Keras Applications)",
        **_SGD,
    ),
    "resnet101": _from_layers(
        "ResNet-101", resnet_layers((3, 4, 23, 3)), 129.0,
        source="129 img/s interpolated from TF benchmarks P100 (ResNet-50 219, -152 91.8)",
        **_SGD,
    ),
    "vgg16": _from_layers(
        "VGG-16", vgg16_layers(), 154.0, source="TF benchmarks P100 154 img/s", **_SGD
    ),
    "resnet50": _from_layers(
        "ResNet-50", resnet_layers((3, 4, 6, 3)), 219.0,
        source="TF benchmarks P100 219 img/s", **_SGD,
    ),
}

_HOROVOD = Strategy(stage=0, bucket_bytes=64 << 20, algorithm="native")
# Goyal et al.: every layer's gradient its own collective (bucket_bytes=1);
# NCCL-style ring inside a server, recursive halving-doubling between servers.
_GOYAL = Strategy(stage=0, bucket_bytes=1,
                  algorithm=Hierarchical(inner="ring", outer="halving_doubling"))


@dataclasses.dataclass(frozen=True)
class PublishedRow:
  """One published scaling result."""

  source: str
  workload: str
  preset: str
  num_devices: int
  per_device_batch: int
  published_efficiency: float
  strategy: Strategy
  baseline: str = "device"


VALIDATION: tuple[PublishedRow, ...] = (
    PublishedRow("Horovod README", "inception_v3", "pascal-pcie-25gbe-roce", 512, 64, 0.90,
                 _HOROVOD),
    PublishedRow("Horovod README", "resnet101", "pascal-pcie-25gbe-roce", 512, 64, 0.90,
                 _HOROVOD),
    PublishedRow("Horovod README", "vgg16", "pascal-pcie-25gbe-roce", 512, 64, 0.68, _HOROVOD),
    PublishedRow("Sergeev & Del Balso 2018", "inception_v3", "pascal-pcie-25gbe-tcp", 128, 64,
                 0.88, _HOROVOD),
    PublishedRow("Sergeev & Del Balso 2018", "resnet101", "pascal-pcie-25gbe-tcp", 128, 64,
                 0.88, _HOROVOD),
    PublishedRow("Goyal et al. 2017", "resnet50", "pascal-nvlink-50gbe", 256, 32, 0.90, _GOYAL,
                 baseline="node"),
)

# The one row the interference is fitted on; every other row is predicted.
FIT_ROW = 5  # Goyal et al. 2017, ResNet-50 (another cluster and framework than Horovod's)


def predict(row: PublishedRow, interference: float) -> float:
  """The model's efficiency for ``row``."""
  return efficiency(
      WORKLOADS[row.workload], row.strategy, row.preset, row.num_devices,
      per_device_batch=row.per_device_batch, baseline=row.baseline, interference=interference,
  )


def fit_interference(row: PublishedRow | None = None, *, tol: float = 1e-4) -> float:
  """The ``kappa`` in [0, 1] at which the model reproduces ``row`` (default :data:`FIT_ROW`).

  Efficiency falls as ``kappa`` grows, so this bisects.

  Raises:
    ValueError: if no ``kappa`` in [0, 1] reaches the published figure.
  """
  row = VALIDATION[FIT_ROW] if row is None else row
  lo, hi = 0.0, 1.0
  if not predict(row, hi) <= row.published_efficiency <= predict(row, lo):
    raise ValueError(
        f"No interference in [0, 1] reproduces {row.source} {row.workload}: the model gives "
        f"{predict(row, hi):.3f}..{predict(row, lo):.3f}, published {row.published_efficiency}."
    )
  while hi - lo > tol:
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if predict(row, mid) > row.published_efficiency else (lo, mid)
  return round((lo + hi) / 2, 2)


@dataclasses.dataclass(frozen=True)
class ValidationResult:
  row: PublishedRow
  predicted_efficiency: float
  fitted_here: bool

  @property
  def error_pp(self) -> float:
    """Prediction minus published figure, in percentage points."""
    return 100 * (self.predicted_efficiency - self.row.published_efficiency)


def validate(interference: float | None = None) -> list[ValidationResult]:
  """Every row of :data:`VALIDATION` predicted with ``interference`` (default: the fit)."""
  kappa = fit_interference() if interference is None else interference
  return [ValidationResult(r, predict(r, kappa), i == FIT_ROW) for i, r in enumerate(VALIDATION)]


def validation_table(results: Sequence[ValidationResult]) -> str:
  """A markdown table: source, workload, cluster, GPUs, published, predicted, error."""
  lines = [
      "| source | model | cluster | GPUs | published | predicted | error (pp) |",
      "|---|---|---|---|---|---|---|",
  ]
  for r in results:
    mark = " (fitted)" if r.fitted_here else ""
    lines.append(
        f"| {r.row.source} | {WORKLOADS[r.row.workload].name} | {r.row.preset} | "
        f"{r.row.num_devices} | {r.row.published_efficiency:.0%} | "
        f"{r.predicted_efficiency:.1%}{mark} | {r.error_pp:+.1f} |"
    )
  return "\n".join(lines)


def bucket_sweep(
    workload: str = "resnet50",
    bucket_bytes: Sequence[int] = (1 << 10, 1 << 20, 5 << 20, 25 << 20, 100 << 20, 1 << 30),
    *,
    num_devices: int = 32,
    per_device_batch: int = 32,
    interference: float | None = None,
) -> dict[int, float]:
  """Predicted step seconds of DP vs bucket size on the DDP paper's cluster."""
  kappa = fit_interference() if interference is None else interference
  topo = Topology.cluster("volta-nvlink-100gb-ib", num_devices)
  return {
      b: step_time(WORKLOADS[workload], Strategy(bucket_bytes=b), topo,
                   per_device_batch=per_device_batch, interference=kappa).step_s
      for b in bucket_bytes
  }
