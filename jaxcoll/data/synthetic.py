"""Synthetic, learnable data sets.

Every data set here is a pure function of ``(seed, step, global_batch_size)``:
the batch of step ``s`` holds the examples numbered ``s * B .. s * B + B - 1``
(``B`` the global batch size), and example ``k`` is computed from ``(seed,
split, k)`` alone by a counter-based hash (splitmix64). So

- a resumed run sees exactly the batches it would have seen (the step index
  is the whole data position);
- any rows of a batch can be computed without the others: in a multi-process
  job each process builds only its own rows (:func:`jaxcoll.data.sharding.global_batch`),
  as a real input pipeline reads only its own shard;
- ``split="eval"`` draws held-out examples from the same task.

Labels come from a fixed random *teacher* network (drawn from ``seed``), so a
student model can learn them and its loss falls:

- :class:`TeacherMLPData`: Gaussian vectors, labels (or regression targets)
  from a random MLP.
- :class:`TeacherImageData`: images = a random low-resolution pattern
  upsampled, plus pixel noise; labels from a random MLP on the pooled image.
- :class:`TokenData`: token sequences from a random topic-bigram teacher,
  masked as BERT does (exactly ``round(15%)`` positions per sequence; of them
  80% ``[MASK]``, 10% a random token, 10% unchanged).
- :class:`ClickData`: DLRM-style click logs: dense features, power-law
  categorical ids, and click labels drawn from a random DLRM-shaped teacher.

Example:
  >>> ds = TeacherMLPData(seed=0)
  >>> batch = ds.batch(step=3, global_batch_size=8)
  >>> sorted(batch), batch["inputs"].shape
  (['inputs', 'labels'], (8, 32))
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxcoll import checks

Batch = dict[str, np.ndarray]

_SPLITS = {"train": 0, "eval": 1}
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix64(z: np.ndarray) -> np.ndarray:
  """splitmix64's finaliser: a bijective, well-mixed hash of uint64 values."""
  with np.errstate(over="ignore"):
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
  return z ^ (z >> np.uint64(31))


def _key(*parts: int) -> np.uint64:
  """Hashes a sequence of non-negative ints into one uint64 key."""
  h = np.zeros((), np.uint64)
  with np.errstate(over="ignore"):
    for part in parts:
      h = _mix64(h + _GOLDEN + np.uint64(part))
  return h


def uniform(key: np.uint64, examples: np.ndarray, shape: Sequence[int] = ()) -> np.ndarray:
  """Uniform [0, 1) float64 values of shape ``(len(examples), *shape)``.

  Element ``j`` of example ``k`` depends on ``(key, k, j)`` only, so the rows
  of any subset of examples are the same as in the full array.
  """
  examples = np.asarray(examples, np.uint64).reshape(-1)
  size = int(np.prod(shape, dtype=np.int64))
  with np.errstate(over="ignore"):
    rows = _mix64(key ^ _mix64(examples * _GOLDEN + _GOLDEN))
    cols = np.arange(1, size + 1, dtype=np.uint64) * _MIX1
    bits = _mix64(rows[:, None] + cols[None, :])
  values = (bits >> np.uint64(11)).astype(np.float64) * (1.0 / 2.0**53)
  return values.reshape((len(examples), *shape))


def normal(key: np.uint64, examples: np.ndarray, shape: Sequence[int] = ()) -> np.ndarray:
  """Standard normal float64 values, per example as :func:`uniform` (Box-Muller)."""
  size = int(np.prod(shape, dtype=np.int64))
  u = uniform(key, examples, (2, size))
  radius = np.sqrt(-2.0 * np.log1p(-u[:, 0]))  # 1 - u is in (0, 1]
  return (radius * np.cos(2.0 * np.pi * u[:, 1])).reshape((len(u), *shape))


def _check_step(step: Any) -> int:
  if not checks.is_int(step) or step < 0:
    raise ValueError(f"`step` must be a non-negative integer (the data position), got {step!r}.")
  return int(step)


class SyntheticDataset(abc.ABC):
  """A data set whose example ``k`` is a pure function of ``(seed, split, k)``.

  Subclasses are frozen dataclasses with a ``seed`` field that implement
  :meth:`examples`.
  """

  seed: int

  @abc.abstractmethod
  def examples(self, index: np.ndarray, split: str = "train") -> Batch:
    """The examples numbered ``index`` (1-D int array), one row per index."""

  def batch(
      self,
      step: int,
      global_batch_size: int,
      rows: slice | None = None,
      split: str = "train",
  ) -> Batch:
    """Rows ``rows`` (default all) of the global batch of step ``step``.

    Args:
      step: data position (the training step), >= 0.
      global_batch_size: examples per step over all processes and devices.
      rows: a slice of ``range(global_batch_size)``; default all rows.
      split: ``"train"`` or ``"eval"`` (held-out examples, same teacher).

    Returns:
      A dict of numpy arrays whose leading dimension is the number of rows.

    Raises:
      ValueError: for a negative step, a non-positive batch size, a slice with
        a step other than 1, or an unknown split.
    """
    step = _check_step(step)
    global_batch_size = checks.positive_int(global_batch_size, "global_batch_size")
    rows = slice(None) if rows is None else rows
    start, stop, stride = rows.indices(global_batch_size)
    if stride != 1:
      raise ValueError(f"`rows` must be a contiguous slice (step 1), got {rows!r}.")
    index = step * global_batch_size + np.arange(start, max(start, stop), dtype=np.int64)
    return self.examples(index, split)

  def _split_key(self, split: str, stream: int) -> np.uint64:
    if split not in _SPLITS:
      raise ValueError(f"`split` must be one of {sorted(_SPLITS)}, got {split!r}.")
    return _key(self.seed, _SPLITS[split], stream)

  def _teacher_rng(self) -> np.random.Generator:
    return np.random.default_rng([self.seed, 7919])


def _random_mlp(rng: np.random.Generator, sizes: Sequence[int]) -> list[tuple[Any, Any]]:
  """He-initialised random MLP layers ``[(w, b), ...]`` for ``sizes``."""
  return [
      (rng.normal(0.0, np.sqrt(2.0 / n_in), (n_in, n_out)), rng.normal(0.0, 0.1, n_out))
      for n_in, n_out in zip(sizes[:-1], sizes[1:], strict=True)
  ]


def _apply_mlp(layers: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray) -> np.ndarray:
  for i, (w, b) in enumerate(layers):
    x = x @ w + b
    if i < len(layers) - 1:
      x = np.maximum(x, 0.0)
  return x


@dataclasses.dataclass(frozen=True)
class TeacherMLPData(SyntheticDataset):
  """Gaussian inputs labelled by a fixed random MLP teacher.

  Batch: ``inputs`` float32 ``(n, input_dim)``; ``labels`` int32 ``(n,)``
  (classification: argmax of the teacher's centred logits) or float32
  ``(n, num_outputs)`` (regression: the teacher's outputs, unit scale).
  """

  input_dim: int = 32
  num_outputs: int = 10
  teacher_widths: tuple[int, ...] = (64,)
  task: str = "classification"
  seed: int = 0

  def __post_init__(self):
    if self.task not in ("classification", "regression"):
      raise ValueError(
          f"`task` must be 'classification' or 'regression', got {self.task!r}."
      )
    checks.positive_int(self.input_dim, "input_dim")
    checks.positive_int(self.num_outputs, "num_outputs")

  @functools.cached_property
  def _teacher(self):
    rng = self._teacher_rng()
    layers = _random_mlp(rng, (self.input_dim, *self.teacher_widths, self.num_outputs))
    calib = rng.normal(size=(4096, self.input_dim))
    out = _apply_mlp(layers, calib)
    return layers, out.mean(axis=0), out.std(axis=0) + 1e-6

  def teacher(self, inputs: np.ndarray) -> np.ndarray:
    """The teacher's centred, unit-scale outputs for ``inputs``."""
    layers, mean, std = self._teacher
    return (_apply_mlp(layers, np.asarray(inputs, np.float64)) - mean) / std

  def examples(self, index: np.ndarray, split: str = "train") -> Batch:
    x = normal(self._split_key(split, 0), index, (self.input_dim,))
    out = self.teacher(x)
    if self.task == "classification":
      labels = np.argmax(out, axis=-1).astype(np.int32)
    else:
      labels = out.astype(np.float32)
    return {"inputs": x.astype(np.float32), "labels": labels}


def _upsample(x: np.ndarray, factor: int) -> np.ndarray:
  """Nearest-neighbour upsampling of ``(n, h, w, c)`` by ``factor``."""
  return np.repeat(np.repeat(x, factor, axis=1), factor, axis=2)


@dataclasses.dataclass(frozen=True)
class TeacherImageData(SyntheticDataset):
  """NHWC images with labels from a random teacher on the pooled image.

  An image is a random ``latent_size x latent_size`` pattern upsampled to
  ``image_size`` plus pixel noise of std ``noise``; its label is the argmax of
  a random MLP teacher applied to the image average-pooled back to
  ``latent_size`` (which sees the pattern and the pooled noise).

  Batch: ``images`` float32 ``(n, image_size, image_size, channels)``;
  ``labels`` int32 ``(n,)``.
  """

  image_size: int = 32
  channels: int = 3
  num_classes: int = 10
  latent_size: int = 4
  noise: float = 0.5
  teacher_width: int = 64
  seed: int = 0

  def __post_init__(self):
    for name in ("image_size", "channels", "num_classes", "latent_size"):
      checks.positive_int(getattr(self, name), name)
    if self.image_size % self.latent_size:
      raise ValueError(
          f"`image_size` ({self.image_size}) must be a multiple of `latent_size` "
          f"({self.latent_size}); choose e.g. image_size={self.latent_size * 8}."
      )

  @functools.cached_property
  def _teacher(self):
    rng = self._teacher_rng()
    dim = self.latent_size**2 * self.channels
    layers = _random_mlp(rng, (dim, self.teacher_width, self.num_classes))
    calib = _apply_mlp(layers, rng.normal(size=(4096, dim)))
    return layers, calib.mean(axis=0)

  def teacher(self, images: np.ndarray) -> np.ndarray:
    """The teacher's centred logits for NHWC ``images``."""
    layers, mean = self._teacher
    n, f = len(images), self.image_size // self.latent_size
    pooled = images.reshape(n, self.latent_size, f, self.latent_size, f, self.channels)
    return _apply_mlp(layers, pooled.mean(axis=(2, 4)).reshape(n, -1)) - mean

  def examples(self, index: np.ndarray, split: str = "train") -> Batch:
    s, ls, c = self.image_size, self.latent_size, self.channels
    latent = normal(self._split_key(split, 0), index, (ls, ls, c))
    pixels = normal(self._split_key(split, 1), index, (s, s, c))
    images = _upsample(latent, s // ls) + self.noise * pixels
    labels = np.argmax(self.teacher(images), axis=-1).astype(np.int32)
    return {"images": images.astype(np.float32), "labels": labels}


MASK_TOKEN = 0


@dataclasses.dataclass(frozen=True)
class TokenData(SyntheticDataset):
  """Masked-LM sequences from a random topic-bigram teacher, masked as BERT.

  The teacher draws a topic per sequence (one of ``num_topics``), then each
  token (ids ``1 .. vocab_size - 1``; id 0 is ``[MASK]``) from logits
  ``sharpness * (topic_logits[topic] + bigram_logits[previous]) / sqrt(2)``,
  two fixed random Gaussian matrices. A masked token is predictable from the
  bag of context tokens (the topic) and, better, from its neighbours.
  Each sequence predicts exactly ``max(1, round(mask_rate * seq_len))``
  positions (as BERT's ``create_pretraining_data``); a predicted position's
  input is ``[MASK]`` with probability 0.8, a random token with 0.1, and
  unchanged with 0.1. Every sequence weighs the same number of tokens, so the
  mean loss over a batch is the mean of the per-shard means.

  Batch: ``tokens`` int32 ``(n, seq_len)`` (the model input); ``targets``
  int32 ``(n, seq_len)`` (the original tokens); ``weights`` float32
  ``(n, seq_len)``, 1.0 at predicted positions, else 0.0.
  """

  vocab_size: int = 128
  seq_len: int = 32
  mask_rate: float = 0.15
  num_topics: int = 8
  sharpness: float = 3.0
  seed: int = 0

  def __post_init__(self):
    if isinstance(self.vocab_size, bool) or self.vocab_size < 3:
      raise ValueError(f"`vocab_size` must be >= 3 ([MASK] + 2 tokens), got {self.vocab_size!r}.")
    checks.positive_int(self.seq_len, "seq_len")
    checks.positive_int(self.num_topics, "num_topics")
    if not 0.0 < self.mask_rate <= 1.0:
      raise ValueError(f"`mask_rate` must be in (0, 1], got {self.mask_rate!r}; BERT uses 0.15.")

  @property
  def num_predictions(self) -> int:
    """Predicted (masked) positions per sequence."""
    return max(1, round(self.mask_rate * self.seq_len))

  @functools.cached_property
  def _teacher_cdf(self) -> np.ndarray:
    """CDF of the next token, indexed ``[topic, previous token]``."""
    n = self.vocab_size - 1
    rng = self._teacher_rng()
    topic = rng.normal(size=(self.num_topics, 1, n))
    bigram = rng.normal(size=(1, n, n))
    logits = self.sharpness * (topic + bigram) / np.sqrt(2.0)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    cdf = np.cumsum(probs / probs.sum(axis=-1, keepdims=True), axis=-1)
    cdf[..., -1] = 1.0
    return cdf

  def examples(self, index: np.ndarray, split: str = "train") -> Batch:
    n, length, k = len(index), self.seq_len, self.num_predictions
    num_tokens = self.vocab_size - 1
    cdf = self._teacher_cdf
    u = uniform(self._split_key(split, 0), index, (length + 1,))
    topic = np.minimum((u[:, -1] * self.num_topics).astype(np.int64), self.num_topics - 1)
    seq = np.empty((n, length), np.int64)
    seq[:, 0] = np.minimum((u[:, 0] * num_tokens).astype(np.int64), num_tokens - 1)
    for t in range(1, length):
      seq[:, t] = (cdf[topic, seq[:, t - 1]] < u[:, t : t + 1]).sum(axis=-1)
    seq = np.minimum(seq, num_tokens - 1) + 1  # ids 1..vocab_size-1

    order = np.argsort(uniform(self._split_key(split, 1), index, (length,)), axis=-1)
    weights = np.zeros((n, length), np.float32)
    np.put_along_axis(weights, order[:, :k], 1.0, axis=-1)
    choice = uniform(self._split_key(split, 2), index, (length,))
    random_tok = 1 + np.minimum(
        (uniform(self._split_key(split, 3), index, (length,)) * num_tokens).astype(np.int64),
        num_tokens - 1,
    )
    tokens = np.where(choice < 0.8, MASK_TOKEN, np.where(choice < 0.9, random_tok, seq))
    tokens = np.where(weights > 0, tokens, seq)
    return {
        "tokens": tokens.astype(np.int32),
        "targets": seq.astype(np.int32),
        "weights": weights,
    }


@dataclasses.dataclass(frozen=True)
class ClickData(SyntheticDataset):
  """DLRM-style click logs with labels from a random DLRM-shaped teacher.

  Dense features are standard normal. Categorical id ``j`` of table ``t`` is
  ``floor(table_sizes[t] * u ** skew)`` for uniform ``u``: a power law that
  favours small ids, like the heavy-tailed ids of real click logs. The
  teacher's score adds a bias per id, a linear term in the dense features,
  and randomly weighted dot products of every pair of vectors (one embedding
  per id, dimension ``teacher_dim``, and a linear map of the dense
  features); standardised and times ``logit_scale``, it is the logit of the
  click probability.

  Batch: ``dense`` float32 ``(n, num_dense)``; ``sparse`` int32
  ``(n, len(table_sizes))``; ``labels`` float32 ``(n,)`` in {0, 1}.
  """

  num_dense: int = 8
  table_sizes: tuple[int, ...] = (64, 128, 256, 32)
  skew: float = 2.0
  teacher_dim: int = 4
  logit_scale: float = 3.0
  seed: int = 0

  def __post_init__(self):
    checks.positive_int(self.num_dense, "num_dense")
    if not self.table_sizes or any(
        isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1
        for s in self.table_sizes
    ):
      raise ValueError(
          f"`table_sizes` must be a non-empty tuple of positive ints, got {self.table_sizes!r}."
      )

  @functools.cached_property
  def _teacher(self):
    rng = self._teacher_rng()
    d, num_tables = self.teacher_dim, len(self.table_sizes)
    tables = [rng.normal(size=(size, d)) for size in self.table_sizes]
    biases = [rng.normal(size=size) for size in self.table_sizes]
    dense_proj = rng.normal(size=(self.num_dense, d + 1)) / np.sqrt(self.num_dense)
    pair_weights = np.triu(rng.normal(size=(num_tables + 1, num_tables + 1)), k=1)
    params = (tables, biases, dense_proj, pair_weights)
    calib_ids = self._ids(rng.uniform(size=(4096, num_tables)))
    calib = self._score(params, rng.normal(size=(4096, self.num_dense)), calib_ids)
    return params, calib.mean(), calib.std() + 1e-6

  def _ids(self, u: np.ndarray) -> np.ndarray:
    """Power-law ids ``floor(size * u ** skew)`` for uniform ``u``."""
    sizes = np.asarray(self.table_sizes, np.int64)
    return np.minimum((sizes * u**self.skew).astype(np.int64), sizes - 1)

  @staticmethod
  def _score(params, dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
    tables, biases, dense_proj, pair_weights = params
    projected = dense @ dense_proj  # last column: the dense features' own term
    main = projected[:, -1] + sum(b[sparse[:, t]] for t, b in enumerate(biases))
    vectors = [projected[:, :-1]] + [tables[t][sparse[:, t]] for t in range(len(tables))]
    v = np.stack(vectors, axis=1)  # (n, T + 1, d)
    pairs = np.einsum("nid,njd,ij->n", v, v, pair_weights)
    # Scaled so that all pairs together weigh about as much as one id's bias.
    num_pairs = v.shape[1] * (v.shape[1] - 1) // 2
    return main + pairs / np.sqrt(num_pairs * v.shape[-1])

  def teacher(self, dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
    """The teacher's click logits (standardised score times ``logit_scale``)."""
    params, mean, std = self._teacher
    return self.logit_scale * (self._score(params, dense, sparse) - mean) / std

  def examples(self, index: np.ndarray, split: str = "train") -> Batch:
    dense = normal(self._split_key(split, 0), index, (self.num_dense,))
    sparse = self._ids(uniform(self._split_key(split, 1), index, (len(self.table_sizes),)))
    prob = 1.0 / (1.0 + np.exp(-self.teacher(dense, sparse)))
    clicks = uniform(self._split_key(split, 2), index) < prob
    return {
        "dense": dense.astype(np.float32),
        "sparse": sparse.astype(np.int32),
        "labels": clicks.astype(np.float32),
    }
