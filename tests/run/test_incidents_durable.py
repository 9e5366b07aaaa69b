"""Incident decisions a hard kill must not lose (WORKDIR/incident_state.json).

A SIGKILL (or a power loss) right after a rollback, before the next checkpoint, used to lose
the rollback's skip range and its count toward max_rollbacks: the resumed run trained on the bad
batches again. An eval-regression flag (raised after its step's save) was unknown to a resumed
run. The in-process runs here stand a hook's exception in for the kill: it leaves on disk what
a kill leaves (no checkpoint is written on an error's way out); the slow test kills process 0
for real (``fail_at_step``: ``os._exit``) in a 2-process job.
"""

import json
import os
import sys

import ml_collections
import pytest

import jobs
from incident_fakes import Checkpoints, Input, KillBefore, Killed

from jaxcoll.run import hooks as hooks_lib
from jaxcoll.run import incidents
from jaxcoll.run.config_error import ConfigError


class KillOnReplay(hooks_lib.Hook):
  """Raises :class:`Killed` before the ``nth`` step of a replay (a step number at or below one
  already run: the loop restarted after a rollback)."""

  def __init__(self, nth: int = 1):
    self.nth, self.seen, self.replayed = nth, 0, 0

  def before_step(self, step, batch, state):
    if step <= self.seen:
      self.replayed += 1
      if self.replayed == self.nth:
        raise Killed(f"killed before step {step} of the replay")
    self.seen = max(self.seen, step)
    return batch, state


def _config(**changes):
  from configs import default  # noqa: PLC0415

  config = default.get_config("smoke")
  # Batch 12 corrupted: the loss spikes at step 12 (judged at the logged step 12); rollback
  # restores checkpoint 5 (rollback_steps=3: at or before step 9) and skips batches 6..12;
  # checkpoint 10 is set aside. The next checkpoint after it is step 10 of the replay.
  config.steps, config.checkpoint_every, config.log_every, config.algorithm = 16, 5, 4, "ring"
  config.incidents.loss_spike, config.incidents.rollback_steps = "rollback", 3
  config.incidents.spike_min_steps = 8
  for key, value in changes.items():
    config[key] = value
  return config


def _train(config, workdir, *hooks):
  from jaxcoll.run import loop  # noqa: PLC0415

  return loop.train_and_evaluate(config, str(workdir), hooks=hooks)


def _state(workdir):
  with open(os.path.join(workdir, incidents.STATE_NAME)) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """The run without a kill: (workdir, summary)."""
  workdir = tmp_path_factory.mktemp("whole") / "run"
  bad = hooks_lib.CorruptBatches(12, 12)
  summary = _train(_config(), workdir, bad)
  assert bad.corrupted == [12]
  rollbacks = [r for r in incidents.read_log(str(workdir)) if r["action"] == "rollback"]
  assert [(r["step"], r["checkpoint_restored"], r["batches_skipped"], r["checkpoints_set_aside"])
          for r in rollbacks] == [(12, 5, [6, 12], [10])]
  return workdir, summary


def test_a_kill_right_after_a_rollback_keeps_its_decision(uninterrupted, tmp_path):
  """Killed 2 steps into the replay (before checkpoint 10 of the replay): the resumed run
  starts from checkpoint 5 and skips batches 6..12 as the rollback decided, never training on
  the bad batch again; one rollback in the log and the count; bit-identical to no kill."""
  whole, summary = uninterrupted
  workdir = tmp_path / "run"
  with pytest.raises(Killed):
    _train(_config(), workdir, hooks_lib.CorruptBatches(12, 12), KillOnReplay(nth=2))
  assert sorted(os.listdir(workdir / "checkpoints")) == ["5"]  # 10 is set aside
  (decision,) = _state(workdir)["rollbacks"]
  assert (decision["rollback"], decision["checkpoint_restored"], decision["batches_skipped"],
          decision["checkpoints_set_aside"]) == (1, 5, [6, 12], [10])
  bad = hooks_lib.CorruptBatches(12, 12)  # the bad data is still there
  resumed = _train(_config(), workdir, bad)
  assert bad.corrupted == []  # before the fix: [12], detected and rolled back again
  assert resumed["start_step"] == 5
  assert [r["rollback"] for r in incidents.read_log(str(workdir)) if r["action"] == "rollback"
          ] == [1]
  assert resumed["incidents"]["rollbacks"] == 1
  assert resumed["params_sha256"] == summary["params_sha256"]
  from jaxcoll.observe import metrics  # noqa: PLC0415

  rows = [r for r in metrics.read_metrics(str(workdir)) if "loss" in r]
  # The abandoned stretch's rows survive the resume from 5 (before: dropped as rows after it).
  assert [(r["step"], r["abandoned_by_rollback"]) for r in rows if r.get("abandoned")] == [
      (8, 1), (12, 1)]
  assert [r["step"] for r in rows if not r.get("abandoned")] == [4, 8, 12, 16]


def test_settle_sets_aside_what_a_recorded_rollback_abandoned(tmp_path):
  """A rollback to 5 recorded, killed before its set-aside: at the resume checkpoint 10 (saved
  before the rollback: its count is 0) goes aside, and nothing is "nothing to do" there; 5 and
  a checkpoint saved after the rollback (count 1) stay."""
  watch = _watch(tmp_path, grad_norm_spike="rollback", rollback_steps=3)
  ckpt = Checkpoints({5: {}, 10: {}})
  ckpt.directory = str(tmp_path / "checkpoints")
  for c in ("5", "10"):
    os.makedirs(os.path.join(ckpt.directory, c))
  watch._flag(12, "grad_norm_spike", 9.0, 2.0)
  with pytest.MonkeyPatch.context() as m:
    m.setattr(incidents.Watch, "_move", lambda *a, **k: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):
      _respond(watch, 12, ckpt=ckpt)
  assert sorted(os.listdir(ckpt.directory)) == ["10", "5"]
  resumed = _watch(tmp_path, grad_norm_spike="rollback")
  resumed.load_state()
  assert resumed.unsettled(10, {}) and not resumed.unsettled(5, {})
  assert not resumed.unsettled(10, {"incident_detectors": {"rollbacks": 1}})  # saved after it
  assert resumed.settle(ckpt) == [10]
  assert sorted(os.listdir(ckpt.directory)) == ["5"]
  assert os.listdir(tmp_path / incidents.ROLLED_BACK_DIR / "incident_step_12") == ["10"]
  inputs = Input()
  assert resumed.resume(5, {}, inputs) == [1] and inputs.schedule.ranges == [(6, 12)]
  (row,) = incidents.read_log(str(tmp_path))  # the row the kill kept from the log
  assert (row["checkpoint_restored"], row["logged_at_resume"]) == (5, True)


@pytest.mark.slow  # ~10 s: two runs; fast cover: test_settle_sets_aside_what_a_recorded_...
def test_a_kill_between_the_record_and_the_set_aside_is_completed_at_resume(
    uninterrupted, tmp_path, monkeypatch):
  """Killed after the decision was written, before checkpoint 10 was set aside and before the
  log row: the resume sets 10 aside (never resumed from), writes the log row and skips the
  batches; bit-identical to no kill."""
  whole, summary = uninterrupted
  workdir = tmp_path / "run"

  def killed(self, *args, **kwargs):
    raise Killed("killed in the set-aside")

  with monkeypatch.context() as m:
    m.setattr(incidents.Watch, "_move", killed)
    with pytest.raises(Killed):
      _train(_config(), workdir, hooks_lib.CorruptBatches(12, 12))
  assert sorted(os.listdir(workdir / "checkpoints")) == ["10", "5"]
  assert not os.path.exists(workdir / incidents.LOG_NAME)  # the row never reached the log
  assert _state(workdir)["rows"][0]["checkpoint_restored"] == 5
  bad = hooks_lib.CorruptBatches(12, 12)
  resumed = _train(_config(), workdir, bad)
  assert bad.corrupted == [] and resumed["start_step"] == 5
  assert os.listdir(workdir / incidents.ROLLED_BACK_DIR / "incident_step_12") == ["10"]
  rows = incidents.read_log(str(workdir))
  assert [(r["signal"], r["action"], r["checkpoint_restored"], r["logged_at_resume"])
          for r in rows] == [("loss_spike", "rollback", 5, True),
                             ("grad_norm_spike", "warn", None, True)]
  assert resumed["params_sha256"] == summary["params_sha256"]


# -- the eval-regression flag --------------------------------------------------------------


def _watch(tmp_path, **given):
  config = ml_collections.ConfigDict({"checkpoint_every": 5, "incidents": given})
  return incidents.Watch.from_config(config, str(tmp_path), is_chief=True)


def _respond(watch, step, ckpt=None, inputs=None):
  return watch.respond(step, f"state after {step}", None, ckpt=ckpt or Checkpoints(),
                       trainer=None, train_input=inputs or Input(), init=lambda: "initial")


def test_an_eval_flag_raised_after_its_save_marks_that_checkpoint_after_a_resume(tmp_path):
  """Eval regression at step 10 (warn), after checkpoint 10's save; the run is resumed from
  checkpoint 10: a later rollback passes over 10 as the first attempt's own would."""
  first = _watch(tmp_path, eval_regression="warn")
  first.after_eval(5, {"eval_loss": 1.0})
  first.after_eval(10, {"eval_loss": 2.0})
  _respond(first, 10)
  assert _state(tmp_path)["flags"] == [{"step": 10, "signal": "eval_regression", "rollbacks": 0,
                                        "answered": True, "incident": None}]
  resumed = _watch(tmp_path, eval_regression="warn", grad_norm_spike="rollback")
  resumed.load_state()
  resumed.resume(10, {}, Input())
  assert 10 in resumed.flagged_steps and resumed.pending == []
  resumed._flag(12, "grad_norm_spike", 9.0, 2.0)
  assert _respond(resumed, 12) == ("state 5", 5)  # before the fix: ("state 10", 10)


def test_an_eval_incident_a_kill_left_unanswered_is_answered_at_the_resume(tmp_path):
  """Killed after the eval at step 10 flagged a regression answered by rollback, before the
  response: checkpoint 10 is unsettled (not "nothing to do") and the resumed run answers
  the incident before its first step."""
  first = _watch(tmp_path, eval_regression="rollback")
  first.after_eval(5, {"eval_loss": 1.0})
  first.after_eval(10, {"eval_loss": 2.0})  # ... killed here
  resumed = _watch(tmp_path, eval_regression="rollback")
  resumed.load_state()
  assert resumed.unsettled(10, {}) and not resumed.unsettled(5, {})
  resumed.resume(10, {}, Input())
  assert [(p["step"], p["signal"], p["action"]) for p in resumed.pending] == [
      (10, "eval_regression", "rollback")]
  assert _respond(resumed, 10) == ("state 5", 5)
  state = _state(tmp_path)
  assert state["flags"] == [] and state["rollbacks"][0]["checkpoint_restored"] == 5
  again = _watch(tmp_path, eval_regression="rollback")
  again.load_state()
  assert not again.unsettled(10, {"incident_detectors": {"rollbacks": 1}})


@pytest.mark.slow  # ~30 s: three runs; fast cover: the Watch-level test above
def test_eval_rollback_answered_after_a_kill_equals_the_replay(tmp_path, monkeypatch):
  """Through the loop: the eval after step 20 regresses, the kill comes before the response;
  the resumed run rolls back to 15 first and ends bit-identical to data.skip=16:22."""
  from jaxcoll.run import loop  # noqa: PLC0415

  def config(corrupt="", skip=""):
    c = _config(steps=25, eval_every=5, log_every=5, corrupt_batches=corrupt)
    c.data.skip = skip
    for signal in ("loss_spike", "grad_norm_spike", "throughput_regression", "straggler"):
      c.incidents[signal] = "off"
    c.incidents.eval_margin, c.incidents.rollback_steps = 0.02, 1
    c.incidents.eval_regression, c.incidents.skip_batches = "rollback", 7
    return c

  workdir = tmp_path / "run"
  with monkeypatch.context() as m:
    m.setattr(incidents.Watch, "respond", lambda *a, **k: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):
      loop.train_and_evaluate(config("16:22"), str(workdir))
  assert sorted(os.listdir(workdir / "checkpoints"), key=int)[-1] == "20"
  resumed = loop.train_and_evaluate(config("16:22"), str(workdir))
  (row,) = incidents.read_log(str(workdir))
  assert (row["step"], row["action"], row["checkpoint_restored"], row["batches_skipped"]) == (
      20, "rollback", 15, [16, 22])
  replay = loop.train_and_evaluate(config(skip="16:22"), str(tmp_path / "replay"))
  assert resumed["params_sha256"] == replay["params_sha256"]


def test_max_rollbacks_counts_a_rollback_a_kill_interrupted(tmp_path):
  """max_rollbacks=1, a kill right after the first rollback (before any checkpoint has its
  count): the resumed run's next rollback is a stop, as in the run without the kill."""
  first = _watch(tmp_path, grad_norm_spike="rollback", max_rollbacks=1)
  first._flag(12, "grad_norm_spike", 9.0, 2.0)
  assert _respond(first, 12) == ("state 10", 10)  # ... killed before checkpoint 15
  resumed = _watch(tmp_path, grad_norm_spike="rollback", max_rollbacks=1)
  resumed.load_state()
  inputs = Input()
  assert resumed.resume(10, {"incident_detectors": {"rollbacks": 0}}, inputs) == [1]
  assert inputs.schedule.ranges == [(11, 12)] and resumed.rollbacks == 1
  resumed._flag(11, "grad_norm_spike", 9.0, 2.0)
  assert _respond(resumed, 11, inputs=inputs) == ("state after 11", None)
  assert resumed.stopping["why"] == "max_rollbacks (1) reached"  # before the fix: rollback 1
  # A checkpoint saved after the rollback carries it: nothing is taken again from there.
  again = _watch(tmp_path, grad_norm_spike="rollback")
  again.load_state()
  assert again.resume(15, {"incident_detectors": {"rollbacks": 1}}, Input()) == []


# -- the state file ------------------------------------------------------------------------


def test_a_workdir_without_the_state_file_resumes_as_before(tmp_path):
  watch = _watch(tmp_path)
  watch.load_state()
  inputs = Input()
  assert watch.resume(10, {"incident_detectors": {"rollbacks": 2}}, inputs) == []
  assert inputs.schedule.ranges == [] and not watch.unsettled(10, {})
  assert not os.path.exists(tmp_path / incidents.STATE_NAME)  # nothing written


@pytest.mark.parametrize("text", ['{"format": 99}', "not json",
                                  '{"format": 1, "rollbacks": [{}]}'])
def test_a_state_file_this_version_did_not_write_is_one_line(tmp_path, text):
  (tmp_path / incidents.STATE_NAME).write_text(text)
  with pytest.raises(ConfigError, match="is not an incident state this jaxcoll wrote") as e:
    _watch(tmp_path).load_state()
  assert "move it away" in str(e.value) and "\n" not in str(e.value)


# -- the residual-restore message ----------------------------------------------------------


def test_residual_notice_takes_the_message_instead_of_the_user_warning(tmp_path, recwarn):
  """Checkpointer.restore(residual_notice=...): the message goes there (the loop's log line),
  not to a UserWarning; without it the UserWarning stays (the library's default)."""
  import optax  # noqa: PLC0415
  from mlp_task import init_mlp, mse  # noqa: PLC0415

  import jaxcoll  # noqa: PLC0415
  from jaxcoll.train import DataParallel, Trainer  # noqa: PLC0415
  from jaxcoll.train.checkpoint import Checkpointer  # noqa: PLC0415

  def trainer(n):
    t = Trainer(mse, optax.adam(3e-2), jaxcoll.devices.flat_mesh(n),
                DataParallel(compression="bf16"))
    return t, t.init(init_mlp())

  eight, state = trainer(8)  # saved with its (zero) residuals of 8 devices
  with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
    ckpt.save(1, eight, state, data_position=1)
    four, _ = trainer(4)
    said = []
    ckpt.restore(four, residual_notice=said.append)
    assert len(said) == 1 and "restart at zero" in said[0] and "8 there, 4 here" in said[0]
    assert not [w for w in recwarn if "restart at zero" in str(w.message)]
    with pytest.warns(UserWarning, match="restart at zero"):
      ckpt.restore(four)


@pytest.mark.slow  # ~20 s: two bf16 runs; fast cover: the Checkpointer-level test above
def test_the_residual_restart_is_one_log_line_not_a_python_warning(tmp_path, caplog, recwarn):
  """A compressed run resumed under another bucket plan: one warning log line says the
  residuals restart at zero (no UserWarning with its source line)."""
  import logging  # noqa: PLC0415

  config = _config(steps=3, checkpoint_every=3, compression="bf16")
  config.incidents.loss_spike = "warn"
  _train(config, tmp_path / "run")
  config.steps, config.bucket_bytes = 4, 4096
  with caplog.at_level(logging.WARNING):
    _train(config, tmp_path / "run")
  lines = [r.getMessage() for r in caplog.records if "restart at zero" in r.getMessage()]
  assert len(lines) == 1 and "\n" not in lines[0], lines
  assert "bucket" in lines[0] and "not bit-identical" in lines[0]
  assert not [w for w in recwarn if "restart at zero" in str(w.message)]


# -- for real: a 2-process job whose process 0 dies abruptly after a rollback ------------------

# Batch 12 spikes at step 12: rollback to checkpoint 10, skipping 11..12; process 0 exits
# abruptly (fail_at_step, os._exit) before step 17, which only the replay reaches, before the
# replay's first checkpoint (20).
FLAGS = ["--config=configs/default.py:smoke", "--config.steps=20", "--config.checkpoint_every=10",
         "--config.log_every=4", "--config.algorithm=ring", "--config.corrupt_batches=12:12",
         "--config.incidents.loss_spike=rollback", "--config.incidents.spike_min_steps=8"]


@pytest.mark.slow  # ~1-2 min: two 2-process jobs; fast cover: the in-process tests above
def test_2x4_job_killed_after_a_rollback_resumes_bit_identical(tmp_path):
  config = _config(steps=20, checkpoint_every=10, corrupt_batches="12:12")
  config.incidents.rollback_steps = 1
  whole = _train(config, tmp_path / "whole")
  workdir = tmp_path / "two"
  cmd = [sys.executable, "-m", "experiments.train", *FLAGS, f"--workdir={workdir}"]
  killed = jobs.launch(*cmd, "--config.fail_at_step=17")
  assert killed.returncode != 0, killed.stdout[-3000:] + killed.stderr[-3000:]
  assert _state(workdir)["rollbacks"][0]["checkpoint_restored"] == 10
  assert sorted(os.listdir(workdir / "checkpoints")) == ["10"]
  again = jobs.launch(*cmd)
  assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
  assert "rollback(s) recorded in incident_state.json" in again.stdout + again.stderr
  assert [r["rollback"] for r in incidents.read_log(str(workdir)) if r["action"] == "rollback"
          ] == [1]
  done = jobs.summary(workdir)
  assert done["num_processes"] == 2 and done["incidents"]["rollbacks"] == 1
  assert done["params_sha256"] == whole["params_sha256"]


def test_a_second_rollback_at_the_same_step_sets_aside_apart(tmp_path):
  """Two rollbacks at step 12 that each set aside a checkpoint 10: the second goes to
  incident_step_12.2 (before: moved inside the first one's 10/ directory)."""
  watch = _watch(tmp_path, grad_norm_spike="rollback", rollback_steps=3)
  ckpt = Checkpoints({5: {}, 10: {}})
  ckpt.directory = str(tmp_path / "checkpoints")
  aside = tmp_path / incidents.ROLLED_BACK_DIR
  for n in (1, 2):
    os.makedirs(os.path.join(ckpt.directory, "10"))
    (tmp_path / "checkpoints" / "10" / "which").write_text(str(n))
    watch._flag(12, "grad_norm_spike", 9.0, 2.0)
    assert _respond(watch, 12, ckpt=ckpt) == ("state 5", 5)
  assert sorted(os.listdir(aside)) == ["incident_step_12", "incident_step_12.2"]
  assert [(aside / d / "10" / "which").read_text() for d in sorted(os.listdir(aside))] == [
      "1", "2"]
  assert [d["set_aside_to"] for d in _state(tmp_path)["rollbacks"]] == [
      os.path.join(incidents.ROLLED_BACK_DIR, "incident_step_12"),
      os.path.join(incidents.ROLLED_BACK_DIR, "incident_step_12.2")]


# -- BatchNorm: an injection that raises a signal, and a rollback that restores the stats -----


def test_corrupt_scale_sets_the_injectors_input_scale():
  (hook,) = hooks_lib.from_config({"corrupt_batches": "3:4", "corrupt_scale": float("nan")})
  assert isinstance(hook, hooks_lib.CorruptBatches) and (hook.first, hook.last) == (3, 4)
  assert hook.scale != hook.scale  # nan
  (default,) = hooks_lib.from_config({"corrupt_batches": "3:4"})
  assert default.scale == 100.0


@pytest.mark.slow  # ~2-3 min: two ResNet runs; fast cover: the injector's scale above
def test_batchnorm_rollback_restores_the_batch_stats(tmp_path):
  """resnet_dp8:smoke normalizes x100 (and x-100) inputs away: no signal. NaN inputs
  (corrupt_scale=nan) make the step non-finite, batch statistics included
  (params["batch_stats"], in params_sha256); non_finite=rollback restores checkpoint 10 with
  its statistics and ends bit-identical to the run that skips the batches."""
  from configs import resnet_dp8  # noqa: PLC0415

  def config(**more):
    c = resnet_dp8.get_config("smoke")
    c.steps, c.checkpoint_every, c.log_every, c.algorithm = 16, 5, 4, "ring"
    for key, value in more.items():
      c[key] = value
    return c

  rolled = config(corrupt_batches="12:12", corrupt_scale=float("nan"))
  rolled.incidents.non_finite = "rollback"
  summary = _train(rolled, tmp_path / "rolled")
  (row,) = [r for r in incidents.read_log(str(tmp_path / "rolled")) if r["action"] == "rollback"]
  assert (row["signal"], row["checkpoint_restored"], row["batches_skipped"]) == (
      "non_finite", 10, [11, 12])
  replay = config()
  replay.data.skip = "11:12"
  assert _train(replay, tmp_path / "replay")["params_sha256"] == summary["params_sha256"]


# -- a skip response (the batch dropped, the state before the step kept) --------------------


def _skip_config():
  # Batch 12 corrupted in the first attempt only (a transient fault: a flipped bit, a bad
  # read): the loss spikes at step 12, answered by skip; killed before step 14, after the
  # skip and before checkpoint 15; the resume starts from checkpoint 10.
  config = _config()
  config.incidents.loss_spike = "skip"
  return config


@pytest.fixture(scope="module")
def skipped_whole(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("skip") / "run"
  bad = hooks_lib.CorruptBatches(12, 12)
  summary = _train(_skip_config(), workdir, bad)
  assert bad.corrupted == [12]
  rows = incidents.read_log(str(workdir))
  assert [(r["step"], r["signal"], r["action"]) for r in rows if r["action"] == "skip"] == [
      (12, "loss_spike", "skip")]
  return workdir, summary


def test_a_kill_after_a_skip_resumes_bit_identical_though_the_fault_was_transient(
    skipped_whole, tmp_path):
  """The skip is recorded (its step, batch and the values judged); the resumed run judges
  step 12 on those values again, skips it again although its batch is clean now, and ends
  with the uninterrupted run's params. Before: it trained on batch 12 (another sha256)."""
  whole, summary = skipped_whole
  workdir = tmp_path / "run"
  with pytest.raises(Killed):
    _train(_skip_config(), workdir, hooks_lib.CorruptBatches(12, 12), KillBefore(14))
  assert sorted(os.listdir(workdir / "checkpoints"), key=int)[-1] == "10"
  resumed = _train(_skip_config(), workdir)  # the fault is gone
  assert resumed["start_step"] == 10
  assert resumed["params_sha256"] == summary["params_sha256"]
  (skip,) = _state(workdir)["skips"]
  assert (skip["step"], skip["batch"], skip["signal"]) == (12, 12, "loss_spike")
  # Logged once (by the attempt that decided it), as in the uninterrupted run.
  assert [(r["step"], r["action"]) for r in incidents.read_log(str(workdir))
          if r["action"] == "skip"] == [(12, "skip")]
  assert resumed["incidents"]["by_action"] == summary["incidents"]["by_action"]


@pytest.mark.parametrize("response", ["skip", "rollback"])
def test_a_kill_between_the_detection_and_the_record_decides_again_the_same_way(
    response, uninterrupted, skipped_whole, tmp_path, monkeypatch):
  """Killed after the spike at step 12 was detected, before its decision was written: nothing
  is recorded; the resume from checkpoint 10 trains steps 11..12 again, detects the same
  spike (the bad batch is still bad; the detectors come back from checkpoint 10) and takes
  the same decision: one row in the log, the uninterrupted run's params."""
  whole, summary = uninterrupted if response == "rollback" else skipped_whole
  config = _config() if response == "rollback" else _skip_config()
  workdir = tmp_path / "run"
  with monkeypatch.context() as m:
    m.setattr(incidents.Watch, "_record", lambda *a, **k: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):
      _train(config, workdir, hooks_lib.CorruptBatches(12, 12))
  assert not os.path.exists(workdir / incidents.STATE_NAME)
  assert not os.path.exists(workdir / incidents.LOG_NAME)
  assert sorted(os.listdir(workdir / "checkpoints"), key=int) == ["5", "10"]
  resumed = _train(config, workdir, hooks_lib.CorruptBatches(12, 12))
  assert resumed["start_step"] == 10
  assert [(r["step"], r["signal"], r["action"]) for r in incidents.read_log(str(workdir))
          if r["action"] == response] == [(12, "loss_spike", response)]
  assert resumed["params_sha256"] == summary["params_sha256"]
