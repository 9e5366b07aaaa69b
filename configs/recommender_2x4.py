r"""DLRM-style recommender on 2 processes x 4 devices, hierarchical all-reduce.

    python -m jaxcoll.launch --num_processes=2 --devices_per_process=4 -- \
        python -m experiments.train --config=configs/recommender_2x4.py --workdir=/tmp/jaxcoll/rec
    python -m jaxcoll.launch --num_processes=2 --devices_per_process=4 -- \
        python -m experiments.train --config=configs/recommender_2x4.py:smoke --workdir=/tmp/rs

The mesh is ("node", "local") = (2, 4): one process is one node, so the
hierarchical all-reduce reduce-scatters inside each process, all-reduces the
quarter-size shards across the two processes (gloo), and all-gathers inside.
Each process builds only its own half of every global batch of interactions.
Global batch 512 = 2 processes x 4 devices x 64.
"""

from configs import base


def get_config(variant: str | None = None):
  c = base.base_config()
  c.model = "recommender"
  c.model_overrides.embed_dim = 16
  c.mesh_shape = "2,4"
  c.mesh_axes = "node,local"
  c.strategy = "dp"
  c.algorithm = "hierarchical"
  c.steps = 100
  c.global_batch_size = 512  # 2 processes x 4 devices x 64
  c.learning_rate = 3e-3
  if variant == "smoke":
    c.steps = 4
    c.global_batch_size = 32
    c.log_every = 2
    c.checkpoint_every = 2
  return c
