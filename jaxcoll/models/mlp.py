"""MLP classifier / regressor on teacher-labelled Gaussian vectors.

Example:
  >>> from jaxcoll.models import mlp
  >>> w = mlp.make_workload(widths=(32,))
  >>> params = w.init_params(0)
  >>> loss, aux = w.loss_fn(params, w.make_batch(step=0, batch_size=8))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxcoll import data
from jaxcoll.models import layers
from jaxcoll.models.workload import Workload, as_key, check_positive, check_widths
from jaxcoll.train.fsdp import fsdp_unit

SCAN_FROM_LAYERS = 8  # scan_layers=None scans this many equal hidden layers or more


class DenseBlock(nn.Module):
  """One hidden layer, ``relu(x @ kernel + bias)``, of ``x``'s width (the scanned block)."""

  features: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return nn.relu(nn.Dense(self.features, dtype=self.dtype)(x))


# Under ZeRO-3 each block is an FSDP unit: gathered where it runs, freed after it.
DenseBlock = fsdp_unit(DenseBlock)


class MLP(nn.Module):
  """Dense layers with ReLU between them.

  Attributes:
    widths: hidden layer widths.
    num_outputs: output features (classes, or regression outputs).
    dtype: computation dtype (parameters stay float32).
    scan_layers: hidden layers 2..n (all of width ``widths[0]``) as one
      ``nn.scan`` over ``nn.remat(DenseBlock)``, params stacked under
      ``"layers"``: ``{"Dense_0": first layer, "layers": {"Dense_0": (n - 1,
      ...)}, "Dense_1": output}``. False: ``Dense_0 .. Dense_n``.
  """

  widths: Sequence[int] = (64, 64)
  num_outputs: int = 10
  dtype: Any = jnp.float32
  scan_layers: bool = False

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.astype(self.dtype)
    if self.scan_layers:
      x = nn.relu(nn.Dense(self.widths[0], dtype=self.dtype)(x))
      # The global name, read at call time (a module-level fsdp_unit reaches it).
      x = layers.repeat(
          DenseBlock, x, length=len(self.widths) - 1, scan=True,
          features=self.widths[0], dtype=self.dtype,
      )
    else:
      for width in self.widths:
        x = nn.relu(nn.Dense(width, dtype=self.dtype)(x))
    return nn.Dense(self.num_outputs, dtype=self.dtype)(x).astype(jnp.float32)


def make_workload(
    *,
    widths: Sequence[int] = (64, 64),
    input_dim: int = 32,
    num_outputs: int = 10,
    task: str = "classification",
    teacher_widths: Sequence[int] = (64,),
    seed: int = 0,
    dtype: Any = jnp.float32,
    depth: int | None = None,
    width: int | None = None,
    scan_layers: bool | None = None,
) -> Workload:
  """The MLP workload.

  Args:
    widths: hidden widths of the student MLP.
    input_dim: input features.
    num_outputs: classes (classification) or outputs (regression).
    task: ``"classification"`` (softmax cross-entropy, teacher argmax labels)
      or ``"regression"`` (mean squared error to the teacher's outputs).
    teacher_widths: hidden widths of the random teacher.
    seed: data seed (the teacher and the inputs).
    dtype: computation dtype.
    depth: with ``width``, ``depth`` hidden layers of ``width`` (replaces
      ``widths``): a stack of equal blocks.
    width: see ``depth``.
    scan_layers: scan the equal hidden layers (see :class:`MLP`; needs at
      least 2 hidden layers, all of one width). ``None`` (default): scan when
      there are ``SCAN_FROM_LAYERS`` (8) or more equal hidden layers, where
      one compiled layer and per-layer remat help; else unrolled.

  Returns:
    A :class:`Workload`; batch keys ``inputs`` and ``labels``; ``aux`` holds
    ``accuracy`` (classification) or ``mse`` (regression).

  Raises:
    ValueError: bad sizes; ``depth`` without ``width`` (or the reverse);
      ``scan_layers=True`` with unequal widths or fewer than 2 hidden layers.
  """
  if (depth is None) != (width is None):
    raise ValueError(
        f"`depth` ({depth!r}) and `width` ({width!r}) go together: pass both "
        "(e.g. depth=8, width=512) or neither (then `widths` applies)."
    )
  if depth is not None:
    widths = (check_positive(width, "width"),) * check_positive(depth, "depth")
  widths = check_widths(widths, "widths")
  stackable = len(widths) >= 2 and len(set(widths)) == 1
  if scan_layers is None:
    scan_layers = stackable and len(widths) >= SCAN_FROM_LAYERS
  elif not isinstance(scan_layers, bool):
    raise TypeError(f"`scan_layers` must be True, False or None (auto); got {scan_layers!r}.")
  elif scan_layers and not stackable:
    raise ValueError(
        f"`scan_layers`=True needs at least 2 hidden layers of one width; got widths={widths}. "
        "Pass depth=L, width=W, or scan_layers=False."
    )
  dataset = data.TeacherMLPData(
      input_dim=check_positive(input_dim, "input_dim"),
      num_outputs=check_positive(num_outputs, "num_outputs"),
      teacher_widths=check_widths(teacher_widths, "teacher_widths"),
      task=task,
      seed=seed,
  )
  model = MLP(widths=widths, num_outputs=num_outputs, dtype=dtype, scan_layers=scan_layers)

  def init_params(rng):
    return dict(model.init(as_key(rng), jnp.zeros((1, input_dim), jnp.float32)))

  def metrics(params, batch):
    out = model.apply(params, batch["inputs"])
    if task == "classification":
      labels = batch["labels"]
      loss = optax.softmax_cross_entropy_with_integer_labels(out, labels).mean()
      return loss, {"accuracy": jnp.mean(jnp.argmax(out, -1) == labels)}
    loss = jnp.mean(jnp.square(out - batch["labels"]))
    return loss, {"mse": loss}

  return Workload(
      name="mlp",
      model=model,
      dataset=dataset,
      init_params=init_params,
      loss_fn=metrics,
      label_classes={"labels": num_outputs} if task == "classification" else {},
      config=dict(
          widths=widths, input_dim=input_dim, num_outputs=num_outputs, task=task,
          teacher_widths=tuple(teacher_widths), seed=seed, dtype=dtype,
          scan_layers=scan_layers,
      ),
  )
