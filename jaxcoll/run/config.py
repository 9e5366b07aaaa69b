"""The run configuration: one frozen dataclass tree, parsed and checked once.

:class:`RunConfig` (with :class:`DataConfig` for ``config.data`` and
:class:`IncidentsConfig` for ``config.incidents``) holds every field of a
training run; its field defaults are the only defaults
(``configs/base.py``'s ``base_config()`` is :meth:`RunConfig.to_config_dict`
of ``RunConfig()``). :func:`parse` turns what the command line or a user
gives (an ``ml_collections.ConfigDict``, a mapping, possibly partial: a
missing field takes its default) into a ``RunConfig``, refusing unknown
fields, wrong types and bad values with the house one-line
:class:`~jaxcoll.errors.ConfigError` (``experiments.train``: exit 2, nothing
written). The runner (loop, inputs, optim, hooks, timing, watchdog,
incidents) reads attributes of the parsed object.

Checks that need the job itself stay where that is known: the mesh (device
count, ``replica_axis`` among its axes), ``slow_process`` below the process
count, ``data.eval_batch_size`` against the data axis, the heartbeat timeout
(:func:`jaxcoll.run.loop.train_and_evaluate` makes them before anything is
written).

  >>> from jaxcoll.run import config
  >>> c = config.parse({"steps": 10, "data": {"prefetch": 4}})
  >>> c.steps, c.data.prefetch, c.watchdog_s
  (10, 4, 600.0)
  >>> config.parse({"stpes": 10})
  Traceback (most recent call last):
  ...
  jaxcoll.errors.ConfigError: `config.stpes`=10: unknown config field 'stpes'; did you mean 'steps'? (the fields: jaxcoll.run.config.RunConfig)
"""

import dataclasses
import difflib
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, get_type_hints

from jaxcoll import checks, models
from jaxcoll.run import data_skip, profiling
from jaxcoll.run.config_error import ConfigError
from jaxcoll.run.config_error import fail as _fail
from jaxcoll.train import strategies as strategies_lib

STRATEGIES = tuple(strategies_lib.STAGES)  # dp, zero1, zero2, zero3
OPTIMIZERS = ("adam", "adamw", "sgd", "momentum", "lion", "adafactor")
SCHEDULES = ("constant", "cosine", "linear")
COMPUTE_DTYPES = ("float32", "bfloat16")
# Incidents (README "Incidents and rollback").
SIGNALS = ("loss_spike", "grad_norm_spike", "non_finite", "eval_regression",
           "throughput_regression", "straggler")
BATCH_SIGNALS = ("loss_spike", "grad_norm_spike", "non_finite")  # those `skip` can answer
ACTIONS = ("off", "warn", "skip", "rollback", "stop")
DEFER_READS = ("auto", "on", "off")  # incidents.defer_reads
EVAL_MODES = ("auto", "min", "max")  # incidents.eval_mode: which way the eval metric improves
# incidents.eval_mode=auto: the words of a metric's name (after "eval_", split at "_") that say
# which way it improves (eval_loss, eval_masked_accuracy, eval_top1); any other name needs
# eval_mode.
_LOWER_IS_BETTER = frozenset(("loss", "logloss", "nll", "perplexity", "ppl", "error", "err",
                              "mse", "mae", "rmse", "wer", "cer"))
_HIGHER_IS_BETTER = frozenset(("accuracy", "acc", "f1", "auc", "precision", "recall", "bleu",
                               "rouge", "map", "ndcg", "top1", "top5", "iou", "r2"))
SAVE_LIMIT_FACTOR = 4  # the watchdog's default save limit: 4 x watchdog_s


_MAX_STEPS = 2**31 - 1  # TrainState.step is an int32
SHARD_BY = ("record", "file")  # jaxcoll.data.files.SHARD_BY (not imported: it imports grain)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """``config.data``: the workload's synthetic set, or files (README "Your own model and data")."""

  # a glob of Parquet / ArrayRecord files, or a list of globs '["a/*.pq", "b/*.pq"]'
  train: str = ""  # "" = the synthetic set
  eval: str = ""  # glob of eval files; "" = `eval_examples` held-out synthetic examples
  shard_by: str = "record"  # record (same batches for any process count) | file
  eval_examples: int = 1024
  eval_batch_size: int = 0  # 0 = global_batch_size
  num_threads: int = 2  # grain reader threads per process
  prefetch: int = 2  # batches read ahead
  cache_mib: int = 256  # MiB of Parquet row groups a process keeps decoded (train; eval too)
  # Resume a checkpoint whose data position no longer fits (other files or file contents,
  # another shard_by, another process count under shard_by=file): go on from the same
  # number of examples in the new order instead of refusing (README "Your own model and data").
  allow_changed_files: bool = False
  skip: str = ""  # "A:B[,C:D]": no step trains on global batches A..B (batch n = step n's)

  def __post_init__(self):
    _check_types(self, "data.")
    if self.shard_by not in SHARD_BY:  # checked even without files (it was only with them)
      raise _fail("data.shard_by", self.shard_by, f"valid choices are {', '.join(SHARD_BY)} "
                  "(record: the same batches for any process count; file: each process its "
                  "own files).")
    _nonneg_int(self, "num_threads", "data.", "0: read in the training thread")
    _nonneg_int(self, "prefetch", "data.", "0: read in the training thread, no read-ahead")
    if self.cache_mib < 1:
      raise _fail("data.cache_mib", self.cache_mib, "must be a positive integer (MiB of "
                  "decoded Parquet row groups each process keeps; default 256).")
    if self.eval_batch_size < 0:
      raise _fail("data.eval_batch_size", self.eval_batch_size,
                  "must be an integer >= 0 (0 = global_batch_size).")
    if self.eval_examples < 1:
      raise _fail("data.eval_examples", self.eval_examples, "must be a positive integer.")
    if data_skip.parse_skip(self.skip) and self.train and self.allow_changed_files:
      raise _fail("data.skip", self.skip, "names global batches by their number in the files' "
                  "order, and data.allow_changed_files=True lets a resume go on in another "
                  "order, where those numbers are other examples; drop one of the two.")


@dataclasses.dataclass(frozen=True)
class IncidentsConfig:
  """``config.incidents`` (README "Incidents and rollback"): each signal's
  response is off | warn | skip | rollback | stop; every incident goes to
  DIR/incidents.jsonl."""

  loss_spike: str = "warn"
  grad_norm_spike: str = "warn"
  non_finite: str = "warn"
  eval_regression: str = "warn"
  throughput_regression: str = "warn"
  straggler: str = "warn"
  spike_z: float = 12.0  # robust z-score vs the running median / MAD of spike_window steps
  spike_window: int = 100
  spike_min_steps: int = 20  # steps seen before a spike can be flagged
  spike_floor: float = 0.1  # the MAD scale is at least spike_floor x |median|
  eval_metric: str = "eval_loss"
  eval_mode: str = "auto"  # min (lower is better) | max | auto (from the metric's name)
  eval_margin: float = 0.25  # worse than the best eval so far by this fraction
  throughput_factor: float = 3.0  # median step time over throughput_rows rows vs baseline
  throughput_rows: int = 10
  throughput_min_excess_s: float = 0.05  # and by this much (less: a loaded host's noise)
  rollback_steps: int = 1  # restore a checkpoint at least this many steps before
  skip_batches: int = 0  # batches skipped from that checkpoint's (at least to the bad one)
  max_rollbacks: int = 3  # then stop
  defer_reads: str = "auto"  # steps wait for the next logged/saved one (on | off | auto: on)

  def __post_init__(self):
    _check_types(self, "incidents.")
    if self.defer_reads not in DEFER_READS:
      raise _fail("incidents.defer_reads", self.defer_reads, "use on (judge a step's loss and "
                  "gradient norm with the next logged or saved step's), off (right after it) or "
                  "auto (on).")
    for signal in SIGNALS:
      action = getattr(self, signal)
      if action not in ACTIONS:
        raise _fail(f"incidents.{signal}", action, f"valid responses: {', '.join(ACTIONS)}, "
                    f"e.g. --config.incidents.{signal}=rollback.")
      if action == "skip" and signal not in BATCH_SIGNALS:
        raise _fail(f"incidents.{signal}", action, f"`skip` drops one batch, which answers "
                    f"{', '.join(BATCH_SIGNALS)} only; use warn, rollback or stop.")
    for name, minimum, strict, example in (
        ("spike_z", 0, True, "12"), ("spike_floor", 0, False, "0.1"),
        ("eval_margin", 0, True, "0.25"), ("throughput_factor", 1, True, "3"),
        ("throughput_min_excess_s", 0, False, "0.05")):
      number = getattr(self, name)
      if not math.isfinite(number) or (number <= minimum if strict else number < minimum):
        raise _fail(f"incidents.{name}", number, f"must be a finite number "
                    f"{'>' if strict else '>='} {minimum:g}, e.g. "
                    f"--config.incidents.{name}={example}.")
    for name, minimum, example in (("spike_window", 3, "100"), ("spike_min_steps", 3, "20"),
                                   ("throughput_rows", 1, "10"), ("rollback_steps", 1, "100"),
                                   ("skip_batches", 0, "200"), ("max_rollbacks", 0, "3")):
      if getattr(self, name) < minimum:
        raise _fail(f"incidents.{name}", getattr(self, name), f"must be an integer >= "
                    f"{minimum}, e.g. --config.incidents.{name}={example}.")
    if not self.eval_metric.startswith("eval_"):
      raise _fail("incidents.eval_metric", self.eval_metric, "name an eval metric, e.g. "
                  "--config.incidents.eval_metric=eval_loss (or eval_accuracy).")
    if self.eval_mode not in EVAL_MODES:
      raise _fail("incidents.eval_mode", self.eval_mode, "use min (lower is better: a loss), "
                  "max (higher is better: an accuracy) or auto (from the metric's name).")
    if self.eval_regression != "off":
      eval_direction(self.eval_metric, self.eval_mode)
    if self.spike_min_steps > self.spike_window:
      raise _fail("incidents.spike_min_steps", self.spike_min_steps, f"must be at most "
                  f"incidents.spike_window ({self.spike_window}).")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Every field of a training run (``python -m experiments.train``,
  :func:`jaxcoll.run.loop.train_and_evaluate`), checked when built.

  Build one directly (``RunConfig(steps=10, data=DataConfig(prefetch=4))``),
  or from a ``ConfigDict`` / mapping with :func:`parse`;
  ``dataclasses.replace`` changes fields (and checks them again).
  """

  model: str = "mlp"  # a built-in name (jaxcoll.models.names()) or "module:function"
  model_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  steps: int = 100
  global_batch_size: int = 256  # = 8 devices x 32 per device
  grad_accum_steps: int = 1
  seed: int = 0
  # Parallelism: strategy in dp, zero1, zero2, zero3; algorithm: any
  # jaxcoll.algorithms("all_reduce") name, or auto.
  strategy: str = "dp"
  algorithm: str = "auto"
  # With algorithm=auto: the tuning table it consults, as `jaxcoll tune --out=PATH` wrote it
  # ("": the table shipped for this device kind, else the cost model).
  tuning_table: str = ""
  bucket_bytes: int = 25 * 2**20
  compression: str = ""  # "", "bf16" or "int8" (dp only)
  mesh_shape: str = ""  # "" = one "data" axis over all devices; "2,4" = (node, local)
  mesh_axes: str = ""
  replica_axis: str = ""  # zero*: replicate over this mesh axis, shard over the rest (hybrid)
  # Optimization.
  optimizer: str = "adam"
  learning_rate: float = 1e-3
  weight_decay: float = 0.0
  clip_global_norm: float = 0.0  # 0 = off
  schedule: str = "constant"  # constant | cosine | linear (to 0 at `steps`), after the warm-up
  warmup_steps: int = 0  # linear warm-up from 0 to learning_rate
  compute_dtype: str = "float32"
  # Data: the workload's synthetic set, or files (README "Your own model and data").
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  eval_every: int = 0  # evaluate every N steps and at the end (0 = never)
  # What a user watches, and what survives a crash.
  log_every: int = 10
  checkpoint_every: int = 50
  keep_checkpoints: int = 3
  tensorboard: bool = True
  profile_steps: str = ""  # "A:B": jax.profiler trace of steps A..B into DIR/profile ("" = off)
  # Straggler report (README "Step time and stragglers"): a process whose own time per step
  # exceeds straggler_factor x the median of all processes for straggler_steps logged rows.
  straggler_factor: float = 1.5
  straggler_steps: int = 3
  # Reliability (see README "Faults and bad input").
  nan_policy: str = "none"  # none | skip (state unchanged, counted) | raise (exit 3)
  check_every: int = 0  # compare replica fingerprints every N steps (0 = off); exit 4 on desync
  watchdog_s: float = 600.0  # no step finished for this long: report the last step, exit 86
  save_timeout_s: float = 0.0  # a checkpoint save or eval may take this long (0: 4 x watchdog_s)
  fail_at_step: int = 0  # fault injection: process fail_process exits at this step, first attempt
  hang_at_step: int = 0  # fault injection: process fail_process hangs at this step, first attempt
  fail_process: int = 0  # the process fail_at_step / hang_at_step act on (0: the coordinator's)
  nan_at_step: int = 0  # fault injection: this step's batch is NaN
  desync_at_step: int = 0  # fault injection: one replica of process 0 drifts, first attempt only
  slow_process: int = 0  # fault injection: this process sleeps slow_seconds before every step
  slow_seconds: float = 0.0  # (0 = off), a straggler for the straggler report
  corrupt_batches: str = ""  # fault injection: "A:B": batches A..B scaled x100, labels shuffled
  corrupt_scale: float = 100.0  # corrupt_batches' input scale (nan: non-finite; BatchNorm
  # models normalize a finite scale away)
  # Incidents (README "Incidents and rollback").
  incidents: IncidentsConfig = dataclasses.field(default_factory=IncidentsConfig)

  def __post_init__(self):
    if _is_mapping(self.data):
      object.__setattr__(self, "data", _build(DataConfig, self.data, "data."))
    if _is_mapping(self.incidents):
      object.__setattr__(self, "incidents", _build(IncidentsConfig, self.incidents,
                                                   "incidents."))
    _check_types(self, "")
    object.__setattr__(self, "model_overrides", _plain(self.model_overrides))
    self._check()

  def _check(self) -> None:
    for field in ("steps", "global_batch_size", "log_every", "checkpoint_every",
                  "check_every", "keep_checkpoints"):
      value = getattr(self, field)
      minimum = 0 if field in ("checkpoint_every", "check_every") else 1
      if value < minimum:
        raise _fail(field, value, f"must be an integer >= {minimum}.")
    if self.steps > _MAX_STEPS:  # the trainer counts steps in an int32
      raise _fail("steps", self.steps, f"must be an integer <= {_MAX_STEPS} (the step counter "
                  "is an int32).")
    for field, zero_ok, example in (("learning_rate", False, "1e-3"), ("watchdog_s", True, "600"),
                                    ("weight_decay", True, "1e-4"),
                                    ("clip_global_norm", True, "1.0")):
      number = getattr(self, field)
      if not math.isfinite(number) or number < 0 or (number == 0 and not zero_ok):
        want = "a finite number >= 0 (0 turns it off)" if zero_ok else "a finite number > 0"
        raise _fail(field, number, f"must be {want}, e.g. --config.{field}={example}.")
    if ":" not in self.model and self.model not in models.names():
      import difflib  # noqa: PLC0415

      module, dot, function = self.model.rpartition(".")
      close = difflib.get_close_matches(self.model, models.names(), n=1)
      if self.model.endswith(".py"):  # a file: its directory on PYTHONPATH, then stem:function
        folder, stem = os.path.split(module)
        raise _fail("model", self.model, f"valid models: {', '.join(models.names())} or your "
                    f"own model's 'module:function' path: a file is named by its module, "
                    f"e.g. {'PYTHONPATH=' + folder + ' ' if folder else ''}--config.model="
                    f"{stem}:make (the function that builds the model).")
      guess = (f" or your own model's 'module:function' path (did you mean "
               f"'{module}:{function}'?)" if dot and module and function.isidentifier() else
               f" (did you mean {close[0]!r}?) or your own model's 'module:function' path"
               if close else " or your own model's 'module:function' path, e.g. 'my_model:make'")
      raise _fail("model", self.model, f"valid models: {', '.join(models.names())}{guess}.")
    if self.eval_every < 0:
      raise _fail("eval_every", self.eval_every, "must be an integer >= 0 (0 = no evaluation).")
    if not math.isfinite(self.save_timeout_s) or self.save_timeout_s < 0:
      raise _fail("save_timeout_s", self.save_timeout_s, "must be a finite number of seconds "
                  f">= 0 (0: {SAVE_LIMIT_FACTOR} x watchdog_s), e.g. --config.save_timeout_s=1200.")
    if not math.isfinite(self.slow_seconds) or self.slow_seconds < 0:
      raise _fail("slow_seconds", self.slow_seconds,
                  "must be a finite number of seconds >= 0 (0 turns it off), e.g. "
                  "--config.slow_seconds=0.2.")
    for field in ("slow_process", "fail_process"):
      if getattr(self, field) < 0:
        raise _fail(field, getattr(self, field), "must be a process id (an integer >= 0), "
                    f"e.g. --config.{field}=1.")
    skipped = data_skip.parse_skip(self.data.skip)
    # Example numbers are int64: a batch past them stopped the run mid-way with an OverflowError.
    past = (2**63 - 1) // self.global_batch_size - self.steps - 1
    if skipped and skipped[-1][1] > past:
      raise _fail("data.skip", self.data.skip, f"batch {skipped[-1][1]} is past any data set "
                  f"(its examples would be numbered beyond 2^63 at global_batch_size="
                  f"{self.global_batch_size}); skip batches up to {past} at most.")
    if self.corrupt_batches and len(data_skip.parse_skip(self.corrupt_batches,
                                                         "corrupt_batches")) != 1:
      raise _fail("corrupt_batches", self.corrupt_batches, "give one range A:B, e.g. "
                  "--config.corrupt_batches=30:39.")
    check_straggler(self.straggler_factor, self.straggler_steps)
    profiling.parse_profile_steps(self.profile_steps, self.steps)
    if self.strategy not in STRATEGIES:
      raise _fail("strategy", self.strategy, f"valid strategies: {', '.join(STRATEGIES)} (dp "
                  "is ZeRO stage 0; ZeRO has stages 0-3).")
    if self.tuning_table and self.algorithm != "auto":
      raise _fail("tuning_table", self.tuning_table, f"only algorithm=auto reads a tuning "
                  f"table (this run's is {self.algorithm!r}); add --config.algorithm=auto or "
                  "leave --config.tuning_table out.")
    if self.compression and self.strategy != "dp":
      raise _fail("compression", self.compression, "compression is for strategy 'dp' only.")
    if self.compute_dtype not in ("", *COMPUTE_DTYPES):  # "": float32
      raise _fail("compute_dtype", self.compute_dtype, "use 'float32' or 'bfloat16'.")
    if self.optimizer not in OPTIMIZERS:
      raise _fail("optimizer", self.optimizer, f"valid optimizers: {', '.join(OPTIMIZERS)}.")
    schedule = self.schedule or "constant"
    if schedule not in SCHEDULES:
      raise _fail("schedule", schedule, f"valid schedules: {', '.join(SCHEDULES)}.")
    if not 0 <= self.warmup_steps <= self.steps:
      raise _fail("warmup_steps", self.warmup_steps,
                  f"must be an integer in 0..steps ({self.steps}).")
    if schedule == "cosine" and self.warmup_steps == self.steps:
      raise _fail("warmup_steps", self.warmup_steps,
                  f"cosine needs warmup_steps < steps ({self.steps}).")
    rolls = [s for s in SIGNALS if getattr(self.incidents, s) == "rollback"]
    if rolls and not self.checkpoint_every:
      raise _fail(f"incidents.{rolls[0]}", "rollback", "a rollback restores a checkpoint, but "
                  "checkpoint_every is 0; set --config.checkpoint_every=50 (or respond "
                  "warn/stop).")
    if rolls:
      # The checkpoints kept when an anomaly at step S is answered: the newest `keep` saved
      # before it, the oldest (keep - 1) * every + 1 steps before S at worst (S one step after
      # a save); an eval's own step is saved first and is no target: (keep - 1) * every. A
      # rollback further back finds only the initial state, and skips every batch before S.
      every, keep = self.checkpoint_every, self.keep_checkpoints
      evals = "eval_regression" in rolls
      reach = (keep - 1) * every + (0 if evals else 1)
      wanted = self.incidents.rollback_steps
      if wanted > reach:
        need = -(-(wanted - (0 if evals else 1)) // every) + 1
        raise _fail("incidents.rollback_steps", wanted,
                    f"with keep_checkpoints={keep} and checkpoint_every={every}, the newest "
                    f"checkpoint at least {wanted} steps before an anomaly can already be "
                    f"pruned{' (an eval regression: its own step is no target)' if evals else ''}"
                    f", and the rollback then restarts from step 0, skipping every batch before "
                    f"the anomaly; set --config.keep_checkpoints={need}"
                    + (f" or --config.incidents.rollback_steps={reach}" if reach >= 1 else "")
                    + ".")

  def to_dict(self) -> dict[str, Any]:
    """Plain nested dicts (as ``ConfigDict.to_dict()``: summary.json, checkpoints)."""
    return _plain(self)

  def to_config_dict(self):
    """An unlocked ``ml_collections.ConfigDict`` with these values (``configs/base.py``)."""
    import ml_collections  # noqa: PLC0415

    out = ml_collections.ConfigDict()
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if isinstance(value, DataConfig):
        # Not type-safe: a config file may set `c.data.train = ["a/*.pq", "b/*.pq"]`, a
        # list of globs where the default is a string (ml_collections refused it with a
        # TypeError); `parse` checks every field's type all the same.
        value = ml_collections.ConfigDict(_plain(value), type_safe=False)
      elif dataclasses.is_dataclass(value):
        value = ml_collections.ConfigDict(_plain(value))
      elif isinstance(value, Mapping):
        value = ml_collections.ConfigDict(_plain(value))
      out[f.name] = value
    return out


def parse(config: Any) -> RunConfig:
  """``config`` as a :class:`RunConfig` (a ``RunConfig`` as it is).

  Args:
    config: a ``RunConfig``, an ``ml_collections.ConfigDict`` (or
      ``FrozenConfigDict``), or a mapping of the same fields, nested for
      ``data`` and ``incidents``; a missing field takes its default.

  Raises:
    ConfigError: (a ``ValueError``) an unknown field, a value of the wrong
      type, or a bad value: one line naming ``config.FIELD``, the value and
      the fix.
  """
  if isinstance(config, RunConfig):
    return config
  return _build(RunConfig, _as_mapping(config, ""), "")


def defaults() -> RunConfig:
  """The defaults: ``RunConfig()``."""
  return RunConfig()


def eval_direction(metric: str, mode: str = "auto") -> str:
  """Which way ``metric`` improves: ``"min"`` or ``"max"``; ``mode`` (``incidents.eval_mode``)
  says it, or ``auto`` reads it from the words of the name (``eval_loss``, ``eval_perplexity``,
  ``eval_error``: min; ``eval_accuracy``, ``eval_acc``, ``eval_f1``, ``eval_auc``: max).

  >>> eval_direction("eval_masked_accuracy"), eval_direction("eval_loss")
  ('max', 'min')

  Raises:
    ConfigError: ``auto`` and a name that says neither (or both).
  """
  if mode != "auto":
    return mode
  words = set(metric.lower().removeprefix("eval_").split("_"))
  lower, higher = bool(words & _LOWER_IS_BETTER), bool(words & _HIGHER_IS_BETTER)
  if lower != higher:
    return "min" if lower else "max"
  raise _fail("incidents.eval_mode", mode, f"cannot tell from the name of "
              f"`config.incidents.eval_metric`={metric!r} whether lower or higher is better; "
              "say it: --config.incidents.eval_mode=min (a loss, an error) or "
              "--config.incidents.eval_mode=max (an accuracy, an AUC).")


def check_straggler(factor: Any, steps: Any) -> tuple[float, int]:
  """``(factor, steps)`` of the straggler report, checked (> 1, >= 1)."""
  number = checks.finite_number(factor)
  if number is None or number <= 1:
    raise _fail("straggler_factor", factor,
                "must be a finite number > 1 (times the median), e.g. "
                "--config.straggler_factor=1.5.")
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    raise _fail("straggler_steps", steps,
                "must be an integer >= 1 (logged rows in a row), e.g. "
                "--config.straggler_steps=3.")
  return number, steps


# -- building and type checks ---------------------------------------------------------------

_SECTIONS = {"": RunConfig, "data.": DataConfig, "incidents.": IncidentsConfig}


def _is_mapping(value: Any) -> bool:
  """A dict, a Mapping, a ConfigDict or FrozenConfigDict (not Mappings to abc)."""
  return isinstance(value, Mapping) or (hasattr(value, "items") and callable(value.items)
                                         and not dataclasses.is_dataclass(value))


def _as_mapping(value: Any, prefix: str) -> Mapping[str, Any]:
  if _is_mapping(value):
    return dict(value.items())
  raise ConfigError(f"`config{'.' + prefix.rstrip('.') if prefix else ''}`={value!r}: must be "
                    "a ConfigDict or a mapping of fields (see jaxcoll.run.config.RunConfig).")


def _build(cls, given: Any, prefix: str):
  if isinstance(given, cls):
    return given
  given = _as_mapping(given, prefix)
  names = [f.name for f in dataclasses.fields(cls)]
  for key in given:
    if key not in names:
      close = difflib.get_close_matches(str(key), names, n=1)
      if prefix == "incidents.":  # the incidents section's own words
        fix = (f"unknown signal or setting; signals: {', '.join(SIGNALS)}; settings: "
               f"{', '.join(k for k in names if k not in SIGNALS)}.")
      else:
        fix = (f"unknown config field {prefix + str(key)!r}; "
               + (f"did you mean {prefix + close[0]!r}? " if close else "")
               + f"(the fields: jaxcoll.run.config.{cls.__name__})")
      raise _fail(prefix + str(key), given[key], fix)
  return cls(**given)


_HINTS: dict[type, dict[str, Any]] = {}


def _check_types(obj, prefix: str) -> None:
  """Each field of ``obj`` has its annotated type (an int is accepted for a
  float, and stored as one); else the one-line error."""
  cls = type(obj)
  hints = _HINTS.setdefault(cls, get_type_hints(cls))
  for f in dataclasses.fields(obj):
    want, value, name = hints[f.name], getattr(obj, f.name), prefix + f.name
    if want is bool:
      ok = isinstance(value, bool)
      what = "True or False"
    elif want is int:
      ok = isinstance(value, int) and not isinstance(value, bool)
      what = "an integer"
    elif want is float:
      ok = isinstance(value, (int, float)) and not isinstance(value, bool)
      what = "a number"
      if ok and not isinstance(value, float):
        object.__setattr__(obj, f.name, float(value))
      elif not ok and name in _NUMBER_FIXES:  # a field with its own words for a bad number
        raise _fail(name, value, _NUMBER_FIXES[name])
    elif want is str:
      ok = isinstance(value, str)
      what = "a string"
      if not ok and name in ("data.train", "data.eval") and isinstance(value, Sequence) and \
          all(isinstance(v, str) for v in value):  # a list of globs
        ok = True
        object.__setattr__(obj, f.name, tuple(value))
    elif want in (DataConfig, IncidentsConfig):
      ok = isinstance(value, want)
      what = f"a section ({want.__name__})"
    else:  # model_overrides: any mapping of the model function's keyword arguments
      ok = _is_mapping(value)
      what = "a mapping of keyword arguments"
    if not ok:
      example = f.default if f.default is not dataclasses.MISSING else None
      eg = f", e.g. --config.{name}={example}" if example not in (None, "") else ""
      raise _fail(name, value, f"must be {what}, not {type(value).__name__}{eg}.")


_NUMBER_FIXES = {
    "learning_rate": "must be a finite number > 0, e.g. --config.learning_rate=1e-3.",
    "watchdog_s": "must be a finite number >= 0 (0 turns it off), e.g. --config.watchdog_s=600.",
    "weight_decay": "must be a finite number >= 0 (0 turns it off), e.g. "
                    "--config.weight_decay=1e-4.",
    "clip_global_norm": "must be a finite number >= 0 (0 turns it off), e.g. "
                        "--config.clip_global_norm=1.0.",
    "straggler_factor": "must be a finite number > 1 (times the median), e.g. "
                        "--config.straggler_factor=1.5.",
}


def _nonneg_int(obj, name: str, prefix: str, meaning: str) -> None:
  if getattr(obj, name) < 0:
    raise _fail(prefix + name, getattr(obj, name), f"must be an integer >= 0 ({meaning}), e.g. 2.")


def _plain(value: Any) -> Any:
  """Dataclasses, ConfigDicts and mappings as plain dicts (nested), the rest as is."""
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if _is_mapping(value):
    return {k: _plain(v) for k, v in value.items()}
  return value
