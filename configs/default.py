r"""Short data-parallel MLP run on 8 emulated CPU devices: README's main command.

    python -m experiments.train --workdir=/tmp/jaxcoll-runs/default
    python -m experiments.train --config=configs/default.py --workdir=/tmp/jaxcoll-runs/default
    python -m experiments.train --config=configs/default.py:smoke --workdir=/tmp/jaxcoll-runs/smoke

Global batch 256 = 8 devices x 32 examples; 200 Adam steps; checkpoints every
50 steps. Finishes in well under 2 minutes on 2 CPU cores.

On files (`:files`), first write the shards from this config's synthetic generator:

    python -m experiments.make_shards --config=configs/default.py --examples=4096 \
        --num_shards=4 --out=/tmp/jaxcoll-runs/shards/default
    python -m experiments.make_shards --config=configs/default.py --split=eval \
        --examples=512 --num_shards=2 --out=/tmp/jaxcoll-runs/shards/default
    python -m experiments.train --config=configs/default.py:files \
        --workdir=/tmp/jaxcoll-runs/default_files

`:smoke,files` reads /tmp/jaxcoll-runs/shards/default_smoke: the same commands with
`--config=configs/default.py:smoke` and that `--out`.
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
  if "smoke" in base.variants(variant):
    c.steps = 6
    c.global_batch_size = 32  # 8 x 4
    c.log_every = 2
    c.checkpoint_every = 3
  if "files" in base.variants(variant):  # after make_shards (see the docstring)
    base.use_shards(c, "default", variant)
  return c
