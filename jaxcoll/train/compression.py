"""Compressed mean all-reduce of one gradient bucket, with error feedback.

* ``"bf16"``: the bucket crosses the wire as bfloat16 (half of float32's
  bytes) through ``jaxcoll.all_reduce(op="mean")``.
* ``"int8"``: a quantized reduce-scatter then a quantized all-gather, as
  ZeRO++'s qgZ (Wang et al., "ZeRO++", 2023). The bucket is padded and cut
  into ``N`` segments; each segment is quantized symmetrically with one
  float32 scale per block of :data:`INT8_BLOCK` values; an all-to-all sends
  segment ``j`` to device ``j``, which dequantizes the ``N`` copies, sums them
  in float32, re-quantizes the mean and all-gathers it. About ``1/4`` of
  float32's bytes cross the wire (plus one scale per block).

Error feedback (Seide et al. 2014; EF-SGD, Karimireddy et al. 2019; 1-bit
Adam, Tang et al. 2021): what quantization dropped is kept in the state and
added to the next step's input, so no gradient is lost, only delayed. Each
device keeps a *worker* residual (its own bucket, before sending) and, for
int8, a *server* residual (the segment it re-quantizes).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxcoll import checks, collectives

INT8_BLOCK = 256  # values per float32 scale (ZeRO++ uses block-based scales)


def residual_shapes(size: int, n: int, compression: str | None) -> dict[str, tuple[int, ...]]:
  """Shapes of one bucket's error-feedback residuals (empty dict: none)."""
  if compression == "bf16":
    return {"worker": (size,)}
  if compression == "int8":
    segment, _ = _int8_segment(size, n)
    return {"worker": (size,), "server": (segment,)}
  return {}


def _int8_segment(size: int, n: int) -> tuple[int, int]:
  """(segment length, block) for a bucket of ``size`` values over ``n`` devices."""
  per_device = max(-(-size // n), 1)
  block = min(INT8_BLOCK, per_device)
  return -(-per_device // block) * block, block


def quantize_int8(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
  """Symmetric int8 with one scale per ``block`` values of the last axis.

  Returns ``(q, scale)``: ``q`` has ``x``'s shape (int8 in [-127, 127]),
  ``scale`` the last axis divided by ``block`` (float32).
  """
  blocks = x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))
  scale = jnp.max(jnp.abs(blocks), axis=-1) / 127.0
  safe = jnp.where(scale > 0, scale, 1.0)
  q = jnp.clip(jnp.round(blocks / safe[..., None]), -127, 127).astype(jnp.int8)
  return q.reshape(x.shape), scale


def dequantize_int8(q: jax.Array, scale: jax.Array, block: int) -> jax.Array:
  blocks = q.reshape(q.shape[:-1] + (q.shape[-1] // block, block)).astype(jnp.float32)
  return (blocks * scale[..., None]).reshape(q.shape)


def compressed_mean(
  bucket: jax.Array,
  residual: dict[str, jax.Array],
  axis,
  *,
  compression: str,
  algorithm,
  error_feedback: bool,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean over ``axis`` of a float32 1-D ``bucket``, compressed on the wire.

  Args:
    bucket: this device's flat gradient bucket (float32).
    residual: this bucket's residuals (see :func:`residual_shapes`).
    axis: the data-parallel axis (or tuple of axes).
    compression: ``"bf16"`` or ``"int8"``.
    algorithm: the all-reduce algorithm (bf16 only; int8 uses ``"auto"``).
    error_feedback: whether to add and update the residuals.

  Returns:
    ``(mean, new_residual)``; ``mean`` is the same on every device.
  """
  x = bucket + residual["worker"] if error_feedback else bucket
  if compression == "bf16":
    wire = x.astype(jnp.bfloat16)
    new = {"worker": x - wire.astype(jnp.float32)} if error_feedback else residual
    mean = collectives.all_reduce(wire, axis, op="mean", algorithm=algorithm)
    return mean.astype(jnp.float32), new
  if compression == "int8":
    return _int8_mean(x, residual, axis, error_feedback)
  raise ValueError(f"`compression` must be 'bf16' or 'int8'; got {compression!r}.")


def _int8_mean(x, residual, axis, error_feedback):
  size = x.shape[0]
  axes = checks.axis_names(axis)
  n = math.prod(int(jax.lax.axis_size(a)) for a in axes)
  segment, block = _int8_segment(size, n)
  padded = jnp.zeros((n * segment,), jnp.float32).at[:size].set(x).reshape(n, segment)
  q, scale = quantize_int8(padded, block)
  new = dict(residual)
  if error_feedback:
    new["worker"] = x - dequantize_int8(q, scale, block).reshape(-1)[:size]

  # Quantized reduce-scatter: row j goes to device j; sum our N copies in f32.
  q_in = collectives.all_to_all(q, axis, 0, 0)
  scale_in = collectives.all_to_all(scale, axis, 0, 0)
  mine = jnp.sum(dequantize_int8(q_in, scale_in, block), axis=0) / n
  if error_feedback:
    mine = mine + residual["server"]

  # Quantized all-gather of the reduced segment.
  q_mine, scale_mine = quantize_int8(mine, block)
  if error_feedback:
    new["server"] = mine - dequantize_int8(q_mine, scale_mine, block)
  q_all = collectives.all_gather(q_mine, axis).reshape(n, segment)
  scale_all = collectives.all_gather(scale_mine, axis).reshape(n, segment // block)
  mean = dequantize_int8(q_all, scale_all, block).reshape(-1)[:size]
  return mean, new
