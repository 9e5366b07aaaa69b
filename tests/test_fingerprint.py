"""jaxcoll.fingerprint: every bit of every dtype changes the checksum."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxcoll.fingerprint import fingerprint, words

DTYPES = [np.bool_, np.int8, np.uint8, np.int16, ml_dtypes.bfloat16, np.float16, np.int32,
          np.uint32, np.float32, np.int64, np.float64, np.complex64, np.complex128]


def _flip(x: np.ndarray, byte: int, bit: int) -> np.ndarray:
  raw = np.ascontiguousarray(x).copy().view(np.uint8)
  raw.reshape(-1)[byte] ^= np.uint8(1 << bit)
  return raw.view(x.dtype).reshape(x.shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_single_bit_flip_changes_the_fingerprint(dtype):
  x = (np.arange(3) % 2).astype(dtype) if dtype is np.bool_ else np.arange(1, 4).astype(dtype)
  base = int(fingerprint([x])[0])
  nbytes = x.nbytes
  for byte in range(nbytes):
    bits = range(1) if dtype is np.bool_ else range(8)  # a bool is 0 or 1
    for bit in bits:
      assert int(fingerprint([_flip(x, byte, bit)])[0]) != base, (byte, bit)


def test_complex_leaves_that_differ_only_in_the_imaginary_part():
  a = np.asarray([1 + 2j, 3 - 1j], np.complex64)
  b = np.asarray([1 + 2j, 3 - 2j], np.complex64)
  assert int(fingerprint([a])[0]) != int(fingerprint([b])[0])
  swapped = np.asarray([2 + 1j, -1 + 3j], np.complex64)  # real and imaginary swapped
  assert int(fingerprint([a])[0]) != int(fingerprint([swapped])[0])


def test_low_half_of_float64_and_signed_zero_and_swaps_count():
  x = np.asarray([1.0, 2.0], np.float64)
  y = np.nextafter(x, 3.0)  # differs in the last mantissa bit: lost by a float32 cast
  assert np.float32(x[0]) == np.float32(y[0])
  assert int(fingerprint([x])[0]) != int(fingerprint([y])[0])
  assert int(fingerprint([np.float32(0.0)])[0]) != int(fingerprint([np.float32(-0.0)])[0])
  assert int(fingerprint([np.asarray([1.0, 2.0], np.float32)])[0]) != int(
      fingerprint([np.asarray([2.0, 1.0], np.float32)])[0])


def test_host_and_jit_agree_and_one_entry_per_leaf():
  tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.int32(7),
          "m": np.asarray([True, False])}
  host = np.asarray(fingerprint(tree))
  device = np.asarray(jax.jit(fingerprint)(jax.tree.map(jnp.asarray, tree)))
  assert host.dtype == np.uint32 and host.shape == (3,)
  np.testing.assert_array_equal(host, device)
  assert fingerprint({}).shape == (0,)


def test_unsupported_width_is_a_value_error():
  with pytest.raises(ValueError, match="cannot fingerprint a leaf of dtype float128"):
    words(np.zeros(2, np.longdouble))
