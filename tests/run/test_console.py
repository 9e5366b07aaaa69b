"""What a person sees on the console (issue 23): the latest eval metrics on
the progress line and bar, the `auto` note on the start line, the expected
noise of JAX and orbax hidden unless asked for, a graceful stop that is not
an error."""

import io
import logging

import pytest

from experiments import _cli
from jaxcoll.observe import metrics
from jaxcoll.run import attempts


def test_progress_lines_carry_the_latest_eval():
  out = io.StringIO()
  progress = metrics.Progress(6, stream=out)
  progress.update(2, {"loss": 2.5})
  progress.show_eval(2, {"eval_loss": 2.4531, "eval_accuracy": 0.125})
  progress.update(4, {"loss": 2.25})
  progress.show_eval(4, {"eval_loss": 2.25, "eval_accuracy": 0.25})
  progress.update(6, {"loss": 2.0})
  assert out.getvalue().splitlines() == [
      "step 2/6 loss=2.5",
      "step 2/6 eval_loss=2.453 eval_accuracy=0.125",
      "step 4/6 loss=2.25 eval_loss=2.453 eval_accuracy=0.125 (eval at step 2)",
      "step 4/6 eval_loss=2.25 eval_accuracy=0.25",
      "step 6/6 loss=2 eval_loss=2.25 eval_accuracy=0.25 (eval at step 4)",
  ]


class _Terminal(io.StringIO):
  def isatty(self):
    return True


def test_progress_bar_carries_the_latest_eval():
  out = _Terminal()
  progress = metrics.Progress(6, stream=out)
  progress.update(2, {"loss": 2.5})
  progress.show_eval(2, {"eval_loss": 2.4531})
  assert progress._bar.postfix == "loss=2.5 eval_loss=2.453"
  progress.update(4, {"loss": 2.25})
  assert progress._bar.postfix == "loss=2.25 eval_loss=2.453 (eval at step 2)"
  progress.close()


def test_auto_is_named_on_the_start_line(caplog):
  with caplog.at_level(logging.INFO, logger="jaxcoll"):
    attempts.announce_start(strategy="DP(auto)", devices=8, processes=2, steps=4, workdir="w")
    attempts.announce_start(strategy="DP(ring)", devices=8, processes=2, steps=4, workdir="w")
  auto, ring = caplog.messages
  assert "algorithm auto picks per topology" in auto and "--config.algorithm=ring" in auto
  assert "auto" not in ring


@pytest.mark.parametrize("logger, message", [
    ("jax._src.xla_bridge", "Unable to initialize backend 'tpu': INTERNAL: Failed to open "
                            "libtpu.so: libtpu.so: cannot open shared object file"),
    ("absl", "Metadata file does not exist: /tmp/run/checkpoints/6/_CHECKPOINT_METADATA"),
])
def test_expected_noise_is_hidden_unless_verbose(logger, message, monkeypatch):
  seen = []

  class Keep(logging.Handler):
    def emit(self, record):
      seen.append(record.getMessage())

  log = logging.getLogger(logger)
  handler = Keep()
  log.addHandler(handler)
  level = log.level
  log.setLevel(logging.INFO)
  monkeypatch.delenv(_cli.VERBOSE_ENV, raising=False)
  try:
    assert _cli.quiet_logs()  # hidden
    log.warning(message)
    log.warning("Unable to initialize backend 'cuda': a real problem")  # not the expected one
    monkeypatch.setenv(_cli.VERBOSE_ENV, "1")
    assert not _cli.quiet_logs()  # shown again
    log.warning(message)
  finally:
    _cli.quiet_logs(verbose=True)
    log.removeHandler(handler)
    log.setLevel(level)
  assert seen == ["Unable to initialize backend 'cuda': a real problem", message]


def test_a_graceful_stop_is_not_an_error(capsys):
  with pytest.raises(SystemExit) as stop:
    _cli.stopped("train", "stopped by SIGTERM after step 3; final checkpoint saved.", 143)
  assert stop.value.code == 143
  assert capsys.readouterr().err == (
      "train: stopped by SIGTERM after step 3; final checkpoint saved.\n")


_GLOO_JOB = """
import numpy as np, jax, jaxcoll
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P
info = jaxcoll.distributed.initialize()
mesh = jaxcoll.devices.flat_mesh(8)
f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh, in_specs=P("data"),
                          out_specs=P()))
x = multihost_utils.host_local_array_to_global_array(
    np.arange(4.0, dtype=np.float32) + 4 * info.process_id, mesh, P("data"))
print("sum", float(multihost_utils.process_allgather(f(x), tiled=True)[0]))
print("last line of", info.process_id)
"""


def _open_mpi_job(**env):
  """Two processes as Open MPI 5 starts them (OMPI_COMM_WORLD_*, JAXCOLL_COORDINATOR),
  without mpirun: nobody reads their output first, as under mpirun and srun."""
  import socket  # noqa: PLC0415
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415

  import jobs  # noqa: PLC0415

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs = [subprocess.Popen(
      [sys.executable, "-c", _GLOO_JOB], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True, env=jobs.clean_env(4, OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK=str(rank),
                                    JAXCOLL_COORDINATOR=f"127.0.0.1:{port}", **env))
      for rank in (0, 1)]
  outs = [p.communicate(timeout=240) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
  return [out for out, _ in outs]


def test_gloo_chatter_is_collapsed_under_mpirun_and_srun_too():
  for rank, out in enumerate(_open_mpi_job()):
    lines = out.splitlines()
    assert lines == ["gloo: connected to 7 peer rank(s) (further gloo connection lines hidden)",
                     "sum 28.0", f"last line of {rank}"], out  # nothing lost, nothing raw


@pytest.mark.slow  # the fast sibling: the test above
def test_gloo_chatter_is_shown_with_jaxcoll_verbose():
  for out in _open_mpi_job(JAXCOLL_VERBOSE="1"):
    assert out.count("[Gloo] Rank") >= 2 and "gloo: connected" not in out, out
