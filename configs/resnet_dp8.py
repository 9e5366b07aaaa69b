r"""CIFAR-style ResNet-18 with synchronized BatchNorm, data parallel on 8 devices.

    python -m experiments.train --config=configs/resnet_dp8.py --workdir=/tmp/jaxcoll-runs/resnet
    python -m experiments.train --config=configs/resnet_dp8.py:smoke --workdir=/tmp/jaxcoll-runs/rs

Global batch 256 = 8 devices x 32 per device. Width 16 (a quarter of the
standard 64, which is `--config.model_overrides.width=64`: 11.2M params) so
that it runs on CPU; BatchNorm statistics are averaged across the data axis
and written back into the params each step (`Trainer(merge_aux=...)`).

On files (`:files`), first write the shards from this config's synthetic generator:

    python -m experiments.make_shards --config=configs/resnet_dp8.py --examples=4096 \
        --num_shards=4 --out=/tmp/jaxcoll-runs/shards/resnet_dp8
    python -m experiments.make_shards --config=configs/resnet_dp8.py --split=eval \
        --examples=512 --num_shards=2 --out=/tmp/jaxcoll-runs/shards/resnet_dp8
    python -m experiments.train --config=configs/resnet_dp8.py:files \
        --workdir=/tmp/jaxcoll-runs/resnet_dp8_files

`:smoke,files` reads /tmp/jaxcoll-runs/shards/resnet_dp8_smoke: the same commands with
`--config=configs/resnet_dp8.py:smoke` and that `--out`.
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
  if "smoke" in base.variants(variant):
    c.model_overrides.width = 4
    c.model_overrides.image_size = 16
    c.model_overrides.stage_sizes = (1, 1)  # two stages of one block: compiles in seconds
    c.steps = 3
    c.global_batch_size = 16  # 8 x 2
    c.log_every = 1
    c.checkpoint_every = 2
  if "files" in base.variants(variant):  # after make_shards (see the docstring)
    base.use_shards(c, "resnet_dp8", variant)
  return c
