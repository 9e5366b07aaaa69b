r"""The smallest data-parallel run: the README's "one device to N" example.

    python -m experiments.train --config=configs/minimal.py --workdir=/tmp/jaxcoll-runs/minimal
    python -m experiments.train --config=configs/minimal.py:smoke --workdir=/tmp/jaxcoll-runs/ms

A one-hidden-layer MLP (width 32), 50 steps, global batch 64 = 8 devices x 8:
the config-driven counterpart of `examples/minimal.py` (jaxcoll's synthetic MLP
workload, not that example's data or optimizer).
"""

from configs import base


def get_config(variant: str | None = None):
  c = base.base_config()
  c.model = "mlp"
  c.model_overrides.widths = (32,)
  c.steps = 50
  c.global_batch_size = 64  # 8 devices x 8
  c.checkpoint_every = 0  # no checkpoints
  if variant == "smoke":
    c.steps = 4
    c.global_batch_size = 16
    c.log_every = 2
  return c
