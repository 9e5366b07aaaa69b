"""Parallel strategies: what is replicated, what is sharded, how grads move.

A strategy is a small frozen config. ``strategy.plan(model, mesh)`` binds it
to one model and returns a :class:`jaxcoll.train.plan.Plan`, which owns the
strategy's behaviour (its state, gradient reduction, update, canonical form);
:class:`jaxcoll.train.Trainer` drives any plan the same way.

* :class:`DataParallel`: parameters and optimizer state replicated on every
  device; gradients reduced with one bucketed all-reduce (as PyTorch DDP and
  Horovod's tensor fusion), optionally compressed to bf16 or int8.
* :class:`ZeRO`: the three stages of Rajbhandari et al., "ZeRO: Memory
  Optimizations Toward Training Trillion Parameter Models" (SC 2020):
  stage 1 shards the optimizer state, stage 2 also the gradients, stage 3
  also the parameters (the FSDP shape); with ``replica_axis``, hybrid
  sharding (sharded inside a group, replicated across groups).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence

from jax.sharding import Mesh

from jaxcoll import checks
from jaxcoll.collectives import DEFAULT_BUCKET_BYTES, Hierarchical, algorithms
from jaxcoll.train import kinds
from jaxcoll.train.dp import DataParallelPlan
from jaxcoll.train.zero import ZeROPlan

# DEFAULT_BUCKET_BYTES (25 MiB, PyTorch DDP's bucket_cap_mb=25) is the pytree collectives' too.
COMPRESSIONS = (None, "bf16", "int8")
ZERO_STAGES = (1, 2, 3)
#: Strategy names (the runner's ``config.strategy``, the step model's) -> ZeRO
#: stage: the one place a name is mapped to a stage (``dp`` is stage 0).
STAGES = kinds.STAGES

AxisName = checks.AxisName
# One axis normalization for the library (jaxcoll.checks); the trainer's old names stay.
axis_tuple = checks.axis_names
axis_spec = checks.axis_spec


def check_axis(axis: AxisName, mesh: Mesh) -> int:
  """Validates ``axis`` against ``mesh``; returns the data-parallel size."""
  if not isinstance(mesh, Mesh):  # None or a list of devices: AttributeError 'axis_names'
    raise ValueError(
      f"`mesh` must be a jax.sharding.Mesh; got {type(mesh).__name__}. Make one with "
      "jaxcoll.devices.flat_mesh(n) (axis 'data') or jax.make_mesh((n,), ('data',)).")
  axes = axis_tuple(axis)
  if not axes or len(set(axes)) != len(axes):
    raise ValueError(
      f"`axis` must name one or more distinct mesh axes; got {axis!r}. "
      f"Mesh axes: {tuple(mesh.axis_names)}."
    )
  missing = [a for a in axes if a not in mesh.axis_names]
  if missing:
    names = tuple(mesh.axis_names)
    near = _near_axes(axes, names)
    if near is not None:  # a misspelt name, or the mesh's own "data" axis
      fix = f"Pass axis={near[0] if len(near) == 1 else near!r}."
    else:  # all of the mesh's axes: one axis='node' would use 2 of 8 devices
      fix = f"Pass axis={names[0] if len(names) == 1 else names!r} for every device of it."
    raise ValueError(
      f"`axis` {axis!r} names {missing}, which the mesh does not have; mesh "
      f"axes: {names}. {fix}"
    )
  return checks.axis_size(mesh, axes)


def _near_axes(axes, names):
  """``axes`` with each name the mesh lacks replaced by its close match among the
  mesh's other axes (difflib), else by the mesh's ``"data"`` axis; None where some
  name has neither (then every axis is the fix)."""
  fixed = []
  for a in axes:
    if a in names:
      fixed.append(a)
      continue
    free = [n for n in names if n not in axes and n not in fixed]
    by_text = {str(n): n for n in free}
    close = difflib.get_close_matches(str(a), list(by_text), n=1)
    if close:
      fixed.append(by_text[close[0]])
    elif "data" in free:
      fixed.append("data")
    else:
      return None
  return tuple(fixed)


def _check_algorithm(algorithm, collectives: Sequence[str], owner: str) -> None:
  if isinstance(algorithm, Hierarchical):
    return
  valid = set.intersection(*(set(algorithms(c)) for c in collectives))
  if not isinstance(algorithm, str) or algorithm not in valid:
    raise ValueError(
      f"{owner}: `algorithm` must be a name valid for {', '.join(collectives)} "
      f"or a jaxcoll.Hierarchical; got {algorithm!r}. Valid names: "
      f"{', '.join(sorted(valid))}."
    )


def _check_hierarchical_axes(algorithm, axis: AxisName, owner: str) -> None:
  """A hierarchical algorithm reduces over a tuple of >= 2 mesh axes: on one axis every
  collective of the step raised inside shard_map, a traceback at the first step."""
  if (algorithm == "hierarchical" or isinstance(algorithm, Hierarchical)) and len(
      axis_tuple(axis)) < 2:
    raise ValueError(
      f"{owner}: `algorithm` 'hierarchical' reduces inside nodes, then across them: it needs "
      f"a tuple of >= 2 mesh axes (outer..., inner), e.g. axis=('node', 'local') on "
      f"jaxcoll.devices.node_local_mesh(2, 4) (the runner: --config.mesh_shape=2,4); got "
      f"axis={axis!r}. Use a mesh of two levels, or a one-level algorithm (ring, native, auto).")


def _check_bucket_bytes(bucket_bytes: int, owner: str) -> None:
  checks.positive_int(bucket_bytes, "bucket_bytes", fix=(
      f"It is {owner}'s bytes per gradient bucket; the default is {DEFAULT_BUCKET_BYTES} "
      "(25 MiB)."))


@dataclasses.dataclass(frozen=True)
class DataParallel:
  """Replicated parameters; gradients all-reduced in buckets.

  Attributes:
    axis: the data-parallel mesh axis, or a tuple of axes such as
      ``("node", "local")`` (flattened row-major; use
      ``algorithm="hierarchical"`` to reduce inside nodes first).
    algorithm: the all-reduce algorithm of every bucket, one of
      ``jaxcoll.algorithms("all_reduce")`` or a ``jaxcoll.Hierarchical``.
      With ``compression="int8"`` the reduction is an all-to-all plus an
      all-gather, which then use ``"auto"``.
    bucket_bytes: the largest bucket of gradients (float32 bytes) reduced by
      one collective; a larger leaf is a bucket of its own. Leaves of
      different dtypes (float32, bfloat16) go to different buckets.
    compression: ``None`` (float32 on the wire), ``"bf16"`` (half the bytes)
      or ``"int8"`` (a quarter: a quantized reduce-scatter by all-to-all then
      a quantized all-gather, as ZeRO++'s qgZ, Wang et al. 2023).
    error_feedback: with compression, keep each device's quantization
      residual in the train state and add it to the next step's gradient
      (EF-SGD, Karimireddy et al. 2019; 1-bit Adam, Tang et al. 2021).

  Example:
    >>> strategy = jaxcoll.DataParallel(axis="data", algorithm="ring")
    >>> trainer = jaxcoll.Trainer(loss_fn, optax.adam(1e-3), mesh, strategy)  # doctest: +SKIP
  """

  axis: AxisName = "data"
  algorithm: str | Hierarchical = "auto"
  bucket_bytes: int = DEFAULT_BUCKET_BYTES
  compression: str | None = None
  error_feedback: bool = True

  def __post_init__(self):
    _check_algorithm(self.algorithm, ("all_reduce",), "DataParallel")
    _check_bucket_bytes(self.bucket_bytes, "DataParallel")
    if self.compression not in COMPRESSIONS:
      raise ValueError(
        f"DataParallel: `compression` must be one of {COMPRESSIONS}; got {self.compression!r}."
      )

  @property
  def stage(self) -> int:
    """0: nothing is sharded (the ZeRO stage of plain data parallelism)."""
    return 0

  @property
  def kind(self) -> kinds.StrategyKind:
    """What this strategy shards and which collectives a step runs, as data."""
    return kinds.DP

  def data_axes(self, mesh: Mesh) -> tuple:
    """``(PartitionSpec entry, size)`` of the axes the batch is split over (checked)."""
    size = check_axis(self.axis, mesh)
    _check_hierarchical_axes(self.algorithm, self.axis, "DataParallel")
    return axis_spec(self.axis), size

  def plan(self, model, mesh):
    """This strategy bound to ``model`` (a :class:`jaxcoll.train.plan.TrainSetup`)."""
    return DataParallelPlan(self, model, axis_spec(self.axis), check_axis(self.axis, mesh))

  @property
  def name(self) -> str:
    algo = getattr(self.algorithm, "name", self.algorithm)
    extra = f", {self.compression}" if self.compression else ""
    return f"DP({algo}{extra})"


@dataclasses.dataclass(frozen=True)
class ZeRO:
  """ZeRO-sharded data parallelism (stage 1, 2 or 3).

  Every parameter leaf is flattened, padded to a multiple of the group size
  ``N`` and cut into ``N`` rows of ``c`` elements; device ``r`` owns row
  ``r``. A row keeps its leaf's rank (shape ``(1, ..., 1, c)``, ``()`` for a
  scalar). The optimizer runs on a pytree of these rows with the same tree
  structure as the parameters, so any elementwise optax optimizer (sgd,
  momentum, adam, adamw, lion, ...) gives exactly the unsharded result, also
  with masks that look at ``ndim`` (e.g. ``optax.adamw(..., mask=lambda p:
  jax.tree.map(lambda x: x.ndim > 1, p))``: no weight decay on biases).
  Optimizers whose update of one parameter reads others (LAMB / LARS trust
  ratios, or ``optax.clip_by_global_norm`` inside the chain), that draw
  random numbers (``optax.add_noise``) or whose choices depend on exact
  shapes or sizes (a mask on ``x.size``) would see only this device's rows:
  they are found when the trainer is built (:mod:`jaxcoll.train.mixing`)
  and their update runs on the full leaves instead, exactly.

  Attributes:
    stage: 1 shards the optimizer state (gradients all-reduced in full, each
      device updates its rows, parameters all-gathered); 2 also shards the
      gradients (reduce-scatter instead of all-reduce); 3 also shards the
      parameters, which are all-gathered for the forward pass and again for
      the backward pass (never kept alive in between), while the gradients
      arrive reduce-scattered.
    axis: the data-parallel mesh axis or tuple of axes.
    algorithm: the algorithm of every reduce-scatter / all-gather (and the
      stage-1 all-reduce): a name registered for all of them (``"auto"``,
      ``"native"``, ``"ring"``, ``"hierarchical"``) or a
      ``jaxcoll.Hierarchical``.
    bucket_bytes: the largest bucket (float32 bytes of the padded leaves)
      moved by one collective; a bucket holds leaves of one dtype.
    replica_axis: hybrid sharding (PyTorch FSDP's HYBRID_SHARD, ZeRO++ hpZ):
      parameters and optimizer state are sharded over ``axis`` and
      replicated over these mesh axes; the batch is split over both;
      gradients are reduce-scattered over ``axis``, then all-reduced over
      ``replica_axis`` on the shard, and parameters are gathered only inside
      ``axis`` (e.g. ``axis="local", replica_axis="node"``: no parameter
      crosses nodes). None: no replication.

  Example:
    >>> strategy = jaxcoll.ZeRO(stage=3, axis="data")
    >>> hybrid = jaxcoll.ZeRO(stage=3, axis="local", replica_axis="node")
  """

  stage: int = 1
  axis: AxisName = "data"
  algorithm: str | Hierarchical = "auto"
  bucket_bytes: int = DEFAULT_BUCKET_BYTES
  replica_axis: AxisName | None = None

  def __post_init__(self):
    # True == 1 and 3.0 == 3 are "in" the stages: True was a silent ZeRO-1.
    if isinstance(self.stage, (bool, float)) or self.stage not in ZERO_STAGES:
      raise ValueError(
        f"ZeRO: `stage` must be 1, 2 or 3; got {self.stage!r}. For replicated "
        "optimizer state use jaxcoll.DataParallel()."
      )
    _check_algorithm(self.algorithm, ("all_reduce", "reduce_scatter", "all_gather"), "ZeRO")
    _check_bucket_bytes(self.bucket_bytes, "ZeRO")
    if self.replica_axis is not None and set(axis_tuple(self.replica_axis)) & set(
        axis_tuple(self.axis)):
      raise ValueError(
        f"ZeRO: `replica_axis` {self.replica_axis!r} overlaps `axis` {self.axis!r}; "
        "parameters are sharded over `axis` and replicated over `replica_axis`, so "
        "they must be different mesh axes, e.g. axis='local', replica_axis='node' "
        "(or replica_axis=None for no replication)."
      )

  def data_axes(self, mesh: Mesh) -> tuple:
    """``(PartitionSpec entry, size)`` of the axes the batch is split over (checked)."""
    n, replica, replicas = self._groups(mesh)
    if replica is None:  # hybrid over one group axis is itself the hierarchy (ZeROPlan)
      _check_hierarchical_axes(self.algorithm, self.axis, "ZeRO")
    axes = axis_tuple(self.axis) if replica is None else (
      axis_tuple(self.replica_axis) + axis_tuple(self.axis))
    return axes[0] if len(axes) == 1 else axes, n * replicas

  def _groups(self, mesh: Mesh):
    n = check_axis(self.axis, mesh)
    if self.replica_axis is None:
      return n, None, 1
    try:
      replicas = check_axis(self.replica_axis, mesh)
    except ValueError:
      raise ValueError(
        f"ZeRO: `replica_axis` {self.replica_axis!r} is not an axis of the mesh "
        f"(axes {tuple(mesh.axis_names)}); pass one of them, e.g. "
        f"replica_axis={mesh.axis_names[0]!r}, or replica_axis=None."
      ) from None
    return n, axis_spec(self.replica_axis), replicas

  def plan(self, model, mesh):
    """This strategy bound to ``model`` (a :class:`jaxcoll.train.plan.TrainSetup`):
    the :class:`~jaxcoll.train.zero.ZeROPlan` subclass of its stage."""
    n, replica, replicas = self._groups(mesh)
    return ZeROPlan(self, model, axis_spec(self.axis), n, replica=replica, replicas=replicas)

  @property
  def kind(self) -> kinds.StrategyKind:
    """What this stage shards and which collectives a step runs, as data."""
    return kinds.BY_STAGE[self.stage]

  @property
  def name(self) -> str:
    return self.kind.name + (" (hybrid)" if self.replica_axis is not None else "")
