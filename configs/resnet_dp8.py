r"""CIFAR-style ResNet-18 with synchronized BatchNorm, data parallel on 8 devices.

    python -m experiments.train --config=configs/resnet_dp8.py --workdir=/tmp/jaxcoll/resnet
    python -m experiments.train --config=configs/resnet_dp8.py:smoke --workdir=/tmp/jaxcoll/rs

Global batch 256 = 8 devices x 32 per device. Width 16 (a quarter of the
standard 64, which is `--config.model_overrides.width=64`: 11.2M params) so
that it runs on CPU; BatchNorm statistics are averaged across the data axis
and written back into the params each step (`Trainer(merge_aux=...)`).
"""

from configs import base


def get_config(variant: str | None = None):
  c = base.base_config()
  c.model = "resnet"
  c.model_overrides.width = 16
  c.model_overrides.image_size = 32
  c.model_overrides.bn_axis_name = "data"
  c.steps = 100
  c.global_batch_size = 256  # 8 devices x 32
  c.optimizer = "momentum"
  c.learning_rate = 0.05
  c.algorithm = "auto"
  c.log_every = 10
  c.checkpoint_every = 50
  if variant == "smoke":
    c.model_overrides.width = 4
    c.model_overrides.image_size = 16
    c.steps = 3
    c.global_batch_size = 16  # 8 x 2
    c.log_every = 1
    c.checkpoint_every = 2
  return c
