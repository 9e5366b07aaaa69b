"""A user's own model for the memory planner and sharded-init tests, reached by its
``module:function`` path (``sharded_model:make``): a scanned MLP of FSDP units."""

from jaxcoll import models


def make(depth: int = 2, width: int = 64) -> models.Workload:
  """``depth`` scanned hidden layers of ``width`` (each one jaxcoll.fsdp_unit)."""
  return models.make_workload("mlp", depth=depth + 1, width=width, scan_layers=True)
