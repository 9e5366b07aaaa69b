"""Issue 20 (signals, pipes, bad input on every process, user exceptions,
summary JSON): Ctrl-C and SIGHUP stop with a final checkpoint; the launcher
outlives its stdout; bad input that one process finds ends every process with
exit 2; the user's own exceptions keep their traceback; a run whose loss is
not finite (or that skipped every step) never exits 0.

The model functions below are the "user's code" of the CLI cases
(``--config.model=test_stop_and_bad_input:NAME``, run from tests/).
Each case is a row of README's "Faults and bad input" table.
"""

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import jax
import jax.numpy as jnp
import jobs
import pytest

from jaxcoll import models
from jaxcoll.run import attempts, config_error, lock, watchdog

TESTS = os.path.dirname(os.path.abspath(__file__))
SMOKE = "--config=configs/default.py:smoke"
_MODULE = os.path.splitext(os.path.basename(__file__))[0]


# -- the user's code -----------------------------------------------------------


def raising_model(**overrides):
  """A user's model function with a bug of its own."""
  raise ValueError("the user's model function raised this")


def _mlp_with_loss(wrap):
  workload = models.make_workload("mlp", widths=(16,))
  inner = workload.loss_fn

  def loss_fn(params, batch):
    loss, aux = inner(params, batch)
    return wrap(loss), aux

  return dataclasses.replace(workload, loss_fn=loss_fn)


def vector_loss(**overrides):
  """A loss per example (forgot the mean)."""
  return _mlp_with_loss(lambda loss: loss * jnp.ones((4,)))


def nan_loss(**overrides):
  """A NaN loss with finite gradients (as labels outside the classes give)."""
  return _mlp_with_loss(lambda loss: loss + jax.lax.stop_gradient(jnp.nan))


def nan_grads(**overrides):
  """Non-finite gradients at every step (as all-NaN inputs give)."""
  return _mlp_with_loss(lambda loss: loss * jnp.nan)


def batchnorm_model(axis_name="data", **overrides):
  """A user's flax model with ``nn.BatchNorm(axis_name=axis_name)`` (what from_flax's
  docstring and the README's single-axis example write), on the MLP's synthetic data."""
  import flax.linen as nn  # noqa: PLC0415
  import optax  # noqa: PLC0415

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
      x = nn.BatchNorm(use_running_average=not train, axis_name=axis_name)(nn.Dense(8)(x))
      return nn.Dense(10)(nn.relu(x))

  def loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

  data = models.make_workload("mlp", widths=(16,)).dataset
  return models.from_flax(Net(), loss, dataset=data, name="bn_mlp")


def _user(model, *flags, workdir, train=jobs.train, **kw):
  return train(SMOKE.replace("configs/", f"{jobs.REPO}/configs/"),
                    f"--config.model={_MODULE}:{model}", *flags, f"--workdir={workdir}",
                    cwd=TESTS, **kw)


def _one_line(out, status=2):
  return jobs.one_line(out, status, prefix="train: error: ")


# -- Ctrl-C, SIGHUP ------------------------------------------------------------


def _train_forever(workdir):
  return jobs.train_cmd(SMOKE, "--config.steps=100000", "--config.log_every=1",
                        "--config.checkpoint_every=100000", f"--workdir={workdir}")


@pytest.mark.usefixtures("sigint_as_from_a_terminal")
def test_ctrl_c_stops_a_one_process_run_like_sigterm(tmp_path):
  """Issue 20: Ctrl-C was a KeyboardInterrupt traceback, attempt "failed", no
  final checkpoint."""
  status, err, _ = jobs.stop_with(_train_forever(tmp_path), signal.SIGINT, workdir=tmp_path,
                                  timeout=60)
  assert status == watchdog.EXIT_INTERRUPTED == 130, err[-2000:]
  assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
  last = err.strip().splitlines()[-1]
  assert last.startswith("train: stopped by SIGINT after step ") and "error" not in last, last
  assert last.endswith("; final checkpoint saved.")
  step = int(last.split("after step ")[1].split(";")[0])
  assert os.listdir(tmp_path / "checkpoints") == [str(step)]
  assert [(a["status"], a["end_step"]) for a in jobs.summary(tmp_path)["attempts"]] == [
      ("stopped", step)]


def test_sigusr1_stops_a_one_process_run_like_sigterm(tmp_path):
  """SIGUSR1 is the stop request mpirun forwards to every rank (its SIGTERM and Ctrl-C give
  them 1 s before SIGKILL: no final checkpoint, the attempt left "running"); it killed the
  process, with nothing saved since the last checkpoint."""
  status, err, _ = jobs.stop_with(_train_forever(tmp_path), signal.SIGUSR1, workdir=tmp_path,
                                  timeout=60)
  assert status == watchdog.EXIT_STOP_REQUEST == 138, err[-2000:]
  last = err.strip().splitlines()[-1]
  assert last.startswith("train: stopped by SIGUSR1 after step "), last
  assert last.endswith("; final checkpoint saved."), last
  step = int(last.split("after step ")[1].split(";")[0])
  assert os.listdir(tmp_path / "checkpoints") == [str(step)]
  assert [(a["status"], a["end_step"]) for a in jobs.summary(tmp_path)["attempts"]] == [
      ("stopped", step)]


@pytest.mark.usefixtures("sigint_as_from_a_terminal")
@pytest.mark.parametrize("how", ["signal.signal", "faulthandler.register"])
def test_sigusr1_a_handler_of_the_users_took_stays_theirs(how):
  """SIGUSR1 has no handler of Python's: one there is the user's code's (a Slurm requeue
  handler, faulthandler.register's stack dump), and the run replaced it; SIGTERM is the
  run's as before. faulthandler's is below Python (signal.getsignal says SIG_DFL)."""
  code = textwrap.dedent(f"""
  import faulthandler, os, signal, sys, time
  from jaxcoll.run import watchdog
  heard = []
  if {how!r} == "signal.signal":
    signal.signal(signal.SIGUSR1, lambda *_: heard.append("requeue"))
  else:
    faulthandler.register(signal.SIGUSR1, file=sys.stdout, all_threads=False)
  stop = watchdog.StopSignal()
  os.kill(os.getpid(), signal.SIGUSR1)
  time.sleep(0.1)
  print("heard", heard, "stop", stop.requested(1), flush=True)
  os.kill(os.getpid(), signal.SIGTERM)
  time.sleep(0.1)
  print("after SIGTERM", stop.requested(1), stop.signum == signal.SIGTERM, flush=True)
  """)
  out = jobs.forked([sys.executable, "-c", code], devices=1, timeout=60)
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.splitlines()
  if how == "signal.signal":
    assert lines[0] == "heard ['requeue'] stop False", out.stdout
  else:  # faulthandler's dump of this thread, then the run goes on
    assert "Stack (most recent call first)" in out.stdout and "heard [] stop False" in lines, (
        out.stdout)
  assert lines[-1] == "after SIGTERM True True", out.stdout


@pytest.mark.usefixtures("sigint_as_from_a_terminal")
def test_ctrl_c_while_starting_is_one_line_and_exit_130(tmp_path):
  """Before the training loop (imports, compile set-up) Ctrl-C was a
  KeyboardInterrupt traceback, or an ImportError when it hit an extension."""
  with jobs.started(_train_forever(tmp_path / "w"), stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE) as proc:
    time.sleep(1.0)  # importing JAX takes longer than this
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err[-2000:]
  assert "Traceback" not in err, err[-2000:]
  assert err.strip().splitlines()[-1].startswith("train: ")


def test_stopped_by_signal_exception_names_the_signal():
  e = watchdog.StopRequested(7, saved=True, signum=signal.SIGINT)
  assert (str(e), e.status) == ("stopped by SIGINT after step 7; final checkpoint saved.", 130)
  assert watchdog.StopRequested(3, saved=False).status == watchdog.EXIT_TERMINATED


@pytest.mark.slow  # fast siblings: SIGTERM to a launched training job (test_reliability) and
# the launcher's SIGHUP passed on as SIGTERM (tests/runtime/test_launch.py)
def test_sighup_to_the_launcher_stops_workers_with_a_final_checkpoint(tmp_path):
  """Issue 20: SIGHUP (a closed terminal) ended the launcher at once and the
  workers were SIGKILLed through the parent-death signal, no final checkpoint."""
  status, err, _ = jobs.stop_with(
      jobs.launch_cmd(*_train_forever(tmp_path), launcher_flags=["--grace_s=60"]),
      signal.SIGHUP, workdir=tmp_path, devices=4)
  assert status == 128 + signal.SIGHUP, err[-3000:]
  stopped = jobs.stopped_steps(err)
  assert set(stopped) == {"[p0]", "[p1]"} and len(set(stopped.values())) == 1, err[-3000:]
  assert os.listdir(tmp_path / "checkpoints") == [stopped["[p0]"]]
  assert [a["status"] for a in jobs.summary(tmp_path)["attempts"]] == ["stopped"]
  assert "received SIGHUP" in err and "Traceback" not in err


# -- the launcher's stdout closing ---------------------------------------------

_CHATTY = textwrap.dedent("""
    import os, sys
    for i in range(20000):  # far more than a pipe holds (64 KiB)
      print(f"line {i} " + "x" * 40)
    open(os.path.join(sys.argv[1], "done" + os.environ["JAXCOLL_PROCESS_ID"]), "w").close()
""")


def test_launcher_survives_its_stdout_closing(tmp_path):
  """Issue 20: `python -m jaxcoll.launch ... | head -n 3`: the pumps died on
  BrokenPipe, the children blocked on their full pipes (a hang), and the
  launcher ended with a BrokenPipeError traceback."""
  with jobs.started(jobs.launch_cmd(sys.executable, "-c", _CHATTY, str(tmp_path), devices=1),
                    devices=1, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
    proc.stdout.readline()  # `head -n 1`
    proc.stdout.close()
    err = proc.stderr.read()
    proc.wait(timeout=60)
  assert proc.returncode == 0, err[-3000:]
  assert sorted(os.listdir(tmp_path)) == ["done0", "done1"]
  assert "Traceback" not in err and "BrokenPipeError:" not in err, err[-3000:]
  assert "[launch] stdout closed (BrokenPipeError); the job goes on" in err


@pytest.mark.slow  # the fast sibling: test_launcher_survives_its_stdout_closing (no JAX)
def test_training_job_completes_when_the_launchers_stdout_is_closed(tmp_path):
  """The same with a 2-process training job: it completes, summary.json says so."""
  read, write = os.pipe()
  os.close(read)  # a reader that left before the first line
  try:
    out = subprocess.run(
        jobs.launch_cmd(*jobs.train_cmd(SMOKE, "--config.checkpoint_every=0",
                                        f"--workdir={tmp_path}")),
        cwd=jobs.REPO, env=jobs.clean_env(4), stdout=write, stderr=subprocess.PIPE, text=True,
        timeout=300, check=False,
    )
  finally:
    os.close(write)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "Traceback" not in out.stderr and "BrokenPipeError:" not in out.stderr
  assert [a["status"] for a in jobs.summary(tmp_path)["attempts"]] == ["completed"]


# -- bad input on every process ------------------------------------------------

_HOLD = "import sys, time\nfrom jaxcoll.run import lock\nlock.WorkdirLock(sys.argv[1]).acquire()\n" \
        "print('held', flush=True)\ntime.sleep(600)\n"


@pytest.mark.parametrize("case", ["busy_workdir", pytest.param("unwritable_workdir",
                                                              marks=pytest.mark.slow)])
def test_bad_input_process_0_finds_ends_every_process_with_exit_2(case, tmp_path):
  """Issue 20: a check only process 0 makes (the workdir, its lock) left
  process 1 in a gloo timeout traceback, and the launcher restarted the job."""
  with contextlib.ExitStack() as stack:
    if case == "busy_workdir":
      workdir = tmp_path / "held"
      workdir.mkdir()
      holder = stack.enter_context(jobs.started([sys.executable, "-c", _HOLD, str(workdir)],
                                                devices=1, stdout=subprocess.PIPE))
      assert holder.stdout.readline().strip() == "held"
      needle = "is in use by pid"
    else:
      (tmp_path / "a_file").write_text("")
      workdir = tmp_path / "a_file" / "run"  # not a directory: ENOTDIR even for root
      needle = "is not a writable directory"
    out = jobs.timed(jobs.launch_cmd(*jobs.train_cmd(SMOKE, f"--workdir={workdir}"),
                                     launcher_flags=["--max_restarts=2"]), devices=4, timeout=300)
  assert out.returncode == 2, out.stderr[-3000:]
  errors = [line for line in out.stderr.splitlines() if "train: error:" in line]
  assert sorted(line[:4] for line in errors) == ["[p0]", "[p1]"], out.stderr[-3000:]
  assert all(needle in line for line in errors)
  assert "Traceback" not in out.stderr and "restart" not in out.stderr.replace(
      "not restarting", ""), out.stderr[-3000:]
  # Together: process 1 does not wait out a gloo timeout (30 s) after process 0's line.
  assert abs(out.seen("[p1] train: error:") - out.seen("[p0] train: error:")) < 20


_SETTLE = textwrap.dedent("""
    import os, sys, time
    if os.environ["JAXCOLL_PROCESS_ID"] == "0":
      sys.exit(1)  # as a process that died of another process's bad input
    time.sleep(0.2)
    print("train: error: bad input", file=sys.stderr)
    sys.exit(2)
""")


def test_any_process_exiting_2_makes_the_attempt_bad_input():
  """A process that fails first with another status does not hide the bad
  input a peer reports: the job is not restarted."""
  out = jobs.launch(sys.executable, "-c", _SETTLE, processes=2, devices=1,
                    launcher_flags=["--max_restarts=2"], timeout=60)
  assert out.returncode == 2, out.stderr
  assert "process 1 exited with status 2 (bad input); not restarting" in out.stderr
  assert "restart 1/2" not in out.stderr


# -- user code, and jaxcoll's own checks ---------------------------------------


def test_user_model_exception_keeps_its_traceback(tmp_path):
  """Issue 20: a ValueError raised in the user's model function was reported
  as a config error (exit 2) and its traceback was lost."""
  out = _user("raising_model", workdir=tmp_path)
  assert out.returncode == 1, out.stderr[-3000:]
  assert "Traceback" in out.stderr and "train: error" not in out.stderr
  assert "in raising_model" in out.stderr
  assert out.stderr.strip().endswith("ValueError: the user's model function raised this")


def test_from_user_code_tells_jaxcoll_checks_from_user_code():
  def users():
    raise ValueError("mine")

  try:
    users()
  except ValueError as e:
    assert config_error.from_user_code(e)
  try:
    models.make_workload("mlp", no_such_override=1)
  except ValueError as e:
    assert not config_error.from_user_code(e)


def test_loss_that_returns_a_vector_is_one_line_before_training(tmp_path):
  """Issue 20: a TypeError traceback at compile (exit 1, which is restarted)."""
  line = _one_line(_user("vector_loss", workdir=tmp_path / "w", train=jobs.train_forked))
  assert "returns shape (4,), not a scalar" in line and f"{_MODULE}:vector_loss" in line
  assert not (tmp_path / "w").exists()


HYBRID = ("--config.mesh_shape=2,4", "--config.mesh_axes=node,local", "--config.strategy=zero3",
          "--config.replica_axis=node")


def test_batchnorm_over_an_axis_the_mesh_lacks_is_one_line_before_training(tmp_path):
  """nn.BatchNorm(axis_name="data") on the hybrid 2x4 mesh (axes node, local): JAX's "unbound
  axis name: data ... call psum under jax.shard_map" traceback at the first compile (it was
  under shard_map), after summary.json and checkpoints/ were written. Now one line naming the
  mesh's axes and the fix, nothing written."""
  line = _one_line(_user("batchnorm_model", *HYBRID, workdir=tmp_path / "w",
                         train=jobs.train_forked))
  assert f"{_MODULE}:batchnorm_model" in line and "mesh axis 'data'" in line
  assert "axis_name=('node', 'local')" in line
  assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("mesh, axis_name", [(None, "data"), ("2,4", ("node", "local"))],
                         ids=["flat-data", "hybrid-both"])
def test_batchnorm_over_the_meshs_axes_passes_the_check(mesh, axis_name):
  """The check traces the loss as the step does (training mode, inside shard_map): a model
  that names the mesh's own axes is not refused (outside shard_map every name is unbound)."""
  import ml_collections  # noqa: PLC0415

  from jaxcoll.run import loop  # noqa: PLC0415

  config = ml_collections.ConfigDict({"model": "user:batchnorm_model"})
  workload = batchnorm_model(axis_name)
  mesh = loop.build_mesh({"mesh_shape": mesh or "", "mesh_axes": "node,local"})[0]

  class Input:
    files = None

  loop._check_loss_is_scalar(config, workload, Input(), 4, mesh)  # no error
  with pytest.raises(config_error.ConfigError, match="mesh axis 'batch'"):
    loop._check_loss_is_scalar(config, batchnorm_model("batch"), Input(), 4, mesh)


def test_lock_path_that_is_a_directory_is_one_line(tmp_path):
  """Issue 20: `jaxcoll.lock` as a directory was an IsADirectoryError traceback."""
  (tmp_path / lock.LOCK_NAME).mkdir()
  line = _one_line(jobs.train_forked(SMOKE, f"--workdir={tmp_path}"))
  assert f"{tmp_path / lock.LOCK_NAME} is a directory, not a lock file" in line
  assert os.listdir(tmp_path) == [lock.LOCK_NAME]


def test_lock_file_that_cannot_be_opened_names_it(tmp_path, monkeypatch):
  """`jaxcoll.lock` with mode 000 (EACCES for anyone but root)."""
  real_open = os.open

  def refuse(path, *args, **kwargs):
    if str(path).endswith(lock.LOCK_NAME):
      raise PermissionError(13, "Permission denied", path)
    return real_open(path, *args, **kwargs)

  monkeypatch.setattr(os, "open", refuse)
  with pytest.raises(lock.WorkdirLockError, match=r"cannot be opened \(Permission denied\)"):
    lock.WorkdirLock(str(tmp_path)).acquire()


# -- never exit 0 on a non-finite loss; summary.json is JSON -------------------


def test_non_finite_loss_never_exits_0_and_summary_stays_json(tmp_path):
  """Issue 20: every loss row null, exit 0, "final loss nan", and a bare NaN
  in summary.json."""
  out = _user("nan_loss", workdir=tmp_path, train=jobs.train_forked)
  assert out.returncode == 3, out.stderr[-3000:]
  last = out.stderr.strip().splitlines()[-1]
  assert "the loss after step 6 is nan (not finite)" in last, last
  with open(tmp_path / "summary.json") as f:
    summary = json.loads(f.read(), parse_constant=lambda c: pytest.fail(f"bare {c}"))
  assert [a["status"] for a in summary["attempts"]] == ["failed"]
  assert "final_loss" not in summary


def test_every_step_skipped_is_not_a_success(tmp_path):
  """Issue 20: nan_policy=skip with every input NaN exited 0, 6 of 6 skipped."""
  out = _user("nan_grads", "--config.nan_policy=skip", workdir=tmp_path, train=jobs.train_forked)
  assert out.returncode == 3, out.stderr[-3000:]
  assert "every one of the 6 steps from step 1 to 6 was skipped" in out.stderr
  assert [a["status"] for a in jobs.summary(tmp_path)["attempts"]] == ["failed"]


def test_summary_json_writes_non_finite_numbers_as_null_and_names_them(tmp_path):
  attempts.write_summary(tmp_path, {"final_loss": float("nan"), "eval": {"loss": float("inf")},
                                    "steps": 6, "non_finite": ["stale"]})
  text = (tmp_path / "summary.json").read_text()
  summary = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in {text}"))
  assert summary == {"final_loss": None, "eval": {"loss": None}, "steps": 6,
                     "non_finite": ["final_loss", "eval.loss"]}


# -- metrics.jsonl, report, config files ---------------------------------------


def test_damaged_middle_line_of_metrics_is_set_aside_with_a_warning(tmp_path):
  """Issue 20: a corrupt middle line was a ValueError that blocked the run
  until the file was repaired."""
  from jaxcoll.observe import metrics

  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo\x00\n{"step": 3, "loss": 0.8}\n'
                  '{"step": 4, "loss": 0.7}\n')
  with pytest.warns(metrics.TornLineWarning, match="line 2"):
    assert [r["step"] for r in metrics.read_metrics(str(tmp_path))] == [1, 3, 4]
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    metrics.MetricsWriter(str(tmp_path), tensorboard=False, start_step=3).close()
  assert any("kept the 1 unreadable line(s)" in str(w.message) for w in caught)
  assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 3]
  aside = [p for p in os.listdir(tmp_path) if p.startswith("metrics.jsonl.unreadable-")]
  assert len(aside) == 1 and (tmp_path / aside[0]).read_text() == '{"step": 2, "lo\x00\n'


_REPORT_UNWRITABLE = """
import errno, sys
sys.argv = ["report", "--workdir={workdir}"]
from jaxcoll.observe import run_report
def refuse(run, path):
  raise PermissionError(errno.EROFS, "Read-only file system", path)
run_report.draw = refuse
import runpy
runpy.run_module("experiments.report", run_name="__main__")
"""


def test_report_on_a_read_only_workdir_prints_the_summary_and_says_why(tmp_path):
  """Issue 20: experiments.report on a read-only workdir was a traceback."""
  rows = [{"step": s, "loss": 2.0 / s, "grad_norm": 1.0, "learning_rate": 1e-3,
           "step_time_s": 0.01, "data_time_s": 0.001, "examples_per_s": 3200.0}
          for s in range(2, 12, 2)]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  # Both forked from a warm Python (jobs.forked: ~2.5 CPU-s less each).
  out = jobs.forked([sys.executable, "-c", _REPORT_UNWRITABLE.format(workdir=tmp_path)])
  assert out.returncode == 2, out.stderr[-3000:]
  assert "Traceback" not in out.stderr and out.stdout.strip()  # the summary, printed
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and "Read-only file system" in lines[0] and "--out_dir=" in lines[0]
  elsewhere = tmp_path / "elsewhere"
  out = jobs.forked([sys.executable, "-m", "experiments.report", f"--workdir={tmp_path}",
                     f"--out_dir={elsewhere}"])
  if out.returncode == 2 and "matplotlib" in out.stderr:
    pytest.skip("no matplotlib")
  assert out.returncode == 0, out.stderr[-3000:]
  assert sorted(os.listdir(elsewhere)) == ["report.png", "report.txt"]


def test_config_file_with_a_variant_is_executed_once(tmp_path):
  """Issue 20: `--config=FILE:VARIANT` executed FILE twice per run."""
  counter = tmp_path / "count"
  config = tmp_path / "counting.py"
  config.write_text(textwrap.dedent(f"""
      with open({str(counter)!r}, "a") as f:
        f.write("x")
      from configs import default
      def get_config(variant=None):
        return default.get_config(variant)
  """))
  out = jobs.train_forked(f"--config={config}:smoke", "--workdir=")  # stops after the variant check
  assert out.returncode == 2 and "`--workdir` must name a directory" in out.stderr, out.stderr
  assert counter.read_text() == "x"
