"""DLRM-like click-through-rate model.

As Naumov et al., "Deep Learning Recommendation Model for Personalization
and Recommendation Systems" (2019): each categorical feature looks up a row of
its own embedding table; the dense features go through a bottom MLP to the
embedding size; the dot products of every pair of these vectors (the strictly
lower triangle of their Gram matrix), concatenated with the bottom MLP's
output, feed a top MLP that ends in one click logit; the loss is the logistic
loss on the binary click label.

Example:
  >>> from jaxcoll.models import recommender
  >>> w = recommender.make_workload()
  >>> loss, aux = w.loss_fn(w.init_params(0), w.make_batch(0, 8))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcoll import data
from jaxcoll.models.workload import Workload, as_key, check_positive, check_widths


class DLRM(nn.Module):
  """Embedding tables, bottom MLP, pairwise dot interactions, top MLP.

  Attributes:
    table_sizes: rows of each embedding table (one per categorical feature).
    embed_dim: embedding size (the bottom MLP's last width).
    bottom_widths: hidden widths of the bottom MLP (before ``embed_dim``).
    top_widths: hidden widths of the top MLP (before the logit).
    dtype: computation dtype (parameters stay float32).
  """

  table_sizes: Sequence[int] = (64, 128, 256, 32)
  embed_dim: int = 16
  bottom_widths: Sequence[int] = (32,)
  top_widths: Sequence[int] = (64, 32)
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, dense: jax.Array, sparse: jax.Array) -> jax.Array:
    x = dense.astype(self.dtype)
    for width in self.bottom_widths:
      x = nn.relu(nn.Dense(width, dtype=self.dtype)(x))
    x = nn.relu(nn.Dense(self.embed_dim, dtype=self.dtype)(x))
    embedded = [
        nn.Embed(size, self.embed_dim, dtype=self.dtype, name=f"table_{t}")(sparse[:, t])
        for t, size in enumerate(self.table_sizes)
    ]
    vectors = jnp.stack([x, *embedded], axis=1)  # (batch, 1 + tables, embed_dim)
    gram = jnp.einsum("bid,bjd->bij", vectors, vectors)
    rows, cols = np.tril_indices(vectors.shape[1], k=-1)
    y = jnp.concatenate([x, gram[:, rows, cols]], axis=-1)
    for width in self.top_widths:
      y = nn.relu(nn.Dense(width, dtype=self.dtype)(y))
    return nn.Dense(1, dtype=self.dtype)(y)[:, 0].astype(jnp.float32)


def click_metrics(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Mean logistic loss and accuracy (threshold 0.5) of click ``logits``."""
  loss = optax.sigmoid_binary_cross_entropy(logits, labels).mean()
  accuracy = jnp.mean((logits > 0) == (labels > 0.5))
  return loss, accuracy


def make_workload(
    *,
    table_sizes: Sequence[int] = (64, 128, 256, 32),
    embed_dim: int = 16,
    num_dense: int = 8,
    bottom_widths: Sequence[int] = (32,),
    top_widths: Sequence[int] = (64, 32),
    seed: int = 0,
    dtype: Any = jnp.float32,
) -> Workload:
  """The DLRM workload (click logs from a random DLRM-shaped teacher).

  Args:
    table_sizes: rows of each embedding table; one categorical feature each.
    embed_dim: embedding size.
    num_dense: dense features.
    bottom_widths: hidden widths of the bottom MLP.
    top_widths: hidden widths of the top MLP.
    seed: data seed.
    dtype: computation dtype.

  Returns:
    A :class:`Workload`; batch keys ``dense``, ``sparse``, ``labels``;
    ``aux`` holds ``accuracy``.
  """
  table_sizes = check_widths(table_sizes, "table_sizes")
  dataset = data.ClickData(
      num_dense=check_positive(num_dense, "num_dense"), table_sizes=table_sizes, seed=seed
  )
  model = DLRM(
      table_sizes=table_sizes,
      embed_dim=check_positive(embed_dim, "embed_dim"),
      bottom_widths=check_widths(bottom_widths, "bottom_widths"),
      top_widths=check_widths(top_widths, "top_widths"),
      dtype=dtype,
  )

  def init_params(rng):
    dense = jnp.zeros((1, num_dense), jnp.float32)
    sparse = jnp.zeros((1, len(table_sizes)), jnp.int32)
    return dict(model.init(as_key(rng), dense, sparse))

  def loss_fn(params, batch):
    logits = model.apply(params, batch["dense"], batch["sparse"])
    loss, accuracy = click_metrics(logits, batch["labels"])
    return loss, {"accuracy": accuracy}

  return Workload(
      name="recommender",
      model=model,
      dataset=dataset,
      init_params=init_params,
      loss_fn=loss_fn,
      config=dict(
          table_sizes=table_sizes, embed_dim=embed_dim, num_dense=num_dense,
          bottom_widths=tuple(bottom_widths), top_widths=tuple(top_widths), seed=seed,
          dtype=dtype,
      ),
  )
