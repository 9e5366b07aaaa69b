r"""A 168M-parameter model that fits this machine only sharded: ZeRO-3 on 8 devices.

    python -m experiments.train --config=configs/big_zero3.py --workdir=/tmp/jaxcoll-runs/big
    python -m experiments.zero3_memory --config=configs/big_zero3.py --json=/tmp/big.json
    python -m experiments.memory_plan --model=mlp --budget_mb=3160 --batch_size=16 \
        --model_overrides=depth=41,width=2048,scan_layers=True

An MLP of 40 scanned hidden layers of width 2048 (each a `jaxcoll.fsdp_unit`),
167.9M float32 parameters; with Adam's two moments the full train state is
2.02 GB. Data parallelism would hold all of it on each of the 8 devices (16 GB
of state; its compiled step peaks at 3359 MB per device, over this 24 GB
machine's 3160 MB per device: the planner says so before anything is
allocated); ZeRO-3 holds 1/8 per device (373 MB step peak), and the parameters
exist in full nowhere, not even at init (`Trainer.init_from`). Evaluation runs
on the sharded state, gathering one layer at a time. Figures: README, "A model
only sharding fits".

`:small` is the same shape at width 512 (1/16 the parameters).
"""

from configs import base


def get_config(variant: str | None = None):
  c = base.base_config()
  c.model = "mlp"
  c.model_overrides.depth = 41  # the input layer, 40 scanned hidden layers, then the output
  c.model_overrides.width = 2048
  c.model_overrides.scan_layers = True
  c.strategy = "zero3"
  c.steps = 4
  c.global_batch_size = 16  # 8 devices x 2
  c.optimizer = "adam"
  c.learning_rate = 1e-4
  c.log_every = 1
  c.checkpoint_every = 2
  c.keep_checkpoints = 1
  c.eval_every = 2
  c.data.eval_examples = 32
  c.tensorboard = False
  if "small" in base.variants(variant):
    c.model_overrides.width = 512
  return c
