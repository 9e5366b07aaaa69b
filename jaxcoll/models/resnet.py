"""CIFAR-style ResNet-18 with cross-replica (synchronised) BatchNorm.

The network of He et al., "Deep Residual Learning for Image Recognition"
(2016), in its CIFAR form: a 3x3 stem convolution (no max-pool), four stages
of two BasicBlocks with ``width * (1, 2, 4, 8)`` channels and strides
``(1, 2, 2, 2)``, global average pooling and a dense classifier. ``width=64``
is the standard ResNet-18 (11.2M parameters); the default 8 trains in seconds
on a CPU.

BatchNorm statistics are taken over the *global* batch however the loss runs:
inside ``jax.shard_map`` / ``jax.pmap`` the per-device means are averaged
with ``lax.pmean`` across ``bn_axis_name`` (flax's
``nn.BatchNorm(axis_name=...)``); the default ``"*"`` means every axis bound
there (the whole data-parallel group, e.g. ``("node", "local")`` on a 2-D
mesh). Under plain ``jit`` (one device, or a global array that XLA
partitions) no axis is bound and the batch is already whole. So one loss
function gives the same update on one device and on N. Naming an axis that
is not bound inside ``shard_map`` / ``pmap`` is an error, never a silent
switch to per-device statistics.

Example:
  >>> from jaxcoll.models import resnet
  >>> w = resnet.make_workload(width=4, image_size=8)
  >>> params = w.init_params(0)
  >>> sorted(params)
  ['batch_stats', 'params']
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxcoll import checks, collectives, data
from jaxcoll.models.workload import Workload, as_key, check_positive, check_widths
from jaxcoll.train.fsdp import fsdp_unit

AxisName = str | tuple[str, ...] | None
ALL_BOUND_AXES = "*"  # bn_axis_name: every axis bound by the enclosing shard_map / pmap


def bound_axis_name(axis_name: AxisName) -> AxisName:
  """The axes BatchNorm averages over here (at trace time), or None.

  Args:
    axis_name: a mesh axis, a tuple of them, ``"*"`` (every bound axis) or
      None (per-device statistics).

  Returns:
    ``axis_name`` (for ``"*"``: the bound axes) inside ``shard_map`` /
    ``pmap``; None where no axis is bound (plain ``jit``: the batch is whole,
    there are no replicas to average over), or for ``axis_name=None``.

  Raises:
    ValueError: inside ``shard_map`` / ``pmap``, an axis of ``axis_name`` that
      is not bound there (statistics would silently become per-device).
  """
  if axis_name is None:
    return None
  bound = collectives.bound_axes()
  if axis_name == ALL_BOUND_AXES:
    names = tuple(bound)
    return None if not names else names[0] if len(names) == 1 else names
  missing = [a for a in checks.axis_names(axis_name) if a not in bound]
  if not missing:
    return axis_name
  if not bound:
    return None
  raise ValueError(
      f"`bn_axis_name`={axis_name!r}: axis {missing[0]!r} is not bound here; the mesh "
      f"axes bound by shard_map / pmap are {tuple(bound)}. Pass bn_axis_name="
      f"{tuple(bound)!r} (or '*', every bound axis) to average BatchNorm statistics over "
      "the whole batch, or None for per-device statistics."
  )


class BasicBlock(nn.Module):
  """Two 3x3 convolutions with BatchNorm and an identity / 1x1 shortcut."""

  channels: int
  strides: int = 1
  norm: Any = nn.BatchNorm
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
    y = conv(self.channels, (3, 3), (self.strides, self.strides))(x)
    y = nn.relu(self.norm()(y))
    y = conv(self.channels, (3, 3))(y)
    # Zero-init the last scale: each block starts as the identity (Goyal et
    # al., "Accurate, Large Minibatch SGD", 2017), which steadies early steps.
    y = self.norm(scale_init=nn.initializers.zeros)(y)
    if x.shape != y.shape:
      x = conv(self.channels, (1, 1), (self.strides, self.strides))(x)
      x = self.norm()(x)
    return nn.relu(x + y)


# Under ZeRO-3 each block is an FSDP unit: gathered where it runs, freed after it.
BasicBlock = fsdp_unit(BasicBlock)


class ResNet(nn.Module):
  """CIFAR-style ResNet (ResNet-18 with the default ``stage_sizes``).

  Attributes:
    num_classes: classifier outputs.
    width: channels of the stem and the first stage (64 = standard).
    stage_sizes: BasicBlocks per stage.
    bn_axis_name: mesh axis (or tuple of axes) over which BatchNorm averages
      its statistics inside shard_map / pmap; ``"*"`` (default) for every
      bound axis; None for per-device statistics. See :func:`bound_axis_name`.
    bn_momentum: decay of the running statistics.
    dtype: computation dtype (parameters and statistics stay float32).
  """

  num_classes: int = 10
  width: int = 8
  stage_sizes: Sequence[int] = (2, 2, 2, 2)
  bn_axis_name: AxisName = ALL_BOUND_AXES
  bn_momentum: float = 0.9
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
    norm = functools.partial(
        nn.BatchNorm,
        use_running_average=not train,
        momentum=self.bn_momentum,
        epsilon=1e-5,
        dtype=self.dtype,
        axis_name=bound_axis_name(self.bn_axis_name) if train else None,
    )
    x = x.astype(self.dtype)
    x = nn.Conv(self.width, (3, 3), use_bias=False, dtype=self.dtype)(x)
    x = nn.relu(norm()(x))
    for stage, num_blocks in enumerate(self.stage_sizes):
      for block in range(num_blocks):
        strides = 2 if stage > 0 and block == 0 else 1
        x = BasicBlock(self.width * 2**stage, strides, norm=norm, dtype=self.dtype)(x)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)


def make_workload(
    *,
    width: int = 8,
    image_size: int = 32,
    num_classes: int = 10,
    stage_sizes: Sequence[int] = (2, 2, 2, 2),
    channels: int = 3,
    bn_axis_name: AxisName = ALL_BOUND_AXES,
    bn_momentum: float = 0.9,
    seed: int = 0,
    dtype: Any = jnp.float32,
) -> Workload:
  """The ResNet-18 workload (teacher-labelled images).

  Args:
    width: base channels (64 = standard ResNet-18).
    image_size: image height and width (a multiple of 4).
    num_classes: classes.
    stage_sizes: BasicBlocks per stage ((2, 2, 2, 2) = ResNet-18).
    channels: image channels.
    bn_axis_name: the data axes of the trainer's mesh, over which BatchNorm
      averages its statistics when the loss runs inside ``shard_map``;
      ``"*"`` (default) is every axis bound there, so a 2-D ``("node",
      "local")`` mesh averages over both. None keeps per-device statistics.
    bn_momentum: decay of the running statistics.
    seed: data seed.
    dtype: computation dtype.

  Returns:
    A :class:`Workload` whose params are ``{"params", "batch_stats"}``;
    ``loss_fn`` returns ``(loss, {"accuracy", "batch_stats"})`` where
    ``batch_stats`` are the updated running statistics: write them back with
    ``params = workload.merge_aux(params, aux)`` after each step.
  """
  dataset = data.TeacherImageData(
      image_size=check_positive(image_size, "image_size"),
      channels=check_positive(channels, "channels"),
      num_classes=check_positive(num_classes, "num_classes"),
      seed=seed,
  )
  model = ResNet(
      num_classes=num_classes,
      width=check_positive(width, "width"),
      stage_sizes=check_widths(stage_sizes, "stage_sizes"),
      bn_axis_name=bn_axis_name,
      bn_momentum=bn_momentum,
      dtype=dtype,
  )

  def init_params(rng):
    x = jnp.zeros((1, image_size, image_size, channels), jnp.float32)
    return dict(model.init(as_key(rng), x, train=False))

  def loss_fn(params, batch):
    logits, updates = model.apply(params, batch["images"], train=True, mutable=["batch_stats"])
    labels = batch["labels"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return loss, {"accuracy": accuracy, "batch_stats": updates["batch_stats"]}

  def eval_fn(params, batch):
    logits = model.apply(params, batch["images"], train=False)
    labels = batch["labels"]
    return {
        "loss": optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(),
        "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels),
    }

  return Workload(
      name="resnet",
      model=model,
      dataset=dataset,
      init_params=init_params,
      loss_fn=loss_fn,
      eval_fn=eval_fn,
      state_collections=("batch_stats",),
      label_classes={"labels": num_classes},
      config=dict(
          width=width, image_size=image_size, num_classes=num_classes,
          stage_sizes=tuple(stage_sizes), channels=channels, bn_axis_name=bn_axis_name,
          bn_momentum=bn_momentum, seed=seed, dtype=dtype,
      ),
  )
