"""Fields every training config has, with their defaults (not run directly).

The fields and their defaults are those of ``jaxcoll.run.config.RunConfig``
(one source: README "Experiments and configs", "The run config").

Each config's `get_config(variant)` starts from `base_config()` and changes
only what differs; `variant="smoke"` shrinks it to seconds for the tests,
`variant="files"` trains on shards that `python -m experiments.make_shards`
wrote from the config's own synthetic generator (variants combine:
`:smoke,files`).
"""

import ml_collections

from jaxcoll.run import config as run_config

SHARDS = "/tmp/jaxcoll-runs/shards"  # where each config's `files` variant looks


def variants(variant: str | None) -> set[str]:
  """``"smoke,files"`` -> ``{"smoke", "files"}``."""
  return {v.strip() for v in (variant or "").split(",") if v.strip()}


def use_shards(c: ml_collections.ConfigDict, name: str, variant: str | None,
               shard_by: str = "record") -> None:
  """Points `data.train` / `data.eval` at SHARDS/name (SHARDS/name_smoke for
  the smoke variant): what make_shards writes there from this config."""
  name += "_smoke" if "smoke" in variants(variant) else ""
  c.data.train = f"{SHARDS}/{name}/train-*.parquet"
  c.data.eval = f"{SHARDS}/{name}/eval-*.parquet"
  c.data.shard_by = shard_by
  c.eval_every = c.steps


def base_config() -> ml_collections.ConfigDict:
  """Every field with its default: ``jaxcoll.run.config.RunConfig()`` as a
  ConfigDict (the dataclass holds the defaults, and what each field means)."""
  return run_config.RunConfig().to_config_dict()
