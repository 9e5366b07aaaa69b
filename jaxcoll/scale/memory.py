"""ZeRO memory model, checked against XLA's own memory analysis.

:func:`zero_bytes_per_device` is the model-state formula of Rajbhandari et
al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC 2020), section 5 and Figure 1: with ``Ψ`` parameters, ``N`` devices,
``p``/``g`` bytes per parameter / gradient and ``K`` bytes of optimizer state
per parameter (mixed-precision Adam: fp16 params and grads, ``p = g = 2``;
fp32 master params, momentum and variance, ``K = 12``), one device holds

==========  ===========================  ===========================
stage       what is sharded              bytes per device
==========  ===========================  ===========================
0 (DP)      nothing                      ``(p + g + K) Ψ``
1           optimizer state              ``(p + g) Ψ + K Ψ / N``
2           + gradients                  ``p Ψ + (g + K) Ψ / N``
3           + parameters                 ``(p + g + K) Ψ / N``
==========  ===========================  ===========================

:func:`predict_peak` predicts the whole *peak* per device of a trainer's
step, not only the model state: state + this device's batch + gradients +
gathered parameters (ZeRO-3) + working buffers + activations, the last taken
from XLA's temporaries of the one-device ``value_and_grad`` of the loss on
the per-device batch (see :class:`PeakEstimate` for each term). :func:`compare`
compiles each trainer's step and puts the formula and the prediction next to
what XLA reports (``compiled.memory_analysis()``: arguments + outputs -
aliased + temporaries) and to the bytes of model state each device holds
between steps. :func:`largest_fitting` finds, by compiling, the largest model
of a family whose step fits a per-device budget.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping

import jax
import numpy as np

from jaxcoll import checks
from jaxcoll.observe import analysis
from jaxcoll.train import kinds
from jaxcoll.train.axes_bound import bound_if_needed
from jaxcoll.train.plan import cast_floating

GB = 1e9  # the ZeRO paper's GB


def zero_bytes_per_device(
  num_params: float,
  num_devices: int,
  stage: int,
  *,
  param_bytes: float = 2,
  grad_bytes: float = 2,
  optimizer_bytes_per_param: float = 12,
) -> float:
  """Model-state bytes per device under ZeRO ``stage`` (0 = plain DP).

  Args:
    num_params: number of parameters ``Ψ``.
    num_devices: data-parallel degree ``N``.
    stage: 0, 1, 2 or 3.
    param_bytes: bytes per parameter as used in forward/backward (2: fp16).
    grad_bytes: bytes per gradient (2: fp16).
    optimizer_bytes_per_param: ``K``; 12 for mixed-precision Adam (fp32
      master copy, momentum, variance), 8 for float32 Adam (momentum and
      variance; the params are their own master copy).

  Returns:
    Bytes (float).

  Raises:
    ValueError: a stage outside 0..3, or a non-positive count.

  Example:
    >>> [round(zero_bytes_per_device(7.5e9, 64, s) / 1e9, 1) for s in range(4)]
    [120.0, 31.4, 16.6, 1.9]
  """
  kind = kinds.of_stage(stage)
  if not num_params > 0:
    raise ValueError(f"`num_params` must be positive; got {num_params!r}.")
  checks.positive_int(num_devices, "num_devices")
  psi, n = float(num_params), int(num_devices)
  # (bytes per parameter, whether the stage shards it), summed in the paper's order.
  terms = ((param_bytes, kind.shards_params), (grad_bytes, kind.shards_gradients),
           (optimizer_bytes_per_param, kind.shards_optimizer_state))
  kept = sum(b for b, sharded in terms if not sharded)
  cut = sum(b for b, sharded in terms if sharded)
  return kept * psi + cut * psi / n


@dataclasses.dataclass(frozen=True)
class MemoryRow:
  """One strategy's memory, per device, in bytes.

  Attributes:
    strategy: the strategy's name, e.g. ``"ZeRO-3"``.
    stage: ZeRO stage (0 for data parallel).
    formula_bytes: :func:`zero_bytes_per_device` for the dtypes in use and
      this row's ``optimizer_bytes_per_param``.
    state_bytes: model state a device holds between steps (params,
      optimizer state, error-feedback residuals; gradients are temporaries
      of the step and show in ``temp_bytes``).
    argument_bytes / output_bytes / alias_bytes / temp_bytes: XLA's
      ``memory_analysis()`` of the compiled step (arguments are the state and
      this device's batch; aliased bytes are donated state reused for the
      output).
  """

  strategy: str
  stage: int
  formula_bytes: float
  state_bytes: int
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  optimizer_bytes_per_param: float = 0.0
  predicted: PeakEstimate | None = None

  @property
  def peak_bytes(self) -> int:
    """Arguments + outputs not aliased to them + temporaries."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  @property
  def predicted_peak_bytes(self) -> int:
    """:func:`predict_peak`'s total (0 if not predicted)."""
    return self.predicted.peak_bytes if self.predicted is not None else 0


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Rows of :func:`compare` and the setting their formula used.

  ``optimizer_bytes_per_param`` is the ``K`` every row shares, or None when
  the trainers' optimizers differ (each row then has its own
  ``MemoryRow.optimizer_bytes_per_param``).
  """

  rows: tuple[MemoryRow, ...]
  num_params: int
  num_devices: int
  param_bytes: float
  grad_bytes: float
  optimizer_bytes_per_param: float | None

  def table(self) -> str:
    """A printable table (bytes in MB = 1e6)."""
    per_row_k = self.optimizer_bytes_per_param is None
    header = ("strategy", "formula", "state held", "XLA args", "outputs", "alias", "temp", "peak",
              "predicted", "error")
    if per_row_k:
      header = ("strategy", "K B/param", *header[1:])
    rows = [
      (
        r.strategy,
        *((f"{r.optimizer_bytes_per_param:.3g}",) if per_row_k else ()),
        *(
          _mb(v)
          for v in (
            r.formula_bytes,
            r.state_bytes,
            r.argument_bytes,
            r.output_bytes,
            r.alias_bytes,
            r.temp_bytes,
            r.peak_bytes,
            r.predicted_peak_bytes,
          )
        ),
        f"{100 * (r.predicted_peak_bytes / r.peak_bytes - 1):+.1f}%" if r.peak_bytes else "-",
      )
      for r in self.rows
    ]
    widths = [max(len(x[i]) for x in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "  ".join(  # noqa: E731
      c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
    )
    k = self.optimizer_bytes_per_param
    k_text = "optimizer K per row" if per_row_k else f"optimizer K={k:.3g} B/param"
    title = (
      f"Model-state memory per device, MB (1e6 bytes): Ψ={self.num_params:,} params, "
      f"N={self.num_devices} devices; formula = ZeRO paper with params "
      f"{self.param_bytes:g} B, grads {self.grad_bytes:g} B, {k_text}"
    )
    notes = (
      "state held = params + optimizer state (+ residuals) kept between steps; "
      "gradients live in XLA temp. peak = args + outputs - alias + temp; predicted = "
      "jaxcoll.memory.predict_peak (state + batch + grads + gathered + buffers + activations)."
    )
    rule = "-" * len(line(header))
    return "\n".join([title, line(header), rule, *(line(r) for r in rows), rule, notes])

  def __str__(self) -> str:
    return self.table()


def _mb(value: float) -> str:
  return f"{value / 1e6:.3f}"


def _array_bytes(tree) -> int:
  return sum(
    math.prod(x.shape) * np.dtype(x.dtype).itemsize
    for x in jax.tree.leaves(tree)
    if hasattr(x, "shape")
  )


def compare(trainers, params, batch) -> MemoryPlan:
  """Compiles each trainer's step and compares its memory with the formula.

  The formula uses the setting actually trained: bytes per parameter and
  per gradient from the parameters' dtype (4 for float32), and ``K`` = the
  optimizer state's bytes per parameter measured with ``jax.eval_shape``
  for each trainer's own optimizer (8 for float32 Adam: momentum and
  variance; the params are the master copy).

  Args:
    trainers: a :class:`jaxcoll.train.Trainer`, a sequence of them (e.g.
      DP and ZeRO-1/2/3 on the same mesh), or a dict of them (its values, in order).
    params: the parameters or their shape structs (``workload.param_shapes``);
      only shapes and dtypes are read: nothing is initialized or allocated.
    batch: a global batch (or its shape structs), as for ``trainer.step``.

  Returns:
    A :class:`MemoryPlan`; ``print(plan)`` shows the table.

  Raises:
    ValueError: if ``trainers`` is empty, holds something that is not a
      Trainer, or the trainers use different numbers of devices.

  Example:
    >>> trainers = [jaxcoll.Trainer(loss_fn, optax.adam(1e-3), mesh, s)
    ...             for s in (jaxcoll.DataParallel(), jaxcoll.ZeRO(stage=3))]  # doctest: +SKIP
    >>> print(jaxcoll.memory.compare(trainers, params, batch))  # doctest: +SKIP

  ``memory.plan`` is the old name of this function (the same function).
  """
  if isinstance(trainers, Mapping):  # {"dp": trainer, ...}: its trainers, in order
    trainers = trainers.values()
  trainers = list(trainers) if isinstance(trainers, Iterable) else [trainers]
  if not trainers:
    raise ValueError("`trainers` is empty; pass a Trainer or a list of Trainers.")
  for t in trainers:
    if not (hasattr(t, "dp_size") and hasattr(t, "strategy")):
      raise ValueError(f"`trainers` must be jaxcoll.Trainer objects (one, a list, or a dict of "
                       f"them); got {type(t).__name__} {checks.short_repr(t, 60)}.")
  sizes = {t.dp_size for t in trainers}
  if len(sizes) != 1:
    raise ValueError(
      f"`trainers` use different data-parallel sizes {sorted(sizes)}; compare trainers on one mesh."
    )
  n = sizes.pop()
  activations: dict[int, int] = {}  # per loss_fn and accumulation: one compile each
  params = _shape_structs(params)  # nothing of the model's size is allocated
  batch = _shape_structs(batch)
  leaves = jax.tree.leaves(params)
  psi = sum(math.prod(x.shape) for x in leaves)
  param_bytes = _array_bytes(params) / psi
  rows = []
  for trainer in trainers:
    k = _array_bytes(jax.eval_shape(trainer.optimizer.init, params)) / psi
    state = abstract_state(trainer, params)
    stats = trainer.compile_step(state, batch).memory_analysis()
    formula = zero_bytes_per_device(
      psi,
      n,
      trainer.stage,
      param_bytes=param_bytes,
      grad_bytes=param_bytes,
      optimizer_bytes_per_param=k,
    )
    rows.append(
      MemoryRow(
        strategy=trainer.strategy.name,
        stage=trainer.stage,
        formula_bytes=formula,
        state_bytes=state_bytes_per_device(state),
        argument_bytes=int(getattr(stats, "argument_size_in_bytes", 0)),
        output_bytes=int(getattr(stats, "output_size_in_bytes", 0)),
        alias_bytes=int(getattr(stats, "alias_size_in_bytes", 0)),
        temp_bytes=int(getattr(stats, "temp_size_in_bytes", 0)),
        optimizer_bytes_per_param=k,
        predicted=predict_peak(trainer, params, batch, _cache=activations),
      )
    )
  ks = {r.optimizer_bytes_per_param for r in rows}
  shared_k = ks.pop() if len(ks) == 1 else None
  return MemoryPlan(tuple(rows), psi, n, param_bytes, param_bytes, shared_k)


#: The old name of :func:`compare` (``plan`` is also a Trainer's strategy plan).
plan = compare


@dataclasses.dataclass(frozen=True)
class PeakEstimate:
  """:func:`predict_peak`'s terms, bytes per device.

  Attributes:
    state_bytes: params + optimizer state this device keeps between steps
      (each sharded leaf padded to a multiple of ``N``, as the trainer does).
    batch_bytes: this device's part of the global batch.
    grad_bytes: the full local gradient (every strategy differentiates the
      full parameters; ZeRO-2/3 reduce-scatter it afterwards); ZeRO-3 with
      units: the outside leaves' + the unit rows + one unrolled unit's (a
      scanned layer's full gradient is a temporary of the loop body, already
      in ``activation_bytes``).
    gathered_bytes: ZeRO-3's all-gathered parameters. Without FSDP units the
      whole model, the forward copy and the backward one (every bucket is
      gathered before ``loss_fn`` runs); with units the leaves outside units
      plus two unrolled units (capped at all). A scanned layer's gathered
      copy is not added: the one-device loop body slices the same bytes out
      of the stacked parameters, so ``activation_bytes`` already holds them.
      Unrolled units beside a scanned stack (a tied embedding as a unit): the
      unrolled units as above, the stack's layers not (on XLA:CPU the
      gradient then holds the stack's rows, the loop's carry).
    row_bytes: ZeRO-1/2's updated rows and their all-gathered copy.
    buffer_bytes: the reduction buffer (a flat bucket of gradients);
      activations and this buffer are not alive together (the buffer fills
      after backward has freed the activations), hence ``max``. With
      ``DataParallel(compression=...)`` it holds the compression's working
      copies too (:data:`COMPRESSION_BUFFERS`, measured on XLA:CPU and
      applied to every backend).
    activation_bytes: XLA's temporaries of the one-device
      ``value_and_grad(loss_fn)`` on the per-device (micro)batch: saved
      activations and backward workspace.
    metrics_bytes: the step's outputs that are not donated state: the loss
      and ``aux`` (e.g. ResNet's updated BatchNorm statistics).
    residual_bytes: ``DataParallel(compression=..., error_feedback=True)``'s
      residuals, kept in the train state between steps (``state.residual``:
      the worker's of every bucket, and int8's server segment).
    guard_bytes: ``Trainer(nan_policy="skip" | "raise")``: the update is
      computed beside the state it may be dropped for, so the new optimizer
      state does not reuse the donated buffers (it feeds the parameters'
      update and the choice between old and new; each new parameter is
      computed in place): the optimizer state the device updates (DP: all of
      it; ZeRO-3: its rows; ZeRO-1/2's updated rows are ``row_bytes``
      already). Measured on the mlp's DP step: XLA's peak grows by it
      (Adam 2x the parameters, SGD with momentum 1x, SGD 0). Added, not in the
      ``max`` with the activations (XLA may schedule them together: on the
      scanned mlp's ZeRO-3 step it did), so an upper bound where it does not
      (the 2-layer transformer's DP step: +13%).
    cast_bytes: with the trainer's ``compute_dtype``, the cast copy of the
      parameters this device holds (all of them; ZeRO-3: its rows, cast
      before the all-gather). The activations are then compiled on the cast
      parameters, and ZeRO-3's gathered parameters and full gradient are in
      ``compute_dtype``.
  """

  state_bytes: int
  batch_bytes: int
  grad_bytes: int
  gathered_bytes: int
  row_bytes: int
  buffer_bytes: int
  activation_bytes: int
  metrics_bytes: int = 0
  cast_bytes: int = 0
  residual_bytes: int = 0
  guard_bytes: int = 0

  @property
  def peak_bytes(self) -> int:
    return (
      self.state_bytes + self.batch_bytes + self.grad_bytes + self.gathered_bytes
      + self.row_bytes + max(self.activation_bytes, self.buffer_bytes) + self.metrics_bytes
      + self.cast_bytes + self.residual_bytes + self.guard_bytes
    )


#: The reduction buffer of a compressed data-parallel step, in full gradients (float32),
#: by (compression, error_feedback); measured in XLA:CPU's buffer assignment of the step
#: (mlp and scanned mlp, 8 devices) and applied as is to other backends' predictions (a
#: GPU's fusions may hold fewer copies): bf16 with feedback holds the bucket plus its
#: residual (x) and x in bfloat16 beside the bucket; int8 the bucket, its int8 blocks, the
#: segment received by all-to-all and its dequantized copy. Error feedback needs a
#: compression, hence no (None, True).
COMPRESSION_BUFFERS = {(None, False): 1.0, ("bf16", False): 1.0, ("bf16", True): 2.5,
                       ("int8", False): 2.0, ("int8", True): 2.0}


def _shape_structs(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.dtype(x.dtype)), tree)


def activation_bytes(
  loss_fn: Callable, params, local_batch, *, has_aux: bool = False,
  axis_names: tuple[str, ...] = (),
) -> tuple[int, int]:
  """XLA temp bytes of the one-device ``value_and_grad(loss_fn)`` (nothing allocated).

  Returns ``(temp bytes, bytes of the loss and aux outputs)``.

  Args:
    loss_fn: ``loss_fn(params, batch)``, as for the trainer.
    params: params or their ``jax.ShapeDtypeStruct``s.
    local_batch: one device's (micro)batch, arrays or shape structs.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    axis_names: the trainer's mesh axes, bound (size 1) while ``loss_fn`` runs where
      it needs them, so a loss that reduces over them (``nn.BatchNorm(axis_name="data")``)
      traces; one that runs its own ``jax.shard_map`` over the mesh is left unbound
      (as the GSPMD baseline decides: :func:`jaxcoll.train.axes_bound.bound_if_needed`).
  """
  params, local_batch = _shape_structs(params), _shape_structs(local_batch)
  loss_fn = bound_if_needed(loss_fn, axis_names, params, local_batch)
  grad = jax.value_and_grad(loss_fn, has_aux=has_aux)
  stats = jax.jit(grad).lower(params, local_batch).compile().memory_analysis()
  metrics = jax.eval_shape(loss_fn, params, local_batch)
  return int(getattr(stats, "temp_size_in_bytes", 0)), _array_bytes(metrics)


def predict_peak(trainer, params, batch, *, _cache: dict | None = None) -> PeakEstimate:
  """Predicted peak bytes per device of ``trainer``'s step, before compiling it.

  Model state and the strategy's working copies come from the parameter
  shapes and the ZeRO stage; activations from :func:`activation_bytes` of
  the loss on one device's batch (one device, not the N-device step).
  Measured against XLA's ``memory_analysis()`` of the compiled step on the
  shipped mlp, transformer and resnet workloads, unrolled and as scanned
  stacks of FSDP units under remat (DP, ZeRO-1/2/3): within 15%
  (``tests/scale/test_memory.py``). The compression's working copies
  (:data:`COMPRESSION_BUFFERS`) are factors measured on XLA:CPU, applied to
  every backend.

  Args:
    trainer: a :class:`jaxcoll.train.Trainer` (its ``strategy.kind``, ``dp_size``,
      ``optimizer``, ``loss_fn``, ``has_aux``, ``grad_accum_steps``).
    params: params or their shape structs.
    batch: the global batch (arrays or shape structs; leading dim = batch).

  Returns:
    A :class:`PeakEstimate`; ``.peak_bytes`` is the total.
  """
  n, kind = trainer.dp_size, trainer.strategy.kind
  leaves = jax.tree.leaves(params)
  itemsize = [np.dtype(x.dtype).itemsize for x in leaves]
  full = sum(math.prod(np.shape(x)) * b for x, b in zip(leaves, itemsize))
  rows = sum(max(-(-math.prod(np.shape(x)) // n), 1) * b for x, b in zip(leaves, itemsize))
  opt_full = _array_bytes(jax.eval_shape(trainer.optimizer.init, _shape_structs(params)))
  opt_rows = opt_full * rows / full
  state = kind.state_bytes(full, opt_full, n, rows, opt_rows)
  accum = getattr(trainer, "grad_accum_steps", 1)
  batch_leaves = jax.tree.leaves(batch)
  global_rows = np.shape(batch_leaves[0])[0]
  local = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct((np.shape(x)[0] // (n * accum),) + np.shape(x)[1:], x.dtype),
    batch,
  )
  batch_bytes = _array_bytes(batch) // n
  # compute_dtype: the step runs the loss on the floating parameters cast to it (Trainer), so
  # the activations are compiled on that cast, as the step runs it; ZeRO-3 casts its rows and
  # gathers (and reduce-scatters the gradients of) the cast parameters.
  compute_dtype = getattr(trainer, "compute_dtype", None)
  loss_fn = trainer.loss_fn if compute_dtype is None else _cast_first(trainer.loss_fn,
                                                                       compute_dtype)
  key = (id(trainer.loss_fn), accum, global_rows, compute_dtype)
  if _cache is not None and key in _cache:
    act, metrics = _cache[key]
  else:
    act, metrics = activation_bytes(loss_fn, params, local, has_aux=trainer.has_aux,
                                    axis_names=tuple(trainer.mesh.axis_names))
    if _cache is not None:
      _cache[key] = act, metrics
  ratio = 1.0 if compute_dtype is None or not full else _array_bytes(
    jax.eval_shape(lambda p: cast_floating(p, compute_dtype), _shape_structs(params))) / full
  compression = getattr(trainer.strategy, "compression", None)
  feedback = bool(compression) and getattr(trainer.strategy, "error_feedback", False)
  grad, gathered, cast_copy = full, 0.0, 0.0
  buffer = full * COMPRESSION_BUFFERS.get((compression, feedback), 1.0)
  guard = 0
  if getattr(trainer, "nan_policy", "none") != "none" and not kind.gathers_updated_params:
    guard = opt_rows if kind.shards_params else opt_full
  residual = 0
  if feedback and hasattr(trainer, "abstract_state"):
    residual = state_bytes_per_device(trainer.abstract_state(_shape_structs(params)).residual)
  if kind.gathers_params_for_compute:
    grad, gathered = full * ratio, 2 * full * ratio
    cast_copy = 0.0 if compute_dtype is None else rows * ratio
  units = _units(trainer, params) if kind.shards_params else None
  if units:
    # Units gather one unit at a time and reduce-scatter its gradient when its
    # backward ends; leaves outside units stay gathered from forward to backward.
    # Unrolled units: XLA may start the next unit's gather early (two gathered) and
    # one unit's full gradient lives until its reduce-scatter; never more than all units.
    # A scanned layer: the one-device value_and_grad runs the same loop body, which
    # slices the layer's parameters out of the stack (the copy ZeRO-3 gathers instead)
    # and computes the layer's full gradient before writing it into the stacked one;
    # both are loop temporaries, so activation_bytes already holds them, with XLA's
    # own overlap (the mlp's slice dies before its gradient: one buffer for both).
    # Only the outside leaves and the stacked gradient's rows are added to it.
    outside, unit_rows, unrolled, one_unit, layer, stack_rows = units
    in_body = one_unit  # the largest unrolled unit; 0 when every unit is a scanned layer
    grad = (outside + in_body) * ratio + unit_rows
    gathered = (outside + min(2 * in_body, unrolled)) * ratio
    buffer = outside
    if unrolled and trainer.mesh.devices.flat[0].platform == "cpu":
      # XLA:CPU takes out remat's optimization barriers before its CSE pass, which then
      # merges each unrolled unit's backward re-gather into its forward gather, and its
      # scheduler starts every gather at the step's start: all unrolled units stay gathered
      # from forward to backward (a deep model holds all of them, as without units). The
      # peak is at backward's start: that, the first unit's full gradient and the
      # activations (measured on 2-8 unrolled MLP blocks 128-256 wide: -1% to +11%; see the
      # README). A scanned stack beside them (a tied embedding as a unit, the layers
      # scanned) is still gathered one layer at a time inside its loop, whose carry holds
      # the stack's gradient rows: those rows, not the stack (it was counted gathered
      # whole: +45% on a 12-layer LM at 6 devices, whose embedding is the largest unit).
      grad, gathered, buffer = in_body * ratio + stack_rows, (outside + unrolled) * ratio, 0
    if layer and compute_dtype is not None:
      # The one-device loss casts the whole stack before its loop (XLA hoists the cast); the
      # ZeRO-3 step casts one gathered layer at a time inside it (cast_copy: the rows).
      act = max(act - int((full - outside - unrolled) * ratio), 0)
  return PeakEstimate(
    state_bytes=int(state),
    batch_bytes=int(batch_bytes),
    grad_bytes=int(grad),
    gathered_bytes=int(gathered),
    row_bytes=int(2 * rows) if kind.gathers_updated_params else 0,
    buffer_bytes=int(buffer),
    activation_bytes=act,
    metrics_bytes=metrics,
    cast_bytes=int(cast_copy),
    residual_bytes=int(residual),
    guard_bytes=int(guard),
  )


def _cast_first(loss_fn: Callable, dtype) -> Callable:
  """``loss_fn`` on its floating parameters cast to ``dtype``, as the trainer's step runs it."""
  def cast_loss(params, *args):
    return loss_fn(cast_floating(params, dtype), *args)

  return cast_loss


def _units(trainer, params) -> tuple[int, int, int, int, int, int] | None:
  """ZeRO-3 FSDP units of ``trainer``'s model (``Trainer.fsdp_unit_bytes``).

  Returns ``(bytes outside units, bytes of the unit rows, bytes of all unrolled
  units, of the largest unrolled unit, of the largest scanned layer, of the scanned
  stacks' rows)``: a model
  may have both (a tied embedding as a unit beside a scanned stack, the largest
  unit of all); ``None`` without units (or
  for a trainer without that method). The loss must have run once
  (``predict_peak`` traces it first) so that the units are known.
  """
  if not hasattr(trainer, "fsdp_unit_bytes"):
    return None
  return trainer.fsdp_unit_bytes(_shape_structs(params), by_kind=True)


def abstract_state(trainer, param_shapes):
  """The state ``trainer.init`` would return, as sharded shape structs (nothing allocated).

  ``trainer.abstract_state`` (:class:`jaxcoll.train.Trainer` and the GSPMD
  baselines have it); the planner never initializes a model.

  Raises:
    ValueError: a trainer without ``abstract_state``.
  """
  if not hasattr(trainer, "abstract_state"):
    raise ValueError(
      f"{type(trainer).__name__} has no `abstract_state(param_shapes)`; the memory planner "
      "needs it to compile the step without allocating the model."
    )
  return trainer.abstract_state(_shape_structs(param_shapes))


def state_bytes_per_device(abstract_state) -> int:
  """Bytes of an (abstract) state the first device holds, from each leaf's sharding."""
  total = 0
  for x in jax.tree.leaves(abstract_state):
    sharding = getattr(x, "sharding", None)
    shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
    total += math.prod(shape) * np.dtype(x.dtype).itemsize
  return total


def compiled_peak_bytes(trainer, param_shapes, batch) -> int:
  """XLA's peak per device (args + outputs - alias + temp) of ``trainer``'s
  step, compiled on abstract inputs: nothing of the model's size is allocated."""
  state = abstract_state(trainer, _shape_structs(param_shapes))
  return analysis.peak_bytes(trainer.compile_step(state, batch).memory_analysis())


def largest_fitting(
  peak_of: Callable[[int], int], budget_bytes: float, *, low: int = 1, cap: int = 4096
) -> tuple[int, int | None]:
  """The largest ``k`` in ``[low, cap]`` with ``peak_of(k) <= budget_bytes``.

  Doubles ``k`` until the budget is exceeded, then bisects (peak is assumed
  to grow with ``k``, as it does with the number of layers).

  Args:
    peak_of: ``k -> bytes`` (e.g. :func:`compiled_peak_bytes` of a model
      with ``k`` layers).
    budget_bytes: the per-device budget.
    low: the smallest ``k`` to try.
    cap: stop doubling here.

  Returns:
    ``(k, peak_of(k))``, or ``(0, None)`` if even ``low`` does not fit.

  Raises:
    ValueError: a non-positive budget.

  Example:
    >>> largest_fitting(lambda k: 100 * k, 1050)
    (10, 1000)
  """
  if not budget_bytes > 0:
    raise ValueError(f"`budget_bytes` must be positive; got {budget_bytes!r}.")
  peaks: dict[int, int] = {}

  def fits(k):
    if k not in peaks:
      peaks[k] = peak_of(k)
    return peaks[k] <= budget_bytes

  if not fits(low):
    return 0, None
  good, bad = low, None
  while bad is None:
    k = min(2 * good, cap)
    if k == good:
      return good, peaks[good]
    if fits(k):
      good = k
    else:
      bad = k
  while bad - good > 1:
    mid = (good + bad) // 2
    good, bad = (mid, bad) if fits(mid) else (good, mid)
  return good, peaks[good]

