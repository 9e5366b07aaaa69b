"""Measured tuning tables: what `algorithm="auto"` picks, and why.

`auto` decides at trace time (so the choice is visible in the HLO):

1. from the active tuning table, when it has an entry for this collective,
   group size and dtype (float32's entry serves other dtypes, sizes being in
   bytes), except a `hierarchical` entry for a group of one axis, where it
   cannot run;
2. otherwise from the cost model (:mod:`jaxcoll.cost`) on the topology of
   the group: the table's fitted topology if it has one, else the preset of
   the platform (`cpu-sim`, `dgx-h100`, `tpu-v5e`).

The active table is the one given to :func:`use`, else the table shipped for
this device kind (``jaxcoll/comm_model/tuning_tables/<kind>.json``, written by
``python -m experiments.tune``), else none. Nothing is read at import: the
shipped table is loaded the first time `auto` decides.

A table is JSON::

  {"device_kind": "cpu", "topology": {...} | null,
   "entries": {"all_reduce": {"8": {"float32": [
       {"max_bytes": 65536, "algorithm": "recursive_doubling"},
       {"max_bytes": null, "algorithm": "native"}]}}}}

Example:
  >>> jaxcoll.tuning.use("my_cluster.json")  # doctest: +SKIP
  >>> jaxcoll.tuning.use(None)  # back to the shipped table / cost model
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

from jaxcoll import checks, collectives
from jaxcoll.collectives import _dispatch
from jaxcoll.comm_model import cost
from jaxcoll.comm_model.topology import Topology

TABLES_DIR = os.path.join(os.path.dirname(__file__), "tuning_tables")
_PLATFORM_PRESETS = {"cpu": "cpu-sim", "gpu": "dgx-h100", "cuda": "dgx-h100", "tpu": "tpu-v5e"}
# When native is within this factor of the fastest, prefer native: it is one
# XLA op, so cheaper to compile and to schedule around.
NATIVE_PREFERENCE = 1.03


@dataclasses.dataclass(frozen=True)
class TuningTable:
  """Size ranges -> algorithm, per collective, group size and dtype."""

  device_kind: str
  entries: Mapping[str, Mapping[str, Mapping[str, list[dict[str, Any]]]]]
  topology: Topology | None = None

  def __post_init__(self):
    # Checked here, not only in from_dict: a table built in Python and given to use() was
    # taken as it was, its group sizes written as ints never matched (lookup reads '8') and
    # a misspelt algorithm failed inside `auto`, at trace time of the user's jit.
    entries = self.entries
    if isinstance(entries, Mapping):  # group sizes and dtypes as the JSON form has them
      entries = {
          collective: ({str(n) if checks.is_int(n) else n: _dtype_keys(v)
                        for n, v in by_size.items()}
                       if isinstance(by_size, Mapping) else by_size)
          for collective, by_size in entries.items()
      }
    _check_entries(entries)
    object.__setattr__(self, "entries", entries)

  def lookup(self, collective: str, group_size: int, dtype: str, nbytes: int) -> str | None:
    """The tabulated algorithm, or None when the table has no entry."""
    by_dtype = self.entries.get(collective, {}).get(str(group_size), {})
    ranges = by_dtype.get(dtype) or by_dtype.get("float32")
    if not ranges:
      return None
    for r in ranges:
      if r["max_bytes"] is None or nbytes <= r["max_bytes"]:
        return r["algorithm"]
    return ranges[-1]["algorithm"]

  def to_dict(self) -> dict[str, Any]:
    return {
        "device_kind": self.device_kind,
        "topology": None if self.topology is None else self.topology.to_dict(),
        "entries": self.entries,
    }

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> TuningTable:
    try:
      topo = data.get("topology")
      table = cls(
          device_kind=str(data["device_kind"]),
          entries=data["entries"],
          topology=None if topo is None else Topology.from_dict(topo),
      )
    except (KeyError, TypeError, AttributeError) as e:
      raise ValueError(
          f"Not a jaxcoll tuning table ({e!r}); expected keys device_kind, "
          "entries and topology, as written by `python -m experiments.tune`."
      ) from None
    return table


def _dtype_keys(by_dtype: Any) -> Any:
  """``{jnp.float32: ranges}`` as ``{'float32': ranges}`` (a dtype given as a type)."""
  if not isinstance(by_dtype, Mapping):
    return by_dtype
  return {k if isinstance(k, str) else (_dtype_name(k) or k): v for k, v in by_dtype.items()}


_RANGE = '{"max_bytes": int or null, "algorithm": name}'


def _check_entries(entries: Any) -> None:
  """Raises one ValueError line for entries that are not collective -> group size -> dtype ->
  size ranges, as ``python -m experiments.tune`` writes them (a hand-edited table that is not
  failed later, inside ``auto``, with a KeyError or TypeError at trace time)."""
  def bad(where: str, want: str, got: Any) -> ValueError:
    return ValueError(f"Tuning table entries{where} must be {want}, as `python -m "
                      f"experiments.tune` writes; got {got!r}.")

  if not isinstance(entries, Mapping):
    raise bad("", "a mapping of collective names", entries)
  for collective, by_size in entries.items():
    # Raises for unknown collectives; a table names real algorithms, not auto.
    valid = tuple(a for a in collectives.algorithms(collective) if a != "auto")
    if not isinstance(by_size, Mapping):
      raise bad(f"[{collective!r}]", "a mapping of group sizes ('8') to dtypes", by_size)
    for n, by_dtype in by_size.items():
      where = f"[{collective!r}][{n!r}]"
      if not (isinstance(n, str) and n.isascii() and n.isdigit() and int(n) >= 1):
        raise bad(f"[{collective!r}]", "keyed by group sizes written as text ('8')", n)
      if not isinstance(by_dtype, Mapping):
        raise bad(where, "a mapping of dtype names ('float32') to size ranges", by_dtype)
      for dtype, ranges in by_dtype.items():
        here = f"{where}[{dtype!r}]"
        if _dtype_name(dtype) != dtype:  # lookup() asks for np.dtype(x.dtype).name
          raise bad(where, "keyed by dtype names as numpy spells them ('float32', 'bfloat16')",
                    dtype)
        if not isinstance(ranges, list) or not all(isinstance(r, Mapping) for r in ranges):
          raise bad(here, f"a list of {_RANGE} ranges", ranges)
        for r in ranges:
          if r.get("algorithm") not in valid:
            raise ValueError(
                f"Tuning table names {collective} algorithm {r.get('algorithm')!r}; "
                f"valid: {', '.join(valid)}."
            )
          limit = r.get("max_bytes", "missing")
          if limit is not None and not (checks.is_int(limit) and limit >= 0):
            raise bad(here, f"a list of {_RANGE} ranges (max_bytes: a whole number of "
                      "bytes, null for no limit)", r)
        # lookup() takes the first range that holds the size: a range after a larger (or
        # unlimited) one would never be picked, the table silently not what was written.
        limits = [r["max_bytes"] for r in ranges]
        bounded = [v for v in limits if v is not None]
        if None in limits[:-1] or any(b <= a for a, b in zip(bounded, bounded[1:])):
          raise bad(here, "size ranges in increasing max_bytes, null (no limit) only last "
                    "(the first range that holds a size is used)", limits)


def _dtype_name(dtype: Any) -> str | None:
  """numpy's name of ``dtype`` (``jnp.float32`` -> ``'float32'``), None if it is none."""
  try:
    return np.dtype(dtype).name
  except TypeError:
    return None


def load(path: str) -> TuningTable:
  """Reads a tuning table written by ``python -m experiments.tune``."""
  with open(path) as f:
    try:
      data = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"Tuning table {path!r} is not valid JSON: {e}.") from None
  return TuningTable.from_dict(data)


def load_agreed(path: str | os.PathLike, what: str = "path") -> TuningTable:
  """:func:`load` on every process of a job, checked to be one table everywhere.

  A process that read another table (another file at ``path`` on its host) would pick other
  algorithms under ``auto`` and the job's collectives would not match; a process that could
  not read it would leave the others waiting. So every process reads, then all compare (one
  small allgather, which every process joins whatever it read), and each raises the same kind
  of line. ``what`` names the setting in the message (``--tuning_table``).

  Raises:
    ValueError: the file cannot be read or is not a tuning table here or on another
      process, or the processes' tables differ.
  """
  fix = "give the JSON file `jaxcoll tune --out=PATH` wrote, the same on every host"
  table, problem = None, None
  try:
    table = load(path)
  except OSError as e:
    problem = f"`{what}`={str(path)!r} cannot be read ({e.strerror or e}); {fix}."
  except ValueError as e:
    problem = f"`{what}`={str(path)!r}: {' '.join(str(e).split())}"
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # noqa: PLC0415

    mine = np.zeros(33, np.uint8)  # [read?, sha256 of the table]
    if problem is None:
      text = json.dumps(table.to_dict(), sort_keys=True).encode()
      mine[0], mine[1:] = 1, np.frombuffer(hashlib.sha256(text).digest(), np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(mine))
    unread = next((p for p, r in enumerate(rows) if not r[0]), None)
    other = next((p for p, r in enumerate(rows) if not np.array_equal(r, rows[0])), None)
    if problem is None and unread is not None:
      problem = (f"`{what}`={str(path)!r} cannot be read on process {unread} (missing or not "
                 f"a tuning table on its host); {fix}.")
    elif problem is None and other is not None:
      problem = (f"`{what}`={str(path)!r} differs between processes 0 and {other} (another "
                 f"file at that path on their hosts): auto would pick other algorithms on "
                 f"each; {fix}.")
  if problem is not None:
    raise ValueError(problem)
  return table


def save(table: TuningTable, path: str) -> None:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(table.to_dict(), f, indent=1, sort_keys=True)
  os.replace(tmp, path)  # never a half-written table


_UNSET = object()
_active: Any = _UNSET  # a TuningTable, None (no table), or _UNSET (not loaded yet)


def use(table: TuningTable | str | os.PathLike | None) -> None:
  """Makes ``table`` (or the table at that path) the one `auto` consults.

  ``None`` goes back to the default: the table shipped for this device kind,
  if any, else the cost model alone.
  """
  global _active  # noqa: PLW0603 - one process-wide setting, like jax.config
  if isinstance(table, (str, os.PathLike)):  # a pathlib.Path too, as load() and open() take
    table = load(table)
  if table is not None and not isinstance(table, TuningTable):
    raise ValueError(f"`table` must be a TuningTable, a path or None; got {table!r}.")
  _active = _UNSET if table is None else table


@contextlib.contextmanager
def kept():
  """The table in use (:func:`use`) when the ``with`` block starts is the one in use after it,
  whatever the block made active (``jaxcoll train --config.tuning_table=PATH``: that run's).

  The table in use is one per process, like ``jax.config``: two threads that each train with
  their own table at the same time (two ``train_and_evaluate`` calls) see each other's.
  """
  global _active  # noqa: PLW0603
  before = _active
  try:
    yield
  finally:
    _active = before


def device_kind() -> str:
  """A file-name-safe name of this process's device kind (e.g. ``cpu``)."""
  kind = jax.devices()[0].device_kind
  return "".join(c if c.isalnum() else "_" for c in kind.lower()).strip("_")


_kind_checked: Any = None  # the table in use whose device kind was last compared with this one's


def active_table() -> TuningTable | None:
  global _active, _kind_checked  # noqa: PLW0603
  if _active is _UNSET:
    path = os.path.join(TABLES_DIR, f"{device_kind()}.json")
    _active = load(path) if os.path.exists(path) else None
  elif _active is not None and _active is not _kind_checked:
    # Said at the first lookup, not in use(): asking for the device kind there would
    # start JAX's backend before a script's simulate_cpu_devices(n).
    _kind_checked = _active
    here = device_kind()
    if _active.device_kind != here:
      warnings.warn(
        f"the tuning table in use was measured on device kind {_active.device_kind!r}, but "
        f"this process runs on {here!r}: its picks are where each algorithm was fastest "
        f"there. Measure one here (python -m experiments.tune) or go back to the "
        f"default with jaxcoll.tuning.use(None).", stacklevel=3)
  return _active


def platform_topology() -> Topology:
  """The topology preset of this platform (``cpu-sim``, ``dgx-h100``, ``tpu-v5e``).

  On accelerators one node per process: a group crossing processes crosses
  the slow level. This is what ``python -m experiments.tune`` fits.
  """
  platform = jax.devices()[0].platform
  preset = _PLATFORM_PRESETS.get(platform, "dgx-h100")
  if preset == "cpu-sim":
    return Topology.preset(preset)
  # One process per host: a group crossing processes crosses the slow level.
  return Topology.preset(preset, nodes=max(jax.process_count(), 1))


def default_topology() -> Topology:
  """The active table's fitted topology, else :func:`platform_topology`."""
  table = active_table()
  if table is not None and table.topology is not None:
    return table.topology
  return platform_topology()


def pick(collective: str, nbytes: int, group, dtype) -> tuple[str, bool]:
  """`auto`'s choice and whether the tuning table made it (False: the cost model did, the
  table having no entry for this collective, group size, dtype and size)."""
  table = active_table()
  if table is not None:
    name = np.dtype(dtype).name
    algorithm = table.lookup(collective, group.size, name, nbytes)
    # Entries are keyed by group size alone: `hierarchical` (a table may name it for the
    # tuple-of-axes groups of that size) cannot run on one axis; the cost model picks there.
    if algorithm is not None and not (algorithm == "hierarchical" and len(group.axes) < 2):
      return algorithm, True
  return cost.auto_chooser(default_topology())(collective, nbytes, group, dtype), False


def choose(collective: str, nbytes: int, group, dtype) -> str:
  """`auto`'s choice: the tuning table, else the cost model (see module doc; :func:`pick`)."""
  return pick(collective, nbytes, group, dtype)[0]


# `auto`'s default (``jaxcoll.collectives.reset_auto_chooser`` goes back to it):
# registered here, one layer above the collectives, so that they never import
# this module. Reads no table (that happens the first time `auto` decides).
_dispatch.set_default_chooser(choose)


# ---------------------------------------------------------------- building


def table_from_measurements(rows: Iterable[Mapping[str, Any]]) -> dict:
  """Entries from benchmark rows (collective, group_size, dtype, algorithm,
  size_bytes, time_us): the fastest algorithm per size, with range
  boundaries at the geometric midpoints between measured sizes."""
  best: dict[tuple, dict[int, dict[str, float]]] = {}
  for r in rows:
    if r["algorithm"] == "auto":
      continue
    key = (r["collective"], str(r["group_size"]), r["dtype"])
    best.setdefault(key, {}).setdefault(int(r["size_bytes"]), {})[r["algorithm"]] = float(
        r["time_us"]
    )
  entries: dict = {}
  for (collective, n, dtype), by_size in best.items():
    sizes = sorted(by_size)
    winners = [_winner(by_size[s]) for s in sizes]
    ranges = []
    for i, (s, w) in enumerate(zip(sizes, winners)):
      upper = None if i + 1 == len(sizes) else int(math.sqrt(s * sizes[i + 1]))
      if ranges and ranges[-1]["algorithm"] == w:
        ranges[-1]["max_bytes"] = upper
      else:
        ranges.append({"max_bytes": upper, "algorithm": w})
    entries.setdefault(collective, {}).setdefault(n, {})[dtype] = ranges
  return entries


def _winner(times: Mapping[str, float]) -> str:
  fastest = min(times, key=times.get)
  if "native" in times and times["native"] <= NATIVE_PREFERENCE * times[fastest]:
    return "native"
  return fastest


def _unit_topology(base: Topology, *, alpha=0.0, beta=None, gamma=None, launch=0.0) -> Topology:
  inf = float("inf")
  levels = tuple(
      dataclasses.replace(
          lv,
          latency_s=alpha,
          bandwidth_Bps=inf if beta is None else beta,
          reduce_Bps=inf if gamma is None else gamma,
      )
      for lv in base.levels
  )
  return dataclasses.replace(base, levels=levels, launch_s=launch)


def fit_topology(
    rows: Iterable[Mapping[str, Any]], base: Topology
) -> tuple[Topology, float]:
  """Fits alpha, beta and gamma of ``base`` to measured ppermute algorithms.

  Every level gets the same figures (one process: one level). The model is
  linear in (alpha, 1/bandwidth, 1/reduce rate): each measured row gives one
  equation whose coefficients are the cost model's step, byte and
  reduced-byte counts, solved by non-negative least squares
  (``scipy.optimize.nnls``) on relative error: no figure can come out
  negative, and one the rows cannot see (e.g. no reduction measured) is 0,
  written as an infinite rate.
  ppermute algorithms pay the per-operation launch cost at every step, like
  alpha, so the two cannot be told apart from their rows: the launch cost is
  taken as the fastest measured ``native`` call (one XLA collective, tiny
  message), or kept from ``base`` when no native row was measured. Returns
  the fitted topology and the median relative prediction error over the
  ppermute rows. Rows of an algorithm without a cost formula (one registered
  with ``jaxcoll.collectives.register``) are left out of the fit.
  """
  rows = list(rows)
  native = [float(r["time_us"]) * 1e-6 for r in rows if r["algorithm"] == "native"]
  if native:
    base = dataclasses.replace(base, launch_s=min(native))
  probes = [
      _unit_topology(base, alpha=1.0),
      _unit_topology(base, beta=1.0),
      _unit_topology(base, gamma=1.0),
  ]
  launch_only = _unit_topology(base, launch=base.launch_s)
  a, y, used = [], [], []
  for r in rows:
    if r["algorithm"] in ("native", "auto") or r["collective"] not in collectives.COLLECTIVES:
      continue
    if r["algorithm"] not in cost.modelled_algorithms(r["collective"]):
      continue  # registered by the user (collectives.register), no cost formula to fit
    n = [int(r["group_size"])]
    coeffs = [
        cost.estimate(r["collective"], r["size_bytes"], p.for_axes(base.names[-1:], n),
                      r["algorithm"])
        for p in probes
    ]
    fixed = cost.estimate(
        r["collective"], r["size_bytes"], launch_only.for_axes(base.names[-1:], n), r["algorithm"]
    )
    t = float(r["time_us"]) * 1e-6
    a.append([c / t for c in coeffs])
    y.append(1.0 - fixed / t)
    used.append((coeffs, fixed, t))
  if len(a) < 3:
    raise ValueError(
        f"Need at least 3 measured ppermute-algorithm rows to fit, got {len(a)}."
    )
  from scipy import optimize  # noqa: PLC0415 (here: scipy.optimize costs ~0.3 s at `import jaxcoll`)

  x, _ = optimize.nnls(np.asarray(a), np.asarray(y))
  alpha, inv_bw, inv_gamma = (float(v) for v in x)
  errors = [abs(float(np.dot(c, x)) + f - t) / t for c, f, t in used]
  if inv_bw <= 0:
    raise ValueError(
        "The measured rows do not determine a bandwidth (the fit gives 0 s per byte); "
        "measure larger sizes, e.g. --max_bytes=16M."
    )
  rate = 1.0 / inv_gamma if inv_gamma > 0 else math.inf
  levels = tuple(
      dataclasses.replace(lv, latency_s=alpha, bandwidth_Bps=1.0 / inv_bw, reduce_Bps=rate)
      for lv in base.levels
  )
  return dataclasses.replace(base, levels=levels), float(np.median(errors))
