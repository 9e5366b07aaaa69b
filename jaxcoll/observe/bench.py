"""nccl-tests-style benchmark harness shared by every collective.

One harness does what every collective shares: the size sweep, the inputs,
warm-up, timing, the check against :mod:`jaxcoll.collectives.reference`, the
table and the JSON / CSV / PNG outputs. Each collective only contributes a
:class:`CollectiveSpec`: how to run it, beside its entry of the one spec table
(:mod:`jaxcoll.collectives.specs`, as nccl-tests' ``struct testColl``): how
many elements each rank sends for a size, its busbw factor and its numpy
reference.

Conventions (nccl-tests ``doc/PERFORMANCE.md``):

* ``size`` is the largest buffer in bytes (the ``all_gather`` output, the
  ``reduce_scatter`` input, the whole buffer otherwise); ``count`` is that
  buffer in elements. A requested size rounds down as nccl-tests rounds it
  (whole elements; whole 16-byte chunks per rank where the buffer is split),
  so that a sweep's rows are nccl-tests' rows (:func:`element_count`).
* ``algbw = size / time``; ``busbw = algbw * bus_bandwidth_factor`` (see
  :func:`jaxcoll.cost.bus_bandwidth_factor`), comparable to the link speed
  whatever the device count. GB/s are 1e9 bytes per second.
* ``#wrong`` counts the output elements (all ranks together) that differ from
  the numpy reference: exactly for integers, max / min and data movement,
  within a relative tolerance for float sums (1e-5 float32, 1e-3 float16,
  1e-2 bfloat16, 1e-12 float64); an output of another dtype or shape is wrong
  in every element. Inputs are small integers (-5..5) stored in the dtype
  (negative ones wrap in unsigned dtypes, so their sums wrap as in NCCL), so
  float sums are exact for every algorithm whatever the order of addition.
* 64-bit dtypes (:data:`X64_DTYPES`) run inside ``jax.enable_x64(True)``,
  their cases only: JAX's default (x64 off) would make them 32-bit.

Timing: one jitted ``shard_map`` program per (algorithm, size), compiled
ahead, ``warmup_iters`` calls, then ``iters`` timed calls, in one of two
modes (:data:`TIMING_MODES`, chosen per platform by :func:`timing_mode`, named
in the table header):

* ``back_to_back`` (GPU, TPU), as nccl-tests: the ``iters`` calls are
  launched back to back, one sync at the end, ``time`` = elapsed / iters.
* ``one_in_flight`` (XLA:CPU): every call is waited for before the next one
  starts and ``time`` is the median call. On the XLA CPU backend dozens of
  executions with collectives in flight at once abort the process
  (rendezvous timeout after 40 s, measured; see BUILD.md), so the bound is
  one call in flight, and the time includes one dispatch (tens of
  microseconds on CPU).

In both, the time of a row is the slowest process's (max over processes, as
nccl-tests reduces its timers across ranks).

In-place (``run_benchmark(in_place=True)``, the CLI's default), as nccl-tests'
second group of columns: the program's input is donated
(``jax.jit(..., donate_argnums=0)``) and the result is written into that one
buffer, laid out as nccl-tests lays it out: ``all_gather`` reads its chunk at
offset ``rank * count / n`` of the output-sized buffer, ``reduce_scatter``
writes its chunk at that offset of the input-sized buffer, the others
overwrite the buffer. The timed calls are chained (each call's output is the
next call's buffer), as nccl-tests reruns on the same buffers; the check is of
one call on a fresh buffer. The row's ``in_place_*`` fields hold the result.

Example:
  >>> rows = jaxcoll.bench.run_benchmark(  # doctest: +SKIP
  ...     "all_reduce", ["native", "ring"], jaxcoll.bench.size_sweep(4096, 1 << 20, 4))
  >>> print(jaxcoll.bench.format_table(rows))  # doctest: +SKIP
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
import re
import statistics
import textwrap
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll import checks, collectives
from jaxcoll.runtime import devices
from jaxcoll.observe import metrics
from jaxcoll.collectives import specs
from jaxcoll.comm_model.cost import bus_bandwidth_factor
from jaxcoll.sizes import format_bytes, human_bytes, parse_size

DTYPES = {  # nccl-tests' -d types (src/common.cu test_typenames), by numpy's names
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "float64": jnp.float64,
    "int8": jnp.int8,  # integer sums wrap (two's complement), in numpy's reference too
    "uint8": jnp.uint8,
    "int32": jnp.int32,
    "uint32": jnp.uint32,
    "int64": jnp.int64,
    "uint64": jnp.uint64,
}
# 64-bit dtypes: JAX has them only with `jax_enable_x64` (off by default, when it would
# silently make int64 int32); run_benchmark turns it on around their cases alone.
X64_DTYPES = ("float64", "int64", "uint64")
# nccl-tests' -d / -o names that differ from ours (its src/common.cu test_typenames,
# test_opnames; char and int are its names before NCCL 2.0): the CLI maps them.
NCCL_DTYPES = {"float": "float32", "half": "float16", "double": "float64", "int": "int32",
               "char": "int8"}
NCCL_OPS = {"avg": "mean"}
# Relative tolerance of float sums (and means) against the float64 reference.
RTOL = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-2, "float64": 1e-12}
OPS = collectives.OPS
TIMING_MODES = ("back_to_back", "one_in_flight")
_TIMING_HEADERS = {
    "back_to_back": "iters launched back to back, one sync, mean (as nccl-tests)",
    "one_in_flight": "XLA:CPU, one call in flight (each call waited for), median",
}


# ------------------------------------------------------------------ per-collective specs


@dataclasses.dataclass(frozen=True)
class CollectiveSpec:
  """What the harness needs to know about one collective.

  The facts (``reduces``, ``rooted``, ``divisible``, ``input_count``,
  ``reference``) are the collective's :class:`jaxcoll.collectives.specs.Spec`;
  the harness adds how to call it.

  Attributes:
    spec: the collective's entry of :data:`jaxcoll.collectives.specs.SPECS`.
    run: ``(x, axis_name, algorithm, op, root) -> y``, called inside
      ``shard_map`` on one rank's 1-D input.
  """

  spec: specs.Spec
  run: Callable[..., jax.Array]

  @property
  def reduces(self) -> bool:
    """Takes an ``op`` (the table shows ``redop``; else ``none``)."""
    return self.spec.reduces

  @property
  def rooted(self) -> bool:
    """Takes a ``root`` (the table shows it; else ``-1``)."""
    return self.spec.rooted

  @property
  def divisible(self) -> bool:
    """The element count must be a multiple of the group size."""
    return self.spec.divisible

  def input_count(self, count: int, n: int) -> int:
    """Elements of each rank's input for a size of ``count`` elements."""
    return self.spec.input_count(count, n)

  def reference(self, xs, op, root) -> list[np.ndarray]:
    """Per-rank numpy outputs."""
    return self.spec.reference(xs, op, root)


_RUN: dict[str, Callable[..., jax.Array]] = {
    "all_reduce": lambda x, ax, algo, op, root: collectives.all_reduce(
        x, ax, op=op, algorithm=algo),
    "reduce_scatter": lambda x, ax, algo, op, root: collectives.reduce_scatter(
        x, ax, op=op, algorithm=algo),
    "all_gather": lambda x, ax, algo, op, root: collectives.all_gather(x, ax, algorithm=algo),
    "broadcast": lambda x, ax, algo, op, root: collectives.broadcast(
        x, ax, root=root, algorithm=algo),
    "reduce": lambda x, ax, algo, op, root: collectives.reduce(
        x, ax, root=root, op=op, algorithm=algo),
    "all_to_all": lambda x, ax, algo, op, root: collectives.all_to_all(
        x, ax, 0, 0, algorithm=algo),
}

SPECS: dict[str, CollectiveSpec] = {
    name: CollectiveSpec(spec=specs.SPECS[name], run=run) for name, run in _RUN.items()
}


@dataclasses.dataclass(frozen=True)
class Row:
  """One line of the table: one (collective, algorithm, size) measurement.

  ``wrong`` is None when the check was skipped; ``root`` is -1 and ``redop``
  ``"none"`` for collectives without them (as nccl-tests prints). ``time_us``,
  ``algbw_gbps``, ``busbw_gbps`` and ``wrong`` are nccl-tests' out-of-place
  columns; the ``in_place_*`` fields its in-place ones (the input buffer donated
  and the result written into it, see :func:`run_benchmark`), None when not
  measured.
  """

  collective: str
  algorithm: str
  size_bytes: int
  count: int
  dtype: str
  redop: str
  root: int
  time_us: float
  algbw_gbps: float
  busbw_gbps: float
  wrong: int | None
  # nccl-tests' in-place columns (None when not measured, see ``run_benchmark(in_place=)``).
  in_place_time_us: float | None = None
  in_place_algbw_gbps: float | None = None
  in_place_busbw_gbps: float | None = None
  in_place_wrong: int | None = None


# ------------------------------------------------------------------ sizes


MAX_SWEEP_SIZES = 1024  # sizes of one sweep: each is compiled and run per algorithm


def size_sweep(min_bytes: int | str, max_bytes: int | str, step_factor: int = 2, *,
               step_bytes: int | str | None = None) -> list[int]:
  """``min_bytes, min_bytes * step_factor, ...`` up to ``max_bytes`` (nccl-tests ``-b -e -f``),
  or ``min_bytes, min_bytes + step_bytes, ...`` (nccl-tests ``-i``) when ``step_bytes`` is given.

  Raises:
    ValueError: a bad size, ``min_bytes > max_bytes``, ``step_factor < 2``, or a sweep of
      more than :data:`MAX_SWEEP_SIZES` sizes.
  """
  lo, hi = parse_size(min_bytes, "min_bytes"), parse_size(max_bytes, "max_bytes")
  if lo > hi:
    raise ValueError(
        f"`min_bytes` ({human_bytes(lo)}) must not exceed `max_bytes` ({human_bytes(hi)})."
    )
  if step_bytes is not None:
    step = parse_size(step_bytes, "step_bytes")
    count = (hi - lo) // step + 1
    if count > MAX_SWEEP_SIZES:
      raise ValueError(
          f"`step_bytes` {human_bytes(step)} from {human_bytes(lo)} to {human_bytes(hi)} is "
          f"{count} sizes, each compiled and run; at most {MAX_SWEEP_SIZES}: use a step of "
          f"{human_bytes(1 << (-(-(hi - lo) // (MAX_SWEEP_SIZES - 1)) - 1).bit_length())} or "
          "more, or a step_factor sweep."
      )
    return list(range(lo, hi + 1, step))
  checks.positive_int(step_factor, "step_factor", minimum=2)
  sizes = [lo]
  while sizes[-1] * step_factor <= hi:
    sizes.append(sizes[-1] * step_factor)
  return sizes


# nccl-tests' chunk of each rank where a collective splits its buffer between the ranks
# (all_gather, reduce_scatter, alltoall: ``base = (count/nranks) & ~(16/eltSize - 1)``).
SPLIT_ALIGN_BYTES = 16


def element_count(collective: str, size_bytes: int, n: int, dtype: str) -> int:
  """Elements of ``collective``'s largest buffer for a requested size, as nccl-tests counts.

  Rounds down, as nccl-tests (``src/common.cu`` ``setupArgs``: ``count = size /
  wordSize``): to whole elements, and where the collective splits its buffer
  between the ``n`` ranks (``all_gather``, ``reduce_scatter``, ``all_to_all``)
  to whole chunks of :data:`SPLIT_ALIGN_BYTES` per rank (its ``(count / nranks)
  & ~(16 / eltSize - 1)``). So a sweep's sizes and counts are nccl-tests' own.

  Returns:
    The count; 0 where the size holds none (nccl-tests prints such a row with
    size 0; :func:`cases` leaves it out, see :func:`smallest_size`).
  """
  itemsize = np.dtype(_dtype(dtype)).itemsize
  count = size_bytes // itemsize
  if SPECS[collective].divisible:
    align = max(1, SPLIT_ALIGN_BYTES // itemsize)
    count = (count // n) // align * align * n
  return count


def smallest_size(collective: str, n: int, dtype: str) -> int:
  """The smallest size in bytes that :func:`element_count` gives a nonzero count."""
  itemsize = np.dtype(_dtype(dtype)).itemsize
  if not SPECS[collective].divisible:
    return itemsize
  return max(1, SPLIT_ALIGN_BYTES // itemsize) * itemsize * n


def left_out_sizes(collective: str, sizes: Sequence[int | str], n: int, dtype: str) -> list[int]:
  """The ``sizes`` (in bytes) that hold no element of ``collective`` (below
  :func:`smallest_size`): :func:`cases` leaves them out."""
  return [s for s in (parse_size(x, "size") for x in sizes)
          if element_count(collective, s, n, dtype) == 0]


# ------------------------------------------------------------------ argument checks


def _spec(collective: str) -> CollectiveSpec:
  return SPECS[collectives.check_collective(collective)]


def _dtype(dtype: str):
  if dtype not in DTYPES:
    raise ValueError(f"Unknown `dtype` {dtype!r}; valid choices: {', '.join(DTYPES)}.")
  return DTYPES[dtype]


def ops_for(dtype: str) -> tuple[str, ...]:
  """The reduction ops the benchmark runs for ``dtype`` (``mean`` needs a float).

  Raises:
    ValueError: an unknown ``dtype``.
  """
  return tuple(o for o in OPS if o != "mean" or jnp.issubdtype(_dtype(dtype), jnp.inexact))


def check_op(op: str, dtype: str) -> None:
  """Raises ValueError for an unknown op or one that makes no sense for ``dtype``."""
  valid = ops_for(dtype)
  if op not in OPS:
    raise ValueError(f"Unknown `op` {op!r}; valid choices: {', '.join(OPS)}.")
  if op not in valid:
    raise ValueError(
        f"`op`={op!r} needs a floating dtype, got {dtype}; valid ops for {dtype}: "
        f"{', '.join(valid)}."
    )


def applicable_algorithms(collective: str, num_axes: int) -> tuple[str, ...]:
  """Registered algorithms of ``collective`` that run over ``num_axes`` axes, minus auto."""
  names = [a for a in collectives.algorithms(collective) if a != "auto"]
  return tuple(a for a in names if a != "hierarchical" or num_axes >= 2)


def resolve_algorithms(
    collective: str, requested: str | Sequence[str], num_axes: int
) -> tuple[str, ...]:
  """Expands ``"all"`` and checks each name against ``collective``'s registry.

  Args:
    collective: a collective name.
    requested: ``"all"``, a comma-separated string or a sequence of names
      (``"auto"`` allowed).
    num_axes: mesh axes the collective runs over; ``hierarchical`` needs >= 2
      and is left out of ``"all"`` on a one-axis mesh.

  Raises:
    ValueError: an unknown name, or ``hierarchical`` on one axis.
  """
  collectives.check_collective(collective)
  names = _split_names(requested)
  if names == ["all"]:
    return applicable_algorithms(collective, num_axes)
  valid = collectives.algorithms(collective)
  for name in names:
    if name not in valid:
      raise ValueError(
          f"Unknown {collective} `algorithm` {name!r}; valid choices: "
          f"{', '.join(valid)}, or all."
      )
    if name == "hierarchical" and num_axes < 2:
      raise ValueError(
          "`algorithm`='hierarchical' needs a mesh of >= 2 axes, e.g. "
          "--mesh_shape=2,4 --mesh_axes=node,local; the mesh has one axis."
      )
  return tuple(dict.fromkeys(names))


def _split_names(requested: str | Sequence[str]) -> list[str]:
  if isinstance(requested, str):
    requested = requested.split(",")
  names = [str(a).strip() for a in requested if str(a).strip()]
  if not names:
    raise ValueError("`algorithms` is empty; name at least one algorithm, or all.")
  return names


def _axes(mesh: Mesh, axis_name: Hashable | Sequence[Hashable] | None) -> tuple[str, ...]:
  if axis_name is None:
    return tuple(mesh.axis_names)
  axes = checks.axis_names(axis_name)
  missing = [a for a in axes if a not in mesh.axis_names]
  if not axes or missing:
    raise ValueError(
        f"`axis_name` {axis_name!r} must name axes of the mesh; valid axes: "
        f"{', '.join(map(str, mesh.axis_names))}."
    )
  return axes


# ------------------------------------------------------------------ inputs and check


def rank_input(rank: int, length: int, dtype: str) -> np.ndarray:
  """Deterministic input of ``rank``: small integers in -5..5, hashed from (rank, i).

  Not periodic in ``i`` (a misplaced chunk is caught) and different on every
  rank (a wrong root or source is caught); sums stay exact in float dtypes.
  """
  mask = np.uint64(0xFFFFFFFF)
  h = np.arange(length, dtype=np.uint64) * np.uint64(0x9E3779B1)
  h = (h + np.uint64((rank + 1) * 0x85EBCA77)) & mask
  h ^= h >> np.uint64(15)
  h = (h * np.uint64(0x2C1B3C6D)) & mask
  h ^= h >> np.uint64(13)
  return ((h % np.uint64(11)).astype(np.int64) - 5).astype(_dtype(dtype))


def count_wrong(got: np.ndarray, want: np.ndarray, *, exact: bool, dtype: str) -> int:
  """Elements of ``got`` that differ from ``want`` (all of them if the shapes or dtypes differ)."""
  got, want = np.asarray(got), np.asarray(want)
  if got.shape != want.shape or got.dtype != want.dtype:  # e.g. int64 made int32 without x64
    return int(want.size)
  if exact:
    return int(np.count_nonzero(got != want))
  g, w = got.astype(np.float64), want.astype(np.float64)
  bad = ~(np.abs(g - w) <= RTOL[dtype] * np.maximum(np.abs(w), 1.0))  # NaN is wrong
  return int(np.count_nonzero(bad))


def _to_host(out: jax.Array) -> np.ndarray:
  if out.is_fully_addressable:
    return np.asarray(out)
  return np.asarray(multihost_utils.process_allgather(out, tiled=True))


# ------------------------------------------------------------------ the harness


@dataclasses.dataclass(frozen=True)
class _Case:
  size_bytes: int
  count: int
  input_count: int


def cases(
    collective: str,
    algorithms: str | Sequence[str],
    sizes: Sequence[int],
    *,
    n: int,
    num_axes: int = 1,
    dtype: str = "float32",
    op: str = "sum",
    root: int = 0,
    iters: int = 20,
    warmup_iters: int = 5,
) -> tuple[tuple[str, ...], list[_Case]]:
  """Checks every argument of :func:`run_benchmark` without running anything.

  Returns:
    The algorithm names and the distinct cases (sizes rounded down to a valid
    element count as nccl-tests rounds them, see :func:`element_count`; sizes
    that hold none left out, :func:`left_out_sizes`).

  Raises:
    ValueError: any bad argument, with the valid choices.
  """
  spec = _spec(collective)
  algos = resolve_algorithms(collective, algorithms, num_axes)
  _dtype(dtype)
  check_op(op, dtype)
  if not checks.is_int(root) or not 0 <= root < n:
    raise ValueError(f"`root` must be a rank in 0..{n - 1} of the {n} devices; got {root!r}.")
  checks.positive_int(iters, "iters")
  checks.positive_int(warmup_iters, "warmup_iters", minimum=0)
  if not sizes:
    raise ValueError("`sizes` is empty; give at least one size in bytes.")
  by_count = {}
  itemsize = np.dtype(_dtype(dtype)).itemsize
  for size in sizes:
    count = element_count(collective, parse_size(size, "size"), n, dtype)
    if count:  # below smallest_size: left out (nccl-tests prints a row of size 0)
      by_count.setdefault(count, _Case(count * itemsize, count, spec.input_count(count, n)))
  if not by_count:
    smallest = smallest_size(collective, n, dtype)
    per_rank = (f", in {SPLIT_ALIGN_BYTES}-byte chunks per rank of {n}"
                if spec.divisible else "")
    raise ValueError(
        f"every size of the sweep ({', '.join(human_bytes(parse_size(x)) for x in sizes)} B) "
        f"is below {smallest} B, the smallest {collective} of {dtype} (sizes round down to "
        f"whole elements{per_rank}, as nccl-tests'); use sizes >= {smallest} B (-b/--min_bytes)."
    )
  todo = [by_count[c] for c in sorted(by_count)]
  check_memory(collective, todo[-1].size_bytes, n=n, dtype=dtype)
  return algos, todo


def memory_needed(collective: str, size_bytes: int, n: int) -> tuple[int, int]:
  """(host bytes, bytes per device) the largest case of a benchmark holds at once.

  A lower bound: every process builds all ``n`` ranks' inputs on the host and
  keeps their numpy reference and the result read back (one rank-sized
  buffer each, 8 B per element for the hash that makes the inputs); each
  device holds its input and output. On XLA:CPU the devices live in the
  host's memory too.
  """
  spec = _spec(collective).spec
  input_bytes = size_bytes // n if spec.gathers else size_bytes
  output_bytes = size_bytes // n if spec.scatters else size_bytes
  itemsize_hash = 8  # rank_input's uint64 hash of one rank's elements
  per_device = input_bytes + output_bytes
  host = n * (input_bytes + 2 * output_bytes) + input_bytes * itemsize_hash
  return host, per_device


def host_memory_bytes() -> int | None:
  """This host's physical memory in bytes (None where the OS does not say)."""
  try:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
    return None


def device_memory_bytes() -> int | None:
  """The first local device's ``bytes_limit`` (None where it reports none: XLA:CPU)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  limit = stats.get("bytes_limit")
  return int(limit) if limit else None


def check_tree_memory(total_bytes: int, n: int, *, host_bytes: int | None = None,
                 device_bytes: int | None = None) -> None:
  """Refuses a pytree (experiments.bench_pytree's) whose buffers cannot fit this machine,
  before anything is traced.

  Each device holds the tree, its result and the packed buffers (XLA's memory analysis of
  a ring all-reduce of 64 MB of 10 leaves: 64 MB of arguments, 64 of outputs, 61 of
  temporaries; tree's 107): at least 3 trees a device; on XLA:CPU the devices share the
  host's memory. ``--mbytes=1e7`` was XLA's RESOURCE_EXHAUSTED traceback (the host kills a
  process that only overcommits).

  Args:
    total_bytes: the tree's bytes per device.
    n: the devices.
    host_bytes, device_bytes: the memory to fit in; default this host's and the first
      device's (jaxcoll.bench.host_memory_bytes, device_memory_bytes).

  Raises:
    ValueError: one line naming ``--mbytes``, the memory needed and the largest that fits.
  """
  if jax.devices()[0].platform == "cpu":
    have = host_memory_bytes() if host_bytes is None else host_bytes
    copies, where = 3 * n, f"this host's memory (the {n} CPU devices share it)"
  else:
    have = device_memory_bytes() if device_bytes is None else device_bytes
    copies, where = 3, "a device's memory"
  need = copies * total_bytes
  if have is None or need <= have:
    return
  raise ValueError(
      f"`--mbytes`={total_bytes / 2**20:g}: a tree of {format_bytes(total_bytes)} a device "
      f"needs at least {format_bytes(need)} for the tree, its result and the packed buffers "
      f"of each device, in {where}, but there are {format_bytes(have)}; use --mbytes of at most "
      f"{math.floor(have / copies / 2**20 * 100) / 100:g}.")



def check_memory(collective: str, size_bytes: int, *, n: int, dtype: str,
                 host_bytes: int | None = None, device_bytes: int | None = None) -> None:
  """Refuses a size whose buffers cannot fit this machine, before anything runs.

  Args:
    collective: a collective name.
    size_bytes: the largest size of the sweep (nccl-tests' ``size``).
    n: the group size.
    dtype: a key of ``DTYPES``.
    host_bytes, device_bytes: the memory to fit in; default this host's
      physical memory and the first local device's ``bytes_limit`` (where
      the device reports one). On XLA:CPU the local devices share the host's.

  Raises:
    ValueError: :func:`memory_needed` exceeds the memory, naming the largest size that fits.
  """
  host_need, device_need = memory_needed(collective, size_bytes, n)
  host_have = host_memory_bytes() if host_bytes is None else host_bytes
  cpu = jax.local_devices()[0].platform == "cpu"
  if cpu and host_have is not None:
    host_need += device_need * min(n, jax.local_device_count())
    have, need, where = host_have, host_need, "this host's memory"
  else:
    device_have = device_memory_bytes() if device_bytes is None else device_bytes
    over = [(h, nd, w) for h, nd, w in (
        (host_have, host_need, "this host's memory"),
        (device_have, device_need, "a device's memory")) if h is not None and nd > h]
    if not over:
      return
    have, need, where = over[0]
  if need <= have:
    return
  itemsize = np.dtype(_dtype(dtype)).itemsize
  raw = int(size_bytes * have / need)  # need grows linearly with the size
  fits = 1 << (raw.bit_length() - 1) if raw > 0 else 0  # a power of two, as sweeps are
  hint = (f"use sizes of at most {human_bytes(fits)} (-e/--max_bytes)"
          if fits >= itemsize * n else "this machine cannot hold it at any size")
  raise ValueError(
      f"size {format_bytes(size_bytes)} of {collective} ({dtype}, {n} devices) needs at "
      f"least {format_bytes(need)} of {where} for its buffers, inputs and reference, but "
      f"there are {format_bytes(have)}; {hint}."
  )


#: The old name of :func:`cases` (the same function).
plan = cases


def run_benchmark(
    collective: str,
    algorithms: str | Sequence[str],
    sizes: Sequence[int],
    *,
    dtype: str = "float32",
    op: str = "sum",
    root: int = 0,
    iters: int = 20,
    warmup_iters: int = 5,
    check: bool = True,
    mesh: Mesh | None = None,
    axis_name: Hashable | Sequence[Hashable] | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    in_place: bool = False,
) -> list[Row]:
  """Measures ``collective`` for every (size, algorithm); nccl-tests' table rows.

  Args:
    collective: one of ``SPECS`` (``jaxcoll.collectives.COLLECTIVES``).
    algorithms: names (or a comma-separated string) from
      ``jaxcoll.algorithms(collective)``, or ``"all"`` (every registered one
      that fits the mesh, without ``auto``).
    sizes: bytes of the largest buffer (ints or strings such as ``"64K"``);
      rounded down to a valid element count as nccl-tests rounds them (see
      :func:`element_count`; a row's ``size_bytes`` is the size used),
      duplicates and sizes that hold no element left out.
    dtype: a key of ``DTYPES``; a 64-bit one runs with ``jax_enable_x64`` on
      (``jax.enable_x64(True)`` around this call only).
    op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"`` (reductions only).
    root: root rank of ``broadcast`` / ``reduce``.
    iters: timed calls per (algorithm, size); ``time_us`` per call, see
      :func:`timing_mode` (mean back to back on accelerators, median on CPU).
    warmup_iters: untimed calls before them.
    check: compare the first call's output with the numpy reference.
    mesh: default one ``"data"`` axis over all devices.
    axis_name: axes the collective runs over; default all axes of ``mesh``
      (flattened row-major, one rank per device).
    progress: called as ``progress(done, total, what)`` before each case and
      once at the end.
    in_place: also measure nccl-tests' in-place variant (the buffer donated,
      see the module doc) into the rows' ``in_place_*`` fields.

  Returns:
    One :class:`Row` per (size, algorithm), sizes ascending.

  Raises:
    ValueError: a bad argument (checked before anything runs).
  """
  mesh = devices.flat_mesh() if mesh is None else mesh
  axes = _axes(mesh, axis_name)
  n = checks.axis_size(mesh, axes)
  _dtype(dtype)
  if dtype in X64_DTYPES and not jax.config.jax_enable_x64:
    with jax.enable_x64(True):  # else JAX makes the inputs 32-bit (with a warning)
      return run_benchmark(
          collective, algorithms, sizes, dtype=dtype, op=op, root=root, iters=iters,
          warmup_iters=warmup_iters, check=check, mesh=mesh, axis_name=axis_name,
          progress=progress, in_place=in_place)
  algos, todo = cases(
      collective, algorithms, sizes, n=n, num_axes=len(axes), dtype=dtype, op=op,
      root=root, iters=iters, warmup_iters=warmup_iters,
  )
  spec = SPECS[collective]
  factor = bus_bandwidth_factor(collective, n)
  group_axis = axes if len(axes) > 1 else axes[0]
  sharding = NamedSharding(mesh, P(group_axis))
  exact = not spec.reduces or op in ("max", "min") or dtype not in RTOL
  total, done = len(todo) * len(algos), 0
  rows = []
  for case in todo:
    host = np.stack([rank_input(r, case.input_count, dtype) for r in range(n)])
    x = jax.make_array_from_callback(host.shape, sharding, lambda idx, h=host: h[idx])
    want = spec.reference(list(host), op, root) if check else None
    for algo in algos:
      if progress is not None:
        progress(done, total, f"{collective} {algo} {human_bytes(case.size_bytes)}")
      seconds, first = _time(
          spec, x, mesh=mesh, group_axis=group_axis, algo=algo, op=op, root=root,
          iters=iters, warmup_iters=warmup_iters,
      )
      wrong = None
      if check:
        got = _to_host(first)
        wrong = sum(
            count_wrong(got[r], want[r], exact=exact, dtype=dtype) for r in range(n)
        )
      del first
      extra = {}
      if in_place:
        ip_seconds, ip_got = _time_in_place(
            collective, spec, host, sharding, mesh=mesh, group_axis=group_axis, algo=algo,
            op=op, root=root, iters=iters, warmup_iters=warmup_iters, check=check,
        )
        ip_algbw = case.size_bytes / ip_seconds / 1e9
        extra = dict(
            in_place_time_us=ip_seconds * 1e6, in_place_algbw_gbps=ip_algbw,
            in_place_busbw_gbps=ip_algbw * factor,
            in_place_wrong=None if ip_got is None else sum(
                count_wrong(ip_got[r], want[r], exact=exact, dtype=dtype) for r in range(n)),
        )
      algbw = case.size_bytes / seconds / 1e9
      rows.append(
          Row(
              collective=collective,
              algorithm=algo,
              size_bytes=case.size_bytes,
              count=case.count,
              dtype=dtype,
              redop=op if spec.reduces else "none",
              root=int(root) if spec.rooted else -1,
              time_us=seconds * 1e6,
              algbw_gbps=algbw,
              busbw_gbps=algbw * factor,
              wrong=wrong,
              **extra,
          )
      )
      done += 1
    del x
  if progress is not None:
    progress(done, total, f"{collective} done")
  return rows


def timing_mode(platform: str | None = None) -> str:
  """``"one_in_flight"`` on XLA:CPU, ``"back_to_back"`` elsewhere (see module doc).

  Args:
    platform: a JAX platform name (``"cpu"``, ``"gpu"``, ``"tpu"``, ...);
      default that of ``jax.devices()[0]``.
  """
  if platform is None:
    platform = jax.devices()[0].platform
  return "one_in_flight" if platform == "cpu" else "back_to_back"


def time_calls(call: Callable[[], jax.Array], *, iters: int, mode: str) -> float:
  """Seconds per call of ``call`` (already warmed up), measured in ``mode``.

  ``back_to_back``: ``iters`` calls launched without waiting, one sync, the
  mean. ``one_in_flight``: each call waited for, the median.

  Raises:
    ValueError: an unknown ``mode``.
  """
  if mode not in TIMING_MODES:
    raise ValueError(f"Unknown timing `mode` {mode!r}; valid modes: {', '.join(TIMING_MODES)}.")
  if mode == "back_to_back":
    start = time.perf_counter()
    outs = [call() for _ in range(iters)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - start) / iters
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    call().block_until_ready()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def slowest_process(seconds: float, gather: Callable[[np.ndarray], np.ndarray] | None = None
                    ) -> float:
  """The largest of every process's ``seconds`` (nccl-tests' reduction of its timers).

  Args:
    seconds: this process's time.
    gather: ``values -> stacked values of all processes``; default
      ``multihost_utils.process_allgather`` (identity in one process).
  """
  if gather is None:
    if jax.process_count() == 1:
      return float(seconds)
    gather = multihost_utils.process_allgather
  return float(np.max(gather(np.asarray([seconds], np.float64))))


def program(
    collective: str,
    algorithm: str,
    mesh: Mesh,
    axis_name: Hashable | Sequence[Hashable] | None = None,
    *,
    op: str = "sum",
    root: int = 0,
) -> Callable[[jax.Array], jax.Array]:
  """``jit(shard_map(...))`` of ``collective`` on each device's block of a 1-D array.

  The input and the output are sharded over ``axis_name`` (default all axes
  of ``mesh``), one block per device, as the benchmark and the demos run it.

  Example:
    >>> mesh = jaxcoll.devices.flat_mesh()  # doctest: +SKIP
    >>> f = jaxcoll.bench.program("all_reduce", "ring", mesh)  # doctest: +SKIP
    >>> f(jnp.ones(8 * 4))  # doctest: +SKIP
  """
  spec = _spec(collective)
  axes = _axes(mesh, axis_name)
  group_axis = axes if len(axes) > 1 else axes[0]
  pspec = P(group_axis)
  return jax.jit(jax.shard_map(
      lambda v: spec.run(v, group_axis, algorithm, op, root), mesh=mesh, in_specs=pspec,
      out_specs=pspec,
  ))


def _time(spec, x, *, mesh, group_axis, algo, op, root, iters, warmup_iters):
  """Seconds per call (the slowest process's), and the first call's output."""
  pspec = P(group_axis)

  def body(v):
    return spec.run(v[0], group_axis, algo, op, root)[None]

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=pspec, out_specs=pspec))
  compiled = fn.lower(x).compile()
  first = compiled(x)
  first.block_until_ready()
  for _ in range(warmup_iters - 1):
    compiled(x).block_until_ready()
  seconds = time_calls(lambda: compiled(x), iters=iters, mode=timing_mode())
  return slowest_process(seconds), first


def _in_place_buffer(collective: str, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
  """Each rank's in-place buffer, as nccl-tests lays it out (see the module doc).

  ``all_gather``: the output-sized buffer with the rank's input at offset
  ``rank * len(input)`` and filler (another rank-like sequence) elsewhere,
  which a correct algorithm never reads; every other collective: the input.
  """
  if collective != "all_gather":
    return [np.asarray(x) for x in inputs]
  n = len(inputs)
  out = []
  for r, chunk in enumerate(np.asarray(x) for x in inputs):
    buf = rank_input(n + r, n * chunk.size, chunk.dtype.name)
    buf[r * chunk.size:(r + 1) * chunk.size] = chunk
    out.append(buf)
  return out


def _in_place_result(collective: str, buffers: Sequence[np.ndarray]) -> list[np.ndarray]:
  """Each rank's result read from its in-place buffer: ``reduce_scatter``'s
  chunk at offset ``rank * len(buffer) / n``, the whole buffer otherwise."""
  if collective != "reduce_scatter":
    return [np.asarray(b) for b in buffers]
  n = len(buffers)
  chunk = len(buffers[0]) // n
  return [np.asarray(b)[r * chunk:(r + 1) * chunk] for r, b in enumerate(buffers)]


def _in_place_program(spec: CollectiveSpec, collective: str, *, mesh: Mesh, group_axis,
                      n: int, algo: str, op: str, root: int):
  """``jit(shard_map(...), donate_argnums=0)`` of one rank's in-place buffer (a row
  of a ``(n, length)`` array) to the same buffer with the result written in."""
  pspec = P(group_axis)

  def body(v):
    buf = v[0]
    if collective == "all_gather":
      chunk = buf.shape[0] // n
      own = lax.dynamic_slice_in_dim(buf, lax.axis_index(group_axis) * chunk, chunk)
      out = spec.run(own, group_axis, algo, op, root)
    elif collective == "reduce_scatter":
      part = spec.run(buf, group_axis, algo, op, root)
      out = lax.dynamic_update_slice_in_dim(
          buf, part, lax.axis_index(group_axis) * part.shape[0], 0)
    else:
      out = spec.run(buf, group_axis, algo, op, root)
    return out[None]

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=pspec, out_specs=pspec),
                 donate_argnums=0)


def _time_chained(step: Callable[[jax.Array], jax.Array], x: jax.Array, *, iters: int,
                 mode: str) -> tuple[float, jax.Array]:
  """Seconds per call of ``x = step(x)`` (``step`` donates its input), and the last ``x``.

  As :func:`time_calls`, except that each call consumes the previous one's
  output, so ``back_to_back`` waits for the last output only (the earlier
  ones are donated, and it depends on them).
  """
  if mode not in TIMING_MODES:
    raise ValueError(f"Unknown timing `mode` {mode!r}; valid modes: {', '.join(TIMING_MODES)}.")
  if mode == "back_to_back":
    start = time.perf_counter()
    for _ in range(iters):
      x = step(x)
    x.block_until_ready()
    return (time.perf_counter() - start) / iters, x
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    x = step(x)
    x.block_until_ready()
    times.append(time.perf_counter() - start)
  return statistics.median(times), x


def _time_in_place(collective, spec, host, sharding, *, mesh, group_axis, algo, op, root,
                   iters, warmup_iters, check):
  """Seconds per in-place call (the slowest process's), and each rank's checked
  result of one call on a fresh buffer (None without ``check``)."""
  buffers = np.stack(_in_place_buffer(collective, list(host)))

  def fresh():
    return jax.make_array_from_callback(buffers.shape, sharding, lambda idx: buffers[idx])

  fn = _in_place_program(spec, collective, mesh=mesh, group_axis=group_axis, n=len(host),
                         algo=algo, op=op, root=root)
  buf = fresh()
  compiled = fn.lower(buf).compile()
  buf = compiled(buf)
  got = _in_place_result(collective, list(_to_host(buf))) if check else None
  for _ in range(warmup_iters - 1):
    buf = compiled(buf)
    buf.block_until_ready()
  seconds, buf = _time_chained(compiled, buf, iters=iters, mode=timing_mode())
  del buf
  return slowest_process(seconds), got


# ------------------------------------------------------------------ outputs

_COLUMNS = (
    # header, unit, width, format of the Row field
    ("size", "(B)", 12, lambda r: f"{r.size_bytes}"),
    ("count", "(elements)", 12, lambda r: f"{r.count}"),
    ("type", "", 9, lambda r: r.dtype),
    ("redop", "", 6, lambda r: r.redop),
    ("root", "", 5, lambda r: f"{r.root}"),
    ("algorithm", "", -22, lambda r: r.algorithm),
    ("time", "(us)", 11, lambda r: f"{r.time_us:.1f}"),
    ("algbw", "(GB/s)", 8, lambda r: f"{r.algbw_gbps:.3f}"),
    ("busbw", "(GB/s)", 8, lambda r: f"{r.busbw_gbps:.3f}"),
    ("#wrong", "", 7, lambda r: "N/A" if r.wrong is None else f"{r.wrong}"),
)
_OUT_OF_PLACE = 6  # the first of _COLUMNS' out-of-place group (time, algbw, busbw, #wrong)


def _or_na(value, fmt: str) -> str:
  return "N/A" if value is None else format(value, fmt)


_IN_PLACE_COLUMNS = (  # nccl-tests' second group, the same four columns
    ("time", "(us)", 11, lambda r: _or_na(r.in_place_time_us, ".1f")),
    ("algbw", "(GB/s)", 8, lambda r: _or_na(r.in_place_algbw_gbps, ".3f")),
    ("busbw", "(GB/s)", 8, lambda r: _or_na(r.in_place_busbw_gbps, ".3f")),
    ("#wrong", "", 7, lambda r: _or_na(r.in_place_wrong, "d")),
)


def _cells(values: Sequence[str], columns=_COLUMNS) -> str:
  out = []
  for (_, _, width, _), v in zip(columns, values):
    out.append(v.ljust(-width) if width < 0 else v.rjust(width))
  return "  ".join(out).rstrip()


def _group_line(columns) -> str:
  """nccl-tests' line above the header: ``out-of-place`` and ``in-place``
  centred over their four columns."""
  lead = sum(abs(c[2]) + 2 for c in columns[:_OUT_OF_PLACE])
  width = sum(abs(c[2]) + 2 for c in _IN_PLACE_COLUMNS) - 2
  return ("#" + " " * (lead - 1) + "out-of-place".center(width) + "  "
          + "in-place".center(width)).rstrip()


def total_wrong(rows: Sequence[Row]) -> int | None:
  """Wrong elements over all rows (out-of-place and in-place), or None if none was checked."""
  checked = [w for r in rows for w in (r.wrong, r.in_place_wrong) if w is not None]
  return sum(checked) if checked else None


def format_table(
    rows: Sequence[Row], *, title: str | None = None, timing: str | None = None
) -> str:
  """nccl-tests-style table, one block per collective, with the footer.

  The header names the timing mode (``timing``, default :func:`timing_mode`
  of this platform); the footer gives the wrong-values verdict (``OK`` /
  ``FAILED``) and the average bus bandwidth of each algorithm over the sizes.
  A block whose rows hold in-place figures gets nccl-tests' layout: the
  out-of-place columns, then the in-place ones, labelled on the line above
  (and a second average in the footer).
  """
  timing = timing_mode() if timing is None else timing
  if timing not in TIMING_MODES:
    raise ValueError(
        f"Unknown `timing` {timing!r}; valid modes: {', '.join(TIMING_MODES)}."
    )
  lines = [f"# {title}"] if title else []
  lines.append(f"# timing: {timing} ({_TIMING_HEADERS[timing]})")
  for collective in dict.fromkeys(r.collective for r in rows):
    block = [r for r in rows if r.collective == collective]
    columns = _COLUMNS
    lines += ["#", f"# {collective}"]
    if any(r.in_place_time_us is not None for r in block):
      columns = _COLUMNS + _IN_PLACE_COLUMNS
      lines.append(_group_line(columns))
    lines.append("#" + _cells([c[0] for c in columns], columns)[1:])
    lines.append("#" + _cells([c[1] for c in columns], columns)[1:])
    lines += [_cells([c[3](r) for c in columns], columns) for r in block]
  wrong = total_wrong(rows)
  verdict = "N/A (not checked)" if wrong is None else f"{wrong} {'OK' if wrong == 0 else 'FAILED'}"
  in_place = any(r.in_place_busbw_gbps is not None for r in rows)
  lines += ["#", f"# Wrong values: {verdict}",
            "# Avg bus bandwidth (GB/s):" + ("  out-of-place  in-place" if in_place else "")]
  # One average per algorithm; per (type, redop) too when the rows hold several (-d all).
  several = len({(r.dtype, r.redop) for r in rows}) > 1
  def key_of(r):
    return (r.collective, r.algorithm) + ((r.dtype, r.redop) if several else ())
  for key in dict.fromkeys(map(key_of, rows)):
    same = [r for r in rows if key_of(r) == key]
    label = f"{key[0]:<15} {key[1]:<22}" + (f" {key[2]:<9} {key[3]:<6}" if several else "")
    line = f"#   {label} {statistics.fmean(r.busbw_gbps for r in same):8.3f}"
    ip = [r.in_place_busbw_gbps for r in same if r.in_place_busbw_gbps is not None]
    if ip:
      line += f"  {statistics.fmean(ip):8.3f}"
    lines.append(line)
  return "\n".join(lines)


FIELDS = tuple(f.name for f in dataclasses.fields(Row))


def write_json(rows: Sequence[Row], path: str, *,
               metadata: dict[str, Any] | None = None) -> None:
  """Writes the rows as a JSON list of objects with the keys ``FIELDS``.

  Args:
    rows: the measurements.
    path: the file to write (its directory is made).
    metadata: fields added to every row, e.g. :func:`run_metadata` (the
      machine, the versions, the timing mode and the date), so that rows of
      several files can be compared in one table.
  """
  _makedirs(path)
  extra = metadata or {}
  with open(path, "w") as f:
    json.dump([dataclasses.asdict(r) | extra for r in rows], f, indent=1)
    f.write("\n")


def run_metadata(mesh: Mesh | None = None) -> dict[str, Any]:
  """What a row of a benchmark was measured on: ``devices`` (count),
  ``device_kind``, ``platform``, ``process_count``, ``mesh`` (axis -> size),
  ``jax_version``, ``jaxlib_version``, ``jaxcoll_version``, ``timing_mode``
  and ``date`` (UTC, ISO 8601).

  Args:
    mesh: the benchmark's mesh; default all devices.
  """
  import datetime  # noqa: PLC0415
  import importlib.metadata  # noqa: PLC0415

  import jaxlib  # noqa: PLC0415

  try:
    version = importlib.metadata.version("jaxcoll")
  except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
    version = "unknown"
  devs = list(mesh.devices.flat) if mesh is not None else jax.devices()
  return {
      "devices": len(devs),
      "device_kind": devs[0].device_kind,
      "platform": devs[0].platform,
      "process_count": jax.process_count(),
      "mesh": dict(mesh.shape) if mesh is not None else {"data": len(devs)},
      "jax_version": jax.__version__,
      "jaxlib_version": jaxlib.__version__,
      "jaxcoll_version": version,
      "timing_mode": timing_mode(devs[0].platform),
      "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
  }


def write_csv(rows: Sequence[Row], path: str) -> None:
  """Writes the rows as CSV with a header line ``FIELDS`` (empty ``wrong`` if unchecked)."""
  _makedirs(path)
  buf = io.StringIO()
  writer = csv.DictWriter(buf, fieldnames=FIELDS, lineterminator="\n")
  writer.writeheader()
  writer.writerows(dataclasses.asdict(r) for r in rows)
  with open(path, "w") as f:
    f.write(buf.getvalue())


def _makedirs(path: str) -> None:
  parent = os.path.dirname(os.path.abspath(path))
  os.makedirs(parent, exist_ok=True)


def require_matplotlib() -> None:
  """Raises ImportError with the fix when matplotlib is not installed."""
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    raise ImportError(
        "`--plot` needs matplotlib, which is not installed; pip install 'jaxcoll[plot]' "
        "(or matplotlib), or drop --plot."
    ) from None


PLOT_COLUMNS = 3  # panels per row of :func:`plot`'s grid


def plot(rows: Sequence[Row], path: str, *, title: str | None = None) -> None:
  """PNG of bus bandwidth vs size: one panel per collective (a grid of at
  most :data:`PLOT_COLUMNS` per row, 600 x 450 pixels each), one line per
  algorithm; ``title`` (e.g. the devices and the timing mode) above them.

  Raises:
    ImportError: matplotlib is not installed (see :func:`require_matplotlib`).
  """
  require_matplotlib()
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = list(dict.fromkeys(r.collective for r in rows))
  ncols = max(1, min(PLOT_COLUMNS, len(names)))
  nrows = max(1, math.ceil(len(names) / ncols))
  fig, axs = plt.subplots(
      nrows, ncols, figsize=(6 * ncols, 4.5 * nrows), squeeze=False, layout="constrained"
  )
  for ax in axs.flat[len(names):]:
    ax.set_axis_off()
  for ax, collective in zip(axs.flat, names):
    block = [r for r in rows if r.collective == collective]
    several = len({(r.dtype, r.redop) for r in block}) > 1  # a line per (type, redop) too
    for key in dict.fromkeys((r.algorithm, r.dtype, r.redop) for r in block):
      line = [r for r in block if (r.algorithm, r.dtype, r.redop) == key]
      ax.plot([r.size_bytes for r in line], [r.busbw_gbps for r in line], marker="o",
              label=" ".join(key) if several else key[0])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"{collective} ({', '.join(dict.fromkeys(r.dtype for r in block))})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
  if title:  # wrapped to the figure's width (about 7.5 pixels a character at this size)
    wrapped = "\n".join(textwrap.fill(part, max(40, int(600 * ncols / 7.5)))
                        for part in title.split("\n"))
    fig.suptitle(wrapped, fontsize="medium")
  _makedirs(path)
  fig.savefig(path, dpi=100)
  plt.close(fig)


class ProgressLine:
  """A ``progress(done, total, what)`` callback shown by :class:`jaxcoll.metrics.Progress`.

  A bar on a terminal; elsewhere (a log) a line ``case done/total what`` per
  call.
  """

  def __init__(self, stream: TextIO | None = None):
    self._stream = stream
    self._progress: metrics.Progress | None = None

  def __call__(self, done: int, total: int, what: str) -> None:
    if self._progress is None or self._progress.total != total:
      if self._progress is not None:
        self._progress.close()
      self._progress = metrics.Progress(total, stream=self._stream, unit="case")
    self._progress.update(done, what)


def to_dicts(rows: Sequence[Row]) -> list[dict[str, Any]]:
  """The rows as plain dicts (the JSON form)."""
  return [dataclasses.asdict(r) for r in rows]


def _names_pattern(names) -> re.Pattern:
  """``all``, or one of ``names`` or a comma-separated list (``-dall``, ``-dfloat,half``)."""
  one = "|".join(sorted(names, key=len, reverse=True))
  return re.compile(f"all|(?:{one})(?:,(?:{one}))*")


# nccl-tests reads its options with getopt, which also takes a short option's value attached
# (``-b8 -e128M -f2 -dfloat``); absl does not ("Unknown command line flag 'b8'"). What the
# value of each may be, so that absl's single-dash long flags (``-dtype=half``) stay theirs.
_ATTACHED_VALUES = {
    **dict.fromkeys("bei", re.compile(r"\d+[kKmMgGtT]?(i?[bB])?")),
    **dict.fromkeys("fnwrctg", re.compile(r"-?\d+")),
    "d": _names_pattern({*DTYPES, *NCCL_DTYPES}),
    "o": _names_pattern({*OPS, *NCCL_OPS}),
}


# nccl-tests' options (src/common.cu's getopt table) that jaxcoll has no equivalent of: the
# one line each gets (exit 2), so that a command line carried over says what to do.
# Its -t N -g M (N threads of M GPUs each per process) are ours only as -t 1 -g <the devices
# of this process>: nccl_argv drops -t 1 and hands -g on as --ngpus (the CLI checks it).
NCCL_UNSUPPORTED = {
    "a": ("average", "a row's time is the slowest process's, as nccl-tests' -a 3; rank 0's, "
                     "the mean and the min are not offered"),
    "z": ("blocking", "the timing mode is set by the platform and named in the table header "
                      "(back to back on GPU/TPU, one call in flight on XLA:CPU)"),
    "m": ("agg_iters", "each timed call is one collective"),
    "N": ("run_cycles", "run the command again for another cycle"),
    "p": ("parallel_init", "JAX initializes the devices"),
    "y": ("stream_null", "XLA chooses the streams"),
    "T": ("timeout", "no timeout is set by the benchmark"),
    "G": ("cudagraph", "each call is one compiled XLA program"),
    "C": ("report_cputime", "time is wall-clock per call"),
    "S": ("report_timestamps", "the --json rows carry the run's date"),
    "J": ("output_file", "use --json=FILE instead (jaxcoll's rows, not nccl-tests' JSON "
                         "layout)"),
    "R": ("local_register", "XLA allocates and registers the buffers"),
    "x": ("cta_policy", "XLA and NCCL choose the CTAs"),
    "D": ("device_implementation", "XLA chooses the implementation"),
    "V": ("device_cta_count", "XLA and NCCL choose the CTAs"),
    "M": ("memory", "a size whose buffers cannot fit is refused before anything runs"),
    "u": ("unalign", "XLA allocates the buffers aligned"),
    "I": ("per_iter_timing", "each row's time is already one call's (the median on XLA:CPU)"),
    "K": ("per_iter_skip", "warm-up calls (-w) are not timed"),
}
# The value of each of those options at which nccl-tests does what jaxcoll does (its
# default, or -a 3: the slowest rank's time): given so, the option is dropped, so that a
# command line carried over runs (`-a 3 -m 1 -G 0`); any other value is the line above.
NCCL_NEUTRAL = {"a": "3", "m": "1", "N": "1", "p": "0", "y": "0", "T": "0", "G": "0", "C": "0",
                "S": "0", "R": "0", "M": "0", "u": "0", "I": "0"}
# nccl-tests' long options whose name differs from ours.
NCCL_LONG_FLAGS = {"minbytes": "min_bytes", "maxbytes": "max_bytes", "stepfactor": "step_factor",
                   "stepbytes": "step_bytes", "datatype": "dtype"}
_NCCL_UNSUPPORTED_LONG = {long: short for short, (long, _) in NCCL_UNSUPPORTED.items()}


def _unsupported(arg: str) -> str | None:
  """The letter of nccl-tests' option ``arg`` is (``-g``, ``-g1``, ``--ngpus=1``) if
  jaxcoll has no equivalent, else None (absl's own single-dash flags stay absl's)."""
  if len(arg) >= 2 and arg[0] == "-" and arg[1] in NCCL_UNSUPPORTED and (
      len(arg) == 2 or re.fullmatch(r"-?\d+", arg[2:])):
    return arg[1]
  name = arg.lstrip("-").partition("=")[0]
  if arg.startswith("--") and name in _NCCL_UNSUPPORTED_LONG:
    return _NCCL_UNSUPPORTED_LONG[name]
  return None


def _option_value(argv: list[str], k: int, letter: str, long: str) -> tuple[str | None, int]:
  """The value given to nccl-tests' option ``argv[k]`` (``-a3``, ``-a 3``, ``--average=3``,
  ``--average 3``) and how many arguments it takes up; ``(None, 1)`` when it has none."""
  arg = argv[k]
  if arg.startswith(f"--{long}="):
    return arg.partition("=")[2].strip(), 1
  if len(arg) > 2 and not arg.startswith("--"):
    return arg[2:].strip(), 1
  if k + 1 < len(argv) and re.fullmatch(r"-?\d+", argv[k + 1].strip()):
    return argv[k + 1].strip(), 2
  return None, 1


def _threads_and_gpus(argv: list[str]) -> list[str]:
  """nccl-tests' ``-t N`` / ``--nthreads``: ``1`` (one thread drives this process's devices,
  as ours) is dropped, another count is a ValueError; ``-g M`` / ``--ngpus`` becomes
  ``--ngpus=M``, which the CLI checks against the devices of this process."""
  out, i = [argv[0]], 1
  while i < len(argv):
    arg = argv[i]
    if arg == "--":
      out += argv[i:]
      break
    for short, long in (("-t", "nthreads"), ("-g", "ngpus")):
      value = None
      if arg in (short, f"--{long}") and i + 1 < len(argv):
        value, i = argv[i + 1], i + 1
      elif arg.startswith(f"--{long}="):
        value = arg.partition("=")[2]
      if value is None:
        continue
      if long == "ngpus":
        arg = f"--ngpus={value}"
      elif value.strip() != "1":
        raise ValueError(
            f"nccl-tests' -t {value} (--nthreads) has no jaxcoll equivalent: one thread "
            "drives the devices of each process (-t 1); choose the devices with --mesh_shape "
            "(JAXCOLL_CPU_DEVICES on CPU), the processes with `jaxcoll launch`, mpirun or srun.")
      else:
        arg = None
      break
    if arg is not None:
      out.append(arg)
    i += 1
  return out


def _split_attached(arg: str) -> list[str]:
  """``-b8`` -> ``["-b", "8"]`` for nccl-tests' short options; any other ``arg`` as it is."""
  if len(arg) > 2 and arg[0] == "-" and arg[1] in _ATTACHED_VALUES:
    if _ATTACHED_VALUES[arg[1]].fullmatch(arg[2:]):
      return [arg[:2], arg[2:]]
  return [arg]


def nccl_argv(argv: list[str]) -> list[str]:
  """nccl-tests' command line as absl reads it: a short option's attached value
  (``-b8``, getopt's form) split off, its long names that differ from ours
  (``--minbytes``) renamed, ``-h`` as ``--help``, and ``-c N`` (a check count, ``0`` = off)
  as absl's ``--check`` / ``--nocheck``: absl reads a boolean's ``-c`` alone,
  and would leave the ``N`` behind as an unexpected argument.

  Raises:
    ValueError: one of nccl-tests' options jaxcoll has no equivalent of
      (:data:`NCCL_UNSUPPORTED`: ``-g``, ``-t``, ``-a``, ``-z``, ...), saying why.
  """
  split, k = [argv[0]], 1
  while k < len(argv):
    given = argv[k]
    if given == "--":
      split += argv[k:]
      break
    arg = "--help" if given == "-h" else given  # nccl-tests' help
    if (letter := _unsupported(arg)) is not None:
      long, why = NCCL_UNSUPPORTED[letter]
      value, taken = _option_value(argv, k, letter, long)
      if value is not None and value == NCCL_NEUTRAL.get(letter):
        k += taken  # what jaxcoll does anyway: dropped
        continue
      drop = "" if "instead" in why else "; drop it"
      neutral = (f" (-{letter} {NCCL_NEUTRAL[letter]}, what jaxcoll does, is taken)"
                 if letter in NCCL_NEUTRAL else "")
      raise ValueError(f"nccl-tests' -{letter} (--{long}) has no jaxcoll equivalent: "
                       f"{why}{drop}{neutral}.")
    name, eq, value = arg[2:].partition("=")
    if arg.startswith("--") and name in NCCL_LONG_FLAGS:
      arg = f"--{NCCL_LONG_FLAGS[name]}{eq}{value}"
    split += _split_attached(arg)
    k += 1
  argv = _threads_and_gpus(split)
  out, i = [argv[0]], 1
  while i < len(argv):
    arg = argv[i]
    if arg == "--":
      out += argv[i:]
      break
    value = None
    if arg in ("-c", "--c") and i + 1 < len(argv) and argv[i + 1].lstrip("-").isdigit():
      value, i = argv[i + 1], i + 1
    elif arg.startswith(("-c=", "--c=")) and arg.partition("=")[2].lstrip("-").isdigit():
      value = arg.partition("=")[2]
    out.append(arg if value is None else ("--check" if int(value) > 0 else "--nocheck"))
    i += 1
  return out
