"""A user's flax.nnx model (``--config.model=nnx_task:make``): Linear -> BatchNorm ->
Dropout -> Linear on the MLP workload's synthetic data, built by
``jaxcoll.models.from_nnx``; what the nnx runner tests train."""

import jax
from dropout_task import _loss  # the same cross-entropy + accuracy
from flax import nnx

from jaxcoll import models


class NnxMLP(nnx.Module):
  def __init__(self, input_dim: int, width: int, rate: float, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(input_dim, width, use_bias=False, rngs=rngs)
    self.bn = nnx.BatchNorm(width, axis_name="data", rngs=rngs)
    self.drop = nnx.Dropout(rate, rngs=rngs)
    self.out = nnx.Linear(width, 10, rngs=rngs)

  def __call__(self, x):
    return self.out(self.drop(jax.nn.relu(self.bn(self.hidden(x)))))


def make(widths=(32,), rate=0.25, input_dim=16) -> models.Workload:
  """``widths``: one hidden layer (as configs/minimal.py's override)."""
  (width,) = widths
  data = models.make_workload("mlp", widths=(width,), input_dim=input_dim).dataset
  return models.from_nnx(lambda rngs: NnxMLP(input_dim, width, rate, rngs), _loss,
                         dataset=data, name="nnx_mlp")
