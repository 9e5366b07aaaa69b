r"""Hybrid ZeRO-3 on 2 processes x 4 devices: sharded in a node, replicated across.

    python -m jaxcoll.launch --num_processes=2 --devices_per_process=4 -- \
        python -m experiments.train --config=configs/hybrid_2x4.py --workdir=/tmp/jaxcoll-runs/hybrid
    python -m jaxcoll.launch --num_processes=2 --devices_per_process=4 -- \
        python -m experiments.train --config=configs/hybrid_2x4.py:smoke --workdir=/tmp/hs

The mesh is ("node", "local") = (2, 4): one process is one node.
``jaxcoll.ZeRO(stage=3, axis="local", replica_axis="node")`` keeps a quarter
of the parameters and optimizer state on each device; parameters are
all-gathered only inside a process, gradients reduce-scattered inside it and
then all-reduced across the two processes (gloo) on the quarter-size shard.
Global batch 256 = 2 processes x 4 devices x 32.
"""

from configs import base


def get_config(variant: str | None = None):
  c = base.base_config()
  c.model = "mlp"
  c.mesh_shape = "2,4"
  c.mesh_axes = "node,local"
  c.strategy = "zero3"
  c.replica_axis = "node"
  c.algorithm = "ring"
  c.steps = 100
  c.global_batch_size = 256
  c.learning_rate = 1e-3
  if variant == "smoke":
    c.steps = 4
    c.global_batch_size = 32
    c.log_every = 2
    c.checkpoint_every = 2
  return c
