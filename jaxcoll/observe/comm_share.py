"""The fraction of a step spent in collectives: estimated, and measured from a trace.

:func:`estimate_comm_time` prices every collective of a compiled program with
the cost model: :func:`jaxcoll.analysis.report_from_hlo` lists each op (kind,
bytes, group size, executions per call) and :func:`jaxcoll.cost.estimate`
gives its seconds on the run's topology (:func:`jaxcoll.tuning.default_topology`:
the shipped tuning table's fitted topology on CPU, the platform's preset
elsewhere). Dividing by a measured step time gives the *estimated*
communication share, :func:`comm_share`.

How each op is priced:

* all-reduce, all-gather, reduce-scatter, all-to-all, collective-broadcast:
  the ``native`` algorithm of the matching collective (the op *is* one XLA
  collective) of ``size_bytes`` on a group of ``group_size`` devices. A group
  of all the topology's devices gets the topology itself; a smaller group gets
  the levels its devices span (``CollectiveOp.groups``) when the topology has
  the program's devices (ranks row-major over its levels, as the mesh's
  positions), so a group over the ``node`` axis costs the links between
  nodes; otherwise it is mapped by its size as
  :meth:`jaxcoll.topology.Topology.for_axes` maps one mesh axis (inside a node
  when it fits, else on the slowest level's figures).
* collective-permute: one ``ppermute`` step, ``launch_s + alpha + S * beta``
  (the per-step cost of :mod:`jaxcoll.cost`'s ppermute-built algorithms) on the
  outermost level one of its source-target pairs crosses when the topology has
  the program's devices, else on the slowest level, so a ring built from
  ppermutes costs what ``cost.estimate(..., "ring")`` says without its
  reduction term.

Every execution counts (ops in loops times their trip count), and ops run one
after another: overlap with compute is not modelled, so the share is an upper
bound of the *exposed* communication when the step overlaps it.

:func:`measured_comm_share` reads a profiler trace instead (the Perfetto JSON
``jax.profiler.start_trace(..., create_perfetto_trace=True)`` writes): per
device, the time inside the program's collective instructions during the
steps marked by ``jax.profiler.StepTraceAnnotation``, over the steps' time.
On the CPU simulation a collective's time includes waiting at the rendezvous
for the other emulated devices, as NCCL's kernel time includes waiting for
peers.

Example:
  >>> mesh = jaxcoll.devices.flat_mesh(8)  # doctest: +SKIP
  >>> f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "data"), mesh=mesh,
  ...                           in_specs=P("data"), out_specs=P("data")))  # doctest: +SKIP
  >>> compiled = f.lower(jnp.zeros(8 * 1024)).compile()  # doctest: +SKIP
  >>> estimate = jaxcoll.comm_share.estimate_comm_time(compiled)  # doctest: +SKIP
  >>> estimate.seconds > 0, len(estimate.ops)  # doctest: +SKIP
  (True, 1)
  >>> comm_share(estimate.seconds, step_time_s=0.01)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import re
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from jaxcoll.observe import analysis
from jaxcoll.comm_model import cost, tuning
from jaxcoll.collectives import specs
from jaxcoll.comm_model.topology import Topology

__all__ = ["CommEstimate", "OpEstimate", "comm_share", "estimate_comm_time",
           "measured_comm_share"]

# HLO collective kind -> the jaxcoll.cost collective priced with algorithm "native".
_OPCODE = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=.*?\s(?P<op>(?:"
    + "|".join(analysis.KINDS) + r")(?:-start|-done)?)\(",
    re.MULTILINE,
)


@dataclasses.dataclass(frozen=True)
class OpEstimate:
  """One collective of the program and its predicted time.

  Attributes:
    op: the op as :func:`jaxcoll.analysis.report_from_hlo` reports it.
    seconds: predicted seconds of one execution.
  """

  op: analysis.CollectiveOp
  seconds: float

  @property
  def total_seconds(self) -> float:
    """Seconds per call of the program: all executions of the op."""
    return self.seconds * self.op.executions


@dataclasses.dataclass(frozen=True)
class CommEstimate:
  """Predicted time of every collective of one compiled program.

  Attributes:
    ops: one entry per collective instruction, in program order.
    topology: the topology the ops were priced on.
  """

  ops: tuple[OpEstimate, ...]
  topology: Topology

  @property
  def seconds(self) -> float:
    """Predicted seconds of the program's collectives per call (0 without any)."""
    return float(sum(e.total_seconds for e in self.ops))


def estimate_comm_time(compiled: Any, topology: Topology | None = None) -> CommEstimate:
  """Predicts the time the collectives of a compiled program take per call.

  Args:
    compiled: a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``),
      a ``jax.stages.Lowered`` (compiled here) or the text of its optimized HLO
      module (``compiled.as_text()``).
    topology: the machine to price the ops on; default
      :func:`jaxcoll.tuning.default_topology`.

  Returns:
    A :class:`CommEstimate`; ``seconds`` is 0 for a program without collectives.

  Raises:
    TypeError: ``compiled`` is neither a compiled program nor HLO text, or
      ``topology`` is not a Topology.

  Example:
    >>> compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(8)).compile()  # doctest: +SKIP
    >>> estimate_comm_time(compiled).seconds  # doctest: +SKIP
    0.0
  """
  text = _hlo_text(compiled)
  if topology is None:
    topology = tuning.default_topology()
  if not isinstance(topology, Topology):
    raise TypeError(
        f"`topology` must be a jaxcoll.topology.Topology or None, got {type(topology).__name__}; "
        "pass e.g. Topology.preset('cpu-sim') or leave it out for the run's topology."
    )
  report = analysis.report_from_hlo(text)
  ops = tuple(OpEstimate(op, _op_seconds(op, topology, report.num_devices))
              for op in report.ops)
  return CommEstimate(ops, topology)


def comm_share(comm_time_s: float, step_time_s: float | None) -> float | None:
  """``comm_time_s / step_time_s``, or None without a positive step time.

  Not clipped to 1: a share above 1 says the model's figures are slower than
  this machine (refit them with ``python -m experiments.tune``).
  """
  if step_time_s is None or not math.isfinite(step_time_s) or step_time_s <= 0:
    return None
  return float(comm_time_s) / float(step_time_s)


def measured_comm_share(trace_path: str, compiled: Any, *,
                        step_name: str = "train") -> dict[str, float] | None:
  """The communication share measured in a Perfetto JSON trace.

  Sums, per device, the time of the trace events of ``compiled``'s collective
  instructions (matched by HLO instruction name and module) that lie inside
  the ``step_name`` step annotations, and divides the mean over devices by
  the steps' total time.

  Args:
    trace_path: a ``perfetto_trace.json.gz`` (or plain ``.json``) written by
      ``jax.profiler.start_trace(..., create_perfetto_trace=True)``.
    compiled: the program whose collectives to count, as for
      :func:`estimate_comm_time`.
    step_name: the name given to ``jax.profiler.StepTraceAnnotation``.

  Returns:
    ``{"comm_share_measured", "comm_time_measured_s", "traced_step_time_s",
    "traced_steps"}`` (times per step), or None when the trace has no step
    annotation of that name.

  Raises:
    TypeError: as :func:`estimate_comm_time`.
    OSError, ValueError: the trace cannot be read or is not JSON.
  """
  text = _hlo_text(compiled)
  names = {m.group("name") for m in _OPCODE.finditer(text)}
  module = analysis.report_from_hlo(text).module
  opener = gzip.open if trace_path.endswith(".gz") else open
  with opener(trace_path, "rt") as f:
    events = json.load(f)
  events = events.get("traceEvents", []) if isinstance(events, dict) else events
  complete = [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e]
  steps = [(float(e["ts"]), float(e["ts"]) + float(e["dur"]))
           for e in complete if e.get("name") == step_name]
  if not steps:
    return None
  step_time = sum(end - begin for begin, end in steps)
  per_device: dict[Any, float] = {}
  for e in complete:
    args = e.get("args") or {}
    if args.get("hlo_op", e.get("name")) not in names:
      continue
    if module and args.get("hlo_module", module) != module:
      continue
    inside = _overlap(float(e["ts"]), float(e["ts"]) + float(e["dur"]), steps)
    if inside > 0:
      device = args.get("device_ordinal", (e.get("pid"), e.get("tid")))
      per_device[device] = per_device.get(device, 0.0) + inside
  comm = sum(per_device.values()) / len(per_device) if per_device else 0.0
  return {
      "comm_share_measured": comm / step_time if step_time > 0 else 0.0,
      "comm_time_measured_s": comm / len(steps) * 1e-6,  # trace times are in microseconds
      "traced_step_time_s": step_time / len(steps) * 1e-6,
      "traced_steps": len(steps),
  }


def _hlo_text(compiled: Any) -> str:
  if isinstance(compiled, str):
    return compiled
  if isinstance(compiled, jax.stages.Lowered):  # its as_text() is StableHLO, before XLA ran
    compiled = compiled.compile()
  if hasattr(compiled, "as_text"):
    return compiled.as_text()
  raise TypeError(
      f"`compiled` must be a jax.stages.Compiled or its HLO text, got {type(compiled).__name__}; "
      "pass jax.jit(f).lower(*args).compile()."
  )


def _group_topologies(topology: Topology, op: analysis.CollectiveOp,
                      num_devices: int) -> list[Topology]:
  """The topology each distinct group of ``op`` sees.

  When the topology describes the program's devices (as many, ranks row-major over its
  levels as the mesh's positions are) and the HLO says which devices a group holds, the
  group spans the levels on which its members differ: a group of 2 over the ``node`` axis
  of a (node, local) mesh crosses the nodes, and costs what the node links cost (it was
  priced by its size alone, inside a node: 7x under on dgx-h100). Otherwise, by size alone.
  """
  if op.group_size == topology.num_devices:
    return [topology]
  shapes = set()
  if op.groups and num_devices == topology.num_devices:
    for members in op.groups:
      coords = np.unravel_index(np.asarray(members), topology.sizes)
      counts = tuple(len(np.unique(c)) for c in coords)
      if math.prod(counts) != len(members):  # not a product of levels: by size alone
        shapes = set()
        break
      shapes.add(counts)
  if not shapes:
    return [topology.for_axes(("group",), (op.group_size,))]
  return [topology.for_axes([lv.name for lv, c in zip(topology.levels, counts) if c > 1],
                            [c for c in counts if c > 1]) for counts in sorted(shapes)]


def _op_seconds(op: analysis.CollectiveOp, topology: Topology, num_devices: int = 0) -> float:
  if op.group_size < 1 or op.size_bytes <= 0:
    return 0.0
  if op.kind == specs.PPERMUTE_HLO_KIND:
    # One ppermute step: what cost.py's ppermute-built algorithms pay per step (launch +
    # alpha + bytes * beta), on the outermost level a pair crosses when the topology has
    # the program's devices, else on the slowest.
    known = op.groups is not None and num_devices == topology.num_devices
    return cost.ppermute_step_seconds(op.size_bytes, topology, op.groups if known else None)
  name = specs.BY_HLO_KIND[op.kind].name
  return max(cost.estimate(name, op.size_bytes, group, "native")
             for group in _group_topologies(topology, op, num_devices))


def _overlap(begin: float, end: float, windows: Iterable[tuple[float, float]]) -> float:
  return sum(max(0.0, min(end, w_end) - max(begin, w_begin)) for w_begin, w_end in windows)
