r"""BERT-style transformer encoder with a masked-LM head, trained with ZeRO-3.

    python -m experiments.train --config=configs/bert_zero3.py --workdir=/tmp/jaxcoll-runs/bert
    python -m experiments.train --config=configs/bert_zero3.py:smoke --workdir=/tmp/jaxcoll-runs/bs

Parameters, gradients and Adam state are sharded over 8 devices (ZeRO stage 3,
the FSDP shape); parameters are gathered bucket by bucket for the forward and
again for the backward pass. Global batch 128 = 8 devices x 16 sequences of
64 tokens; loss over the 15% masked tokens.

On files (`:files`), first write the shards from this config's synthetic generator:

    python -m experiments.make_shards --config=configs/bert_zero3.py --examples=4096 \
        --num_shards=4 --out=/tmp/jaxcoll-runs/shards/bert_zero3
    python -m experiments.make_shards --config=configs/bert_zero3.py --split=eval \
        --examples=512 --num_shards=2 --out=/tmp/jaxcoll-runs/shards/bert_zero3
    python -m experiments.train --config=configs/bert_zero3.py:files \
        --workdir=/tmp/jaxcoll-runs/bert_zero3_files

`:smoke,files` reads /tmp/jaxcoll-runs/shards/bert_zero3_smoke: the same commands with
`--config=configs/bert_zero3.py:smoke` and that `--out`.
"""

from configs import base


def get_config(variant: str | None = None):
  c = base.base_config()
  c.model = "transformer"
  c.model_overrides.num_layers = 4
  c.model_overrides.d_model = 128
  c.model_overrides.num_heads = 4
  c.model_overrides.vocab_size = 512
  c.model_overrides.seq_len = 64
  c.strategy = "zero3"
  c.algorithm = "auto"
  c.bucket_bytes = 4 * 2**20  # several buckets: gathered one at a time
  c.steps = 100
  c.global_batch_size = 128  # 8 devices x 16
  c.optimizer = "adamw"
  c.learning_rate = 1e-3
  c.weight_decay = 0.01
  c.clip_global_norm = 1.0
  if "smoke" in base.variants(variant):
    c.model_overrides.num_layers = 1
    c.model_overrides.d_model = 32
    c.model_overrides.num_heads = 2
    c.model_overrides.vocab_size = 64
    c.model_overrides.seq_len = 16
    c.bucket_bytes = 2**14
    c.steps = 3
    c.global_batch_size = 16
    c.log_every = 1
    c.checkpoint_every = 2
  if "files" in base.variants(variant):  # after make_shards (see the docstring)
    base.use_shards(c, "bert_zero3", variant)
  return c
