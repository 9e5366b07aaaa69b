"""One checksum of a pytree's bits: every bit of every dtype counts.

``fingerprint(tree)`` is one uint32 per leaf, ``sum(words[i] * (2i + 1)) mod
2**32`` over the leaf's bits as 32-bit words: a leaf of 1-, 2- or 4-byte
elements gives one word per element (zero-extended), an 8-byte element two,
a complex element the words of its real part then those of its imaginary
part, a bool one. Each weight is odd, so flipping any single bit changes the
sum (``2**k * odd`` is never 0 mod 2**32), and the position weights make a
swap of two elements or of the real and imaginary parts change it too
(except with probability ~2**-32). Nothing is cast to another float type on
the way, so -0.0, NaN payloads, the imaginary part and the low half of a
float64 all count.

It runs inside ``jit`` (jax arrays) and on the host (numpy arrays: their
8-byte leaves are read as they are, even when ``jax_enable_x64`` is off).

Example:
  >>> import numpy as np
  >>> from jaxcoll.fingerprint import fingerprint
  >>> a = np.complex64(1 + 2j) * np.ones(3, np.complex64)
  >>> b = np.complex64(1 + 3j) * np.ones(3, np.complex64)
  >>> bool(fingerprint([a])[0] != fingerprint([b])[0])
  True
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

WIDTHS = (1, 2, 4, 8)  # bytes per (real) element that a fingerprint covers


def _check_width(dtype) -> int:
  width = np.dtype(dtype).itemsize
  if width not in WIDTHS:
    raise ValueError(
        f"cannot fingerprint a leaf of dtype {np.dtype(dtype).name} ({width} bytes); "
        "fingerprints cover bool, 1-, 2-, 4- and 8-byte dtypes and complex. Cast the leaf first."
    )
  return width


def _host_words(x: np.ndarray) -> np.ndarray:
  x = np.ascontiguousarray(x).reshape(-1)
  if x.dtype == np.bool_:
    return x.astype(np.uint32)
  if np.issubdtype(x.dtype, np.complexfloating):
    return np.concatenate([_host_words(x.real.copy()), _host_words(x.imag.copy())])
  width = _check_width(x.dtype)
  if width == 8:
    return x.view(np.uint32)
  return x.view(np.dtype(f"uint{8 * width}")).astype(np.uint32)


def _device_parts(x: jax.Array) -> list[jax.Array]:
  """The bits of ``x`` as uint32 arrays, in flat order one after the other.

  Not flattened: each part keeps ``x``'s shape (plus a trailing 2 for 8-byte
  elements, whose two words follow each other in the flat order), so a
  sharded leaf is checksummed where it lives, shard by shard, and never
  gathered (a ``reshape(-1)`` of a sharded array replicates it).
  """
  if x.dtype == jnp.bool_:  # bitcast_convert_type refuses bool
    return [x.astype(jnp.uint32)]
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    return _device_parts(jnp.real(x)) + _device_parts(jnp.imag(x))
  width = _check_width(x.dtype)
  if width == 8:
    return [jax.lax.bitcast_convert_type(x, jnp.uint32)]
  return [jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * width}")).astype(jnp.uint32)]


def _flat_positions(shape) -> jax.Array:
  """Each element's row-major flat index mod 2**32, as an array of ``shape``."""
  index, stride = jnp.zeros(shape, jnp.uint32), 1
  for d in reversed(range(len(shape))):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride % 2**32)
    stride *= shape[d]
  return index


def words(x) -> jax.Array:
  """The bits of ``x`` as a flat uint32 vector (see the module docstring for the layout).

  Raises:
    ValueError: a dtype whose elements are not 1, 2, 4 or 8 bytes (e.g. 4-bit).
  """
  if isinstance(x, (np.ndarray, np.generic)):
    return jnp.asarray(_host_words(np.asarray(x)))
  return jnp.concatenate([p.reshape(-1) for p in _device_parts(jnp.asarray(x))])


def _leaf_sum(leaf) -> jax.Array:
  """``sum(words[i] * (2i + 1)) mod 2**32`` of one leaf."""
  if isinstance(leaf, (np.ndarray, np.generic)):
    w = words(leaf)
    return jnp.sum(w * (2 * jnp.arange(w.shape[0], dtype=jnp.uint32) + 1), dtype=jnp.uint32)
  total, offset = jnp.uint32(0), 0
  for part in _device_parts(jnp.asarray(leaf)):
    position = _flat_positions(part.shape) + jnp.uint32(offset % 2**32)
    total = total + jnp.sum(part * (2 * position + 1), dtype=jnp.uint32)
    offset += part.size
  return total


def fingerprint(tree) -> jax.Array:
  """One uint32 per leaf of ``tree``: ``sum(words[i] * (2i + 1)) mod 2**32``.

  Args:
    tree: a pytree of jax or numpy arrays (or scalars).

  Returns:
    A uint32 vector with one entry per leaf, in ``jax.tree.leaves`` order.

  Raises:
    ValueError: a leaf of an unsupported dtype (see :func:`words`).
  """
  sums = [_leaf_sum(leaf) for leaf in jax.tree.leaves(tree)]
  return jnp.stack(sums) if sums else jnp.zeros((0,), jnp.uint32)


# Elements one step of :func:`block_sum` reads: XLA:CPU materializes the
# weighted words of a reduction's input, so a whole-leaf sum would take a
# temporary as large as the leaf.
_CHUNK = 2**18


def block_sum(block: jax.Array, start, shape) -> jax.Array:
  """What ``block`` (a slice of a leaf) contributes to the leaf's fingerprint.

  ``fingerprint([leaf])[0]`` is the sum mod 2**32 of the block sums of any
  disjoint blocks that cover ``leaf``: each element is weighted by its flat
  position in the whole leaf. Meant for a shard inside ``shard_map`` (no
  sharded leaf is ever gathered), read a chunk at a time so that temporaries
  stay a few MB whatever the block's size.

  Args:
    block: the slice of the leaf (a jax array, e.g. one device's shard).
    start: the leaf index of the block's first element, one (possibly traced)
      integer per dimension of ``shape``.
    shape: the whole leaf's shape.

  Returns:
    A uint32 scalar.
  """
  block = jnp.asarray(block)
  shape, local = tuple(int(d) for d in shape), block.shape
  size = math.prod(shape)
  strides = [math.prod(shape[d + 1:]) % 2**32 for d in range(len(shape))]
  base = sum((jnp.asarray(s).astype(jnp.uint32) * jnp.uint32(g) for s, g in zip(start, strides)),
             jnp.uint32(0))

  def chunk_sum(x, first):
    """Sum over the chunk ``x``: the block's flat elements ``first, first + 1, ...``."""
    index, flat = first + jax.lax.iota(jnp.uint32, x.shape[0]), base
    for d in reversed(range(len(local))):  # unravel in the block, ravel in the leaf
      flat = flat + index % jnp.uint32(local[d]) * jnp.uint32(strides[d])
      index = index // jnp.uint32(local[d])
    total, offset = jnp.uint32(0), 0
    for part in _device_parts(x):  # (k,) or, for 8-byte elements, (k, 2) words
      first_word = jnp.uint32(offset % 2**32)
      if part.ndim == 2:  # word w of element i is word 2i + w of the part
        position = first_word + 2 * flat[:, None] + jax.lax.iota(jnp.uint32, 2)[None]
      else:
        position = first_word + flat
      total = total + jnp.sum(part * (2 * position + 1), dtype=jnp.uint32)
      offset += size * (part.shape[1] if part.ndim == 2 else 1)
    return total

  flat = block.reshape(-1)
  full = flat.shape[0] // _CHUNK
  total = jnp.uint32(0)
  if full:
    def body(k, acc):
      chunk = jax.lax.dynamic_slice_in_dim(flat, k * _CHUNK, _CHUNK)
      return acc + chunk_sum(chunk, (k * _CHUNK).astype(jnp.uint32))

    total = jax.lax.fori_loop(0, full, body, total)
  if flat.shape[0] % _CHUNK:
    total = total + chunk_sum(flat[full * _CHUNK:], jnp.uint32(full * _CHUNK))
  return total
