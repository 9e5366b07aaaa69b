"""Data-parallel and ZeRO training: Trainer, strategies, buckets, compression.

``jaxcoll.train.Trainer`` runs one jitted ``shard_map`` program per step for
a ``loss_fn`` written with flax + optax, with a :class:`DataParallel` or
:class:`ZeRO` strategy.
"""

from jaxcoll.train.fsdp import fsdp_params as fsdp_params
from jaxcoll.train.fsdp import fsdp_unit as fsdp_unit
from jaxcoll.train.guards import NonFiniteGradientsError as NonFiniteGradientsError
from jaxcoll.train.state import TrainState as TrainState
from jaxcoll.train.strategies import DataParallel as DataParallel
from jaxcoll.train.strategies import ZeRO as ZeRO
from jaxcoll.train.trainer import Trainer as Trainer


def __getattr__(name: str):
  # The runner modules moved to `jaxcoll.run` (loop, inputs, evaluate, ...).
  from jaxcoll import _moved  # noqa: PLC0415

  if f"jaxcoll.train.{name}" in _moved.MOVED:
    return _moved.import_moved(f"jaxcoll.train.{name}")
  raise AttributeError(f"module 'jaxcoll.train' has no attribute {name!r}")
