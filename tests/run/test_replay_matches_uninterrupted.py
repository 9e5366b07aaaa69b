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
from incident_fakes import KillBefore, Killed

from jaxcoll.run import hooks as hooks_lib
from jaxcoll.run import incidents

NAN = float("nan")


def _train(config, workdir, *hooks):
  from jaxcoll.run import loop  # noqa: PLC0415

  return loop.train_and_evaluate(config, str(workdir), hooks=hooks)


def _state(workdir):
  with open(os.path.join(workdir, incidents.STATE_NAME)) as f:
    return json.load(f)


def _nan_config(non_finite="off", steps=16):
  from configs import default  # noqa: PLC0415

  # Batch 12 is NaN in the first attempt only (a transient fault); nan_policy="skip" drops the
  # step inside the trainer. Killed before step 14: after the skip, before checkpoint 15; the
  # resume starts from checkpoint 10 and trains step 12 again, on a clean batch 12.
  config = default.get_config("smoke")
  config.steps, config.checkpoint_every, config.log_every, config.algorithm = steps, 5, 4, "ring"
  config.nan_policy = "skip"
  config.incidents.non_finite = non_finite
  return config


@pytest.mark.parametrize("non_finite", ["off", "warn", "skip"])
def test_a_kill_after_a_trainer_skip_resumes_bit_identical(non_finite, tmp_path):
  """The trainer's skip at step 12 is recorded (even with the incident signal off; with
  `skip` as the incident's response too, the record is the response's); the resumed run skips
  step 12 again though its batch is clean now, counts it in summary.json and ends with the
  uninterrupted run's params and incident counts. Before: it trained on batch 12."""
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
  signal = "non_finite" if non_finite == "skip" else "nan_policy"
  assert [(d["step"], d["batch"], d["signal"], d["judged"][2]) for d in recorded] == [
      (12, 12, signal, 1)]


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


def test_skipped_steps_counts_the_run_not_the_attempt(tmp_path):
  """Batch 7 is NaN: a run of 10 steps skips step 7; resumed to 16 steps, summary.json's and
  the rows' skipped_steps still count it (before: 0, the resumed attempt's own count)."""
  first = _train(_nan_config(steps=10), tmp_path, hooks_lib.CorruptBatches(7, 7, NAN))
  assert first["skipped_steps"] == 1
  resumed = _train(_nan_config(), tmp_path)
  assert (resumed["start_step"], resumed["skipped_steps"]) == (10, 1)
  from jaxcoll.observe import metrics  # noqa: PLC0415

  assert [r["skipped_steps"] for r in metrics.read_metrics(str(tmp_path)) if "loss" in r] == [
      0, 1, 1, 1, 1]  # steps 4, 8, 10 | 12, 16


def test_a_rollback_does_not_count_the_skips_of_the_stretch_it_abandons(tmp_path):
  """non_finite=rollback: the NaN step 12 (skipped by the trainer) rolls back to checkpoint 10
  and skips batches 11..12: the run trains what data.skip=11:12 trains and counts what it
  counts (a resume from checkpoint 10 after a kill would count the same). Before: 1."""
  rolled = _nan_config("rollback")
  summary = _train(rolled, tmp_path / "rolled", hooks_lib.CorruptBatches(12, 12, NAN))
  assert summary["incidents"]["rollbacks"] == 1
  replay = _nan_config()
  replay.data.skip = "11:12"
  again = _train(replay, tmp_path / "replay")
  assert summary["params_sha256"] == again["params_sha256"]
  assert summary["skipped_steps"] == again["skipped_steps"] == 0


# -- the recorded skips are pruned below the oldest retained checkpoint -----------------------


def test_recorded_skips_at_or_before_the_oldest_retained_checkpoint_are_pruned(tmp_path):
  import ml_collections  # noqa: PLC0415

  watch = incidents.Watch.from_config(ml_collections.ConfigDict({"incidents": {}}),
                                      str(tmp_path), is_chief=True)
  oldest = [None]
  watch.oldest_checkpoint = lambda: oldest[0]
  for step in (5, 10, 12):
    watch.trainer_skip(step, "state", None, {"loss": NAN, "grad_norm": NAN, "skipped": 1}, step)
  watch.prune_skips()  # no checkpoint yet: a resume starts from 0 and replays all
  assert [d["step"] for d in _state(tmp_path)["skips"]] == [5, 10, 12]
  oldest[0] = 10  # checkpoints 10 and later: a resume replays the steps after 10 at most
  watch.prune_skips()
  assert [d["step"] for d in _state(tmp_path)["skips"]] == [12]  # before: never pruned


def test_a_pruned_record_still_replays_what_the_retained_checkpoints_need(tmp_path):
  """NaN batches 3 and 13 (transient), keep_checkpoints=2, killed before step 14: skip 3 is
  pruned once checkpoint 5 is the oldest; skip 13 (after checkpoint 10) stays and the resume
  from 10 skips step 13 again: bit-identical to the uninterrupted run."""
  def config():
    c = _nan_config()
    c.keep_checkpoints = 2
    return c

  def bad():
    return hooks_lib.CorruptBatches(3, 3, NAN), hooks_lib.CorruptBatches(13, 13, NAN)

  whole = _train(config(), tmp_path / "whole", *bad())
  workdir = tmp_path / "run"
  with pytest.raises(Killed):
    _train(config(), workdir, *bad(), KillBefore(14))
  assert sorted(os.listdir(workdir / "checkpoints"), key=int) == ["5", "10"]
  assert [d["step"] for d in _state(workdir)["skips"]] == [13]
  resumed = _train(config(), workdir)
  assert resumed["params_sha256"] == whole["params_sha256"]
  assert resumed["skipped_steps"] == whole["skipped_steps"] == 2


def test_the_rows_a_resume_trains_again_are_those_of_the_timeline_it_follows(tmp_path):
  """The log's rows after a resume's checkpoint that the resume would log again: not those a
  rollback abandoned (logged before it, or by its own response, after its target), not the
  rollback's (its decision is taken from the record), not a stop's (a stop again is news)."""
  import ml_collections  # noqa: PLC0415
  from incident_fakes import Checkpoints, Input  # noqa: PLC0415

  rows = [(4, "loss_spike", "warn", 1.0, None), (7, "loss_spike", "warn", 2.0, None),
          (12, "loss_spike", "rollback", 3.0, 5), (12, "grad_norm_spike", "warn", 3.0, None),
          (8, "grad_norm_spike", "warn", 4.0, None), (9, "loss_spike", "stop", 5.0, None)]
  (tmp_path / incidents.LOG_NAME).write_text("".join(json.dumps(
      {"step": s, "signal": g, "action": a, "time": t, "checkpoint_restored": c,
       "attempt_start_step": 0}) + "\n" for s, g, a, t, c in rows))
  watch = incidents.Watch.from_config(
      ml_collections.ConfigDict({"incidents": {"grad_norm_spike": "warn"}}), str(tmp_path),
      is_chief=True)
  assert watch._rows_after(5) == {(8, "grad_norm_spike", "warn"): 1}
  assert watch._rows_after(8) == {}
  watch.resume(5, {}, Input())
  for _ in range(2):  # the first is the one logged before the resume; the second is news
    watch._flag(8, "grad_norm_spike", 9.0, 2.0)
    watch.respond(8, "state", None, ckpt=Checkpoints(), trainer=None, train_input=Input(),
                  init=lambda: "initial")
    watch._last_flag.clear()
  assert [(r["step"], r["signal"]) for r in incidents.read_log(str(tmp_path))][len(rows):] == [
      (8, "grad_norm_spike")]
