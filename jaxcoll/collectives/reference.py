"""numpy reference of every collective: the executable spec.

Each function takes the list of per-rank inputs ``xs`` (rank order of the
flattened group) and returns the list of per-rank outputs. Float sums are
computed in float64 (complex ones in complex128) and cast back, so the
reference is the exact answer rounded once.
"""

from __future__ import annotations

import numpy as np

_NP_REDUCE = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}


def _reduce(xs: list[np.ndarray], op: str) -> np.ndarray:
  dtype = np.asarray(xs[0]).dtype
  if op in ("sum", "mean") and not np.issubdtype(dtype, np.integer):
    wide = np.complex128 if np.issubdtype(dtype, np.complexfloating) else np.float64
    stacked = np.stack([np.asarray(x, wide) for x in xs])
  else:
    stacked = np.stack([np.asarray(x) for x in xs])
  return _NP_REDUCE[op](stacked, axis=0).astype(dtype)


def all_reduce(xs, op="sum"):
  total = _reduce(xs, op)
  return [total.copy() for _ in xs]


def reduce_scatter(xs, op="sum", scatter_dimension=0):
  total = _reduce(xs, op)
  return list(np.split(total, len(xs), axis=scatter_dimension))


def all_gather(xs, axis=0):
  full = np.concatenate([np.asarray(x) for x in xs], axis=axis)
  return [full.copy() for _ in xs]


def broadcast(xs, root=0):
  return [np.asarray(xs[root]).copy() for _ in xs]


def reduce(xs, root=0, op="sum"):
  total = _reduce(xs, op)
  return [total if r == root else np.asarray(x).copy() for r, x in enumerate(xs)]


def all_to_all(xs, split_axis, concat_axis):
  n = len(xs)
  pieces = [np.split(np.asarray(x), n, axis=split_axis) for x in xs]
  return [
      np.concatenate([pieces[src][dst] for src in range(n)], axis=concat_axis)
      for dst in range(n)
  ]
