"""One spec per collective: its size, busbw factor, HLO kind and reference.

As nccl-tests keeps one ``struct testColl`` per collective, every fact about a
collective that more than one module needs lives in its :class:`Spec`, and
the others read it: the nccl size of an input (``auto``'s choice,
:func:`jaxcoll.collectives._dispatch.nccl_size_bytes`), the bus-bandwidth
factor (:func:`jaxcoll.cost.bus_bandwidth_factor`, the HLO report's bytes
sent per device, the benchmark's busbw), the HLO instruction that *is* the
collective (the HLO report, the comm-share estimate), the per-rank input of
a benchmark size, and the numpy reference the benchmark and the tests check
against.

Sizes are nccl-tests' ``size`` (``doc/PERFORMANCE.md``): the largest buffer
(the all-gather output, the reduce-scatter input, the whole all-to-all
buffer); ``n`` is the group size.

Example:
  >>> SPECS["all_reduce"].busbw_factor(8)
  1.75
  >>> BY_HLO_KIND["reduce-scatter"].name, SPECS["all_gather"].size_count(4, 8)
  ('reduce_scatter', 32)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jaxcoll.collectives import reference

#: The HLO instruction of a ``lax.ppermute`` step (no collective of its own:
#: every device sends ``S`` to its partner; ppermute-built algorithms are
#: sequences of them).
PPERMUTE_HLO_KIND = "collective-permute"


@dataclasses.dataclass(frozen=True)
class Spec:
  """What jaxcoll knows about one collective.

  Attributes:
    name: the collective (``"all_reduce"``, ...).
    hlo_kind: the XLA instruction that is this collective
      (``"all-reduce"``, ...); None when XLA has none (``reduce``: jaxcoll's
      native reduce is an all-reduce).
    busbw_factor: ``n -> busbw / algbw`` (nccl-tests): ``2(n-1)/n`` for
      all-reduce, ``(n-1)/n`` for reduce-scatter, all-gather and all-to-all,
      1 for broadcast and reduce. Times ``S``: the bytes each device sends
      with a bandwidth-optimal algorithm.
    reduce_factor: ``n -> bytes each device reduces / S`` with one:
      ``(n-1)/n`` for all-reduce and reduce-scatter, 1 for reduce, else 0.
    reduces: takes an ``op``.
    rooted: takes a ``root``.
    divisible: the element count of ``S`` must be a multiple of ``n``.
    gathers: ``S`` is ``n`` inputs (all-gather: the output is largest).
    scatters: ``S`` is ``n`` results (reduce-scatter: the input is largest).
    reference: ``(xs, op, root) -> ys``: per-rank numpy outputs.
  """

  name: str
  hlo_kind: str | None
  busbw_factor: Callable[[int], float]
  reduce_factor: Callable[[int], float]
  reduces: bool
  rooted: bool
  divisible: bool
  gathers: bool
  scatters: bool
  reference: Callable[..., list[np.ndarray]]

  def size_count(self, input_count: int, n: int) -> int:
    """Elements of ``S`` for one rank's (canonical) input of ``input_count``."""
    return input_count * n if self.gathers else input_count

  def input_count(self, size_count: int, n: int) -> int:
    """Elements of one rank's input for a size ``S`` of ``size_count`` elements."""
    return size_count // n if self.gathers else size_count

  def size_from_result(self, result_bytes: int, n: int) -> int:
    """``S`` from the bytes of the HLO instruction's result."""
    return result_bytes * n if self.scatters else result_bytes


def _all_pairs(n: int) -> float:
  return 2 * (n - 1) / n


def _one_pass(n: int) -> float:
  return (n - 1) / n


def _one(n: int) -> float:
  del n
  return 1.0


def _none(n: int) -> float:
  del n
  return 0.0


SPECS: dict[str, Spec] = {
    "all_reduce": Spec(
        "all_reduce", hlo_kind="all-reduce", busbw_factor=_all_pairs, reduce_factor=_one_pass,
        reduces=True, rooted=False, divisible=False, gathers=False, scatters=False,
        reference=lambda xs, op, root: reference.all_reduce(xs, op=op)),
    "reduce_scatter": Spec(
        "reduce_scatter", hlo_kind="reduce-scatter", busbw_factor=_one_pass,
        reduce_factor=_one_pass,
        reduces=True, rooted=False, divisible=True, gathers=False, scatters=True,
        reference=lambda xs, op, root: reference.reduce_scatter(xs, op=op)),
    "all_gather": Spec(
        "all_gather", hlo_kind="all-gather", busbw_factor=_one_pass, reduce_factor=_none,
        reduces=False, rooted=False, divisible=True, gathers=True, scatters=False,
        reference=lambda xs, op, root: reference.all_gather(xs)),
    "broadcast": Spec(
        "broadcast", hlo_kind="collective-broadcast", busbw_factor=_one, reduce_factor=_none,
        reduces=False, rooted=True, divisible=False, gathers=False, scatters=False,
        reference=lambda xs, op, root: reference.broadcast(xs, root=root)),
    "reduce": Spec(
        "reduce", hlo_kind=None, busbw_factor=_one, reduce_factor=_one,
        reduces=True, rooted=True, divisible=False, gathers=False, scatters=False,
        reference=lambda xs, op, root: reference.reduce(xs, root=root, op=op)),
    "all_to_all": Spec(
        "all_to_all", hlo_kind="all-to-all", busbw_factor=_one_pass, reduce_factor=_none,
        reduces=False, rooted=False, divisible=True, gathers=False, scatters=False,
        reference=lambda xs, op, root: reference.all_to_all(xs, 0, 0)),
}

#: HLO instruction -> the collective it is.
BY_HLO_KIND: dict[str, Spec] = {s.hlo_kind: s for s in SPECS.values() if s.hlo_kind}

#: The collective instructions of an HLO module (the HLO report's kinds).
HLO_KINDS: tuple[str, ...] = (
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", PPERMUTE_HLO_KIND,
    "collective-broadcast",
)
