"""summary.json's ``params_sha256`` / ``params_global_norm``, streamed: no replicated
copy of the model on any device, and at most one layer of a leaf on the host at a time.

The values are exactly those of ``jaxcoll.run.loop.params_digest`` of the full
parameters: the SHA-256 of every leaf's float32 little-endian bytes in tree order
(streamed piece by piece, which SHA-256 allows), and the square root of the sum over
leaves of ``np.sum(np.square(leaf, dtype=np.float64))``. That sum is numpy's
pairwise summation; :func:`square_sum` splits a leaf exactly where numpy's
``pairwise_sum`` would and lets numpy sum the pieces, so the result is the same
float64, bit for bit, without the leaf's float64 squares (twice its size) in memory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

import numpy as np

# Pieces of at most this many elements are summed by numpy itself; any size > 128
# (numpy's PW_BLOCKSIZE) gives the same split, this one bounds the float64 temporary.
_BLOCK = 1 << 18


def square_sum(get: Callable[[int, int], np.ndarray], n: int, start: int = 0) -> float:
  """``np.sum(np.square(x, dtype=np.float64))`` of the flat ``x`` of ``n`` elements
  whose elements ``[a, b)`` ``get(a, b)`` returns; bit-identical to numpy's."""
  if n <= _BLOCK:
    return np.sum(np.square(get(start, start + n), dtype=np.float64))
  half = n // 2
  half -= half % 8  # numpy's pairwise_sum: n2 = n / 2; n2 -= n2 % 8
  return square_sum(get, half, start) + square_sum(get, n - half, start + half)


class Piecewise:
  """A flat float32 leaf of ``size`` elements given as consecutive pieces of
  ``piece`` elements (e.g. one layer each): ``fetch(k)`` returns piece ``k``.
  Only the piece in use is held (pairwise summation reads in order)."""

  def __init__(self, size: int, piece: int, fetch: Callable[[int], np.ndarray]):
    self.size, self.piece, self.fetch = size, max(piece, 1), fetch
    self._k, self._data = None, None

  def _get_piece(self, k: int) -> np.ndarray:
    if self._k != k:
      self._data = None  # free the previous piece first
      self._data = np.asarray(self.fetch(k), dtype="<f4").reshape(-1)
      self._k = k
    return self._data

  def get(self, a: int, b: int) -> np.ndarray:
    parts = []
    while a < b:
      k, offset = divmod(a, self.piece)
      data = self._get_piece(k)
      take = min(b - a, self.piece - offset)
      parts.append(data[offset:offset + take])
      a += take
    if not parts:  # a zero-size leaf (e.g. a scan of length 0)
      return np.empty(0, "<f4")
    return parts[0] if len(parts) == 1 else np.concatenate(parts)

  def pieces(self) -> Iterable[np.ndarray]:
    for k in range(-(-self.size // self.piece)):
      yield self._get_piece(k)


def digest(leaves: Iterable[tuple[str, Piecewise]]) -> tuple[float, str, list[str]]:
  """``(global norm, sha256, names of non-finite leaves)`` of ``(name, leaf)`` pairs."""
  sha = hashlib.sha256()
  total, bad = 0.0, []
  for name, leaf in leaves:
    finite = True
    for data in leaf.pieces():
      sha.update(data.tobytes())
      finite = finite and bool(np.isfinite(data).all())
    if not finite:
      bad.append(name)
    total += float(square_sum(leaf.get, leaf.size))
  return float(np.sqrt(total)), sha.hexdigest(), bad
