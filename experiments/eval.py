r"""Evaluate a run's checkpoint without training: `python -m experiments.eval --workdir=DIR`.

    python -m experiments.train --config=configs/default.py:smoke --workdir=/tmp/run
    python -m experiments.eval --workdir=/tmp/run                       # the newest checkpoint
    python -m experiments.eval --workdir=/tmp/run --step=3 \
        --config.data.eval='/data/eval-*.parquet' --config.strategy=zero3
    JAXCOLL_CPU_DEVICES=4 python -m experiments.eval --workdir=/tmp/run --out_dir=/tmp/evals

Restores the newest trusted checkpoint in DIR/checkpoints (or --step=N) onto
this job's devices and strategy (checkpoints reshard), runs the in-training
evaluation on it (the same code as --config.eval_every, so the figures equal
that step's eval row) and prints one line. The config is the one the
checkpoint was saved with; --config.FIELD=VALUE overrides a field of it (the
eval set, its batch size, the strategy or mesh), --config=FILE replaces it.
It never writes, prunes or changes a checkpoint, metrics.jsonl or
summary.json: the result is appended to DIR/evals.jsonl (--out_dir=OTHER:
OTHER/evals.jsonl), which `python -m experiments.report` shows. A workdir it
cannot write: the result is printed, one line says it was not recorded, exit
0. Bad input (no checkpoint, no such step, eval data missing, a model that
does not match the checkpoint): one line on stderr, exit 2. Library side:
jaxcoll/run/eval_only.py.
"""

from __future__ import annotations

import logging as std_logging
import os
import sys

os.environ.setdefault("JAXCOLL_CPU_DEVICES", "8")

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from experiments import _cli  # noqa: E402

_PROG = "eval"
_REPO = _cli.use_shipped_configs(_PROG)  # --config=NAME: a shipped one
# Whether --config=FILE was given: then it is the config; else the checkpoint's, and the
# --config.FIELD overrides (checked against this default's fields) apply to that one.
_GIVEN_CONFIG = any(a.startswith("--config=") or a == "--config" for a in sys.argv[1:])
try:
  _CONFIG = config_flags.DEFINE_config_file(
      "config",
      os.path.join(_REPO, "configs", "default.py"),
      "Default: the config the checkpoint was saved with; --config.FIELD=VALUE overrides a "
      "field of it (e.g. --config.data.eval=GLOB); --config=FILE (or a shipped name) "
      "replaces it.",
      lock_config=True,
  )
except (KeyError, AttributeError, ValueError, TypeError, OSError) as e:
  _cli.fail(_PROG, _cli.explain_config_error(e, os.path.join(_REPO, "configs", "default.py")))
_WORKDIR = flags.DEFINE_string("workdir", None, "The --workdir of a training run.")
_STEP = flags.DEFINE_integer("step", None, "The checkpoint to evaluate (default: the newest "
                             "trusted one).")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Where evals.jsonl goes (default: the "
                               "--workdir), e.g. for a read-only workdir.")


def _parse_flags(argv):
  try:
    return _cli.flags_parser(_PROG)(argv)
  except Exception as e:  # noqa: BLE001  (the user's config file raised it)
    _cli.fail(_PROG, f"cannot load `--config`: {type(e).__name__}: {e}")
    raise  # unreachable: fail exits


def main(argv):
  _cli.no_positional(_PROG, argv, path_flag="workdir")
  if not _WORKDIR.value:
    _cli.fail(_PROG, "`--workdir` is required: the --workdir of a training run, e.g. "
              "--workdir=runs/default.")
  if not flags.FLAGS["verbosity"].present and not _cli.is_verbose():
    logging.set_verbosity(logging.WARNING)  # orbax and JAX log every read at INFO
    std_logging.getLogger("jaxcoll").setLevel(std_logging.INFO)
  import jax  # noqa: PLC0415  (after flag parsing: JAXCOLL_CPU_DEVICES)

  try:
    config = _CONFIG.value if _GIVEN_CONFIG else None
    if config is not None:
      config.get("steps")  # a file that failed to load raises here
    overrides = dict(config_flags.get_override_values(flags.FLAGS["config"]))
  except Exception as e:  # noqa: BLE001  (the user's config file failed to load)
    _cli.fail(_PROG, f"cannot load `--config`: {type(e).__name__}: {e}")
  import jaxcoll  # noqa: PLC0415
  from jaxcoll.observe import metrics  # noqa: PLC0415
  from jaxcoll.run import eval_only  # noqa: PLC0415
  from jaxcoll.run.config_error import ConfigError  # noqa: PLC0415

  try:
    jaxcoll.distributed.initialize()
    row = eval_only.evaluate_checkpoint(_WORKDIR.value, step=_STEP.value, config=config,
                                        overrides=overrides)
  except (ConfigError, ValueError) as e:
    _cli.fail(_PROG, str(e))
  if jax.process_index() != 0:
    return
  print(eval_only.describe(row), flush=True)
  out = _OUT_DIR.value or _WORKDIR.value
  try:
    path = metrics.append_eval_row(row, out)
  except OSError as e:  # a read-only workdir: the result is printed above
    print(f"{_PROG}: not recorded: cannot write {os.path.join(out, metrics.EVALS_NAME)} "
          f"({e.strerror or e}); the result is printed above; pass --out_dir=A_WRITABLE_DIR "
          "to record it there (and the same --out_dir to experiments.report).",
          file=sys.stderr)
    return
  print(f"recorded in {path}", file=sys.stderr)


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
