"""What a person sees on the console (issue 23): the latest eval metrics on
the progress line and bar, the `auto` note on the start line, the expected
noise of JAX and orbax hidden unless asked for, a graceful stop that is not
an error."""

import io
import json
import logging
import sys

import jobs
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


def test_non_finite_values_show_as_nan_and_inf():
  """A NaN loss showed as `loss=None` (JSON's null, for the files) on the console."""
  import numpy as np  # noqa: PLC0415

  out = io.StringIO()
  progress = metrics.Progress(6, stream=out)
  progress.update(2, {"loss": float("nan"), "grad_norm": np.float32("inf")})
  progress.show_eval(2, {"eval_loss": float("-inf"), "eval_accuracy": 0.125})
  progress.update(4, {"loss": 2.25, "skipped": None})
  assert out.getvalue().splitlines() == [
      "step 2/6 loss=nan grad_norm=inf",
      "step 2/6 eval_loss=-inf eval_accuracy=0.125",
      "step 4/6 loss=2.25 skipped=None eval_loss=-inf eval_accuracy=0.125 (eval at step 2)",
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


def test_a_log_line_clears_the_bar_first_and_the_bar_comes_back_after():
  """`...| 3/6 [00:00, loss=nan]W1207 ... incident at step 3` on a terminal: the log line was
  glued to the half-drawn bar. Now the bar's line is cleared before it and drawn after."""
  out = _Terminal()
  root = logging.getLogger()
  handler = logging.StreamHandler(out)
  root.addHandler(handler)
  try:
    progress = metrics.Progress(6, stream=out)
    progress.update(3, {"loss": 2.5})
    logging.getLogger("jaxcoll.test").warning("incident at step 3: loss_spike")
    progress.update(4, {"loss": 2.25})
    progress.close()
    assert not any(isinstance(h, metrics._Call) for h in root.handlers)  # removed at close
  finally:
    root.removeHandler(handler)
  text = out.getvalue()
  before, after = text.split("incident at step 3: loss_spike\n")
  assert before.endswith("\r") and "3/6" in before.rsplit("\r", 2)[0]  # bar, then cleared
  assert after.lstrip("\r").startswith(" 50%") and "3/6" in after.split("\r")[1]  # redrawn


def test_a_rollback_drops_the_abandoned_stretchs_eval_from_the_lines():
  """After a rollback from step 20 to 15, the replayed steps' lines carried the abandoned
  eval of step 20 (`step 16/30 ... eval_accuracy=0.2402 (eval at step 20)`), and the replayed
  step 20 showed it as its own."""
  out = io.StringIO()
  progress = metrics.Progress(30, stream=out)
  progress.show_eval(15, {"eval_accuracy": 0.28})
  progress.show_eval(20, {"eval_accuracy": 0.24})  # regressed: rolled back to 15
  progress.rewind(15)
  progress.update(16, {"loss": 2.0})
  progress.rewind(15)  # again (a second rollback to the same checkpoint)
  progress.show_eval(20, {"eval_accuracy": 0.3})
  progress.update(22, {"loss": 1.9})
  assert out.getvalue().splitlines()[2:] == [
      "step 16/30 loss=2 eval_accuracy=0.28 (eval at step 15)", "step 20/30 eval_accuracy=0.3",
      "step 22/30 loss=1.9 eval_accuracy=0.3 (eval at step 20)"]


def test_steps_after_the_last_one_are_shown_on_a_bar_again():
  """A rollback answering the last step's incident (its row closed the bar) trains steps
  again: they were plain log lines on the terminal; now on a new bar."""
  out = _Terminal()
  progress = metrics.Progress(6, stream=out)
  progress.update(6, {"loss": 2.0})  # the last row: the bar ends
  assert progress._bar is None
  progress.update(5, {"loss": 2.1})  # rolled back to checkpoint 4
  assert progress._bar is not None and "step 5/6" not in out.getvalue()
  progress.update(6, {"loss": 1.9})
  assert progress._bar is None and out.getvalue().count("6/6") >= 2


def test_a_one_line_warning_clears_the_bar_first(monkeypatch):
  """A jaxcoll warning while the bar showed was glued to it, as a log line was."""
  import warnings  # noqa: PLC0415

  from jaxcoll import errors  # noqa: PLC0415

  out = _Terminal()
  monkeypatch.setattr(sys, "stderr", out)
  monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
  _cli.one_line_warnings("train")
  progress = metrics.Progress(6, stream=out)
  progress.update(3, {"loss": 2.5})
  with warnings.catch_warnings():
    warnings.simplefilter("always")
    warnings.warn("dropping the torn last line", errors.TornLineWarning, stacklevel=1)
  progress.close()
  before, after = out.getvalue().split("train: warning: TornLineWarning: dropping the torn "
                                       "last line\n")
  assert before.endswith("\r") and "3/6" in before and "3/6" in after


def test_the_bar_is_closed_when_a_step_raises(tmp_path, monkeypatch):
  """A step that raised left the bar open: the error line was glued to it (and the log
  handlers it adds stayed). Now the loop closes it on the way out."""
  from jaxcoll.run import hooks, loop  # noqa: PLC0415

  made = []

  class Watched(metrics.Progress):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      self.closed = False
      made.append(self)

    def close(self):
      self.closed = True
      super().close()

  class Boom(hooks.Hook):
    def before_step(self, step, batch, state):
      if step == 2:
        raise RuntimeError("a step that raises")
      return batch, state

  monkeypatch.setattr(metrics, "Progress", Watched)
  config = {"model_overrides": {"widths": (8,), "input_dim": 4}, "steps": 4,
            "global_batch_size": 8, "log_every": 1, "checkpoint_every": 0,
            "tensorboard": False}
  with pytest.raises(RuntimeError, match="a step that raises"):
    loop.train_and_evaluate(config, str(tmp_path), hooks=[Boom()])
  assert [p.closed for p in made] == [True]


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
    # on both processes of a 2-process job stopped by SIGTERM (trial17), beside the stop's line
    ("absl", "[process=1][thread=MainThread] Reached preemption sync point, step=401"),
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


def test_jaxcolls_warnings_are_one_line_and_others_as_python_shows_them(capsys, monkeypatch):
  """A CorruptCheckpointWarning at the command line showed Python's `file:line: ...` and the
  source line of the call under it (the message's own newlines too). Now one line; a warning
  of anyone else goes to the showwarning that was there, unchanged."""
  import warnings  # noqa: PLC0415

  from jaxcoll import errors  # noqa: PLC0415

  others = []
  monkeypatch.setattr(warnings, "showwarning", lambda *a, **k: others.append(a[:2]))
  _cli.one_line_warnings("train")
  _cli.one_line_warnings("train")  # idempotent: not wrapped twice
  with warnings.catch_warnings():
    warnings.simplefilter("always")
    warnings.warn("Skipping checkpoint /w/checkpoints/6: its arrays\n  cannot be read.",
                  errors.CorruptCheckpointWarning, stacklevel=1)
    warnings.warn("a library's own", UserWarning, stacklevel=1)  # from this file: not jaxcoll's
    warnings.warn("old", DeprecationWarning, stacklevel=1)
  assert capsys.readouterr().err == (
      "train: warning: CorruptCheckpointWarning: Skipping checkpoint /w/checkpoints/6: its "
      "arrays cannot be read.\n")
  assert [(str(m), c) for m, c in others] == [("a library's own", UserWarning),
                                              ("old", DeprecationWarning)]
  assert not _cli._ours(UserWarning, _cli.__file__)  # experiments/: the user's side
  from jaxcoll.train import checkpoint  # noqa: PLC0415

  assert _cli._ours(UserWarning, checkpoint.__file__)  # a plain UserWarning jaxcoll gave


def test_every_command_lines_flag_parser_installs_it(monkeypatch):
  import warnings  # noqa: PLC0415

  monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
  _cli.flags_parser("report")(["report"])
  assert hasattr(warnings.showwarning, "jaxcoll_previous")


@pytest.mark.slow  # ~8 s: a report run (matplotlib); fast cover: the two tests above
def test_a_warning_at_the_command_line_is_one_line(tmp_path):
  """experiments.report on a metrics.jsonl with a damaged middle line: the TornLineWarning is
  one line (before: `.../metrics.py:252: TornLineWarning: ...` and the source line)."""
  rows = [json.dumps({"step": s, "loss": 1.0, "step_time_s": 0.01}) + "\n" for s in (1, 2, 3)]
  rows[1] = '{"step": 2, "lo\n'
  (tmp_path / "metrics.jsonl").write_text("".join(rows))
  out = jobs.forked([sys.executable, "-m", "experiments.report", f"--workdir={tmp_path}",
                     f"--out_dir={tmp_path / 'out'}"])
  if out.returncode == 2 and "matplotlib" in out.stderr:
    pytest.skip("no matplotlib")
  torn = [line for line in out.stderr.splitlines() if "TornLineWarning" in line]
  assert torn and all(line.startswith("report: warning: TornLineWarning: dropping line 2")
                      for line in torn), out.stderr
  assert "warnings.warn(" not in out.stderr and "metrics.py:" not in out.stderr


def test_a_closed_stream_is_dropped_and_the_work_goes_on(tmp_path):
  """A write to a stream whose reader left raised BrokenPipeError in the middle of the work;
  now the descriptor goes to /dev/null and every later write (of any object on it) passes."""
  import os  # noqa: PLC0415

  read, write = os.pipe()
  os.close(read)  # the reader left (`| head -3` after its three lines)
  raw = os.fdopen(write, "w")
  try:
    guarded = _cli._ReaderMayLeave(raw)
    assert guarded.write("step 4/6 loss=2.25\n") == 19  # buffered: nothing found yet
    guarded.flush()  # EPIPE: dropped, the descriptor now /dev/null
    guarded.write("step 6/6 loss=2\n")
    guarded.flush()
    raw.write("a handler holding the stream itself\n")
    raw.flush()  # the same descriptor: /dev/null now, no BrokenPipeError
    assert os.path.samefile(f"/proc/self/fd/{write}", os.devnull)
  finally:
    raw.close()


def test_train_outlives_a_reader_that_leaves(tmp_path):
  """`jaxcoll train ... 2>&1 | head -3`: the run ended at its next progress line, exit 1,
  attempt "failed" at step 2 (BrokenPipeError). Now it trains to the end and says done."""
  import subprocess  # noqa: PLC0415

  with jobs.started(jobs.train_cmd(jobs.SMOKE, "--config.log_every=1",
                                   f"--workdir={tmp_path}"),
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
    lines = [proc.stdout.readline() for _ in range(3)]
    proc.stdout.close()  # as `head -3` does
    assert proc.wait(timeout=120) == 0, lines
  assert lines[1].startswith("step 1/6"), lines
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["steps"] == 6
  assert [a["status"] for a in summary["attempts"]] == ["completed"]


def test_every_command_outlives_a_reader_that_leaves(tmp_path):
  """The same helper for every command: `simulate`'s table to a closed pipe was a
  BrokenPipeError traceback and exit 1."""
  import os  # noqa: PLC0415

  read, write = os.pipe()
  os.close(read)
  try:
    import subprocess  # noqa: PLC0415

    done = subprocess.run([sys.executable, "-m", "experiments.simulate"], cwd=jobs.REPO,
                          env=jobs.clean_env(), stdout=write, stderr=subprocess.PIPE,
                          text=True, timeout=120, check=False)
  finally:
    os.close(write)
  assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("argv", [["configs"], ["--help"]])
def test_the_dispatchers_own_listing_ends_quietly_for_a_reader_that_left(argv):
  import os  # noqa: PLC0415
  import subprocess  # noqa: PLC0415

  read, write = os.pipe()
  os.close(read)
  try:
    done = subprocess.run([sys.executable, "-c", "import sys; from jaxcoll import cli; "
                           "sys.exit(cli.main(sys.argv[1:]))", *argv], cwd=jobs.REPO,
                          env=jobs.clean_env(), stdout=write, stderr=subprocess.PIPE,
                          text=True, timeout=60, check=False)
  finally:
    os.close(write)
  assert done.returncode == 0 and done.stderr == "", done.stderr


def test_ctrl_c_outside_the_loop_ends_with_its_status_when_stderrs_reader_left():
  """The SIGINT line to a closed stderr raised BrokenPipeError in the handler, before its
  os._exit: exit 1 (or the run went on) instead of 130."""
  code = ("import os; r, w = os.pipe(); os.close(r); os.dup2(w, 2); "
          "from experiments import train; train._interrupted(2, None)")
  out = jobs.run([sys.executable, "-c", code], timeout=60)
  assert out.returncode == 130, out
