"""Checkpoint faults (issue 20): races between processes, disk full, saves
that outlive a peer, a damaged final checkpoint, eval after the save.

Each case is a row of README's "Faults and bad input" table.
"""

import os
import sys
import textwrap

import jobs
import pytest

SMOKE = "--config=configs/default.py:smoke"
_TRAIN = [sys.executable, "-m", "experiments.train"]
_LAUNCH_FLAGS = ("--init_timeout_s=60", "--timeout_s=200", "--grace_s=2")
_ORBAX_RACE_SIGN = "Metadata file does not exist"

# Delays orbax's CheckpointManager.reload by 2 s on process 1 only, then runs
# experiments.train: a process that lists the steps late (issue 20: it
# deadlocked in orbax's delete barrier every time).
_SLOW_RELOAD = """
import os, runpy, sys, time
import orbax.checkpoint as ocp
_reload = ocp.CheckpointManager.reload
def reload(self):
  if os.environ.get("JAXCOLL_PROCESS_ID") == "1":
    time.sleep(2.0)
  return _reload(self)
ocp.CheckpointManager.reload = reload
sys.argv = ["train", *sys.argv[1:]]
runpy.run_module("experiments.train", run_name="__main__")
"""


def _two_process_run(workdir, steps, cmd=_TRAIN, timeout=240):
  out = jobs.launch(
      *cmd, SMOKE, f"--config.steps={steps}", "--config.checkpoint_every=1",
      "--config.keep_checkpoints=1", "--config.log_every=1000", "--config.watchdog_s=20",
      f"--workdir={workdir}", launcher_flags=_LAUNCH_FLAGS, timeout=timeout)
  log = out.stdout + out.stderr
  return out, log


def _assert_clean_two_process_run(out, log, workdir, steps):
  assert out.returncode == 0, log[-3000:]
  assert _ORBAX_RACE_SIGN not in log, [l for l in log.splitlines() if _ORBAX_RACE_SIGN in l]
  assert "Traceback" not in log and "watchdog" not in log, log[-3000:]
  assert sorted(os.listdir(workdir / "checkpoints")) == [str(steps)]
  assert jobs.summary(workdir)["steps"] == steps


def test_two_process_saves_every_step_keep_1_never_hang_nor_warn(tmp_path):
  """Issue 20.0: checkpoint_every=1, keep_checkpoints=1 on 2 processes hung
  at a save (orbax's delete barrier) and logged orbax's metadata warning."""
  out, log = _two_process_run(tmp_path, 40)
  _assert_clean_two_process_run(out, log, tmp_path, 40)


@pytest.mark.slow
def test_two_process_saves_every_step_keep_1_for_hundreds_of_steps(tmp_path):
  out, log = _two_process_run(tmp_path, 400, timeout=900)
  _assert_clean_two_process_run(out, log, tmp_path, 400)


def test_a_process_that_lists_checkpoints_late_does_not_deadlock_the_prune(tmp_path):
  """Issue 20.0, deterministic: orbax's reload 2 s late on process 1 deadlocked
  every run (process 0 waited in delete's barrier for a delete process 1
  skipped, as it no longer saw the step)."""
  wrapper = tmp_path / "slow_reload.py"
  wrapper.write_text(textwrap.dedent(_SLOW_RELOAD))
  workdir = tmp_path / "run"
  out, log = _two_process_run(workdir, 6, cmd=[sys.executable, str(wrapper)])
  _assert_clean_two_process_run(out, log, workdir, 6)


# Runs experiments.train in this process after patching the code it runs.
_PATCHED_TRAIN = """
import sys
sys.argv = ["train"] + {flags!r}
import runpy
{patch}
runpy.run_module("experiments.train", run_name="__main__")
"""


def _patched_train(patch, *flags, timeout=300, **env):
  code = _PATCHED_TRAIN.format(flags=list(flags), patch=textwrap.dedent(patch))
  return jobs.run([sys.executable, "-c", code], timeout=timeout, **env)


_EVAL_FAILS = """
from jaxcoll.run import evaluate, loop
def broken(self, params):
  raise {error}("the eval set is unreadable")
evaluate.Evaluator.__call__ = broken
"""


@pytest.mark.parametrize("error,status", [("RuntimeError", 1), ("loop.ConfigError", 2)])
def test_a_failing_eval_never_costs_the_checkpoint_of_its_step(error, status, tmp_path):
  """Issue 20.4: eval ran before the save of the same step, so a failing eval
  lost that step's checkpoint (and a restart repeated it); its error did not
  say it came from the eval."""
  flags = [SMOKE, "--config.eval_every=3", "--config.checkpoint_every=3",
           f"--workdir={tmp_path}"]
  out = _patched_train(_EVAL_FAILS.format(error=error), *flags)
  assert out.returncode == status, out.stderr[-3000:]
  last = out.stderr.strip().splitlines()[-1]
  assert ("the evaluation after step 3 failed (checkpoint 3 is saved): " in last
          and "the eval set is unreadable" in last), last
  assert os.listdir(tmp_path / "checkpoints") == ["3"]
  assert os.path.exists(tmp_path / "checkpoints" / "3" / "commit_success.txt")
  if status == 2:
    return
  again = jobs.train(*flags)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "Resuming from step 3 of 6" in again.stderr
  assert jobs.summary(tmp_path)["eval_examples"] == 1024
