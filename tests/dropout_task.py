"""A user's flax model with ``nn.Dropout`` (``--config.model=dropout_task:make``),
on the MLP workload's synthetic data: what the dropout tests train."""

import flax.linen as nn
import jax.numpy as jnp
import optax

from jaxcoll import models


class DropoutMLP(nn.Module):
  width: int = 32
  rate: float = 0.5

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = nn.relu(nn.Dense(self.width)(x))
    x = nn.Dropout(self.rate, deterministic=not train)(x)
    return nn.Dense(10)(x)


def _loss(logits, batch):
  labels = batch["labels"]
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  return ce, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


def make(widths=(32,), rate=0.5, input_dim=16) -> models.Workload:
  """``widths``: one hidden layer (as configs/minimal.py's override)."""
  (width,) = widths
  data = models.make_workload("mlp", widths=(width,), input_dim=input_dim).dataset
  return models.from_flax(DropoutMLP(width, rate), _loss, dataset=data, name="dropout_mlp")


def make_without_dropout(widths=(32,), input_dim=16) -> models.Workload:
  """The same model with rate 0: what a run that ignored the key would train."""
  return make(widths, 0.0, input_dim)
