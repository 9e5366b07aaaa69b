"""BERT-style transformer encoder with a masked-LM head.

As Devlin et al., "BERT: Pre-training of Deep Bidirectional Transformers"
(2019): token + learned position embeddings, LayerNorm, post-LN encoder
layers (self-attention, add & norm, GELU feed-forward, add & norm), and an
MLM head (dense, GELU, LayerNorm, then logits through the token embedding
matrix, tied, plus an output bias). No dropout: ``loss_fn(params, batch)``
takes no random key, and the synthetic task does not need it.

The loss is the cross-entropy over the masked positions only, averaged over
them. :class:`jaxcoll.data.TokenData` masks the same number of
positions in every sequence, so this mean over a local batch, averaged over
equal shards, is the mean over the global batch.

Example:
  >>> from jaxcoll.models import transformer
  >>> w = transformer.make_workload(num_layers=1)
  >>> loss, aux = w.loss_fn(w.init_params(0), w.make_batch(0, 4))
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxcoll import data
from jaxcoll.models import layers
from jaxcoll.models.workload import Workload, as_key, check_positive
from jaxcoll.train.fsdp import fsdp_unit

SCAN_FROM_LAYERS = 8  # scan_layers=None scans from this depth on

_init = nn.initializers.truncated_normal(0.02)  # BERT's initializer_range


class EncoderLayer(nn.Module):
  """Post-LN transformer encoder layer (BERT)."""

  num_heads: int
  mlp_dim: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    y = nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads, dtype=self.dtype, kernel_init=_init
    )(x, x)
    x = nn.LayerNorm(epsilon=1e-12, dtype=self.dtype)(x + y)
    y = nn.Dense(self.mlp_dim, dtype=self.dtype, kernel_init=_init)(x)
    y = nn.Dense(x.shape[-1], dtype=self.dtype, kernel_init=_init)(nn.gelu(y, approximate=False))
    return nn.LayerNorm(epsilon=1e-12, dtype=self.dtype)(x + y)


# Under ZeRO-3 each block is an FSDP unit: gathered where it runs, freed after it.
EncoderLayer = fsdp_unit(EncoderLayer)


class BertMLM(nn.Module):
  """Transformer encoder returning masked-LM logits ``(batch, seq, vocab)``.

  Attributes:
    vocab_size: token ids ``0 .. vocab_size - 1``.
    max_len: the longest sequence (position embeddings).
    num_layers: encoder layers.
    d_model: hidden size.
    num_heads: attention heads (must divide ``d_model``).
    mlp_dim: feed-forward hidden size (BERT: ``4 * d_model``).
    dtype: computation dtype (parameters stay float32).
    scan_layers: run the encoder layers as one ``nn.scan`` over
      ``nn.remat(EncoderLayer)``, params stacked under ``"layers"`` with a
      leading layer axis (see :mod:`jaxcoll.models.layers`); False: separate
      ``EncoderLayer_0``, ``EncoderLayer_1``, ... submodules.
  """

  vocab_size: int = 128
  max_len: int = 32
  num_layers: int = 2
  d_model: int = 64
  num_heads: int = 4
  mlp_dim: int = 256
  dtype: Any = jnp.float32
  scan_layers: bool = False

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    embed = nn.Embed(self.vocab_size, self.d_model, embedding_init=_init, name="token_embed")
    positions = self.param("position_embed", _init, (self.max_len, self.d_model))
    x = embed(tokens) + positions[: tokens.shape[-1]]
    x = nn.LayerNorm(epsilon=1e-12, dtype=self.dtype)(x.astype(self.dtype))
    # The global name, read at call time: a module-level
    # `EncoderLayer = jaxcoll.fsdp_unit(EncoderLayer)` reaches both forms.
    x = layers.repeat(
        EncoderLayer, x, length=self.num_layers, scan=self.scan_layers,
        num_heads=self.num_heads, mlp_dim=self.mlp_dim, dtype=self.dtype,
    )
    x = nn.Dense(self.d_model, dtype=self.dtype, kernel_init=_init, name="mlm_dense")(x)
    x = nn.LayerNorm(epsilon=1e-12, dtype=self.dtype, name="mlm_norm")(
        nn.gelu(x, approximate=False)
    )
    bias = self.param("mlm_bias", nn.initializers.zeros, (self.vocab_size,))
    return (embed.attend(x) + bias).astype(jnp.float32)


def masked_lm_loss(logits: jax.Array, batch: dict) -> tuple[jax.Array, jax.Array]:
  """Mean cross-entropy and accuracy over the positions with weight 1."""
  weights = batch["weights"].astype(jnp.float32)
  targets = batch["targets"]
  count = jnp.maximum(weights.sum(), 1.0)
  loss = (optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weights).sum()
  correct = ((jnp.argmax(logits, -1) == targets) * weights).sum()
  return loss / count, correct / count


def make_workload(
    *,
    num_layers: int = 2,
    d_model: int = 64,
    num_heads: int = 4,
    mlp_dim: int | None = None,
    vocab_size: int = 128,
    seq_len: int = 32,
    mask_rate: float = 0.15,
    seed: int = 0,
    dtype: Any = jnp.float32,
    scan_layers: bool | None = None,
) -> Workload:
  """The BERT masked-LM workload (sequences from a random topic-bigram teacher).

  Args:
    num_layers: encoder layers.
    d_model: hidden size.
    num_heads: attention heads; must divide ``d_model``.
    mlp_dim: feed-forward size; default ``4 * d_model``.
    vocab_size: vocabulary including ``[MASK]`` (id 0).
    seq_len: sequence length.
    mask_rate: fraction of positions predicted per sequence (BERT: 0.15).
    seed: data seed.
    dtype: computation dtype.
    scan_layers: scan the encoder layers (one compiled layer, params stacked
      on a leading axis under ``params["layers"]``, each layer rematerialized
      in backward). ``None`` (default): scan from ``SCAN_FROM_LAYERS`` (8)
      layers on, where it helps: compile time stops growing with depth and
      activation memory drops to the layer inputs; shallower models stay
      unrolled (``EncoderLayer_0``, ...; no recompute cost). The loss is the
      same for the same (stacked) parameters.

  Returns:
    A :class:`Workload`; batch keys ``tokens``, ``targets``, ``weights``;
    ``aux`` holds ``accuracy`` over the masked positions.

  Raises:
    ValueError: if ``num_heads`` does not divide ``d_model``.
  """
  d_model = check_positive(d_model, "d_model")
  num_heads = check_positive(num_heads, "num_heads")
  if d_model % num_heads:
    raise ValueError(
        f"`num_heads` ({num_heads}) must divide `d_model` ({d_model}); "
        f"e.g. num_heads={next(h for h in (8, 4, 2, 1) if d_model % h == 0)}."
    )
  mlp_dim = 4 * d_model if mlp_dim is None else check_positive(mlp_dim, "mlp_dim")
  num_layers = check_positive(num_layers, "num_layers")
  if scan_layers is None:
    scan_layers = num_layers >= SCAN_FROM_LAYERS
  elif not isinstance(scan_layers, bool):
    raise TypeError(f"`scan_layers` must be True, False or None (auto); got {scan_layers!r}.")
  dataset = data.TokenData(
      vocab_size=vocab_size, seq_len=seq_len, mask_rate=mask_rate, seed=seed
  )
  model = BertMLM(
      vocab_size=vocab_size,
      max_len=seq_len,
      num_layers=num_layers,
      d_model=d_model,
      num_heads=num_heads,
      mlp_dim=mlp_dim,
      dtype=dtype,
      scan_layers=scan_layers,
  )

  def init_params(rng):
    return dict(model.init(as_key(rng), jnp.zeros((1, seq_len), jnp.int32)))

  def loss_fn(params, batch):
    loss, accuracy = masked_lm_loss(model.apply(params, batch["tokens"]), batch)
    return loss, {"accuracy": accuracy}

  return Workload(
      name="transformer",
      model=model,
      dataset=dataset,
      init_params=init_params,
      loss_fn=loss_fn,
      label_classes={"tokens": vocab_size, "targets": vocab_size},
      config=dict(
          num_layers=num_layers, d_model=d_model, num_heads=num_heads, mlp_dim=mlp_dim,
          vocab_size=vocab_size, seq_len=seq_len, mask_rate=mask_rate, seed=seed, dtype=dtype,
          scan_layers=scan_layers,
      ),
  )
