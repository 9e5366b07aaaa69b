r"""Train a jaxcoll workload: `python -m experiments.train --workdir=DIR`.

    python -m experiments.train --config=configs/resnet_dp8.py --workdir=/tmp/resnet
    python -m experiments.train --config=configs/default.py --config.strategy=zero3 \
        --config.algorithm=ring --workdir=/tmp/zero3
    python -m jaxcoll.launch --num_processes=2 --devices_per_process=4 -- \
        python -m experiments.train --config=configs/recommender_2x4.py --workdir=/tmp/rec

Writes DIR/metrics.jsonl, TensorBoard events in DIR/tensorboard, checkpoints
in DIR/checkpoints and DIR/summary.json (with the history of attempts);
resumes from the newest checkpoint in DIR, and when that one is already at
--config.steps says "nothing to do" and exits 0 without changing a file in
DIR (only its lock and write probe come and go); `python -m experiments.eval
--workdir=DIR` evaluates a checkpoint without training. The
start / resume line goes to stderr (``--verbosity=-1`` hides it). Without
accelerators it emulates JAXCOLL_CPU_DEVICES CPU devices (default 8). Bad
configuration: one line on stderr, exit status 2; faults have their own
statuses (README, "Faults and bad input"); anything else is a bug and shows
its traceback.
"""

from __future__ import annotations

import logging as std_logging
import os
import signal
import sys

os.environ.setdefault("JAXCOLL_CPU_DEVICES", "8")


def _interrupted(signum, frame):
  """Ctrl-C outside the training loop (which stops after a step, with a
  checkpoint): while starting nothing is written yet, so end at once, in one
  line (a KeyboardInterrupt inside an import would show as an ImportError)."""
  del frame
  try:
    os.write(2, b"train: interrupted by SIGINT outside the training loop; nothing more is "
                b"written (checkpoints already written are intact).\n")
  except OSError:  # stderr's reader left: the line has no one to go to, the status still does
    pass
  os._exit(128 + signum)


if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not an ignored one (`&`)
  signal.signal(signal.SIGINT, _interrupted)


from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from experiments import _cli  # noqa: E402

_REPO = _cli.use_shipped_configs("train")  # --config=NAME: a shipped one
try:  # config_flags applies --config.field overrides while defining the flag
  _CONFIG = config_flags.DEFINE_config_file(
      "config",
      os.path.join(_REPO, "configs", "default.py"),
      "Training config: a file (ml_collections), e.g. configs/resnet_dp8.py or its :smoke "
      "variant, or a shipped config by name (default, resnet_dp8:smoke; `jaxcoll configs`).",
      lock_config=True,
  )
except (KeyError, AttributeError, ValueError, TypeError, OSError) as e:
  _cli.fail("train", _cli.explain_config_error(e, os.path.join(_REPO, "configs", "default.py")))
_WORKDIR = flags.DEFINE_string(
    "workdir", "runs/default", "Directory for metrics, checkpoints and summary.json."
)


def _parse_flags(argv):
  """``_cli``'s parser, and a ``--config`` file that fails to load (a syntax
  error, an exception at import) is bad input too."""
  try:
    return _cli.flags_parser("train")(argv)
  except Exception as e:  # noqa: BLE001  (the user's config file raised it)
    _cli.fail("train", f"cannot load `--config`: {type(e).__name__}: {e}")
    raise  # unreachable: fail exits


def _first_line(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def _peer_gone(lost: BaseException) -> None:
  """Ends this process after a collective failed because a peer process is gone (``lost``:
  gloo's error): the liveness watch names that peer (exit 76); else one line (Python's
  status 1). At once either way: JAX's shutdown at a normal exit would wait for the dead
  peer (300 s, then an abort with a stack dump); the others are told this process failed."""
  import jax  # noqa: PLC0415

  from jaxcoll.runtime import liveness  # noqa: PLC0415

  liveness.end_after_lost_peer(
      f"train: error: process {jax.process_index()} of {jax.process_count()}: a collective "
      f"failed because a peer process is gone ({_first_line(lost)}); see the other "
      "processes' output for why it ended.")


def main(argv):
  _cli.no_positional("train", argv, path_flag="workdir")
  if not flags.FLAGS["verbosity"].present and not _cli.is_verbose():
    logging.set_verbosity(logging.WARNING)  # orbax and JAX log every save at INFO
    # ... but the run's own start / resume / nothing-to-do lines show; an explicit
    # --verbosity applies to them too (-1 hides them, as every INFO line).
    std_logging.getLogger("jaxcoll").setLevel(std_logging.INFO)
  # After flag parsing: JAXCOLL_CPU_DEVICES must be set before JAX starts.
  import jax  # noqa: PLC0415

  try:
    config = _CONFIG.value
    config.get("steps")  # a file that failed to load raises here
  except Exception as e:  # noqa: BLE001  (the user's config file failed to load)
    _cli.fail("train", f"cannot load `--config`: {type(e).__name__}: {e}")
  try:
    import jaxcoll  # noqa: PLC0415  (reads JAXCOLL_CPU_DEVICES)

    from jaxcoll.run import config as run_config  # noqa: PLC0415
    from jaxcoll.run import watchdog  # noqa: PLC0415  (light: no JAX work)

    # Every field checked once (unknown fields, types, values): one line, exit 2.
    config = run_config.parse(config)

    if not _WORKDIR.value:
      raise ValueError("`--workdir` must name a directory for metrics and checkpoints.")
    # A heartbeat long enough for the watchdog to report a hung peer first.
    jaxcoll.distributed.initialize(heartbeat_s=watchdog.heartbeat_needed_s(config))
  except ValueError as e:  # the environment or the command line
    from jaxcoll.runtime import liveness  # noqa: PLC0415

    # Joined, then refused by initialize's last check (this process's count is wrong):
    # the others end too, at once, instead of waiting for it in a collective.
    if liveness.active():
      liveness.fail_now(f"train: error: {' '.join(str(e).split())}", 2)
    _cli.fail("train", str(e))
  from jaxcoll import disk, errors  # noqa: PLC0415
  from jaxcoll.run import incidents, loop, watchdog  # noqa: PLC0415

  try:
    try:
      summary = loop.train_and_evaluate(config, _WORKDIR.value)
    except Exception as e:  # a collective whose peer is gone, however wrapped (eval, save)
      lost = jaxcoll.distributed.lost_peer_error(e)
      if lost is not None:
        _peer_gone(lost)
      raise
  except loop.ConfigError as e:  # bad configuration; anything else shows its traceback
    _cli.fail("train", str(e))
  except FloatingPointError as e:  # nan_policy="raise", or a non-finite state
    _cli.fail("train", str(e), status=errors.EXIT_NON_FINITE)
  except loop.ReplicaDesyncError as e:  # diverged replicas (check_every, or at a save)
    _cli.fail("train", str(e), status=errors.EXIT_REPLICA_DESYNC)
  except incidents.IncidentStop as e:  # an incident's response was `stop`
    _cli.fail("train", str(e), status=incidents.EXIT_INCIDENT_STOP)
  except watchdog.StopRequested as e:  # SIGTERM / SIGINT / SIGHUP: after a final checkpoint
    _cli.stopped("train", str(e), status=e.status)  # what was asked for: not an error
  except errors.CheckpointSaveError as e:  # a fault of the storage: one line, Python's status 1
    sys.exit(f"train: error: {' '.join(str(e).split())}")
  except Exception as e:  # a full disk, wherever it surfaced (orbax wraps it deeply)
    if not disk.is_full(e):
      raise
    _cli.fail("train", disk.message(e), status=errors.EXIT_DISK_FULL)
  if jax.process_index() == 0 and not summary.get("nothing_to_do"):  # that one said so
    # `... | head -n 0`: the run is done and recorded all the same (_cli.outlive_closed_readers)
    print(
        f"done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
        f"params sha256 {summary['params_sha256'][:16]}..., {summary['wall_time_s']:.1f} s",
        flush=True,
    )


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
