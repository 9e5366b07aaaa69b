"""Fields every training config has, with their defaults (not run directly).

Each config's `get_config(variant)` starts from `base_config()` and changes
only what differs; `variant="smoke"` shrinks it to seconds for the tests,
`variant="files"` trains on shards that `python -m experiments.make_shards`
wrote from the config's own synthetic generator (variants combine:
`:smoke,files`).
"""

import ml_collections

SHARDS = "/tmp/jaxcoll/shards"  # where each config's `files` variant looks


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
  c = ml_collections.ConfigDict()
  c.model = "mlp"
  c.model_overrides = ml_collections.ConfigDict()
  c.steps = 100
  c.global_batch_size = 256  # = 8 devices x 32 per device
  c.grad_accum_steps = 1
  c.seed = 0
  # Parallelism: strategy in dp, zero1, zero2, zero3; algorithm: any
  # jaxcoll.algorithms("all_reduce") name, or auto.
  c.strategy = "dp"
  c.algorithm = "auto"
  c.bucket_bytes = 25 * 2**20
  c.compression = ""  # "", "bf16" or "int8" (dp only)
  c.mesh_shape = ""  # "" = one "data" axis over all devices; "2,4" = (node, local)
  c.mesh_axes = ""
  # Optimization.
  c.optimizer = "adam"
  c.learning_rate = 1e-3
  c.weight_decay = 0.0
  c.clip_global_norm = 0.0  # 0 = off
  c.schedule = "constant"  # constant | cosine | linear (to 0 at `steps`), after the warm-up
  c.warmup_steps = 0  # linear warm-up from 0 to learning_rate
  c.compute_dtype = "float32"
  # Data: the workload's synthetic set, or files (README "Your own model and data").
  c.data = ml_collections.ConfigDict()
  # a glob of Parquet / ArrayRecord files, or a list of globs '["a/*.pq", "b/*.pq"]'
  c.data.train = ""  # "" = the synthetic set
  c.data.eval = ""  # glob of eval files; "" = `eval_examples` held-out synthetic examples
  c.data.shard_by = "record"  # record (same batches for any process count) | file
  c.data.eval_examples = 1024
  c.data.eval_batch_size = 0  # 0 = global_batch_size
  c.data.num_threads = 2  # grain reader threads per process
  c.data.prefetch = 2  # batches read ahead
  # Resume a checkpoint whose data position no longer fits (other files or file contents,
  # another shard_by, another process count under shard_by=file): go on from the same
  # number of examples in the new order instead of refusing (README "Your own model and data").
  c.data.allow_changed_files = False
  c.data.skip = ""  # "A:B[,C:D]": no step trains on global batches A..B (batch n = step n's)
  c.eval_every = 0  # evaluate every N steps and at the end (0 = never)
  # What a user watches, and what survives a crash.
  c.log_every = 10
  c.checkpoint_every = 50
  c.keep_checkpoints = 3
  c.tensorboard = True
  c.profile_steps = ""  # "A:B": jax.profiler trace of steps A..B into DIR/profile ("" = off)
  # Straggler report (README "Step time and stragglers"): a process whose own time per step
  # exceeds straggler_factor x the median of all processes for straggler_steps logged rows.
  c.straggler_factor = 1.5
  c.straggler_steps = 3
  # Reliability (see README "Faults and bad input").
  c.nan_policy = "none"  # none | skip (state unchanged, counted) | raise (exit 3)
  c.check_every = 0  # compare replica fingerprints every N steps (0 = off); exit 4 on desync
  c.watchdog_s = 600.0  # no step finished for this long: report the last step, exit 86
  c.save_timeout_s = 0.0  # a checkpoint save or eval may take this long (0: 4 x watchdog_s)
  c.fail_at_step = 0  # fault injection: process 0 exits at this step, first attempt only
  c.hang_at_step = 0  # fault injection: process 0 hangs at this step, first attempt only
  c.nan_at_step = 0  # fault injection: this step's batch is NaN
  c.desync_at_step = 0  # fault injection: one replica of process 0 drifts, first attempt only
  c.slow_process = 0  # fault injection: this process sleeps slow_seconds before every step
  c.slow_seconds = 0.0  # (0 = off), a straggler for the straggler report
  c.corrupt_batches = ""  # fault injection: "A:B": batches A..B scaled x100, labels shuffled
  # Incidents (README "Incidents and rollback"): each signal's response is off | warn | skip |
  # rollback | stop; every incident goes to DIR/incidents.jsonl.
  c.incidents = ml_collections.ConfigDict()
  c.incidents.loss_spike = "warn"
  c.incidents.grad_norm_spike = "warn"
  c.incidents.non_finite = "warn"
  c.incidents.eval_regression = "warn"
  c.incidents.throughput_regression = "warn"
  c.incidents.straggler = "warn"
  c.incidents.spike_z = 12.0  # robust z-score vs the running median / MAD of spike_window steps
  c.incidents.spike_window = 100
  c.incidents.spike_min_steps = 20  # steps seen before a spike can be flagged
  c.incidents.spike_floor = 0.1  # the MAD scale is at least spike_floor x |median|
  c.incidents.eval_metric = "eval_loss"
  c.incidents.eval_margin = 0.25  # worse than the best eval so far by this fraction
  c.incidents.throughput_factor = 3.0  # median step time over throughput_rows rows vs baseline
  c.incidents.throughput_rows = 10
  c.incidents.throughput_min_excess_s = 0.05  # and by this much (less: a loaded host's noise)
  c.incidents.rollback_steps = 1  # restore a checkpoint at least this many steps before
  c.incidents.skip_batches = 0  # batches skipped from that checkpoint's (at least to the bad one)
  c.incidents.max_rollbacks = 3  # then stop
  c.incidents.defer_reads = "auto"  # judge a step during the next (on | off | auto: not on CPU)
  return c
