r"""DLRM-style recommender on 2 processes x 4 devices, hierarchical all-reduce.

    python -m jaxcoll.launch --num_processes=2 --devices_per_process=4 -- \
        python -m experiments.train --config=configs/recommender_2x4.py --workdir=/tmp/jaxcoll-runs/rec
    python -m jaxcoll.launch --num_processes=2 --devices_per_process=4 -- \
        python -m experiments.train --config=configs/recommender_2x4.py:smoke --workdir=/tmp/rs

The mesh is ("node", "local") = (2, 4): one process is one node, so the
hierarchical all-reduce reduce-scatters inside each process, all-reduces the
quarter-size shards across the two processes (gloo), and all-gathers inside.
Each process builds only its own half of every global batch of interactions.
Global batch 512 = 2 processes x 4 devices x 64.

On files (`:files`), first write the shards from this config's synthetic generator
(4 files: each process streams its own 2):

    python -m experiments.make_shards --config=configs/recommender_2x4.py --examples=8192 \
        --num_shards=4 --out=/tmp/jaxcoll-runs/shards/recommender_2x4
    python -m experiments.make_shards --config=configs/recommender_2x4.py --split=eval \
        --examples=1024 --num_shards=2 --out=/tmp/jaxcoll-runs/shards/recommender_2x4
    python -m jaxcoll.launch --num_processes=2 --devices_per_process=4 -- \
        python -m experiments.train --config=configs/recommender_2x4.py:files \
        --workdir=/tmp/jaxcoll-runs/recommender_2x4_files

`:smoke,files` reads /tmp/jaxcoll-runs/shards/recommender_2x4_smoke: the same commands with
`--config=configs/recommender_2x4.py:smoke` and that `--out`.
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
  if "smoke" in base.variants(variant):
    c.steps = 4
    c.global_batch_size = 32
    c.log_every = 2
    c.checkpoint_every = 2
  if "files" in base.variants(variant):  # after make_shards (see the docstring)
    base.use_shards(c, "recommender_2x4", variant, shard_by="file")
  return c
