"""What each strategy kind shards and which collectives one of its steps runs.

Pure data, one :class:`StrategyKind` per kind (data parallel, ZeRO-1/2/3),
read by everything that needs to know it without running a step: the plans
(:mod:`jaxcoll.train.dp`, :mod:`jaxcoll.train.zero`) carry theirs,
``jaxcoll.DataParallel().kind`` / ``jaxcoll.ZeRO(stage=s).kind`` answer it,
the memory model (:mod:`jaxcoll.scale.memory`) reads what is sharded and the
step-time model (:mod:`jaxcoll.scale.step_model`) reads the collectives. No
other module maps a stage number to behaviour.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StrategyKind:
  """One strategy kind, as data.

  Attributes:
    stage: 0 for data parallelism, else the ZeRO stage.
    name: ``"DP"`` or ``"ZeRO-<stage>"``.
    shards_optimizer_state / shards_gradients / shards_params: what each
      device keeps ``1/N`` of (the rest it keeps in full).
    gradient_collective: how the gradients are averaged: ``"all_reduce"``
      (every device gets the full mean) or ``"reduce_scatter"`` (each gets
      the mean of its rows).
    gathers_updated_params: the updated parameter rows are all-gathered after
      the optimizer (ZeRO-1/2: the parameters are kept in full).
    gathers_params_for_compute: the parameters are all-gathered before the
      forward pass and again before the backward pass (ZeRO-3).
  """

  stage: int
  name: str
  shards_optimizer_state: bool
  shards_gradients: bool
  shards_params: bool
  gradient_collective: str
  gathers_updated_params: bool
  gathers_params_for_compute: bool

  @property
  def collectives(self) -> tuple[str, ...]:
    """The collectives one step runs (besides the scalars: loss, norm, aux), in order.

    Hybrid sharding (``ZeRO(replica_axis=...)``) adds, in stages 2 and 3, an
    all-reduce of the gradient rows across the replicas; the step model adds
    it for ``StepStrategy(hybrid=True)``."""
    gathers = ("all_gather",) if self.gathers_params_for_compute else ()
    after = ("all_gather",) if self.gathers_updated_params else ()
    return gathers + (self.gradient_collective,) + after

  def state_bytes(self, params: float, optimizer: float, devices: int,
                  params_sharded: float | None = None,
                  optimizer_sharded: float | None = None) -> float:
    """Bytes of parameters + optimizer state one device keeps between steps.

    ``params`` / ``optimizer``: the bytes in full; ``*_sharded``: one device's
    part when sharded (default: the full bytes / ``devices``).
    """
    p = (params / devices if params_sharded is None else params_sharded) if (
      self.shards_params) else params
    o = (optimizer / devices if optimizer_sharded is None else optimizer_sharded) if (
      self.shards_optimizer_state) else optimizer
    return p + o


DP = StrategyKind(0, "DP", False, False, False, "all_reduce", False, False)
ZERO1 = StrategyKind(1, "ZeRO-1", True, False, False, "all_reduce", True, False)
ZERO2 = StrategyKind(2, "ZeRO-2", True, True, False, "reduce_scatter", True, False)
ZERO3 = StrategyKind(3, "ZeRO-3", True, True, True, "reduce_scatter", False, True)

#: ZeRO stage (0: data parallel) -> its kind.
BY_STAGE: dict[int, StrategyKind] = {k.stage: k for k in (DP, ZERO1, ZERO2, ZERO3)}

#: Strategy names (the runner's ``config.strategy``, the step model's) -> ZeRO
#: stage: the one place a name is mapped to a stage (``dp`` is stage 0).
STAGES = {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3}


def of_stage(stage: int) -> StrategyKind:
  """The kind of ZeRO ``stage`` (0: data parallel); ValueError for another value."""
  if isinstance(stage, bool) or stage not in BY_STAGE:
    raise ValueError(f"`stage` must be 0 (DP), 1, 2 or 3; got {stage!r}.")
  return BY_STAGE[stage]
