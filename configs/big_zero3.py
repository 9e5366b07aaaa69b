r"""A 151M-parameter model that fits this machine only sharded: ZeRO-3 on 8 devices.

    python -m experiments.train --config=configs/big_zero3.py --workdir=/tmp/jaxcoll/big
    python -m experiments.zero3_memory --config=configs/big_zero3.py --json=/tmp/big.json
    python -m experiments.memory_plan --model=mlp --budget_mb=3000 --batch_size=16 \
        --model_overrides=depth=10,width=4096,scan_layers=True

An MLP of 9 scanned hidden layers of width 4096 (each a `jaxcoll.fsdp_unit`),
151.2M float32 parameters; with Adam's two moments the full train state is
1.81 GB. Data parallelism would hold all of it on each of the 8 devices
(14.5 GB of state, and the step's gradients and buffers on top: the planner
says it does not fit a 24 GB machine's 3 GB per device before anything is
allocated); ZeRO-3 holds 1/8 per device, and the parameters exist in full
nowhere, not even at init (`Trainer.init_from`). Evaluation runs on the
sharded state, gathering one layer at a time.

`:small` is the same shape at 1/16 the width squared (the test suite's version).
"""

from configs import base


def get_config(variant: str | None = None):
  c = base.base_config()
  c.model = "mlp"
  c.model_overrides.depth = 10  # the input layer, 9 scanned hidden layers, then the output
  c.model_overrides.width = 4096
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
    c.model_overrides.width = 1024
  return c
