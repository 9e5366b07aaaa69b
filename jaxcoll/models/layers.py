"""Repeated blocks, unrolled or scanned (``nn.scan`` + ``nn.remat``).

A scanned stack keeps one copy of the block's code and its parameters
stacked on a leading layer axis (``params["layers"][...]`` of shape
``(num_layers, ...)``), as MaxText does: compile time no longer grows with
depth, and with ``nn.remat`` of the block the backward pass keeps only each
layer's input alive (activations ``O(layers x batch x width)`` instead of every
intermediate of every layer). The block class is looked up by the caller at
call time, so a module-level ``Block = jaxcoll.fsdp_unit(Block)`` applies to
both forms.

Example:
  >>> import flax.linen as nn, jax, jax.numpy as jnp
  >>> class Net(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x):
  ...     return repeat(nn.Dense, x, length=3, scan=True, features=4)
  >>> p = Net().init(jax.random.key(0), jnp.ones((2, 4)))
  >>> p["params"]["layers"]["kernel"].shape
  (3, 4, 4)
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax

from jaxcoll.train import fsdp

LAYERS = "layers"  # the name of a scanned stack's params (its leading axis is the layer)


def repeat(
    block: type[nn.Module], x: jax.Array, *, length: int, scan: bool, remat: bool = True,
    **block_kwargs: Any,
) -> jax.Array:
  """``x`` through ``length`` instances of ``block`` (each maps ``x -> x``).

  Call it inside a parent's ``nn.compact`` method.

  Args:
    block: a flax linen Module class whose ``__call__(x)`` returns an array
      of ``x``'s shape.
    x: the input.
    length: number of blocks.
    scan: False: ``length`` separate submodules (``Block_0``, ``Block_1``,
      ...); True: one ``nn.scan`` over the block named ``"layers"``, its
      params stacked on axis 0.
    remat: with ``scan``, wrap the block in ``nn.remat`` (recompute its
      activations in backward; the layer inputs are the only ones saved).
    **block_kwargs: the block's attributes.

  Returns:
    The output of the last block.
  """
  if not scan:
    for _ in range(length):
      x = block(**block_kwargs)(x)
    return x
  # scan already stops CSE; FSDP units in the block skip their own remat (one gather in
  # backward, not two: fsdp.inside_remat).
  cls = nn.remat(fsdp.inside_remat(block), prevent_cse=False) if remat else block
  stack = nn.scan(
      lambda mdl, carry, _: (mdl(carry), None),
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=length,
  )
  x, _ = stack(cls(**block_kwargs, name=LAYERS), x, None)
  return x
