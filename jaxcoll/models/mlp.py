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
from jaxcoll.models.workload import Workload, as_key, check_positive, check_widths


class MLP(nn.Module):
  """Dense layers with ReLU between them.

  Attributes:
    widths: hidden layer widths.
    num_outputs: output features (classes, or regression outputs).
    dtype: computation dtype (parameters stay float32).
  """

  widths: Sequence[int] = (64, 64)
  num_outputs: int = 10
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.astype(self.dtype)
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

  Returns:
    A :class:`Workload`; batch keys ``inputs`` and ``labels``; ``aux`` holds
    ``accuracy`` (classification) or ``mse`` (regression).
  """
  widths = check_widths(widths, "widths")
  dataset = data.TeacherMLPData(
      input_dim=check_positive(input_dim, "input_dim"),
      num_outputs=check_positive(num_outputs, "num_outputs"),
      teacher_widths=check_widths(teacher_widths, "teacher_widths"),
      task=task,
      seed=seed,
  )
  model = MLP(widths=widths, num_outputs=num_outputs, dtype=dtype)

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

  def eval_fn(params, batch):
    loss, aux = metrics(params, batch)
    return {"loss": loss, **aux}

  return Workload(
      name="mlp",
      model=model,
      dataset=dataset,
      init_params=init_params,
      loss_fn=metrics,
      eval_fn=eval_fn,
      config=dict(
          widths=widths, input_dim=input_dim, num_outputs=num_outputs, task=task,
          teacher_widths=tuple(teacher_widths), seed=seed, dtype=dtype,
      ),
  )
