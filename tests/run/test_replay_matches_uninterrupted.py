"""A run killed and resumed tells the same story as one never interrupted.

The stretch between the checkpoint a resume starts from and the kill is trained again: what the
attempt before the kill decided there must be decided again the same way (a step the trainer
skipped, ``nan_policy="skip"``, on a NaN that need not come back), and what it logged there is
not logged twice (``warn`` incidents: summary.json's counts). The in-process runs stand a hook's
exception in for the kill (it leaves on disk what a kill leaves), as in
tests/run/test_incidents_durable.py.
"""

import json
import os

import pytest

from jaxcoll.run import hooks as hooks_lib
from jaxcoll.run import incidents

NAN = float("nan")


class Killed(BaseException):
  """The stand-in for SIGKILL (a BaseException: nothing of the loop catches it)."""


class KillBefore(hooks_lib.Hook):
  def __init__(self, step: int):
    self.step = step

  def before_step(self, step, batch, state):
    if step == self.step:
      raise Killed(f"killed before step {step}")
    return batch, state


def _train(config, workdir, *hooks):
  from jaxcoll.run import loop  # noqa: PLC0415

  return loop.train_and_evaluate(config, str(workdir), hooks=hooks)


def _state(workdir):
  with open(os.path.join(workdir, incidents.STATE_NAME)) as f:
    return json.load(f)


def _nan_config(non_finite="off"):
  from configs import default  # noqa: PLC0415

  # Batch 12 is NaN in the first attempt only (a transient fault); nan_policy="skip" drops the
  # step inside the trainer. Killed before step 14: after the skip, before checkpoint 15; the
  # resume starts from checkpoint 10 and trains step 12 again, on a clean batch 12.
  config = default.get_config("smoke")
  config.steps, config.checkpoint_every, config.log_every, config.algorithm = 16, 5, 4, "ring"
  config.nan_policy = "skip"
  config.incidents.non_finite = non_finite
  return config


@pytest.mark.parametrize("non_finite", ["off", "warn"])
def test_a_kill_after_a_trainer_skip_resumes_bit_identical(non_finite, tmp_path):
  """The trainer's skip at step 12 is recorded (even with the incident signal off); the
  resumed run skips step 12 again though its batch is clean now, counts it in summary.json
  and ends with the uninterrupted run's params. Before: it trained on batch 12."""
  whole = _train(_nan_config(non_finite), tmp_path / "whole", hooks_lib.CorruptBatches(12, 12, NAN))
  assert whole["skipped_steps"] == 1
  workdir = tmp_path / "run"
  with pytest.raises(Killed):
    _train(_nan_config(non_finite), workdir, hooks_lib.CorruptBatches(12, 12, NAN), KillBefore(14))
  assert sorted(os.listdir(workdir / "checkpoints"), key=int)[-1] == "10"
  recorded = os.path.exists(workdir / incidents.STATE_NAME) and _state(workdir)["skips"]
  resumed = _train(_nan_config(non_finite), workdir)  # the fault is gone
  assert resumed["start_step"] == 10
  assert resumed["params_sha256"] == whole["params_sha256"]  # before: batch 12 trained
  assert resumed["skipped_steps"] == whole["skipped_steps"] == 1
  assert resumed["incidents"] == whole["incidents"]
  assert [(d["step"], d["batch"], d["signal"], d["judged"][2]) for d in recorded] == [
      (12, 12, "nan_policy", 1)]


def _warn_config():
  from configs import default  # noqa: PLC0415

  # Batches 9..11 and 13 spike (the bad data is there in every attempt), answered by warn: an
  # episode of 9..11 (logged once, at 9) across checkpoint 10, and step 13. Killed before
  # step 15 (after 13's row, before checkpoint 15): the resume from 10 trains 11..14 again.
  config = default.get_config("smoke")
  config.steps, config.checkpoint_every, config.log_every, config.algorithm = 16, 5, 1, "ring"
  config.incidents.spike_min_steps = 5
  return config


def _bad_batches():
  return hooks_lib.CorruptBatches(9, 11), hooks_lib.CorruptBatches(13, 13)


def _rows(workdir):
  return [(r["step"], r["signal"], r["action"]) for r in incidents.read_log(str(workdir))]


def test_warn_incidents_of_the_replayed_steps_are_logged_once(tmp_path):
  """The log and summary.json's counts after a kill and a resume equal the uninterrupted
  run's. Before: step 13's rows were logged again by the replay, and step 11's (the episode
  that began at 9 goes on past checkpoint 10) as a new episode."""
  whole = _train(_warn_config(), tmp_path / "whole", *_bad_batches())
  assert {s for s, _, _ in _rows(tmp_path / "whole")} == {9, 13}
  workdir = tmp_path / "run"
  with pytest.raises(Killed):
    _train(_warn_config(), workdir, *_bad_batches(), KillBefore(15))
  assert {s for s, _, _ in _rows(workdir)} == {9, 13}
  resumed = _train(_warn_config(), workdir, *_bad_batches())
  assert resumed["start_step"] == 10
  assert _rows(workdir) == _rows(tmp_path / "whole")
  assert resumed["incidents"] == whole["incidents"]
  assert resumed["params_sha256"] == whole["params_sha256"]
