"""Communication report of any jitted function, read from its compiled HLO.

:func:`comm_report` lowers and compiles a function (``jax.jit``, GSPMD with
``NamedSharding``, ``jax.shard_map``, ``jax.pmap``: anything that lowers),
reads the optimized HLO text (``compiled.as_text()``) and lists every
collective instruction XLA emitted: its kind, dtype, shape, group size, how
many times it runs per call, and the bytes each device sends.

Cost conventions (nccl-tests, ``doc/PERFORMANCE.md``): ``S`` is the size of
the op's largest buffer and ``n`` its group size. Bytes sent per device, per
execution of the op:

=====================  =====================  ===============================
kind                   bytes sent per device  S
=====================  =====================  ===============================
all-reduce             ``2(n-1)/n * S``       the (summed) operand
all-gather             ``(n-1)/n * S``        the gathered result
reduce-scatter         ``(n-1)/n * S``        the full input (``n`` x result)
all-to-all             ``(n-1)/n * S``        the operand (or sum of operands)
collective-permute     ``S``                  the operand
collective-broadcast   ``S``                  the operand
=====================  =====================  ===============================

These are the volumes of the bandwidth-optimal algorithms (ring, pairwise),
i.e. nccl-tests' ``busbw`` factors times ``S`` (both read from the spec
table, :mod:`jaxcoll.collectives.specs`). A collective-permute charges
``S`` to every *sending* device (its ``group`` column is the number of
source-target pairs); devices that only receive send nothing. A combined
(tuple-shaped) op sums the bytes of its arrays.

Executions: ops inside ``while`` loops are multiplied by XLA's
``known_trip_count`` (``lax.fori_loop`` / ``lax.scan`` with static bounds);
ops in computations reached through ``call``, ``fusion`` and ``async-start``
count as their caller; every branch of a ``conditional`` counts once per
execution of the conditional (an upper bound: only one branch runs), which
the entry's ``note`` says. Async pairs (``all-reduce-start`` /
``all-reduce-done``, ...) are counted once, at the ``-start``.

Limits:

* The report counts what XLA emitted *after* optimization, for this backend:
  XLA may combine, split, decompose or remove collectives (e.g. the CPU
  backend upcasts bf16 all-reduces to f32), so the same function can report
  differently on GPU or TPU.
* Bytes are per device for the largest participating group, and for
  collective-permute per sending device: for algorithms made of many
  ``ppermute`` steps whose busiest device changes from step to step (trees),
  the sum over steps is an upper bound of what the busiest device sends.
* A ``while`` loop without a known trip count is counted once (noted).
* ``send`` / ``recv``, ``ragged-all-to-all`` and custom calls are not counted.

Example:
  >>> mesh = jaxcoll.devices.flat_mesh(8)  # doctest: +SKIP
  >>> f = jax.shard_map(lambda v: jax.lax.psum(v, "data"), mesh=mesh,
  ...                   in_specs=P("data"), out_specs=P("data"))
  >>> report = jaxcoll.analysis.comm_report(f, jnp.zeros(8 * 256))  # doctest: +SKIP
  >>> report.total_bytes_sent_per_device  # doctest: +SKIP
  1792.0
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from jaxcoll.collectives import specs
from jaxcoll.sizes import format_bytes

__all__ = [
    "KINDS",
    "CollectiveOp",
    "CommReport",
    "comm_report",
    "peak_bytes",
    "report_from_hlo",
]

KINDS = specs.HLO_KINDS  # all-reduce, all-gather, reduce-scatter, all-to-all, ...


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
  """One collective instruction of the optimized HLO.

  Attributes:
    kind: one of :data:`KINDS`.
    dtype: HLO element type of the result, e.g. ``"f32"``; distinct types
      joined by ``","`` for a combined op of mixed types.
    shape: the result's dimensions; a tuple of shapes for a combined
      (tuple-shaped) op. For reduce-scatter this is the scattered output.
    group_size: devices per replica group (the largest group); for
      collective-permute, the number of source-target pairs.
    num_groups: number of replica groups (1 for collective-permute).
    executions: times the op runs per call of the function.
    size_bytes: nccl-tests' ``S``: the op's largest buffer, in bytes.
    bytes_sent_per_device: bytes one device sends per execution under the
      op's standard cost (see the module docstring).
    name: the HLO instruction name.
    computation: the HLO computation that holds the instruction.
    note: how the count was made when it is not exact, else ``""``.
    senders: for collective-permute, the device ids that send; ``None``
      means every device of the groups sends.
    groups: the device ids of each group (the program's device positions,
      ``mesh.devices.flat[i]``), read from the HLO's replica groups (listed or
      iota form) when its ids are such positions (a ``jit`` / ``shard_map``
      program, or ``pmap``'s replicas); ``None`` otherwise. For
      collective-permute, its (source, target) pairs. Which devices a group
      holds says which links it crosses (``jaxcoll.comm_share`` prices it on
      them).
  """

  kind: str
  dtype: str
  shape: tuple
  group_size: int
  num_groups: int
  executions: int
  size_bytes: int
  bytes_sent_per_device: float
  name: str
  computation: str
  note: str = ""
  senders: tuple[int, ...] | None = None
  groups: tuple[tuple[int, ...], ...] | None = None

  @property
  def total_bytes_sent_per_device(self) -> float:
    """Bytes one device sends per call: all executions of this op."""
    return self.bytes_sent_per_device * self.executions


@dataclasses.dataclass(frozen=True)
class CommReport:
  """Every collective of one compiled function, and the bytes they send.

  Attributes:
    ops: one entry per collective instruction, in program order.
    num_devices: devices the program runs on (replicas x partitions).
    module: the HLO module name, e.g. ``"jit_train_step"``.
  """

  ops: tuple[CollectiveOp, ...]
  num_devices: int
  module: str = ""

  @property
  def total_bytes_sent_per_device(self) -> float:
    """Bytes the busiest device sends per call (max over devices).

    Equal to the sum over ops of bytes x executions when every device takes
    part in every op; collective-permutes count only for their senders, so a
    tree (where few devices send at each step) is not over-counted.
    """
    return float(max(self.bytes_sent_by_device(), default=0.0))

  def bytes_sent_by_device(self) -> list[float]:
    """Bytes each device sends per call, by its position in the program (HLO's partition
    id: the mesh's devices in row-major order, ``mesh.devices.flat[i]``), not ``Device.id``:
    the two differ on a mesh whose devices are not in id order."""
    sent = np.zeros(max(self.num_devices, 1))
    for op in self.ops:
      if op.senders is None:
        sent += op.total_bytes_sent_per_device
      else:
        for d in op.senders:
          if d < len(sent):
            sent[d] += op.total_bytes_sent_per_device
    return [float(v) for v in sent] if self.ops else []

  def by_kind(self) -> dict[str, dict[str, float]]:
    """Totals per kind: ``{kind: {"ops", "executions", "bytes_sent_per_device"}}``.

    ``bytes_sent_per_device`` is per call (all executions); kinds that do not
    occur are left out.
    """
    summary: dict[str, dict[str, float]] = {}
    for kind in KINDS:
      ops = [op for op in self.ops if op.kind == kind]
      if ops:
        summary[kind] = {
            "ops": len(ops),
            "executions": sum(op.executions for op in ops),
            "bytes_sent_per_device": float(
                sum(op.total_bytes_sent_per_device for op in ops)
            ),
        }
    return summary

  def to_dict(self) -> dict[str, Any]:
    """A JSON-serializable dict: totals, per-kind summary and every op."""
    ops = []
    for op in self.ops:
      entry = dataclasses.asdict(op)
      entry["shape"] = _shape_to_json(op.shape)
      entry["total_bytes_sent_per_device"] = op.total_bytes_sent_per_device
      ops.append(entry)
    return {
        "module": self.module,
        "num_devices": self.num_devices,
        "total_bytes_sent_per_device": self.total_bytes_sent_per_device,
        "by_kind": self.by_kind(),
        "ops": ops,
    }

  def __str__(self) -> str:
    header = ("kind", "dtype", "shape", "group", "executions", "bytes/device")
    rows = [
        (
            op.kind,
            op.dtype,
            _format_shape(op.shape),
            str(op.group_size),
            str(op.executions),
            _format_bytes(op.total_bytes_sent_per_device),
        )
        for op in self.ops
    ]
    notes = [op.note for op in self.ops]
    if any(notes):
      header += ("note",)
      rows = [row + (note,) for row, note in zip(rows, notes, strict=True)]
    total = self.total_bytes_sent_per_device
    total_row = ("total", "", "", "", "", _format_bytes(total))
    widths = [
        max(len(row[i]) for row in [header, total_row, *rows] if i < len(row))
        for i in range(len(header))
    ]
    right = {3, 4, 5}  # numeric columns

    def line(row) -> str:
      cells = [
          cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
          for i, cell in enumerate(row)
      ]
      return "  ".join(cells).rstrip()

    title = (
        f"Collectives of {self.module or 'the program'} on {self.num_devices} "
        "device(s); bytes/device = bytes one device sends per call "
        "(nccl-tests conventions)"
    )
    rule = "-" * len(line(header))
    body = [line(row) for row in rows] or ["(no collectives)"]
    footer = f"{line(total_row)}  ({format_bytes(total)})"
    return "\n".join([title, line(header), rule, *body, rule, footer])


def comm_report(fn: Callable, *args: Any, **kwargs: Any) -> CommReport:
  """Compiles ``fn`` for ``args`` and reports every collective it runs.

  ``fn`` may be a plain function (it is jitted), a ``jax.jit`` function
  (with shardings, static arguments, ...), a ``jax.shard_map`` or a
  ``jax.pmap`` function. Arguments may be arrays or ``jax.ShapeDtypeStruct``.
  A program already lowered or compiled (``f.lower(x)``, ``f.lower(x).compile()``)
  is read as it is, without arguments.

  Args:
    fn: the function to analyze, or a ``jax.stages.Lowered`` / ``Compiled``.
    *args: positional arguments, as for a call of ``fn``.
    **kwargs: keyword arguments, as for a call of ``fn``.

  Returns:
    A :class:`CommReport` with one entry per collective instruction of the
    optimized HLO; empty (total 0) when there is none.

  Raises:
    ValueError: arguments given with a program already lowered or compiled.
    TypeError: ``fn`` is not callable.
    Whatever JAX raises when ``fn`` cannot be traced, lowered or compiled.

  Example:
    >>> report = comm_report(step, params, batch)  # doctest: +SKIP
    >>> print(report)  # doctest: +SKIP
    >>> report.by_kind()["all-reduce"]["bytes_sent_per_device"]  # doctest: +SKIP
  """
  if isinstance(fn, (jax.stages.Lowered, jax.stages.Compiled)):
    if args or kwargs:
      raise ValueError(
          f"`fn` is already a {type(fn).__name__} program, for the arguments it was lowered "
          "with; call comm_report(program) without arguments, or pass the function itself."
      )
    compiled = fn.compile() if isinstance(fn, jax.stages.Lowered) else fn
    return report_from_hlo(compiled.as_text())
  if not callable(fn):
    raise TypeError(
        f"`fn` must be a function, a jitted function or a lowered / compiled program, got "
        f"{type(fn).__name__}."
    )
  staged = fn if hasattr(fn, "lower") else jax.jit(fn)
  compiled = staged.lower(*args, **kwargs).compile()
  return report_from_hlo(compiled.as_text())


def peak_bytes(memory: Any) -> int | None:
  """Peak bytes per device of a compiled program, from XLA's memory analysis.

  ``arguments + outputs - aliased + temporaries`` of
  ``compiled.memory_analysis()`` (outputs that reuse an argument's buffer,
  e.g. donated state, count once).

  Args:
    memory: ``jax.stages.Compiled.memory_analysis()``; ``None`` where the
      backend reports none.

  Returns:
    The peak in bytes, or None when ``memory`` is None.

  Example:
    >>> compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(256)).compile()  # doctest: +SKIP
    >>> jaxcoll.analysis.peak_bytes(compiled.memory_analysis())  # doctest: +SKIP
    2048
  """
  if memory is None:
    return None
  return int(
      memory.argument_size_in_bytes + memory.output_size_in_bytes
      - memory.alias_size_in_bytes + memory.temp_size_in_bytes
  )


def report_from_hlo(hlo_text: str) -> CommReport:
  """Reports the collectives of an HLO module's text (as :func:`comm_report`).

  Args:
    hlo_text: text of one HLO module, e.g. ``jax.jit(f).lower(x).compile()
      .as_text()``; optimized HLO is what runs.

  Returns:
    A :class:`CommReport`.

  Raises:
    ValueError: if ``hlo_text`` is not a string or has no ENTRY computation.
  """
  if not isinstance(hlo_text, str):
    raise ValueError(
        f"`hlo_text` must be the text of an HLO module (a str), got "
        f"{type(hlo_text).__name__}; pass compiled.as_text()."
    )
  module = _parse_module(hlo_text)
  ops = list(_walk(module))
  return CommReport(tuple(ops), module.replica_count * module.num_partitions, module.name)


# ----------------------------------------------------------------------------
# HLO text parsing.


@dataclasses.dataclass
class _Instruction:
  name: str
  type_text: str
  opcode: str
  operands: list[str]
  attrs: dict[str, str]
  computation: str


@dataclasses.dataclass
class _Module:
  name: str
  replica_count: int
  num_partitions: int
  entry: str
  computations: dict[str, list[_Instruction]]
  by_name: dict[str, _Instruction]
  done_of: dict[str, _Instruction]  # -start name -> its -done


_COMMENT = re.compile(r"/\*.*?\*/")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_OPENERS = {"(": ")", "{": "}", "[": "]"}


def _scan(text: str, start: int = 0) -> Iterator[tuple[int, str, int]]:
  """Yields ``(index, char, depth)`` for every character outside quotes;
  ``depth`` counts the brackets open around it (a closing bracket is counted
  as already closed)."""
  depth, quote, i = 0, None, start
  while i < len(text):
    c = text[i]
    if quote:
      if c == "\\":
        i += 1
      elif c == quote:
        quote = None
    elif c in "\"'":
      quote = c
    else:
      if c in ")}]":
        depth -= 1
      yield i, c, depth
      if c in _OPENERS:
        depth += 1
    i += 1


def _matching(text: str, start: int) -> int:
  """Index just past the bracket that closes ``text[start]`` (quote aware)."""
  for i, c, depth in _scan(text, start):
    if c in ")}]" and depth == 0:
      return i + 1
  return len(text)


def _split_top(text: str) -> list[str]:
  """Splits ``text`` at commas outside brackets and quotes."""
  parts, begin = [], 0
  for i, c, depth in _scan(text):
    if c == "," and depth == 0:
      parts.append(text[begin:i])
      begin = i + 1
  parts.append(text[begin:])
  return [p.strip() for p in parts if p.strip()]


def _parse_instruction(line: str, computation: str) -> _Instruction | None:
  body = line.strip()
  if body.startswith("ROOT "):
    body = body[5:].lstrip()
  name, eq, rest = body.partition("=")
  if not eq or not name.strip() or " " in name.strip():
    return None
  rest = rest.lstrip()
  if rest.startswith("("):
    end = _matching(rest, 0)
  else:
    end = len(rest.split(" ", 1)[0])
  type_text, rest = rest[:end], rest[end:].lstrip()
  match = re.match(r"([A-Za-z][\w\-]*)\(", rest)
  if not match:
    return None
  open_at = match.end() - 1
  close_at = _matching(rest, open_at)
  operands = [
      token.split()[-1].lstrip("%") for token in _split_top(rest[open_at + 1 : close_at - 1])
  ]
  attrs = {}
  for part in _split_top(rest[close_at:]):
    key, _, value = part.partition("=")
    attrs[key.strip()] = value.strip()
  return _Instruction(
      name.strip().lstrip("%"), type_text, match.group(1), operands, attrs, computation
  )


def _parse_module(text: str) -> _Module:
  text = _COMMENT.sub("", text)
  header = re.search(r"^HloModule\s+(\S+?),?(\s.*)?$", text, re.MULTILINE)
  head = header.group(0) if header else ""
  replicas = re.search(r"\breplica_count=(\d+)", head)
  partitions = re.search(r"\bnum_partitions=(\d+)", head)
  computations: dict[str, list[_Instruction]] = {}
  entry, current = None, None
  for line in text.splitlines():
    if not line.strip():
      continue
    if not line[0].isspace():
      current = None
      stripped = line.strip()
      if stripped.endswith("{") and not stripped.startswith("HloModule"):
        words = stripped.split()
        is_entry = words[0] == "ENTRY"
        current = (words[1] if is_entry else words[0]).lstrip("%")
        computations[current] = []
        if is_entry:
          entry = current
      continue
    if current is not None:
      instruction = _parse_instruction(line, current)
      if instruction is not None:
        computations[current].append(instruction)
  if entry is None:
    raise ValueError(
        "`hlo_text` has no ENTRY computation; pass the text of one HLO module, "
        "e.g. jax.jit(f).lower(*args).compile().as_text()."
    )
  by_name = {i.name: i for instrs in computations.values() for i in instrs}
  done_of = {}
  for instruction in by_name.values():
    if instruction.opcode.endswith("-done") and instruction.operands:
      done_of[instruction.operands[0]] = instruction
  return _Module(
      name=header.group(1) if header else "",
      replica_count=int(replicas.group(1)) if replicas else 1,
      num_partitions=int(partitions.group(1)) if partitions else 1,
      entry=entry,
      computations=computations,
      by_name=by_name,
      done_of=done_of,
  )


# ----------------------------------------------------------------------------
# Walking the call graph.


def _called(value: str) -> list[str]:
  return re.findall(r"%?([^\s{},%]+)", value)


def _trip_count(instruction: _Instruction) -> int | None:
  config = instruction.attrs.get("backend_config", "")
  match = re.search(r"known_trip_count\W*n\W*(\d+)", config)
  return int(match.group(1)) if match else None


def _walk(module: _Module) -> Iterator[CollectiveOp]:
  """Yields the collectives reached from ENTRY, with their execution counts."""

  def visit(computation: str, times: int, notes: tuple[str, ...], depth: int):
    if depth > 64 or computation not in module.computations:
      return
    for instruction in module.computations[computation]:
      opcode = instruction.opcode
      base = opcode.removesuffix("-start")
      if base in KINDS:
        yield _collective(module, instruction, base, times, notes)
      elif opcode == "while":
        trip = _trip_count(instruction)
        inner = notes
        if trip is None:
          trip = 1
          inner = notes + (f"in while %{instruction.name} of unknown trip count: counted once",)
        for body in _called(instruction.attrs.get("body", "")):
          yield from visit(body, times * trip, inner, depth + 1)
        for cond in _called(instruction.attrs.get("condition", "")):
          yield from visit(cond, times * (trip + 1), inner, depth + 1)
      elif opcode == "conditional":
        if "branch_computations" in instruction.attrs:
          branches = _called(instruction.attrs["branch_computations"])
        else:
          branches = [
              name
              for key in ("true_computation", "false_computation")
              for name in _called(instruction.attrs.get(key, ""))
          ]
        for k, branch in enumerate(branches):
          note = (
              f"branch {k} of {len(branches)} of conditional %{instruction.name} "
              "(every branch counted)"
          )
          yield from visit(branch, times, notes + (note,), depth + 1)
      elif opcode in ("fusion", "async-start"):
        for callee in _called(instruction.attrs.get("calls", "")):
          yield from visit(callee, times, notes, depth + 1)
      elif opcode == "call":
        for callee in _called(instruction.attrs.get("to_apply", "")):
          yield from visit(callee, times, notes, depth + 1)

  yield from visit(module.entry, 1, (), 0)


# ----------------------------------------------------------------------------
# One collective: shape, group and bytes.


def _element_bits(dtype: str) -> int | None:
  if dtype == "pred":
    return 8
  if dtype in ("token", "opaque"):
    return 0
  if dtype == "bf16":
    return 16
  match = re.fullmatch(r"[suf](\d+)|c(\d+)|f(\d+)e\d+m\d+\w*", dtype)
  if not match:
    return None
  return int(next(g for g in match.groups() if g))


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
  arrays = []
  for dtype, dims_text in _ARRAY.findall(type_text):
    dims = dims_text.replace("<=", "").split(",")
    shape = tuple(int(d) for d in dims if d.strip().isdigit())
    arrays.append((dtype, shape))
  return arrays


def _nbytes(arrays: list[tuple[str, tuple[int, ...]]]) -> tuple[int, bool]:
  """Total bytes, and whether every element type was known."""
  total_bits, known = 0, True
  for dtype, shape in arrays:
    bits = _element_bits(dtype)
    if bits is None:
      known = False
      continue
    total_bits += math.prod(shape) * bits
  return (total_bits + 7) // 8, known


def _groups(
    module: _Module, instruction: _Instruction, kind: str
) -> tuple[int, int]:
  """(devices in the largest group, number of groups) of a collective."""
  attrs = instruction.attrs
  devices = module.replica_count * module.num_partitions
  if kind == "collective-permute":
    pairs = re.findall(r"\{\s*\d+\s*,\s*\d+\s*\}", attrs.get("source_target_pairs", ""))
    return len(pairs), 1
  value = attrs.get("replica_groups", "{}")
  if value.startswith("mesh["):
    return _mesh_groups(value, attrs.get("device_ids", ""))
  if value.startswith("maximal_mesh"):
    return 1, devices
  iota = re.match(r"\[(\d+),(\d+)\]<=", value)
  if iota:
    return int(iota.group(2)), int(iota.group(1))
  listed = [g for g in re.findall(r"\{([\d,\s]*)\}", value[1:-1]) if g.strip()]
  has_channel = "channel_id" in attrs
  global_ids = attrs.get("use_global_device_ids") == "true"
  # XLA's CollectiveOpGroupMode decides what the listed ids mean.
  if kind in ("all-to-all", "collective-broadcast") and has_channel:
    per_group_factor, everyone = 1, module.num_partitions  # cross-partition
  elif not has_channel:
    per_group_factor, everyone = 1, module.replica_count  # cross-replica
  elif global_ids:
    per_group_factor, everyone = 1, devices  # flattened ids
  else:
    per_group_factor, everyone = module.num_partitions, devices  # replica x partition
  if not listed:
    return everyone, max(devices // max(everyone, 1), 1)
  largest = max(len([d for d in g.split(",") if d.strip()]) for g in listed)
  return largest * per_group_factor, len(listed)


def _group_members(
    module: _Module, instruction: _Instruction, kind: str
) -> tuple[tuple[int, ...], ...] | None:
  """The device positions of each group, where the HLO's ids are positions (else None).

  Listed (``{{0,4},{1,5}}``) and iota (``[4,2]<=[2,4]T(1,0)``) replica groups; ids are
  device positions in flattened-id mode, and in cross-partition (cross-replica) mode when
  the program has one replica (partition): XLA's CollectiveOpGroupMode, as ``_groups``.
  """
  attrs = instruction.attrs
  devices = module.replica_count * module.num_partitions
  has_channel = "channel_id" in attrs
  if attrs.get("use_global_device_ids") == "true":
    positions = True
  elif kind in ("all-to-all", "collective-broadcast") and has_channel:
    positions = module.replica_count == 1
  elif not has_channel:
    positions = module.num_partitions == 1
  else:
    positions = False  # replica x partition: the listed ids are replicas
  value = attrs.get("replica_groups", "{}")
  if not positions or value.startswith("maximal_mesh"):
    return None
  if value.startswith("mesh["):
    return _mesh_members(value, attrs.get("device_ids", ""), devices)
  iota = re.fullmatch(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", value.strip())
  if iota:
    ids = _iota(iota.group(3), iota.group(4))
    groups = ids.reshape(int(iota.group(1)), int(iota.group(2))).tolist()
  else:
    listed = re.findall(r"\{([\d,\s]*)\}", value[1:-1]) if value.startswith("{") else None
    if listed is None:
      return None
    groups = [[int(d) for d in g.split(",") if d.strip()] for g in listed]
    groups = [g for g in groups if g] or [list(range(devices))]
  if any(d >= devices for g in groups for d in g):
    return None
  return tuple(tuple(int(d) for d in g) for g in groups)


def _iota(dims: str, perm: str | None) -> np.ndarray:
  """XLA's iota device list ``[dims]T(perm)``: ``arange`` in the shape ``dims``, transposed
  by ``perm`` when given."""
  shape = [int(d) for d in dims.split(",") if d.strip()]
  ids = np.arange(math.prod(shape)).reshape(shape)
  return ids.transpose([int(d) for d in perm.split(",") if d.strip()]) if perm else ids


def _mesh_axes(value: str, device_ids: str
               ) -> tuple[dict[str, int], list[tuple[str, tuple[int, int] | None]], str]:
  """XLA's mesh-axes replica groups, ``mesh['a'=2,'b'=4], device_ids=(...) {'a':(1)2}``,
  read: ``{axis: size}`` in the mesh's order, the axes of a group as ``(axis, (pre, size))``
  for a sub-axis or ``(axis, None)`` for a whole one, and the text between the mesh and
  the braces (``device_ids=(...)``, whose attribute the HLO parser may split off)."""
  head, _, rest = value.partition("]")
  sizes = {name: int(n) for name, n in re.findall(r"'?([^',\[\]=\s]+)'?\s*=\s*(\d+)", head)}
  tail = rest + " " + device_ids
  braces = re.search(r"\{([^}]*)\}", tail)
  refs = []
  for ref in _split_top(braces.group(1) if braces else ""):
    sub = re.search(r":\((\d+)\)(\d+)", ref)
    refs.append((ref.split(":")[0].strip().strip("'\""),
                 (int(sub.group(1)), int(sub.group(2))) if sub else None))
  # device_ids=(...): before the braces, whose sub-axes ('a':(2)2) hold parentheses too
  return sizes, refs, tail.split("{", 1)[0]


def _mesh_members(value: str, device_ids: str, devices: int
                  ) -> tuple[tuple[int, ...], ...] | None:
  """The groups of ``mesh['a'=2,'b'=4], device_ids=(...) {'b'}`` (XLA's mesh-axes form).

  The mesh's device ids are iota in its shape unless ``device_ids`` gives them (iota
  reshaped and transposed, ``[2,2,2]T(0,2,1)``, or listed); a group holds the devices
  that differ only along the named axes. A sub-axis ``'a':(k)m`` is the middle factor of
  axis ``a`` split major-to-minor into ``(k, m, size/(k*m))``. None where the text is not
  of that form.
  """
  by_name, named_refs, before = _mesh_axes(value, device_ids)
  names, sizes = list(by_name), list(by_name.values())
  if not sizes or math.prod(sizes) != devices:
    return None
  given = re.search(r"\(([^()]*(?:\([^()]*\))?)\)", before)
  iota = given and re.fullmatch(r"\s*\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?\s*", given.group(1))
  if iota:  # iota in these dims, transposed: [2,2,2]T(0,2,1)
    ids = _iota(iota.group(1), iota.group(2))
  elif given:  # listed ids
    ids = np.array([int(d) for d in re.findall(r"\d+", given.group(1))])
  else:
    ids = np.arange(devices)
  if ids.size != devices or sorted(ids.ravel().tolist()) != list(range(devices)):
    return None
  refs = []
  for name, sub in named_refs:
    if name not in names:
      return None
    axis = names.index(name)
    pre, size = sub or (1, sizes[axis])
    if sizes[axis] % (pre * size):
      return None
    refs.append((axis, pre, pre * size))
  # Split every axis at its sub-axes' bounds into factors, major to minor.
  factors, named = [], []
  for axis, size in enumerate(sizes):
    bounds = sorted({1, size} | {b for a, lo, hi in refs if a == axis for b in (lo, hi)})
    for lo, hi in zip(bounds, bounds[1:]):
      factors.append(hi // lo)
      named.append(any(a == axis and r_lo <= lo and hi <= r_hi for a, r_lo, r_hi in refs))
  grid = ids.reshape(factors)
  inside = [i for i, n in enumerate(named) if n]
  outside = [i for i, n in enumerate(named) if not n]
  group = math.prod(factors[i] for i in inside)
  members = grid.transpose(outside + inside).reshape(-1, group)
  return tuple(tuple(int(d) for d in g) for g in members)


def _mesh_groups(value: str, device_ids: str) -> tuple[int, int]:
  """Group size of ``mesh['a'=2,'b'=4] {'b'}`` (sub-axes ``'a':(1)2``)."""
  sizes, refs, _ = _mesh_axes(value, device_ids)
  group = math.prod(sub[1] if sub else sizes.get(name, 1) for name, sub in refs)
  total = math.prod(sizes.values()) if sizes else group
  return group, max(total // max(group, 1), 1)


def _collective(
    module: _Module,
    instruction: _Instruction,
    kind: str,
    times: int,
    notes: tuple[str, ...],
) -> CollectiveOp:
  notes = list(notes)
  result = instruction
  if instruction.opcode.endswith("-start"):
    done = module.done_of.get(instruction.name)
    if done is not None:
      result = done  # the -done's type is the op's result
    else:
      notes.append("no matching -done: bytes from the -start's type")
  arrays = _arrays(result.type_text)
  nbytes, known = _nbytes(arrays)
  if not known:
    notes.append("unknown element type counted as 0 bytes")
  n, num_groups = _groups(module, instruction, kind)
  spec = specs.BY_HLO_KIND.get(kind)  # None: collective-permute
  size = spec.size_from_result(nbytes, n) if spec else nbytes
  if spec is not None:  # S times the collective's busbw factor
    sent = spec.busbw_factor(n) * size if n else 0.0
  else:  # collective-permute: S per sending device
    sent = float(size) if n else 0.0
  in_place = kind in (specs.PPERMUTE_HLO_KIND, "collective-broadcast")
  if in_place and "slice_sizes" in instruction.attrs:
    notes.append("in-place collective-permute: bytes of the whole output buffer")
  dtypes = list(dict.fromkeys(dtype for dtype, _ in arrays))
  shapes = tuple(shape for _, shape in arrays)
  is_tuple = result.type_text.startswith("(")
  return CollectiveOp(
      kind=kind,
      dtype=",".join(dtypes),
      shape=shapes if is_tuple else (shapes[0] if shapes else ()),
      group_size=n,
      num_groups=num_groups,
      executions=times,
      size_bytes=size,
      bytes_sent_per_device=float(sent),
      name=instruction.name,
      computation=instruction.computation,
      note="; ".join(notes),
      senders=_permute_sources(instruction) if kind == "collective-permute" else None,
      groups=(_permute_pairs(module, instruction) if kind == "collective-permute"
              else _group_members(module, instruction, kind)),
  )


def _permute_pairs(module: _Module, instruction: _Instruction) -> tuple[tuple[int, ...], ...] | None:
  """The (source, target) pairs, where their ids are device positions (else None)."""
  if module.replica_count > 1 and module.num_partitions > 1:
    return None
  pairs = re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}",
                     instruction.attrs.get("source_target_pairs", ""))
  return tuple((int(s), int(t)) for s, t in pairs)


def _permute_sources(instruction: _Instruction) -> tuple[int, ...]:
  pairs = re.findall(r"\{\s*(\d+)\s*,\s*\d+\s*\}", instruction.attrs.get("source_target_pairs", ""))
  return tuple(sorted({int(p) for p in pairs}))


# ----------------------------------------------------------------------------
# Formatting.


def _shape_to_json(shape: tuple) -> list:
  return [_shape_to_json(s) if isinstance(s, tuple) else s for s in shape]


def _format_shape(shape: tuple) -> str:
  if shape and isinstance(shape[0], tuple):
    parts = [_format_shape(s) for s in shape]
    if len(set(parts)) == 1:
      return f"{len(parts)}x{parts[0]}"
    return "(" + ", ".join(parts) + ")"
  return "[" + ",".join(str(d) for d in shape) + "]"


def _format_bytes(value: float) -> str:
  if float(value).is_integer():
    return f"{int(value):,}"
  return f"{value:,.1f}"
