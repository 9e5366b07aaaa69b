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

:func:`plan` compiles a :class:`jaxcoll.train.Trainer`'s step and puts the
formula next to what XLA reports (``compiled.memory_analysis()``) and to the
bytes of model state each device actually holds between steps, so a user can
see before launch whether a configuration fits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np

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
  if stage not in (0, 1, 2, 3):
    raise ValueError(f"`stage` must be 0 (DP), 1, 2 or 3; got {stage!r}.")
  if not num_params > 0:
    raise ValueError(f"`num_params` must be positive; got {num_params!r}.")
  if (
    isinstance(num_devices, bool)
    or not isinstance(num_devices, (int, np.integer))
    or num_devices < 1
  ):
    raise ValueError(f"`num_devices` must be a positive int; got {num_devices!r}.")
  psi, n = float(num_params), int(num_devices)
  p, g, k = param_bytes, grad_bytes, optimizer_bytes_per_param
  if stage == 0:
    return (p + g + k) * psi
  if stage == 1:
    return (p + g) * psi + k * psi / n
  if stage == 2:
    return p * psi + (g + k) * psi / n
  return (p + g + k) * psi / n


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

  @property
  def peak_bytes(self) -> int:
    """Arguments + outputs not aliased to them + temporaries."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Rows of :func:`plan` and the setting their formula used.

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
    header = ("strategy", "formula", "state held", "XLA args", "outputs", "alias", "temp", "peak")
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
          )
        ),
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
      "gradients live in XLA temp. peak = args + outputs - alias + temp."
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


def plan(trainers, params, batch) -> MemoryPlan:
  """Compiles each trainer's step and compares its memory with the formula.

  The formula uses the setting actually trained: bytes per parameter and
  per gradient from the parameters' dtype (4 for float32), and ``K`` = the
  optimizer state's bytes per parameter measured with ``jax.eval_shape``
  for each trainer's own optimizer (8 for float32 Adam: momentum and
  variance; the params are the master copy).

  Args:
    trainers: a :class:`jaxcoll.train.Trainer` or a sequence of them (e.g.
      DP and ZeRO-1/2/3 on the same mesh).
    params: the parameters (host or device pytree), as for ``trainer.init``.
    batch: a global batch, as for ``trainer.step``.

  Returns:
    A :class:`MemoryPlan`; ``print(plan)`` shows the table.

  Raises:
    ValueError: if ``trainers`` is empty or the trainers use different
      numbers of devices.

  Example:
    >>> trainers = [jaxcoll.Trainer(loss_fn, optax.adam(1e-3), mesh, s)
    ...             for s in (jaxcoll.DataParallel(), jaxcoll.ZeRO(stage=3))]  # doctest: +SKIP
    >>> print(jaxcoll.memory.plan(trainers, params, batch))  # doctest: +SKIP
  """
  trainers = list(trainers) if isinstance(trainers, Sequence) else [trainers]
  if not trainers:
    raise ValueError("`trainers` is empty; pass a Trainer or a list of Trainers.")
  sizes = {t.dp_size for t in trainers}
  if len(sizes) != 1:
    raise ValueError(
      f"`trainers` use different data-parallel sizes {sorted(sizes)}; compare trainers on one mesh."
    )
  n = sizes.pop()
  leaves = jax.tree.leaves(params)
  psi = sum(math.prod(np.shape(x)) for x in leaves)
  param_bytes = _array_bytes(params) / psi
  rows = []
  for trainer in trainers:
    k = _array_bytes(jax.eval_shape(trainer.optimizer.init, params)) / psi
    state = trainer.init(params)
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
        state_bytes=trainer.state_bytes_per_device(state),
        argument_bytes=int(getattr(stats, "argument_size_in_bytes", 0)),
        output_bytes=int(getattr(stats, "output_size_in_bytes", 0)),
        alias_bytes=int(getattr(stats, "alias_size_in_bytes", 0)),
        temp_bytes=int(getattr(stats, "temp_size_in_bytes", 0)),
        optimizer_bytes_per_param=k,
      )
    )
  ks = {r.optimizer_bytes_per_param for r in rows}
  shared_k = ks.pop() if len(ks) == 1 else None
  return MemoryPlan(tuple(rows), psi, n, param_bytes, param_bytes, shared_k)
