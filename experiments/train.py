r"""Train a jaxcoll workload: `python -m experiments.train --workdir=DIR`.

    python -m experiments.train --config=configs/resnet_dp8.py --workdir=/tmp/resnet
    python -m experiments.train --config=configs/default.py --config.strategy=zero3 \
        --config.algorithm=ring --workdir=/tmp/zero3
    python -m jaxcoll.launch --num_processes=2 --devices_per_process=4 -- \
        python -m experiments.train --config=configs/recommender_2x4.py --workdir=/tmp/rec

Writes DIR/metrics.jsonl, TensorBoard events in DIR/tensorboard, checkpoints
in DIR/checkpoints and DIR/summary.json; resumes from the newest checkpoint
in DIR. Without accelerators it emulates JAXCOLL_CPU_DEVICES CPU devices
(default 8). Bad input: one line on stderr, exit status 2.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAXCOLL_CPU_DEVICES", "8")


from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from experiments import _cli  # noqa: E402

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)  # configs/*.py import `configs.base`
try:  # config_flags applies --config.field overrides while defining the flag
  _CONFIG = config_flags.DEFINE_config_file(
      "config",
      os.path.join(_REPO, "configs", "default.py"),
      "Training config file (ml_collections), e.g. configs/resnet_dp8.py or its :smoke variant.",
      lock_config=True,
  )
except (KeyError, AttributeError, ValueError, TypeError, OSError) as e:
  _cli.fail("train", _cli.explain_config_error(e, os.path.join(_REPO, "configs", "default.py")))
_WORKDIR = flags.DEFINE_string(
    "workdir", "runs/default", "Directory for metrics, checkpoints and summary.json."
)


def main(argv):
  if len(argv) > 1:
    _cli.fail("train", f"unexpected arguments {argv[1:]}; every option is a --flag.")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax and JAX log every save at INFO
  # After flag parsing: JAXCOLL_CPU_DEVICES must be set before JAX starts.
  import jax  # noqa: PLC0415

  import jaxcoll  # noqa: PLC0415
  from jaxcoll.train import loop  # noqa: PLC0415

  try:
    jaxcoll.distributed.initialize()
    if not _WORKDIR.value:
      raise ValueError("`--workdir` must name a directory for metrics and checkpoints.")
    try:
      config = _CONFIG.value
      config.get("steps")  # a file that failed to load raises here
    except (OSError, AttributeError, KeyError, TypeError, SyntaxError) as e:
      raise ValueError(f"cannot load `--config`: {e}") from None
    summary = loop.train_and_evaluate(config, _WORKDIR.value)
  except ValueError as e:
    _cli.fail("train", str(e))
  except FloatingPointError as e:  # nan_policy="raise"
    _cli.fail("train", str(e), status=3)
  except loop.ReplicaDesyncError as e:  # check_every found diverged replicas
    _cli.fail("train", str(e), status=4)
  if jax.process_index() == 0:
    print(
        f"done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
        f"params sha256 {summary['params_sha256'][:16]}..., {summary['wall_time_s']:.1f} s"
    )


if __name__ == "__main__":
  app.run(main, flags_parser=_cli.flags_parser("train"))
