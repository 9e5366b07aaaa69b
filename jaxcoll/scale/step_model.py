"""Training-step time model: compute, communication overlapped with backward, optimizer.

One level above :mod:`jaxcoll.cost` (one collective's time), this predicts a
whole data-parallel training step of a workload on ``N`` devices of a
:class:`~jaxcoll.topology.Topology`, for each strategy the trainers have:
DP (bucketed all-reduce, optionally bf16 / int8 compressed), ZeRO-1/2/3 and
hybrid ZeRO-3 (sharded inside a node, replicated across nodes).

The step is simulated as two resources, the device's compute stream and its
link, over explicit events:

* forward, then backward layer by layer in *reverse* layer order; a layer's
  compute is its share (``WorkloadSpec.layer_compute``, by default in
  proportion to its parameters) of ``per-device batch x seconds_per_example``,
  and backward is ``backward_fraction`` (2/3: backward costs about twice the
  forward FLOPs) of it;
* gradients are packed into buckets exactly as the trainers pack them
  (:func:`jaxcoll.train.buckets.plan_buckets`, reverse leaf order); a bucket's
  collective is *issued* when backward has produced its last gradient and
  *starts* when the link is free (one collective at a time, first issued
  first served); its duration is :func:`jaxcoll.cost.estimate`;
* ZeRO-3 gathers each bucket's parameters before its forward and again
  before its backward compute (issued one bucket ahead: prefetch), and
  reduce-scatters its gradients after; ZeRO-1/2 all-gather the updated
  parameters after the optimizer (exposed, as the trainers do it);
* the optimizer reads and writes ``optimizer_traffic_bytes_per_param`` bytes
  per parameter it updates (all of them for DP, ``1/N`` under ZeRO) at the
  device's memory bandwidth (the innermost level's ``reduce_Bps``: HBM in the
  presets).

Overlap: while a collective runs at the same time as compute, both proceed
at ``1 / (1 + kappa)`` of their own speed (the **overlap interference**:
communication kernels and copies compete with compute for SMs, memory
bandwidth and PCIe). ``kappa = 0`` is perfect overlap, ``kappa = 1`` no gain
from overlap at all. It is held at :data:`DEFAULT_INTERFERENCE` (0.34, the
earlier fit on Goyal et al. 2017), not refitted.

Synchronizing ``N > 1`` devices costs, besides the collectives, the wait for
the slowest device (``straggler_sigma`` x E[max of N standard normals] of the
step's compute) and a fixed ``sync_s`` per optimizer step.

The host input pipeline: when a step's examples are decoded on the CPU by
``input_workers`` data-loader processes per device (:func:`step_time`) and
two or more GPUs of a node share its CPUs, a device trains at most
``input_workers x loader_rate`` examples per second (the loader prefetches,
so the step takes the longer of the two). One GPU alone is not limited: its
published rate, the model's compute speed, was measured with its loader.

These three, ``straggler_sigma``, ``sync_s`` and ``loader_rate``, are the
free parameters (:class:`ModelParams`), fitted on a third of the published
rows of :mod:`jaxcoll.scale.published` and checked on the rest;
:data:`DEFAULT_PARAMS` is that fit. The links' achieved ``bus_fraction``
(for clusters built from their links,
:meth:`jaxcoll.topology.Topology.from_hardware`) is held at the line rate.

Scaling efficiency is weak scaling (fixed per-device batch): the step time of
one device (or of one node, ``baseline="node"``) over the step time on ``N``.
Memory per device is the ZeRO paper's model-state formula
(:func:`jaxcoll.memory.zero_bytes_per_device`); activations are not included.

Limits, on purpose: one link per device (collectives never run concurrently,
as on one NCCL stream), an input pipeline only where its workers are given,
compute per example independent of the batch size, and the collective model's own limits
(:mod:`jaxcoll.cost`).

Example:
  >>> w = WorkloadSpec.from_numbers("7B", num_params=7e9, flops_per_example=6 * 7e9 * 2048,
  ...                               achieved_flops=4e14)
  >>> topo = Topology.cluster("dgx-h100", 64)
  >>> t = step_time(w, StepStrategy(stage=3), topo, per_device_batch=4)
  >>> round(t.compute_s, 2), t.exposed_comm_s < t.compute_s
  (0.86, True)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import unittest.mock
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxcoll.comm_model import cost
from jaxcoll.collectives.hierarchical import Hierarchical
from jaxcoll.scale.memory import zero_bytes_per_device
from jaxcoll.comm_model.topology import Topology
from jaxcoll.train import kinds
from jaxcoll.train.buckets import plan_buckets
from jaxcoll.train.strategies import DEFAULT_BUCKET_BYTES

# The overlap interference kappa (see ModelParams), the earlier fit on Goyal et al. 2017;
# DEFAULT_PARAMS holds the fitted parameters (tests/scale/test_step_model.py checks them).
DEFAULT_INTERFERENCE = 0.34

# Backward ~ 2x forward FLOPs (the 6N-per-token rule of Kaplan et al. 2020,
# 2N forward + 4N backward), so backward is 2/3 of a step's compute.
BACKWARD_FRACTION = 2.0 / 3.0

COMPRESSIONS = (None, "bf16", "int8")
BASELINES = ("device", "node")


@dataclasses.dataclass(frozen=True)
class ModelParams:
  """The step model's free parameters (fitted on published rows: jaxcoll.scale.published).

  Attributes:
    straggler_sigma: relative standard deviation of one device's compute
      time per step. A synchronous step waits for the slowest of ``N``
      devices; the expected maximum of ``N`` such (Gaussian) times exceeds
      the mean by ``sigma x E[max of N standard normals]`` of it
      (:func:`expected_max_normal`, which grows like ``sqrt(2 ln N)``), so
      that is what the step pays on ``N > 1`` devices.
    sync_s: fixed seconds per optimizer step on ``N > 1`` devices besides the
      collectives' own time (framework bookkeeping: Horovod's negotiation,
      DDP's bucket finalization, stream synchronization, the host wait).
    bus_fraction: the part of a link's line rate that NCCL's bus bandwidth
      reaches; used when a cluster is built from its links
      (:meth:`jaxcoll.topology.Topology.from_hardware`), not by the presets
      (whose bandwidths are measured busbw already). Not fitted:
      :data:`DEFAULT_PARAMS` holds it at 1.0 (the line rate).
    interference: the overlap interference ``kappa`` (module docstring).
    loader_rate: examples per second that ONE host input-pipeline worker
      (a CPU data-loader process: JPEG decode and augmentation) delivers
      while every GPU of the node trains and all their workers run. A
      device fed by ``input_workers`` such workers (:func:`step_time`) can
      train at most ``input_workers x loader_rate`` examples per second when
      two or more GPUs of a node share the host; ``inf``: no input limit.
  """

  straggler_sigma: float = 0.0
  sync_s: float = 0.0
  bus_fraction: float = 0.80
  interference: float = DEFAULT_INTERFERENCE
  loader_rate: float = math.inf

  def __post_init__(self):
    _positive(self.straggler_sigma, "straggler_sigma", allow_zero=True)
    _positive(self.sync_s, "sync_s", allow_zero=True)
    _positive(self.bus_fraction, "bus_fraction")
    _positive(self.interference, "interference", allow_zero=True)
    if isinstance(self.loader_rate, bool) or not isinstance(
        self.loader_rate, (int, float, np.integer, np.floating)) or not self.loader_rate > 0:
      raise ValueError(
          f"`loader_rate` must be a number > 0 (examples/s of one data-loader worker; inf: "
          f"no input limit); got {self.loader_rate!r}. Pass e.g. 130.")
    if self.bus_fraction > 1 or self.interference > 1:
      raise ValueError(
          f"`bus_fraction` must be in (0, 1] and `interference` in [0, 1]; got "
          f"{self.bus_fraction!r}, {self.interference!r}."
      )

  def input_seconds(self, examples: int, input_workers: int | None,
                    gpus_sharing_host: int) -> float:
    """Seconds the host input pipeline needs for ``examples`` of one device.

    0 (no limit) without ``input_workers`` (synthetic data, or a pipeline
    the model has no rate for), or when one GPU has the host to itself
    (its published one-GPU rate already includes its own loader).
    """
    if input_workers is None or gpus_sharing_host <= 1 or math.isinf(self.loader_rate):
      return 0.0
    return examples / (input_workers * self.loader_rate)

  def sync_cost(self, compute_s: float, num_devices: int) -> float:
    """Seconds that synchronizing ``num_devices`` adds to a step of ``compute_s``."""
    if num_devices <= 1:
      return 0.0
    return self.sync_s + self.straggler_sigma * expected_max_normal(num_devices) * compute_s


@functools.lru_cache(maxsize=None)
def expected_max_normal(n: int) -> float:
  """E[max of ``n`` independent standard normals] (0.564 for 2, 1.424 for 8, 3.04 for 512).

  Numerical integral of ``x n phi(x) Phi(x)^(n-1)``; it grows like
  ``sqrt(2 ln n)`` (the bound it approaches from below).
  """
  n = _positive(n, "n", integer=True)
  if n == 1:
    return 0.0
  x = np.linspace(-8.0, 8.0, 8001)
  pdf = np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
  cdf = 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
  return float(np.sum(x * n * pdf * cdf ** (n - 1)) * (x[1] - x[0]))


_FLOPS_EXAMPLE = "1.5e14 (FLOP/s: an A100's bf16 peak 3.12e14 x 50% utilization)"


def _positive(value: Any, what: str, *, integer: bool = False, allow_zero: bool = False,
              example: str = "1") -> Any:
  kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
  if isinstance(value, bool) or not isinstance(value, kinds):
    raise TypeError(f"`{what}` must be a {'whole ' if integer else ''}number; got {value!r}.")
  if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
    bound = ">= 0" if allow_zero else "> 0"
    raise ValueError(f"`{what}` must be a finite number {bound}; got {value!r}. Pass e.g. "
                     f"{example}.")
  return value


def _xla_flops(closed: Any) -> float:
  """XLA's cost-analysis FLOPs of a closed jaxpr (a loop's body counted once)."""
  import jax  # noqa: PLC0415
  from jax.extend import core  # noqa: PLC0415

  cost = jax.jit(core.jaxpr_as_fun(closed)).lower(*closed.in_avals).cost_analysis()
  return float((cost or {}).get("flops", 0.0))


def _scans(jaxpr: Any):
  """The ``scan`` equations of ``jaxpr`` and of the jaxprs inside its equations (jit, remat,
  custom derivatives), not those inside another scan (its body counts them)."""
  from jax.extend import core  # noqa: PLC0415

  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      yield eqn
    else:
      for sub in core.jaxprs_in_params(eqn.params):
        yield from _scans(sub)


def _jaxpr_flops(closed: Any) -> float:
  """FLOPs of a closed jaxpr with every scan's body counted ``length`` times."""
  total = _xla_flops(closed)
  for eqn in _scans(closed.jaxpr):
    body = eqn.params["jaxpr"]
    total += eqn.params["length"] * _jaxpr_flops(body) - _xla_flops(body)
  return total


def _loop_aware_flops(fn: Any, *args: Any, **kwargs: Any) -> int:
  """flax.linen.summary's ``_get_flops`` (XLA's FLOPs of ``jax.jit(fn)``), loops unrolled."""
  import jax  # noqa: PLC0415

  return int(_jaxpr_flops(jax.make_jaxpr(fn)(*args, **kwargs)))


# ------------------------------------------------------------------ inputs


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
  """What the step model needs to know of a model.

  Attributes:
    name: a label.
    layer_params: parameters of each layer (or leaf), in forward order; the
      gradient buckets are planned over them as the trainers plan theirs.
    seconds_per_example: forward + backward time of one example on one
      device (measured, or from a published single-GPU benchmark: 1 /
      images per second).
    layer_compute: relative compute of each layer (default: in proportion to
      ``layer_params``, right for dense layers, not for convolutions).
    param_bytes: bytes per parameter in the model state (4: float32).
    grad_bytes: bytes per gradient element on the wire (4: float32).
    optimizer_state_bytes_per_param: ZeRO's ``K`` (8: float32 Adam; 0: SGD).
    optimizer_traffic_bytes_per_param: memory bytes one parameter's update
      reads and writes (28 for Adam: reads param, grad, m, v, writes param,
      m, v in float32; 12 for plain SGD).
    backward_fraction: backward's share of ``seconds_per_example``.
    source: where the figures come from.
  """

  name: str
  layer_params: tuple[float, ...]
  seconds_per_example: float
  layer_compute: tuple[float, ...] | None = None
  param_bytes: float = 4
  grad_bytes: float = 4
  optimizer_state_bytes_per_param: float = 8
  optimizer_traffic_bytes_per_param: float = 28
  backward_fraction: float = BACKWARD_FRACTION
  source: str = ""

  def __post_init__(self):
    params = tuple(self.layer_params)
    if not params:
      raise ValueError(f"`layer_params` of {self.name!r} is empty; give each layer's parameters.")
    for p in params:
      _positive(p, "layer_params entry", allow_zero=True)
    if sum(params) <= 0:
      raise ValueError(f"`layer_params` of {self.name!r} sum to 0; a workload needs parameters.")
    object.__setattr__(self, "layer_params", params)
    if self.layer_compute is not None:
      compute = tuple(self.layer_compute)
      if len(compute) != len(params):
        raise ValueError(
            f"`layer_compute` has {len(compute)} entries but `layer_params` {len(params)}; "
            "give one per layer."
        )
      for c in compute:
        _positive(c, "layer_compute entry", allow_zero=True)
      if sum(compute) <= 0:
        raise ValueError("`layer_compute` sums to 0; give each layer's relative compute.")
      object.__setattr__(self, "layer_compute", compute)
    _positive(self.seconds_per_example, "seconds_per_example")
    for what in ("param_bytes", "grad_bytes"):
      _positive(getattr(self, what), what)
    for what in ("optimizer_state_bytes_per_param", "optimizer_traffic_bytes_per_param"):
      _positive(getattr(self, what), what, allow_zero=True)
    if not 0 < self.backward_fraction < 1:
      raise ValueError(
          f"`backward_fraction` must be in (0, 1); got {self.backward_fraction!r} (2/3 is typical)."
      )

  @property
  def num_params(self) -> float:
    return float(sum(self.layer_params))

  @property
  def compute_shares(self) -> np.ndarray:
    """Each layer's fraction of the compute (sums to 1)."""
    weights = np.asarray(self.layer_compute or self.layer_params, np.float64)
    return weights / weights.sum()

  @classmethod
  def from_numbers(
      cls,
      name: str,
      *,
      num_params: float,
      flops_per_example: float,
      achieved_flops: float,
      layers: int = 32,
      **fields: Any,
  ) -> WorkloadSpec:
    """A workload given by numbers: ``layers`` equal layers of ``num_params``.

    Args:
      name: a label.
      num_params: parameters.
      flops_per_example: training FLOPs of one example (forward + backward;
        ``6 x params x tokens`` for a transformer LM).
      achieved_flops: FLOP/s one device sustains (peak x utilization).
      layers: number of equal layers (bucket boundaries and ZeRO-3 units).
      **fields: other :class:`WorkloadSpec` fields.
    """
    _positive(num_params, "num_params")
    _positive(flops_per_example, "flops_per_example")
    _positive(achieved_flops, "achieved_flops", example=_FLOPS_EXAMPLE)
    _positive(layers, "layers", integer=True)
    return cls(
        name, (num_params / layers,) * layers, flops_per_example / achieved_flops, **fields
    )

  @classmethod
  def from_model(
      cls, workload: Any, *, batch_size: int = 32, steps: int = 5, **fields: Any
  ) -> WorkloadSpec:
    """A shipped ``jaxcoll.models`` workload, its compute measured here.

    Times ``jax.jit(jax.grad(loss_fn))`` on one local device (median of
    ``steps`` after one warm-up) with a batch of ``batch_size``; one layer per
    leaf of the trainer's params pytree.
    """
    import time  # noqa: PLC0415

    import jax  # noqa: PLC0415 - only this builder runs the model

    _positive(batch_size, "batch_size", integer=True)
    _positive(steps, "steps", integer=True)
    params = workload.init_params(0)
    batch = workload.make_batch(0, batch_size)
    grad = jax.jit(jax.grad(lambda p, b: workload.loss_fn(p, b)[0]))
    jax.block_until_ready(grad(params, batch))
    times = []
    for _ in range(steps):
      start = time.perf_counter()
      jax.block_until_ready(grad(params, batch))
      times.append(time.perf_counter() - start)
    seconds = float(np.median(times)) / batch_size
    fields.setdefault("source", f"measured here: jit(grad) at batch {batch_size}")
    return cls.from_params(workload.name, params, seconds, **fields)

  @classmethod
  def from_flax(
      cls,
      module: Any,
      *example_args: Any,
      achieved_flops: float,
      name: str | None = None,
      rngs: Any = None,
      batch_size: int | None = None,
      **fields: Any,
  ) -> WorkloadSpec:
    """A workload from a flax module (linen, or nnx) and one example batch, nothing trained.

    One layer per top-level submodule, in call order: its parameter count
    and dtype bytes (shapes from ``jax.eval_shape`` of ``module.init``), and
    its forward + backward FLOPs from XLA's cost analysis of the
    submodule's VJP (flax's module table, ``compute_vjp_flops``). The step's
    compute is the whole module's VJP FLOPs per example over
    ``achieved_flops`` (FLOP/s one device sustains: its peak x the
    utilization you expect, e.g. a published MFU).

    Args:
      module: a ``flax.linen.Module``, or a ``flax.nnx.Module`` (one layer per top-level
        entry of its ``nnx.Param`` state, compute in proportion to parameters; see
        :meth:`_from_nnx`).
      *example_args: its call arguments for one batch (arrays, or
        ``jax.ShapeDtypeStruct`` made zeros); axis 0 of the first is the batch
        (of a dict, axis 0 its leaves share).
      achieved_flops: FLOP/s of one device.
      name: a label (default: the module's class name).
      rngs: ``init`` rngs (default ``{"params": jax.random.key(0)}``).
      batch_size: the examples in ``example_args`` (default: axis 0 of the first
        argument, which every leaf of a dict must share); give it where the first
        argument's leaves differ there (a per-batch table beside the examples).
      **fields: other :class:`WorkloadSpec` fields (``grad_bytes`` defaults
        to the parameters' dtype bytes).

    Raises:
      ValueError: ``achieved_flops`` <= 0, no batch axis, a module with
        no parameters, or one that does not trace on ``example_args``.
    """
    import jax  # noqa: PLC0415 - only this builder needs jax and flax
    from flax.linen import summary  # noqa: PLC0415

    _positive(achieved_flops, "achieved_flops", example=_FLOPS_EXAMPLE)
    batch = _example_count(example_args, batch_size)
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(module, nnx.Module):
      return cls._from_nnx(module, example_args, batch, achieved_flops, name=name, fields=fields)
    if not hasattr(module, "init"):
      raise ValueError(f"`module` must be a flax linen or nnx Module; got {type(module).__name__}.")
    rngs = {"params": jax.random.key(0)} if rngs is None else rngs
    table = summary._get_module_table(  # noqa: SLF001 - flax's own per-module FLOP counter
        module, depth=1, show_repeated=True, compute_flops=True, compute_vjp_flops=True)

    args = _zeros_for_structs(example_args)  # the inputs only; the parameters stay abstract
    # flax's table asks XLA's cost analysis for each row's FLOPs, which counts a loop's body
    # once: an nn.scan of L layers (and its backward) weighed one layer. Count each scan's body
    # `length` times instead (_loop_aware_flops).
    # show_repeated: every call of a top-level submodule is a row, so that a layer called again
    # (a tied embedding's Embed and its attend at the head, an ALBERT-style block shared by
    # every layer) gets the FLOPs of each call: with one row per submodule those calls' FLOPs
    # were in no layer (a GPT-style LM's head, most of its compute, weighed nothing). flax
    # would also price the deeper repeated calls and methods a lifted transform makes up:
    # those rows are left out here, and not priced (_top_level_flops).
    real_call_flops = summary._get_call_flops  # noqa: SLF001

    def _top_level_flops(c, *flags):
      if len(c.path) > 1 or not hasattr(c.module, c.method):
        return 0, 0
      return real_call_flops(c, *flags)

    try:  # the user's module on the user's batch: a failure there is bad input, in one line
      tree = jax.eval_shape(module.init, rngs, *args).get("params", {})
    except Exception as e:  # noqa: BLE001 - whatever the module raises while it traces
      raise _does_not_trace(module, example_args, e) from e
    with unittest.mock.patch.object(summary, "_get_flops", _loop_aware_flops), \
         unittest.mock.patch.object(summary, "_get_call_flops", _top_level_flops):
      rows = table(rngs, *args)
    root, subs, repeats = rows[0], [], {}
    for row in rows[1:]:
      if len(row.path) != 1:
        continue  # a deeper call: in its top-level parent's FLOPs already
      if row.path in repeats:
        repeats[row.path].append(row)
      else:
        repeats[row.path] = []
        subs.append(row)

    def counted(row) -> tuple[float, float]:
      # counted_variables: the row's own parameters and those of its children below the table's
      # depth (a block of Dense layers, an nn.scan's stacked layers); module_variables would
      # hold only the parameters the row's module creates itself (0 for such a block).
      leaves = jax.tree.leaves(row.counted_variables.get("params", {}))
      count = float(sum(math.prod(np.shape(x)) for x in leaves))
      nbytes = float(sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in leaves))
      return count, nbytes

    def iterations(row, count: float) -> int:
      # A lifted loop's row (nn.scan) reports ONE iteration's call and FLOPs but holds the
      # stacked parameters of all of them: k = stacked / one call's parameters.
      try:
        inputs = jax.tree.map(summary._from_value_representation, row.inputs)  # noqa: SLF001
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        one = jax.eval_shape(row.module_copy.init, jax.random.key(0), *inputs)
      except Exception:  # noqa: BLE001 - a call we cannot repeat: take it as not a loop
        return 1
      single = sum(math.prod(np.shape(x)) for x in jax.tree.leaves(one.get("params", {})))
      k = count / single if single else 1.0
      return int(round(k)) if k > 1 and abs(k - round(k)) < 1e-9 else 1

    # The parameters themselves come from `init`'s tree, per top-level entry: flax's table shows
    # no variables for a module that a lifted transform of another runs (the cell that
    # nn.RNN(nn.GRUCell(...)) scans: defined in the parent, its parameters were counted nowhere,
    # a GRU classifier came out with 650 of its 14,730).

    def entry(key) -> tuple[float, float]:
      leaves = jax.tree.leaves(tree.get(key, {}))
      return (float(sum(math.prod(np.shape(x)) for x in leaves)),
              float(sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in leaves)))

    layers, compute, again, total_bytes = [], [], [], 0.0
    for row in subs:
      count, nbytes = counted(row)
      if row.path[0] in tree:
        count, nbytes = max((count, nbytes), entry(row.path[0]))
      layers.append(count)
      loops = iterations(row, count) if count else 1
      compute.append(float(max(row.vjp_flops, 0)) * loops)
      # A lifted loop (nn.scan) traces its body twice: its second row is not a second call.
      again.append(0.0 if loops > 1 else sum(float(max(r.vjp_flops, 0))
                                             for r in repeats[row.path]))
      total_bytes += nbytes
    if sum(compute) + sum(again) <= 1.01 * float(root.vjp_flops):  # whole model: the bound
      compute = [c + a for c, a in zip(compute, again, strict=True)]
    own, own_bytes = counted(root)
    rest = [entry(key) for key in tree if key not in {row.path[0] for row in subs}]
    if sum(c for c, _ in rest) > own:  # top-level entries no row owns: the module's own
      own, own_bytes = sum(c for c, _ in rest), sum(b for _, b in rest)
    if own:  # parameters of the module itself (a ViT's class token and position embedding)
      # The root row's FLOPs are the whole model's: its own are what the submodules leave.
      layers.insert(0, own)
      compute.insert(0, max(float(root.vjp_flops) - sum(compute), 0.0))
      total_bytes += own_bytes
    if not sum(layers):
      raise ValueError(f"`module` {type(module).__name__} has no parameters to train.")
    if not sum(compute):
      compute = list(layers)
    flops_per_example = float(root.vjp_flops) / batch
    label = name or type(module).__name__
    fields.setdefault("param_bytes", total_bytes / sum(layers))
    fields.setdefault("grad_bytes", fields["param_bytes"])
    fields.setdefault("source", f"flax {label}: {flops_per_example:.3g} FLOPs/example (XLA cost "
                                f"analysis) at {achieved_flops:.3g} FLOP/s")
    return cls(label, tuple(layers), flops_per_example / achieved_flops,
               layer_compute=tuple(compute), **fields)

  @classmethod
  def _from_nnx(cls, module, example_args, batch, achieved_flops, *, name,
                fields) -> WorkloadSpec:
    """:meth:`from_flax` of a flax.nnx Module: one layer per top-level entry of its
    ``nnx.Param`` state (the trainer's tree order); FLOPs of the whole model's
    forward + backward (``jax.grad`` w.r.t. the params, scans counted per
    iteration, the model in ``eval()`` mode); each layer's compute in proportion
    to its parameters."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    layers, total_bytes = [], 0.0
    for key in params:
      leaves = jax.tree.leaves(params[key])
      layers.append(float(sum(math.prod(np.shape(x)) for x in leaves)))
      total_bytes += float(sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize
                               for x in leaves))
    if not sum(layers):
      raise ValueError(f"`module` {type(module).__name__} has no nnx.Param to train.")
    args = _zeros_for_structs(example_args)

    def half_square(p, r, *a):  # the state passes as arguments: nnx mutates it in the trace
      net = nnx.merge(graphdef, p, r)
      net.eval()  # BatchNorm(axis_name=...) would reduce over an axis unbound here
      out = net(*a)
      # Its cotangent is the output itself, as a loss's is: a cotangent of ones (sum(out))
      # lets XLA fold the last layer's backward matmuls into sums, counted as ~0 FLOPs.
      return sum(0.5 * jnp.sum(jnp.square(jnp.asarray(x, jnp.float32)))
                 for x in jax.tree.leaves(out))

    try:
      closed = jax.make_jaxpr(jax.grad(half_square))(params, rest, *args)
    except Exception as e:  # noqa: BLE001 - whatever the module raises while it traces
      raise _does_not_trace(module, example_args, e) from e
    flops_per_example = _jaxpr_flops(closed) / batch
    label = name or type(module).__name__
    fields.setdefault("param_bytes", total_bytes / sum(layers))
    fields.setdefault("grad_bytes", fields["param_bytes"])
    fields.setdefault("source", f"flax.nnx {label}: {flops_per_example:.3g} FLOPs/example (XLA "
                                f"cost analysis) at {achieved_flops:.3g} FLOP/s")
    return cls(label, tuple(layers), flops_per_example / achieved_flops, **fields)

  @classmethod
  def from_params(
      cls, name: str, params: Any, seconds_per_example: float, **fields: Any
  ) -> WorkloadSpec:
    """A workload from a real parameter pytree (or shape structs): one layer per leaf.

    The leaves in tree order are what the trainers bucket, so the bucket plan
    is the trainer's. ``param_bytes`` and ``grad_bytes`` default to the leaves'
    dtype bytes (2 for a bfloat16 model), as :meth:`from_flax` takes them.
    """
    import jax  # noqa: PLC0415 - only this builder needs it

    leaves = jax.tree.leaves(params)
    sizes = tuple(float(math.prod(np.shape(x))) for x in leaves)
    if sum(sizes):
      dtypes = [x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype for x in leaves]
      nbytes = sum(size * np.dtype(d).itemsize for size, d in zip(sizes, dtypes))
      fields.setdefault("param_bytes", nbytes / sum(sizes))
      fields.setdefault("grad_bytes", fields["param_bytes"])
    return cls(name, sizes, seconds_per_example, **fields)


def _does_not_trace(module: Any, example_args: Sequence[Any], error: Exception) -> ValueError:
  """``from_flax``'s one line for a module that fails on the user's batch: its shapes, the
  first line of what the module raised, and the fix."""
  import jax  # noqa: PLC0415

  shapes = [jax.tree.map(lambda a: tuple(np.shape(a)), a) for a in example_args]
  why = (str(error).strip().splitlines() or [""])[0]
  return ValueError(
      f"`module` {type(module).__name__} does not trace on `example_args` of shapes {shapes}: "
      f"{type(error).__name__}: {why}; pass the batch its __call__ takes (arrays or "
      f"jax.ShapeDtypeStruct).")


def _example_count(example_args: Sequence[Any], batch_size: int | None) -> int:
  """The examples of ``from_flax``'s batch: ``batch_size``, else axis 0 of the first
  argument (an array, or a pytree of them that all agree there)."""
  import jax  # noqa: PLC0415

  if batch_size is not None:
    return _positive(batch_size, "batch_size", integer=True)
  first = [x for x in (jax.tree.leaves(example_args[0]) if example_args else []) if np.shape(x)]
  if not first:
    raise ValueError("`example_args` must start with a batched array, or a pytree (a dict) "
                     "of them (axis 0 of its leaves is the batch); or give `batch_size=`.")
  sizes = sorted({int(np.shape(x)[0]) for x in first})
  if len(sizes) > 1:  # the first leaf in key order was taken: FLOPs/example off by the ratio
    raise ValueError(
        f"The leaves of the first of `example_args` differ in axis 0 ({sizes}), so which is "
        "the batch is ambiguous; give `batch_size=` (the examples in this batch).")
  if sizes[0] < 1:  # FLOPs per example would divide by it
    raise ValueError(
        f"The first of `example_args` has {sizes[0]} examples (axis 0); pass a batch of at "
        "least 1 example, e.g. jax.ShapeDtypeStruct((8, ...), dtype).")
  return sizes[0]


def _zeros_for_structs(example_args: Sequence[Any]) -> list[Any]:
  """``example_args`` with every ``jax.ShapeDtypeStruct`` leaf made zeros (nested ones too)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  def zeros(a):
    return jnp.zeros(a.shape, a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a

  return [jax.tree.map(zeros, a) for a in example_args]


@dataclasses.dataclass(frozen=True)
class StepStrategy:
  """A training strategy as the step model sees it.

  Which collectives it runs come from its :attr:`kind` (the same
  :class:`jaxcoll.train.kinds.StrategyKind` the trainers' plans carry).
  ``jaxcoll.step_model.Strategy`` is the old name of this class (kept: the
  same class; ``jaxcoll.train.trainer.Strategy`` is the trainers'
  ``DataParallel | ZeRO``).

  Attributes:
    stage: 0 (data parallel), or ZeRO stage 1, 2, 3.
    bucket_bytes: the largest gradient bucket (one collective), as in
      ``jaxcoll.DataParallel(bucket_bytes=...)``; 25 MiB by default (DDP's).
    algorithm: every collective's algorithm: a name of :mod:`jaxcoll.cost`,
      ``"auto"`` (the model's fastest per collective) or a
      ``jaxcoll.Hierarchical`` (on one node: its inner algorithm).
    compression: ``None``, ``"bf16"`` (half the bytes) or ``"int8"`` (an
      all-to-all + all-gather of a quarter of the bytes); DP only.
    hybrid: ZeRO-3 sharded over the devices of a node and replicated across
      nodes (HSDP; ``jaxcoll.ZeRO(stage=3, axis="local", replica_axis="node")``).
  """

  stage: int = 0
  bucket_bytes: int = DEFAULT_BUCKET_BYTES
  algorithm: str | Hierarchical = "native"
  compression: str | None = None
  hybrid: bool = False

  def __post_init__(self):
    if self.stage not in (0, 1, 2, 3) or isinstance(self.stage, bool):
      raise ValueError(f"`stage` must be 0 (DP), 1, 2 or 3; got {self.stage!r}.")
    _positive(self.bucket_bytes, "bucket_bytes", integer=True)
    if self.compression not in COMPRESSIONS:
      raise ValueError(
          f"`compression` must be one of {COMPRESSIONS}; got {self.compression!r}."
      )
    if self.compression is not None and self.stage != 0:
      raise ValueError(
          f"`compression`={self.compression!r} needs stage=0 (data parallel); the ZeRO "
          f"trainers move float32. Use StepStrategy(stage=0, compression={self.compression!r})."
      )
    if self.hybrid and self.stage != 3:
      raise ValueError(f"`hybrid`=True needs stage=3 (HSDP); got stage={self.stage}.")
    if not isinstance(self.algorithm, (str, Hierarchical)):
      raise TypeError(
          f"`algorithm` must be a name or jaxcoll.Hierarchical(...); got {self.algorithm!r}."
      )

  @property
  def kind(self) -> kinds.StrategyKind:
    """What this stage shards and which collectives a step runs (as the trainers' plans)."""
    return kinds.BY_STAGE[self.stage]

  @property
  def name(self) -> str:
    base = self.kind.name
    if self.hybrid:
      base = "hybrid ZeRO-3"
    algo = "hierarchical" if isinstance(self.algorithm, Hierarchical) else self.algorithm
    extra = [] if algo == "native" else [algo]
    return " ".join([base, *extra, *([self.compression] if self.compression else [])])

  @classmethod
  def from_trainer(cls, strategy: Any) -> Strategy:
    """The step-model view of a ``jaxcoll.DataParallel`` or ``jaxcoll.ZeRO``."""
    stage = getattr(strategy, "stage", None)
    if stage is None and hasattr(strategy, "compression"):
      stage = 0
    if stage is None:
      raise TypeError(
          f"`strategy` must be a jaxcoll.DataParallel or jaxcoll.ZeRO; got {strategy!r}."
      )
    return cls(
        stage=stage,
        bucket_bytes=strategy.bucket_bytes,
        algorithm=strategy.algorithm,
        compression=getattr(strategy, "compression", None),
        hybrid=getattr(strategy, "replica_axis", None) is not None,
    )


#: The old name of :class:`StepStrategy` (the same class).
Strategy = StepStrategy


# ------------------------------------------------------------------ output


@dataclasses.dataclass(frozen=True)
class StepTime:
  """One predicted step on one device (seconds; memory in bytes).

  ``step_s = compute_s + exposed_comm_s + optimizer_s + sync_s``:
  ``exposed_comm_s`` is what communication adds to the step (the collectives
  not hidden behind compute, and the slowdown that overlapping costs);
  ``comm_s`` is the sum of the collectives' own durations (each alone on the
  link), hidden or not; ``sync_s`` is what synchronizing ``N > 1`` devices
  costs besides the collectives (the wait for the slowest device and the
  fixed per-step cost, :class:`ModelParams`). ``compute_s`` covers all
  ``accumulation_steps`` micro-batches of one optimizer step. ``input_s``:
  the time the host input pipeline needs for the step's examples (0 when not
  modelled); the step takes ``max(`` the sum above ``, input_s)`` (the
  loader runs ahead, prefetching, so it only limits when it is the slower).
  """

  strategy: str
  num_devices: int
  per_device_batch: int
  compute_s: float
  exposed_comm_s: float
  optimizer_s: float
  step_s: float
  comm_s: float
  memory_bytes: float
  sync_s: float = 0.0
  accumulation_steps: int = 1
  input_s: float = 0.0

  @property
  def host_bound(self) -> bool:
    """True when the host input pipeline, not the GPU, sets the step time."""
    return self.input_s > 0 and self.input_s >= self.step_s - 1e-15

  @property
  def hidden_fraction(self) -> float:
    """Share of the link's busy time that compute hid (1 when there is none)."""
    if self.comm_s <= 0:
      return 1.0
    return max(0.0, 1.0 - self.exposed_comm_s / self.comm_s)


# ------------------------------------------------------------------ simulation


@dataclasses.dataclass
class _Segment:
  seconds: float
  waits: list[int] = dataclasses.field(default_factory=list)  # ops that must finish first


@dataclasses.dataclass
class _Op:
  seconds: float
  after: int  # the segment whose end issues it (-1: the start of the step)


def _run(segments: list[_Segment], ops: list[_Op], kappa: float) -> float:
  """Event simulation of one compute stream and one link; returns the step's end."""
  issued = [math.inf] * len(ops)
  done = [False] * len(ops)
  for k, op in enumerate(ops):
    if op.after < 0:
      issued[k] = 0.0
  t, seg, seg_left, started = 0.0, 0, None, False
  link, link_left = None, 0.0
  started_ops = [False] * len(ops)
  eps = 1e-15
  while seg < len(segments) or link is not None or not all(done):
    if link is None:
      ready = [k for k in range(len(ops)) if not started_ops[k] and issued[k] <= t]
      if ready:
        link = min(ready, key=lambda k: (issued[k], k))
        started_ops[link], link_left = True, ops[link].seconds
    if seg < len(segments) and not started and all(done[k] for k in segments[seg].waits):
      started, seg_left = True, segments[seg].seconds
    computing = seg < len(segments) and started
    # Overlapped, compute and the collective share the device: each runs at
    # 1 / (1 + kappa) of its own speed (kappa = 1: time-sharing, no gain).
    rate = 1.0 / (1.0 + kappa) if (computing and link is not None) else 1.0
    steps = []
    if computing:
      steps.append(seg_left / rate)
    if link is not None:
      steps.append(link_left / rate)
    if not steps:
      raise RuntimeError("step model deadlock: an event waits on an op never issued")  # a bug
    dt = max(min(steps), 0.0)
    t += dt
    if link is not None:
      link_left -= dt * rate
      if link_left <= eps:
        done[link], link = True, None
    if computing:
      seg_left -= dt * rate
      if seg_left <= eps:
        for k, op in enumerate(ops):
          if op.after == seg:
            issued[k] = t
        seg, started = seg + 1, False
  return t


def _sub(topology: Topology, levels: Sequence) -> Topology:
  return dataclasses.replace(topology, levels=tuple(levels))


def _collective(kind: str, nbytes: float, topology: Topology, algorithm) -> float:
  if topology.num_devices == 1 or nbytes <= 0:
    return 0.0
  if isinstance(algorithm, str) and algorithm == "hierarchical":
    algorithm = Hierarchical()  # the name is the spec's defaults (cost.estimate reads it so)
  if isinstance(algorithm, Hierarchical) and len(topology.levels) < 2:
    algorithm = algorithm.inner  # one node: hierarchical is its inner algorithm
  if algorithm == "auto":
    algorithm = cost.choose(kind, nbytes, topology)
  return cost.estimate(kind, nbytes, topology, algorithm)


def _gradient_reduce(strategy: Strategy, nbytes: float, topology: Topology) -> float:
  """Seconds of the collective(s) that average one bucket of gradients."""
  algo = strategy.algorithm
  if strategy.kind.gradient_collective == "all_reduce":
    if strategy.compression == "bf16":
      return _collective("all_reduce", nbytes / 2, topology, algo)
    if strategy.compression == "int8":  # ZeRO++ qgZ: all-to-all + all-gather of int8
      # The trainer runs them with `auto` whatever the all-reduce algorithm
      # (train/compression.py); a ring or tree all-reduce name has no all-to-all.
      qgz = algo if isinstance(algo, str) and algo in ("native", "auto") else "auto"
      return _collective("all_to_all", nbytes / 4, topology, qgz) + _collective(
          "all_gather", nbytes / 4, topology, qgz
      )
    return _collective("all_reduce", nbytes, topology, algo)
  if strategy.hybrid and len(topology.levels) > 1:
    inner, outer = _sub(topology, topology.levels[-1:]), _sub(topology, topology.levels[:-1])
    return _collective("reduce_scatter", nbytes, inner, algo) + _collective(
        "all_reduce", nbytes / inner.num_devices, outer, algo
    )
  return _collective("reduce_scatter", nbytes, topology, algo)


def _shard_group(strategy: Strategy, topology: Topology) -> Topology:
  if strategy.hybrid and len(topology.levels) > 1:
    return _sub(topology, topology.levels[-1:])
  return topology


def _check_batch(topology, global_batch, per_device_batch) -> int:
  n = topology.num_devices
  if (global_batch is None) == (per_device_batch is None):
    raise ValueError("Give exactly one of `global_batch` and `per_device_batch`.")
  if per_device_batch is not None:
    return _positive(per_device_batch, "per_device_batch", integer=True)
  _positive(global_batch, "global_batch", integer=True)
  if global_batch % n:
    raise ValueError(
        f"`global_batch`={global_batch} is not divisible by the {n} devices; use a multiple "
        f"of {n}, e.g. {n * max(1, global_batch // n)}."
    )
  return global_batch // n


def step_time(
    workload: WorkloadSpec,
    strategy: Strategy,
    topology: Topology,
    *,
    global_batch: int | None = None,
    per_device_batch: int | None = None,
    interference: float | None = None,
    accumulation_steps: int = 1,
    params: ModelParams | None = None,
    input_workers: int | None = None,
) -> StepTime:
  """Predicted time of one training step on every device of ``topology``.

  Args:
    workload: the model (:class:`WorkloadSpec`).
    strategy: the strategy (:class:`Strategy`, or see :meth:`Strategy.from_trainer`).
    topology: the machine; all its devices train data-parallel.
    global_batch: the global batch (a multiple of the device count), or
    per_device_batch: the batch of one device (give exactly one).
    interference: ``kappa`` in [0, 1] (see the module docstring); default
      ``params.interference``.
    accumulation_steps: micro-batches of ``per_device_batch`` per optimizer
      step (gradient accumulation): the gradients are reduced once, after
      the last micro-batch's backward (its buckets overlap that backward).
    params: the model's parameters (default :data:`DEFAULT_PARAMS`, fitted).
    input_workers: host data-loader worker processes that decode each
      device's examples on the CPU (e.g. PyTorch ``DataLoader(num_workers=)``
      per GPU); with two or more devices on a node each device then trains
      at most ``input_workers x params.loader_rate`` examples per second.
      ``None`` (default): the input is not modelled (synthetic data, or a
      GPU-decoding pipeline).

  Returns:
    A :class:`StepTime`.

  Raises:
    ValueError: bad sizes, a batch not divisible by the devices, an algorithm
      the collectives cannot use, ``interference`` outside [0, 1].
    TypeError: a wrong type.
  """
  if not isinstance(workload, WorkloadSpec):
    raise TypeError(f"`workload` must be a jaxcoll.step_model.WorkloadSpec; got {workload!r}.")
  if not isinstance(strategy, Strategy):
    raise TypeError(
        f"`strategy` must be a jaxcoll.step_model.StepStrategy (StepStrategy.from_trainer "
        f"converts a trainer's); got {strategy!r}."
    )
  if not isinstance(topology, Topology):
    raise TypeError(f"`topology` must be a jaxcoll.Topology; got {topology!r}.")
  params = DEFAULT_PARAMS if params is None else params
  if not isinstance(params, ModelParams):
    raise TypeError(f"`params` must be a jaxcoll.step_model.ModelParams; got {params!r}.")
  interference = params.interference if interference is None else interference
  _positive(interference, "interference", allow_zero=True)
  if interference > 1:
    raise ValueError(f"`interference` must be in [0, 1]; got {interference!r}.")
  accumulation = _positive(accumulation_steps, "accumulation_steps", integer=True)
  if input_workers is not None:
    _positive(input_workers, "input_workers", integer=True)
  if accumulation > 1 and strategy.kind.shards_optimizer_state:
    raise ValueError(
        f"`accumulation_steps`={accumulation} is modelled for data parallel only (stage=0); "
        f"got stage={strategy.stage}. Use accumulation_steps=1."
    )
  b = _check_batch(topology, global_batch, per_device_batch)
  n = topology.num_devices
  sharded = strategy.kind.shards_optimizer_state
  shards = _shard_group(strategy, topology).num_devices if sharded else 1

  compute = b * workload.seconds_per_example
  shares = workload.compute_shares
  fwd = compute * (1 - workload.backward_fraction) * shares
  bwd = compute * workload.backward_fraction * shares
  hbm = topology.levels[-1].reduce_Bps
  update_params = workload.num_params / (shards if sharded else 1)
  optimizer = workload.optimizer_traffic_bytes_per_param * update_params / hbm

  leaf_bytes = [p * workload.grad_bytes for p in workload.layer_params]
  if sharded:  # ZeRO pads every leaf to a multiple of the shard group
    leaf_bytes = [math.ceil(p / shards) * shards * workload.grad_bytes if p else 0
                  for p in workload.layer_params]
  buckets = plan_buckets([int(x) for x in leaf_bytes], strategy.bucket_bytes)
  bucket_bytes = [sum(leaf_bytes[i] for i in bucket) for bucket in buckets]
  param_bytes = [nb / workload.grad_bytes * workload.param_bytes for nb in bucket_bytes]
  group = _shard_group(strategy, topology)

  segments: list[_Segment] = []
  ops: list[_Op] = []
  if accumulation > 1:  # the earlier micro-batches: compute only, no communication
    segments.append(_Segment((accumulation - 1) * compute))
  if not strategy.kind.gathers_params_for_compute:
    segments.append(_Segment(float(fwd.sum())))
    last_segment = {}  # layer -> its backward segment
    for layer in reversed(range(len(shares))):
      segments.append(_Segment(float(bwd[layer])))
      last_segment[layer] = len(segments) - 1
    grad_ops = []
    for bucket, nbytes in zip(buckets, bucket_bytes):
      ops.append(_Op(_gradient_reduce(strategy, nbytes, topology), last_segment[min(bucket)]))
      grad_ops.append(len(ops) - 1)
    segments.append(_Segment(optimizer, grad_ops))
    if strategy.kind.gathers_updated_params:  # all-gather the updated parameters
      gathers = []
      for nbytes in param_bytes:
        ops.append(_Op(_collective("all_gather", nbytes, topology, strategy.algorithm),
                       len(segments) - 1))
        gathers.append(len(ops) - 1)
      segments.append(_Segment(0.0, gathers))
  else:
    order = list(reversed(range(len(buckets))))  # forward order of the buckets
    # Each bucket's compute spans its layers and any parameter-free ones after them.
    starts = [min(buckets[k]) for k in order]
    starts[0] = 0
    span = {k: range(start, end) for k, start, end in
            zip(order, starts, [*starts[1:], len(shares)])}
    gather = [_collective("all_gather", param_bytes[k], group, strategy.algorithm)
              for k in range(len(buckets))]
    # Each gather is issued when the compute before the bucket that needs it
    # starts (the end of the segment two back): one bucket of prefetch.
    for k in order:  # forward
      ops.append(_Op(gather[k], len(segments) - 2))
      segments.append(_Segment(float(sum(fwd[i] for i in span[k])), [len(ops) - 1]))
    grad_ops = []
    for k in range(len(buckets)):  # backward: the reverse of the forward order
      ops.append(_Op(gather[k], len(segments) - 2))
      segments.append(_Segment(float(sum(bwd[i] for i in span[k])), [len(ops) - 1]))
      ops.append(_Op(_gradient_reduce(strategy, bucket_bytes[k], topology), len(segments) - 1))
      grad_ops.append(len(ops) - 1)
    segments.append(_Segment(optimizer, grad_ops))

  end = _run(segments, ops, interference)
  compute *= accumulation
  sync = params.sync_cost(compute, n)
  on_node = min(n, topology.levels[-1].size)
  input_s = params.input_seconds(b * accumulation, input_workers, on_node)
  memory = zero_bytes_per_device(
      workload.num_params, shards, strategy.stage,
      param_bytes=workload.param_bytes, grad_bytes=workload.grad_bytes,
      optimizer_bytes_per_param=workload.optimizer_state_bytes_per_param,
  )
  return StepTime(
      strategy=strategy.name, num_devices=n, per_device_batch=b, compute_s=compute,
      exposed_comm_s=max(end - compute - optimizer, 0.0), optimizer_s=optimizer,
      step_s=max(end + sync, input_s), comm_s=sum(op.seconds for op in ops),
      memory_bytes=memory, sync_s=sync, accumulation_steps=accumulation, input_s=input_s,
  )


# ------------------------------------------------------------------ scaling


def efficiency(
    workload: WorkloadSpec,
    strategy: Strategy,
    preset: str | Topology,
    num_devices: int,
    *,
    per_device_batch: int,
    baseline: str | int = "device",
    interference: float | None = None,
    accumulation_steps: int = 1,
    baseline_accumulation_steps: int | None = None,
    params: ModelParams | None = None,
    input_workers: int | None = None,
) -> float:
  """Weak-scaling efficiency on ``num_devices`` of ``preset``'s cluster.

  Throughput (examples per second) per device on ``num_devices`` over that
  of the baseline: one device, one node (``baseline="node"``) or a given
  device count, same per-device batch. With gradient accumulation the
  baseline may accumulate more micro-batches (``baseline_accumulation_steps``,
  default the same) as published tables that keep the global batch do.
  ``input_workers``: host data-loader workers per device (:func:`step_time`).

  Raises:
    ValueError: as :func:`step_time`, an unknown preset or baseline, a baseline
      of more devices than ``num_devices``, or a device count that is not a
      whole number of nodes.
  """
  topo = _cluster(preset, num_devices)
  if baseline == "device":
    base_n = 1
  elif baseline == "node":
    base_n = min(topo.levels[-1].size, num_devices)
  elif isinstance(baseline, int) and not isinstance(baseline, bool) and 1 <= baseline:
    base_n = baseline
  else:
    raise ValueError(
        f"`baseline` must be one of {BASELINES} or a device count >= 1; got {baseline!r}."
    )
  if base_n > num_devices:  # weak-scaling efficiency against MORE devices: always > 100%
    raise ValueError(
        f"`baseline`={baseline} is more devices than `num_devices`={num_devices}; the baseline "
        f"is the smaller run (e.g. baseline=1, 'node', or a count <= {num_devices}).")
  base_topo = _cluster(preset, base_n, what="baseline") if base_n != num_devices else topo
  base_acc = accumulation_steps if baseline_accumulation_steps is None else (
      baseline_accumulation_steps)
  kw = dict(per_device_batch=per_device_batch, interference=interference, params=params,
            input_workers=input_workers)
  base = step_time(workload, strategy, base_topo, accumulation_steps=base_acc, **kw)
  here = step_time(workload, strategy, topo, accumulation_steps=accumulation_steps, **kw)
  return (accumulation_steps / here.step_s) / (base_acc / base.step_s)


def _cluster(preset: str | Topology, num_devices: int, *, what: str = "num_devices"
             ) -> Topology:
  """``Topology.cluster`` of a preset name, or ``preset.resized(num_devices)`` (``preset``
  itself at its own size). ``what``: the caller's argument that gave ``num_devices``, named
  when it is not a whole number of nodes (``baseline``, an entry of ``device_counts``)."""
  if isinstance(preset, Topology):
    if preset.num_devices == num_devices:
      return preset
    if len(preset.levels) > 2:  # resized's own message names a method the user never called
      raise ValueError(
          f"`preset` {preset.name!r} has {len(preset.levels)} levels and cannot be resized to "
          f"{num_devices} devices (efficiency, scaling and knee resize a topology of one or two "
          f"levels: node, local); pass a two-level Topology.from_hardware(...), or call "
          f"step_time on topologies of each size you build.")
  said = {"num_devices": None, "baseline": f"`baseline`={num_devices}",
          "device_counts": f"an entry of `device_counts`, {num_devices},"}[what]
  if isinstance(preset, Topology):
    return preset.resized(num_devices, what=said)
  return Topology.cluster(preset, num_devices, what=said)


@dataclasses.dataclass(frozen=True)
class ScalingRow:
  """One point of :func:`scaling`: a strategy on ``num_devices``."""

  num_devices: int
  strategy: str
  efficiency: float
  step: StepTime


def scaling(
    workload: WorkloadSpec,
    strategies: Sequence[Strategy],
    preset: str | Topology,
    device_counts: Sequence[int],
    *,
    per_device_batch: int,
    interference: float | None = None,
    baseline: str = "device",
    params: ModelParams | None = None,
    input_workers: int | None = None,
) -> list[ScalingRow]:
  """Step time and efficiency of every strategy at every device count."""
  rows = []
  for strategy in strategies:
    for n in device_counts:
      topo = _cluster(preset, n, what="device_counts")
      step = step_time(workload, strategy, topo, per_device_batch=per_device_batch,
                       interference=interference, params=params, input_workers=input_workers)
      eff = efficiency(workload, strategy, preset, n, per_device_batch=per_device_batch,
                       baseline=baseline, interference=interference, params=params,
                       input_workers=input_workers)
      rows.append(ScalingRow(n, strategy.name, eff, step))
  return rows


def knee(rows: Sequence[ScalingRow], strategy: str, threshold: float) -> int | None:
  """The smallest device count where ``strategy``'s efficiency is below ``threshold``.

  ``None``: never below it in ``rows``. A ``strategy`` no row has is a ``ValueError``.
  """
  if not 0 < threshold <= 1:
    raise ValueError(f"`threshold` must be in (0, 1]; got {threshold!r}, e.g. 0.8.")
  names = list(dict.fromkeys(r.strategy for r in rows))
  if strategy not in names:  # None would read as "never below": a typo must not say that
    raise ValueError(
        f"`strategy` {strategy!r} is not in `rows` (their strategies: {names}); pass one of "
        f"them, a StepStrategy's .name (e.g. StepStrategy(stage=3).name == 'ZeRO-3').")
  below = [r.num_devices for r in rows if r.strategy == strategy and r.efficiency < threshold]
  return min(below) if below else None


# ------------------------------------------------------------------ calibration


def fit_native_level(
    topology: Topology, *, tiny_s: float, big_s: float, big_bytes: float
) -> Topology:
  """``topology`` with its (single) level fitted to two measured native all-reduces.

  The launch cost becomes the all-reduce of a tiny message (``tiny_s``; hop
  latency folded into it), and the level's bandwidth the one at which a
  native all-reduce of ``big_bytes`` takes ``big_s`` (reduction folded into
  it). This is how ``cpu-sim`` is calibrated on the machine at hand.

  Raises:
    ValueError: a topology of more than one level, or ``big_s <= tiny_s``.
  """
  if len(topology.levels) != 1:
    raise ValueError(f"`topology` must have one level to fit; got {topology}.")
  _positive(tiny_s, "tiny_s")
  _positive(big_s, "big_s")
  _positive(big_bytes, "big_bytes")
  if big_s <= tiny_s:
    raise ValueError(f"`big_s` ({big_s}) must exceed `tiny_s` ({tiny_s}) to fit a bandwidth.")
  n = topology.num_devices
  level = dataclasses.replace(
      topology.levels[0], latency_s=0.0, reduce_Bps=math.inf,
      bandwidth_Bps=cost.bus_bandwidth_factor("all_reduce", n) * big_bytes / (big_s - tiny_s),
  )
  return dataclasses.replace(topology, levels=(level,), launch_s=tiny_s)


# straggler_sigma, sync_s and loader_rate: fitted on the fitted third of
# jaxcoll.scale.published.ROWS (published.fit()); tests/scale/test_step_model.py checks that the
# fit reproduces these figures. bus_fraction is held at the line rate (1.0), where an earlier fit
# of it ran to its bound; it is not one of the three fitted parameters.
DEFAULT_PARAMS = ModelParams(straggler_sigma=0.0286, sync_s=0.0014, bus_fraction=1.0,
                             loader_rate=129.7)
