"""Faults and bad input: restart with nothing lost, no hangs, guarded steps,
desync detection, and one-line errors (exit 2) that leave the workdir as it was.

Each case here is a row of README's "Faults and bad input" table.
"""

import errno
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import jobs
import pytest

from configs import default
from jaxcoll.observe import run_report
from jaxcoll.run import config as run_config
from jaxcoll.run import hooks, lock, loop, watchdog
from jaxcoll.run.config_error import ConfigError

SMOKE = "--config=configs/default.py:smoke"
# One-process runs are forked from a warm Python (jobs.train_forked: the same
# `python -m experiments.train` module, argv and environment in a process of its
# own, ~2.5 CPU-s less each); the real command line: REAL_START below, the
# launched jobs, the signal tests (jobs.started / stop_with / timed).
_train = jobs.train_forked
_summary = jobs.summary


def _forever(workdir):
  """A run that trains until it is stopped, logging every step, saving none."""
  return jobs.train_cmd(SMOKE, "--config.steps=100000", "--config.log_every=1",
                        "--config.checkpoint_every=100000", f"--workdir={workdir}")


def _no_result(workdir) -> bool:
  """A failed run writes no result: summary.json has only its attempt, "failed"."""
  summary = _summary(workdir)
  return "params_sha256" not in summary and [a["status"] for a in summary["attempts"]] == [
      "failed"]


def _tree_digest(path):
  """Names, sizes and contents of every file under ``path``."""
  sha = hashlib.sha256()
  for root, dirs, files in sorted(os.walk(path)):
    dirs.sort()
    for name in sorted(files):
      full = os.path.join(root, name)
      sha.update(full.encode())
      with open(full, "rb") as f:
        sha.update(f.read())
  return sha.hexdigest()


@pytest.mark.parametrize("victim", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_restart_after_lost_process_ends_like_uninterrupted_run(tmp_path, victim):
  """Process `victim` of 2 dies at step 7 (`fail_process`; 0 serves JAX's coordinator); the
  survivor says which and ends (exit 76), the launcher restarts the job, which resumes to
  the params of the uninterrupted run. The ring all-reduce sums in the same order on 1 x 8
  and 2 x 4 devices (bit for bit, as test_incidents_durable's 2x4 rollback test uses),
  so the uninterrupted run is one process (forked, ~3 CPU-s), not a second launched job
  (~12 CPU-s)."""
  flags = [SMOKE, "--config.steps=9", "--config.checkpoint_every=3", "--config.algorithm=ring"]
  cmd = jobs.train_cmd(*flags)
  straight = jobs.train_forked(*flags, f"--workdir={tmp_path / 'straight'}")
  assert straight.returncode == 0, straight.stderr[-2000:]
  failing = jobs.launch(*cmd, "--config.fail_at_step=7", f"--config.fail_process={victim}",
                        f"--workdir={tmp_path / 'failing'}", launcher_flags=["--max_restarts=1"])
  text = failing.stdout + failing.stderr
  assert failing.returncode == 0, text[-4000:]
  assert f"[launch] attempt 0 failed: process {victim} exited with status 17" in text, text
  survivor = 1 - victim
  gone = ("process 0 (it serves the coordinator) is gone" if victim == 0
          else "process 1 of 2 is gone")
  assert f"[p{survivor}] jaxcoll.distributed: process {survivor} of 2: {gone} (" in text, text
  for crash in ("EnforceNotMet", "Fatal Python error", "Traceback"):
    assert crash not in text, text[-4000:]
  resumed = _summary(tmp_path / "failing")
  assert resumed["start_step"] in (3, 6)
  assert resumed["params_sha256"] == _summary(tmp_path / "straight")["params_sha256"]
  first, second = resumed["attempts"]
  assert second["status"] == "completed"
  if victim == 0:  # the process that keeps summary.json died without a word
    assert first["status"] == "interrupted", first
  else:  # process 0 recorded its end (it stayed "running": "ended without a word")
    assert (first["status"], first["end_step"], first["exit_status"]) == ("failed", 6, 76)
    assert "process 1 of 2 is gone" in first["reason"], first


@pytest.mark.parametrize("fields,want", [
    ({"fail_at_step": 3, "fail_process": 1}, "from 0 to 0"),  # this test runs one process
    ({"hang_at_step": 3, "fail_process": 2}, "from 0 to 0"),
    ({"fail_at_step": 3, "fail_process": -1}, "must be a process id"),
])
def test_fail_process_is_a_process_of_the_job(fields, want):
  with pytest.raises(ConfigError, match=f"`config.fail_process`.*{want}"):
    hooks.from_config(fields)


def test_fail_at_step_acts_on_fail_process_only(monkeypatch):
  """The fault injector could only kill process 0; `fail_process` picks the process."""
  assert hooks.from_config({"fail_process": 1}) == []  # no fault asked for: nothing to check
  monkeypatch.setattr(hooks.jax, "process_count", lambda: 2)
  (fail,) = hooks.from_config({"fail_at_step": 3, "fail_process": 1})
  assert (type(fail).__name__, fail.step, fail.process) == ("FailAt", 3, 1)
  monkeypatch.setattr(hooks.jax, "process_index", lambda: 0)
  assert fail.before_step(3, "batch", "state") == ("batch", "state")  # not this process
  monkeypatch.setattr(hooks.os, "_exit", lambda status: (_ for _ in ()).throw(SystemExit(status)))
  monkeypatch.setattr(hooks.jax, "process_index", lambda: 1)
  with pytest.raises(SystemExit, match="17"):
    fail.before_step(3, "batch", "state")
  assert fail.before_step(4, "batch", "state") == ("batch", "state")


def test_watchdog_ends_a_hung_run(tmp_path):
  # No checkpoints: the first save (orbax's set-up, the fingerprint program's
  # compile) can outlast its 4 x 3 s limit on a loaded machine, and the step
  # limit is what this test is about (test_watchdog_covers_checkpoint_saves: saves).
  out = jobs.timed(jobs.train_cmd(SMOKE, "--config.hang_at_step=4", "--config.watchdog_s=3",
                                  "--config.checkpoint_every=0", f"--workdir={tmp_path}"),
                   timeout=300)
  assert out.returncode == watchdog.EXIT_WATCHDOG, out.stderr[-2000:]
  assert "no training step finished for 3 s (last finished step: 3)" in out.stderr
  # Recorded as what it is: the attempt stayed "running", and experiments.report said it
  # "ended without a word (killed, or its host lost)" under the watchdog's own line.
  (attempt,) = _summary(tmp_path)["attempts"]
  assert (attempt["status"], attempt["end_step"], attempt["exit_status"]) == ("failed", 3, 86)
  assert attempt["reason"].startswith(
      "watchdog: no training step finished for 3 s (last finished step: 3); exiting with status "
      "86"), attempt
  report = run_report.summarize(run_report.load_run(str(tmp_path)))
  assert "without a word" not in report
  assert "  the last attempt failed after step 3 (exit 86): watchdog: no training step" in report
  # Timed from the hang, not from the start-up (JAX's import and compile take
  # minutes on a loaded machine): 3 s of silence, then the exit.
  hung = out.seen("hang_at_step=4: process 0 hangs")
  assert out.seen("no training step finished") - hung < 3 + 60
  assert out.ended - hung < 3 + 60


def test_nan_skip_counts_and_trains_on(tmp_path):
  out = _train(SMOKE, "--config.nan_policy=skip", "--config.nan_at_step=3",
               f"--workdir={tmp_path}")
  assert out.returncode == 0, out.stderr[-2000:]
  assert _summary(tmp_path)["skipped_steps"] == 1
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [r["skipped_steps"] for r in rows if "loss" in r] == [0, 1, 1]  # train rows


def test_nan_raise_stops_with_the_step_number(tmp_path):
  out = _train(SMOKE, "--config.nan_policy=raise", "--config.nan_at_step=3",
               f"--workdir={tmp_path}")
  assert out.returncode == 3
  assert "Non-finite gradients at step 3" in out.stderr.strip().splitlines()[-1]


def test_desync_stops_naming_step_and_leaf(tmp_path):
  out = _train(SMOKE, "--config.check_every=2", "--config.desync_at_step=3",
               "--config.checkpoint_every=0", f"--workdir={tmp_path}")
  assert out.returncode == 4
  last = out.stderr.strip().splitlines()[-1]
  assert "replicas diverged at step 4" in last and "Dense_0" in last and "devices [7]" in last
  assert _no_result(tmp_path)


BAD_CONFIGS = {  # written by the test: a syntax error would fail the linter here
    "syntax_error.py": "def get_config(:\n  pass\n",
    "raises.py": "raise RuntimeError('raised at import')\n",
}
BAD_INPUT = [
    ("batch", ["--config.global_batch_size=30"], "30 is not divisible by data-parallel size 8"),
    ("huge_batch", [f"--config.global_batch_size={2**34}"], "GiB per process"),
    ("learning_rate", ["--config.learning_rate=-1"], "must be a finite number > 0"),
    ("variant", ["--config=configs/default.py:nosuch"], "variant 'nosuch'"),
    ("config_syntax", ["--config={bad}/syntax_error.py"], "SyntaxError"),
    ("config_raises", ["--config={bad}/raises.py"], "RuntimeError: raised at import"),
    ("mesh", ["--config.mesh_shape=3,2"], "product is 8"),
    ("config_key", ["--config.learning_rat=0.1"], "unknown config field 'learning_rat'"),
    ("zero_stage", ["--config.strategy=zero4"], "ZeRO has stages 0-3"),
    ("algorithm", ["--config.algorithm=rign"], "Valid names"),
    # On the default one-axis mesh: a traceback from inside shard_map at the first step.
    ("hierarchical", ["--config.algorithm=hierarchical"],
     "`config.algorithm` 'hierarchical' reduces inside nodes, then across them"),
    ("model", ["--config.model=vgg"], "valid models: mlp"),
    ("config_file", ["--config=configs/nope.py"], "--config"),
    ("workdir", ["--workdir=/proc/version/run"], "is not a writable directory"),
]


# These start a real `python -m experiments.train` (one bad input found while
# the module is imported, one found by the training loop); the others fork it.
REAL_START = {"config_file", "batch"}


@pytest.mark.parametrize("flags,message,name", [(*b[1:], b[0]) for b in BAD_INPUT],
                         ids=[b[0] for b in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_2(flags, message, name, tmp_path, tmp_path_factory):
  bad = tmp_path_factory.mktemp("bad_configs")
  for config_name, text in BAD_CONFIGS.items():
    (bad / config_name).write_text(text)
  flags = [f.format(bad=bad) for f in flags]
  workdir = [] if any(f.startswith("--workdir") for f in flags) else [f"--workdir={tmp_path}"]
  config = [] if any(f.startswith("--config=") for f in flags) else [SMOKE]
  train = jobs.train if name in REAL_START else jobs.train_forked
  line = jobs.one_line(train(*config, *flags, *workdir), prefix="train: error: ")
  assert message in line
  assert not os.listdir(tmp_path)  # nothing written


@pytest.mark.parametrize("name,char", [("sweep[lr=3e-3]", "'['"), ("run?", "'?'")],
                         ids=["bracket", "question_mark"])
def test_a_workdir_with_a_glob_character_is_one_line_and_no_directory_is_made(name, char,
                                                                               tmp_path):
  """The refusal came from the Checkpointer, after the workdir had been created to probe it:
  the one line, exit 2, and an empty `sweep[lr=3e-3]/` left behind."""
  line = jobs.one_line(jobs.train_forked(SMOKE, f"--workdir={tmp_path / name}"),
                       prefix="train: error: checkpoints/ of --workdir: ")
  assert f"contains {char}" in line, line
  assert not os.listdir(tmp_path)  # nothing written, no directory made


# Checks of the config alone (run/config.py's parse, the CLI's first step) run
# in this process; the CLI's exit 2 and one line for them: learning_rate and
# zero_stage above, and tests/run/test_config.py's files.
BAD_FIELDS = [
    ("learning_rate_nan", {"learning_rate": float("nan")}, "must be a finite number > 0"),
    ("weight_decay_nan", {"weight_decay": float("nan")}, "`config.weight_decay`=nan"),
    ("prefetch", {"data.prefetch": -1}, "`config.data.prefetch`=-1"),
    ("eval_batch_size", {"data.eval_batch_size": -8, "eval_every": 2},
     "`config.data.eval_batch_size`=-8"),
    ("check_every", {"check_every": -1}, "`config.check_every`=-1"),
    ("watchdog_s", {"watchdog_s": -1.0}, "`config.watchdog_s`=-1.0"),
    ("strategy", {"strategy": "fsdp"}, "valid strategies: dp, zero1"),
]


@pytest.mark.parametrize("fields,message", [b[1:] for b in BAD_FIELDS],
                         ids=[b[0] for b in BAD_FIELDS])
def test_bad_config_field_is_a_one_line_config_error(fields, message):
  config = default.get_config("smoke")
  for name, value in fields.items():
    section, _, field = name.rpartition(".")
    (config[section] if section else config)[field] = value
  with pytest.raises(ConfigError) as e:
    run_config.parse(config)
  assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("value", ["0", "-1", "abc"])
def test_bad_cpu_device_count_is_one_line_and_exit_2(value, tmp_path):
  train = jobs.train if value == "abc" else jobs.train_forked  # one real start (above)
  line = jobs.one_line(train(SMOKE, f"--workdir={tmp_path}", JAXCOLL_CPU_DEVICES=value))
  assert "`JAXCOLL_CPU_DEVICES` must be a positive integer" in line and f"got {value!r}" in line
  assert not os.listdir(tmp_path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A finished smoke run with one kept checkpoint."""
  workdir = tmp_path_factory.mktemp("trained")
  out = _train(SMOKE, "--config.keep_checkpoints=1", f"--workdir={workdir}")
  assert out.returncode == 0, out.stderr[-2000:]
  return workdir


def test_checkpoint_of_another_model_is_refused_untouched(trained, tmp_path):
  before = _tree_digest(trained)
  out = _train(SMOKE, "--config.model_overrides.widths=(64,)", "--config.steps=8",
               f"--workdir={trained}")
  assert out.returncode == 2
  line = out.stderr.strip().splitlines()[-1]
  assert line.startswith("train: error: ") and "model_overrides" in line
  assert _tree_digest(trained) == before


def test_checkpoint_of_another_optimizer_says_what_differs(trained):
  """Issue 12.8: adam checkpoints resumed with adamw were called damaged."""
  before = _tree_digest(trained)
  line = jobs.one_line(jobs.train_forked(SMOKE, "--config.optimizer=adamw", "--config.steps=8",
                                         f"--workdir={trained}"))
  assert "written with optimizer='adam', this run has optimizer='adamw'" in line
  assert _tree_digest(trained) == before


def _copy(src, dst):
  subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
  return dst


def test_nan_never_replaces_good_checkpoints(tmp_path):
  """Issue 12.1: a NaN step with nan_policy="none" pruned every finite checkpoint
  and exited 0."""
  out = _train(SMOKE, "--config.nan_at_step=5", "--config.checkpoint_every=2",
               "--config.keep_checkpoints=2", f"--workdir={tmp_path}")
  assert out.returncode == 3, out.stderr[-2000:]
  assert "the state of step 6 is not finite" in out.stderr.strip().splitlines()[-1]
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]
  assert _no_result(tmp_path)


def test_restart_after_desync_uses_only_verified_checkpoints(trained, tmp_path):
  """Issue 12.2: checkpoints saved after a divergence, before the next
  fingerprint check, were resumed from. Every save is verified now."""
  flags = [SMOKE, "--config.checkpoint_every=1", "--config.check_every=5",
           "--config.desync_at_step=3", f"--workdir={tmp_path}"]
  first = _train(*flags)
  assert first.returncode == 4, first.stderr[-2000:]
  assert "replicas diverged at step 3" in first.stderr
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2"]
  again = _train(*flags, JAXCOLL_RESTART="1")
  assert again.returncode == 0, again.stderr[-2000:]
  assert _summary(tmp_path)["params_sha256"] == _summary(trained)["params_sha256"]


def test_torn_metrics_line_and_stale_lock_do_not_brick_the_workdir(trained, tmp_path):
  """Issue 12.4 / 12.5: a cut-off last row (a kill mid-write) and the lock file
  of a job that was SIGKILLed (no process holds it)."""
  workdir = _copy(trained, tmp_path / "copy")
  with open(workdir / "metrics.jsonl", "a") as f:
    f.write('{"step": 7, "loss": 0.5, "grad_')
  (workdir / lock.LOCK_NAME).write_text(json.dumps({"pid": 999999, "host": "gone"}))
  out = _train(SMOKE, "--config.steps=8", f"--workdir={workdir}")
  assert out.returncode == 0, out.stderr[-2000:]
  assert "dropping the torn last line" in out.stderr
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  assert [r["step"] for r in rows if "loss" in r] == [2, 4, 6, 8]  # train rows
  assert not (workdir / lock.LOCK_NAME).exists()


def test_second_job_in_a_workdir_is_refused_naming_the_holder(trained, tmp_path):
  """Issue 12.5: a relaunch ran beside the job still in the workdir."""
  workdir = _copy(trained, tmp_path / "copy")
  before = _tree_digest(workdir)
  with lock.WorkdirLock(str(workdir)):
    line = jobs.one_line(jobs.train_forked(SMOKE, "--config.steps=8", f"--workdir={workdir}"))
    assert f"in use by pid {os.getpid()} on host {socket.gethostname()}" in line
  assert _tree_digest(workdir) == before


_IN_PROCESS = """
import sys
sys.argv = ["train"] + {flags!r}
import errno, runpy
from jaxcoll.observe import metrics
def full(self, step, scalars):
  raise OSError(errno.ENOSPC, "No space left on device", self.path)
metrics.MetricsWriter.write = full
runpy.run_module("experiments.train", run_name="__main__")
"""


def test_disk_full_has_its_own_exit_status(tmp_path):
  """Issue 12.4: ENOSPC was reported as bad input (exit 2)."""
  code = _IN_PROCESS.format(flags=[SMOKE, f"--workdir={tmp_path}"])
  out = jobs.forked([sys.executable, "-c", code])
  assert out.returncode == loop.EXIT_DISK_FULL, out.stderr[-2000:]
  assert errno.ENOSPC != 2 and "disk full" in out.stderr.strip().splitlines()[-1]


def test_sigterm_ends_a_run_promptly_after_a_final_checkpoint(tmp_path):
  """Issue 12.6: SIGTERM was swallowed (multi-process) or lost the steps since
  the last checkpoint."""
  # Forked from a warm Python (~2 CPU-s less); the real start a signal stops: the Ctrl-C test
  # of test_stop_and_bad_input.
  status, err, elapsed = jobs.stop_with(_forever(tmp_path), signal.SIGTERM, workdir=tmp_path,
                                        forked=True)
  assert status == watchdog.EXIT_TERMINATED, err[-2000:]
  last = err.strip().splitlines()[-1]
  step = int(last.split("after step ")[1].split(";")[0])
  # Promptly: one step and one save, not the 100000 steps (nor the 90 s limit).
  assert "final checkpoint saved" in last and elapsed < 60
  assert os.listdir(tmp_path / "checkpoints") == [str(step)]


_SIGTERM_IN_EVAL = """
import os, signal, sys
sys.argv = ["train"] + {flags!r}
import runpy
from jaxcoll.data import files
original = files.eval_batches
def preempted(*a, **k):
  for i, b in enumerate(original(*a, **k)):
    if i == 1:  # a preemption notice during the eval's second batch (of four)
      os.kill(os.getpid(), signal.SIGTERM)
    yield b
files.eval_batches = preempted
runpy.run_module("experiments.train", run_name="__main__")
"""


def test_sigterm_during_an_eval_saves_that_step_at_once_and_a_resume_goes_on(tmp_path):
  """A preemption notice during a long eval waited for the whole eval and one more step
  (past a grace period of 30 s, the SIGKILL lost every step since the last checkpoint):
  the eval is left unfinished, the step it followed is saved, the run stops."""
  flags = [SMOKE, "--config.steps=6", "--config.eval_every=3", "--config.checkpoint_every=5",
           "--config.data.eval_examples=128", f"--workdir={tmp_path}"]
  out = jobs.forked([sys.executable, "-c", _SIGTERM_IN_EVAL.format(flags=flags)])
  assert out.returncode == watchdog.EXIT_TERMINATED, out.stderr[-2000:]
  assert out.stderr.strip().splitlines()[-1] == (
      "train: stopped by SIGTERM after step 3; final checkpoint saved.")
  assert ("the evaluation is left unfinished (no eval row for step 3); evaluate checkpoint 3 "
          "later with python -m experiments.eval") in out.stderr
  assert os.listdir(tmp_path / "checkpoints") == ["3"]
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert not [r for r in rows if "eval_loss" in r]
  resumed = jobs.train_forked(*flags)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in rows if "eval_loss" in r] == [6]


_STALLED_SAVE = """
from configs import default
from jaxcoll.run import hooks, loop
config = default.get_config("smoke")
config.watchdog_s = 2.0
loop.train_and_evaluate(config, {workdir!r}, hooks=[hooks.StallSave(3)])
"""


def test_watchdog_covers_checkpoint_saves(tmp_path):
  """Issue 12.7: the watchdog was paused during saves, so a save stuck in
  orbax's barrier hung until JAX's heartbeat aborted the process."""
  out = jobs.forked([sys.executable, "-c", textwrap.dedent(_STALLED_SAVE.format(workdir=str(
      tmp_path)))], timeout=240)
  assert out.returncode == watchdog.EXIT_WATCHDOG, out.stderr[-2000:]
  assert ("the checkpoint save of step 3 did not finish within 8 s (last finished step: 3)"
          in out.stderr)


def test_corrupted_checkpoint_is_refused_untouched(trained, tmp_path):
  workdir = tmp_path / "copy"
  subprocess.run(["cp", "-r", str(trained), str(workdir)], check=True)
  step_dir = workdir / "checkpoints" / "6"
  for root, _, files in os.walk(step_dir / "state"):
    for name in files:
      if "manifest" in name or name.endswith(".ocdbt") or "d" in os.path.basename(root):
        with open(os.path.join(root, name), "r+b") as f:
          f.truncate(max(os.path.getsize(os.path.join(root, name)) // 2, 1))
  before = _tree_digest(workdir)
  out = jobs.train_forked(SMOKE, "--config.steps=8", f"--workdir={workdir}")
  assert out.returncode == 2, out.stderr[-2000:]
  assert "train: error: " in out.stderr and "checkpoint" in out.stderr.lower()
  assert _tree_digest(workdir) == before


def test_injected_fault_exit_code_is_distinct():
  from jaxcoll.runtime import distributed

  statuses = [loop.EXIT_INJECTED_FAULT, watchdog.EXIT_WATCHDOG, watchdog.EXIT_TERMINATED,
              loop.EXIT_DISK_FULL, distributed.INIT_TIMEOUT_EXIT_CODE, 2, 3, 4]
  assert len(set(statuses)) == len(statuses)


def test_sigterm_to_the_launcher_ends_workers_at_one_checkpointed_step(tmp_path):
  """Issue 12.6, several processes: JAX's preemption service swallowed SIGTERM,
  so every launcher stop ended in SIGKILL. Now the processes agree on a step
  (JAX's preemption sync point), save it and exit 143 before the grace period."""
  # The launcher forked from a warm Python, its processes from it (~7 CPU-s less).
  status, err, _ = jobs.stop_with(
      jobs.launch_cmd(*_forever(tmp_path), launcher_flags=["--grace_s=60"]), signal.SIGTERM,
      workdir=tmp_path, devices=4, forked=True, warm_workers=True)
  assert status == watchdog.EXIT_TERMINATED, err[-3000:]
  stopped = jobs.stopped_steps(err)
  assert set(stopped) == {"[p0]", "[p1]"} and len(set(stopped.values())) == 1, err[-3000:]
  assert "final checkpoint saved" in err
  assert os.listdir(tmp_path / "checkpoints") == [stopped["[p0]"]]


def test_metrics_reader_drops_a_torn_last_line_and_warns_on_a_damaged_one(tmp_path):
  from jaxcoll.observe import metrics

  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.9}\n{"step": 3, "lo')
  with pytest.warns(metrics.TornLineWarning, match="torn last line"):
    assert [r["step"] for r in metrics.read_metrics(str(tmp_path))] == [1, 2]
  path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo\n{"step": 3, "loss": 0.8}\n')
  with pytest.warns(metrics.TornLineWarning, match="line 2 \\(not a JSON row\\)"):
    assert [r["step"] for r in metrics.read_metrics(str(tmp_path))] == [1, 3]


def test_workdir_lock_is_exclusive_released_and_taken_over_when_stale(tmp_path):
  held = lock.WorkdirLock(str(tmp_path))
  held.acquire()
  with pytest.raises(lock.WorkdirBusyError, match=f"in use by pid {os.getpid()}"):
    lock.WorkdirLock(str(tmp_path)).acquire()
  held.release()
  assert not (tmp_path / lock.LOCK_NAME).exists()
  # The file of a job that was SIGKILLed: nobody holds its flock.
  (tmp_path / lock.LOCK_NAME).write_text(json.dumps({"pid": 999999, "host": "elsewhere"}))
  with lock.WorkdirLock(str(tmp_path)) as taken:
    assert taken.holder() == {"pid": os.getpid(), "host": socket.gethostname()}
  assert not (tmp_path / lock.LOCK_NAME).exists()
