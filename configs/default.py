r"""Short data-parallel MLP run on 8 emulated CPU devices: README's main command.

    python -m experiments.train --workdir=/tmp/jaxcoll/default
    python -m experiments.train --config=configs/default.py --workdir=/tmp/jaxcoll/default
    python -m experiments.train --config=configs/default.py:smoke --workdir=/tmp/jaxcoll/smoke

Global batch 256 = 8 devices x 32 examples; 200 Adam steps; checkpoints every
50 steps. Finishes in well under 2 minutes on 2 CPU cores.
"""

from configs import base


def get_config(variant: str | None = None):
  c = base.base_config()
  c.model = "mlp"
  c.model_overrides.widths = (128, 128)
  c.model_overrides.input_dim = 32
  c.steps = 200
  c.global_batch_size = 256  # 8 devices x 32
  c.learning_rate = 3e-3
  c.log_every = 20
  c.checkpoint_every = 50
  if variant == "smoke":
    c.steps = 6
    c.global_batch_size = 32  # 8 x 4
    c.log_every = 2
    c.checkpoint_every = 3
  return c
