"""Incidents (issue 22): signals, responses, the incident log, data.skip, corrupt_batches."""

import json
import os
import sys

import ml_collections
import numpy as np
import pytest

import jobs
from incident_fakes import Checkpoints, Input

from jaxcoll.run import data_skip, incidents
from jaxcoll.run.config_error import ConfigError

SMOKE = "--config=configs/default.py:smoke"
# One-process runs are forked from a warm Python (jobs.train_forked: the same
# `python -m experiments.train`, argv and environment in a process of its own,
# ~2.5 CPU-s less each); the launched 2 x 4 jobs start real Pythons.
# A corrupted stretch at batches 25..27 of a 40-step run checkpointed every 5 steps: the
# loss spikes at step 25; rollback restores checkpoint 20 and skips batches 21..29.
CORRUPT = [SMOKE, "--config.steps=40", "--config.checkpoint_every=5", "--config.algorithm=ring",
           "--config.incidents.spike_min_steps=10", "--config.corrupt_batches=25:27"]
ROLLBACK = ["--config.incidents.loss_spike=rollback", "--config.incidents.skip_batches=4"]


def _log(workdir):
  return incidents.read_log(str(workdir))


def _read_jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


# -- data.skip ---------------------------------------------------------------------


def test_skip_schedule_maps_steps_past_the_ranges():
  s = data_skip.BatchSchedule(data_skip.parse_skip("3:4, 7:7"))
  assert [s.batch_number(n) for n in range(1, 8)] == [1, 2, 5, 6, 8, 9, 10]
  s.add(9, 12)  # touches nothing before step 5; merged with nothing
  assert [s.batch_number(n) for n in range(1, 8)] == [1, 2, 5, 6, 8, 13, 14]
  s.add(5, 6)  # adjacent to 3:4 and 7:7: one range 3..7
  assert s.ranges == [(3, 7), (9, 12)] and s.skipped == 9
  assert data_skip.format_skip(s.ranges) == "3:7,9:12"


@pytest.mark.parametrize("value, says", [
    ("5:3", "runs backwards; write it 3:5"),
    ("1:4,3:6", "overlap; merge them into 1:6"),
    ("0:2", "batches count from 1"),
    ("3-4", "give batch ranges A:B"),
    (7, "in one string"),
])
def test_bad_skip_ranges_name_the_fix(value, says):
  with pytest.raises(ConfigError, match="config.data.skip") as e:
    data_skip.parse_skip(value)
  assert says in str(e.value)


# -- the detectors -----------------------------------------------------------------


def test_robust_spike_flags_only_the_spike_and_keeps_it_out_of_the_window():
  rng = np.random.default_rng(0)
  spike = incidents.RobustSpike(z=12.0, window=100, min_steps=20, floor=0.1)
  series = 2.0 * np.exp(-np.arange(300) / 100) + 0.05 * rng.standard_normal(300)  # decays
  assert not any(spike.update(float(v))[0] for v in series)
  flagged, z, threshold = spike.update(50.0)
  assert flagged and z > 12 and threshold < 50
  assert 50.0 not in spike.values
  assert not spike.update(float(series[-1]))[0]


def _watch(tmp_path, **given):
  config = ml_collections.ConfigDict({"checkpoint_every": 5, "incidents": given})
  return incidents.Watch.from_config(config, str(tmp_path), is_chief=True)


def test_eval_regression_against_the_best_so_far(tmp_path):
  watch = _watch(tmp_path, eval_margin=0.1)
  for step, loss in ((10, 1.0), (20, 0.8), (30, 0.85)):  # 0.85 < 0.8 * 1.1: no incident
    watch.after_eval(step, {"eval_loss": loss})
  assert watch.pending == []
  watch.after_eval(40, {"eval_loss": 0.9})
  (got,) = watch.pending
  assert (got["signal"], got["step"], got["value"]) == ("eval_regression", 40, 0.9)
  assert got["threshold"] == pytest.approx(0.88) and got["best"] == 0.8


@pytest.mark.parametrize("metric, mode, direction", [
    ("eval_loss", "auto", "min"), ("eval_perplexity", "auto", "min"),
    ("eval_error", "auto", "min"), ("eval_accuracy", "auto", "max"),
    ("eval_masked_accuracy", "auto", "max"), ("eval_f1", "auto", "max"),
    ("eval_auc", "auto", "max"), ("eval_score", "max", "max"), ("eval_auc", "min", "min"),
])
def test_eval_regression_goes_the_way_the_metric_improves(tmp_path, metric, mode, direction):
  """An AUC that rose from 0.5 to 0.7 was an eval regression (lower was better for every name
  without "acc"); eval_mode says the way, auto reads it from the name."""
  watch = _watch(tmp_path, eval_metric=metric, eval_mode=mode, eval_margin=0.1)
  better, worse = (0.5, 0.7) if direction == "min" else (0.7, 0.5)
  for step, value in ((10, 0.6), (20, better)):
    watch.after_eval(step, {metric: value})
  assert watch.pending == []
  watch.after_eval(30, {metric: worse})
  (got,) = watch.pending
  assert (got["step"], got["best"], got["mode"]) == (30, better, direction)
  assert got["threshold"] == pytest.approx(0.55 if direction == "min" else 0.63)
  sign = ">" if direction == "min" else "<"  # an accuracy below its threshold was "0.5 > 0.63"
  assert f"eval_regression {worse:g} {sign} threshold" in incidents.describe(watch._row(got))


@pytest.mark.parametrize("mode", ["min", "max"])
def test_a_non_finite_eval_is_a_regression_and_never_the_best(tmp_path, mode):
  """A NaN eval compared False both ways: never flagged, and as the first eval it became the
  best, after which no regression was ever flagged again."""
  watch = _watch(tmp_path, eval_mode=mode, eval_margin=0.1)
  good, bad = (1.0, 5.0) if mode == "min" else (1.0, 0.2)
  for step, value in ((10, float("nan")), (20, good), (30, float("inf")), (40, bad)):
    watch.after_eval(step, {"eval_loss": value})
  assert [(p["step"], p["value"], p["threshold"]) for p in watch.pending] == [
      (10, "nan", "finite"), (30, "inf", pytest.approx(1.1 if mode == "min" else 0.9)),
      (40, bad, pytest.approx(1.1 if mode == "min" else 0.9))]
  assert incidents.describe(watch._row(watch.pending[0])).startswith(
      "incident at step 10: eval_regression nan; warn")


def test_an_eval_metric_whose_name_says_no_direction_asks_for_eval_mode(tmp_path):
  with pytest.raises(ConfigError) as e:
    _watch(tmp_path, eval_metric="eval_bleuish")
  assert str(e.value).startswith("`config.incidents.eval_mode`='auto': cannot tell")
  assert "--config.incidents.eval_mode=min" in str(e.value)
  with pytest.raises(ConfigError, match="use min .*, max .* or auto"):
    _watch(tmp_path, eval_mode="lower")
  _watch(tmp_path, eval_metric="eval_bleuish", eval_regression="off")  # not watched: no need


def test_a_resume_watching_another_eval_metric_starts_its_best_afresh(tmp_path, caplog):
  """Checkpoint saved watching eval_loss (best 0.2), resumed watching eval_accuracy: the
  accuracy 0.3 was judged against the loss's best (flagged as a regression below 0.2 x 0.75);
  now the best starts afresh, said once."""
  first = _watch(tmp_path)
  first.after_eval(5, {"eval_loss": 0.2})
  extra = {"incident_detectors": first.checkpoint_extra(5)["incident_detectors"],
           "config": {"incidents": {"eval_metric": "eval_loss"}}}
  resumed = _watch(tmp_path, eval_metric="eval_accuracy")
  with caplog.at_level("WARNING"):
    resumed.restore(extra)
    resumed._rewind(5, extra)  # a rollback to a checkpoint of the run before: the same
  resumed.after_eval(10, {"eval_accuracy": 0.3})
  resumed.after_eval(15, {"eval_accuracy": 0.4})
  assert resumed.pending == []
  said = [r.getMessage() for r in caplog.records if "starts afresh" in r.getMessage()]
  assert len(said) == 1 and "eval_loss (min)" in said[0] and "eval_accuracy (max)" in said[0]
  same = _watch(tmp_path)  # the same metric: the best is kept
  same.restore(extra)
  same.after_eval(10, {"eval_loss": 0.3})
  assert [p["best"] for p in same.pending] == [0.2]
  old = {"incident_detectors": {"best_eval": 0.2}, "config": {"incidents": {}}}  # before
  older = _watch(tmp_path, eval_metric="eval_accuracy")  # ...best_eval_metric was kept
  older.restore(old)
  older.after_eval(10, {"eval_accuracy": 0.3})
  assert older.pending == []


def test_an_eval_metric_the_evaluation_lacks_is_bad_input_before_training(tmp_path):
  """--config.incidents.eval_metric=eval_acc (a typo) watched nothing, silently, for the whole
  run; now exit 2 in one line naming what the evaluation reports, nothing written."""
  workdir = tmp_path / "run"
  out = jobs.train_forked(SMOKE, "--config.eval_every=2", "--config.incidents.eval_metric=eval_acc",
                          f"--workdir={workdir}")
  line = jobs.one_line(out, 2, "train: error: `config.incidents.eval_metric`='eval_acc'")
  assert "reports eval_accuracy, eval_loss" in line
  assert "--config.incidents.eval_metric=eval_accuracy" in line
  assert not workdir.exists()
  with pytest.raises(ConfigError, match="eval_regression=off"):
    incidents.Watch.from_config({"incidents": {"eval_metric": "eval_acc"}}, str(tmp_path),
                                is_chief=True, eval_metrics=("eval_loss", "eval_accuracy"))
  incidents.Watch.from_config({"incidents": {"eval_metric": "eval_acc", "eval_mode": "max",
                                             "eval_regression": "off"}}, str(tmp_path),
                              is_chief=True, eval_metrics=("eval_loss",))


def test_the_default_eval_metric_an_eval_fn_lacks_is_said_not_refused(tmp_path, caplog):
  """An eval_fn of the user's that reports no loss: the default eval_metric (eval_loss) is not
  theirs to have named wrong; one warning says the signal watches nothing, and the run goes."""
  with caplog.at_level("WARNING"):
    incidents.Watch.from_config({}, str(tmp_path), is_chief=True,
                                eval_metrics=("eval_accuracy",))
  (said,) = [r.getMessage() for r in caplog.records]
  assert said.startswith("incidents: eval_regression watches nothing: `config.incidents."
                         "eval_metric`='eval_loss' (the default); the evaluation reports "
                         "eval_accuracy; name one of them, e.g. "
                         "--config.incidents.eval_metric=eval_accuracy")


def test_throughput_regression_once_per_episode(tmp_path):
  watch = _watch(tmp_path, throughput_factor=2.0, throughput_rows=3,
                 throughput_min_excess_s=0.02)
  times = [0.5, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.3, 0.3, 0.3, 0.3, 0.1, 0.1, 0.1]
  flagged = []
  for i, t in enumerate(times):
    watch.after_row(10 * (i + 1), {"step_time_s": t})
    flagged += [p["step"] for p in watch.pending]
    watch.pending = []
  assert flagged == [90]  # the median of the last 3 rows passes 2 x 0.1 at row 9, once
  tiny = _watch(tmp_path, throughput_factor=2.0, throughput_rows=3)
  for i, t in enumerate(times):  # 10 ms steps that take 30: below 50 ms more, a host's noise
    tiny.after_row(10 * (i + 1), {"step_time_s": t / 10})
  assert tiny.pending == []


def test_non_finite_and_straggler_signals(tmp_path):
  watch = _watch(tmp_path)
  for step in (3, 4, 5):  # one episode of `warn`: one incident
    watch.after_step(step, {"loss": float("nan"), "grad_norm": 1.0})
  assert watch.flagged_steps == {3, 4, 5}
  from jaxcoll.run import timing  # noqa: PLC0415

  rule = timing.StragglerDetector(factor=1.5, steps=3)
  reports = [m for step in (10, 20, 30) for m in rule.update(step, [0.1, 0.3])]
  watch.straggler_warning(None)(*reports)
  assert [(p["signal"], p["step"], p["processes"]) for p in watch.pending] == [
      ("non_finite", 3, "all"), ("straggler", 30, [1])]


def test_the_straggler_incident_carries_the_rules_ratio_and_factor(tmp_path):
  """The incident read the ratio back from the warning's text (rounded: 1.54x as 1.5, not
  over a factor of 1.5) and recorded no threshold; now the rule's own figures."""
  from jaxcoll.run import timing  # noqa: PLC0415

  watch = _watch(tmp_path)
  seen = []
  timer = timing.StepTimer(clock=iter([0.0] * 16).__next__, gather=lambda own: [0.1, 0.154],
                           straggler=timing.StragglerDetector(factor=1.5, steps=2),
                           warn=watch.straggler_warning(seen.append))
  for step in (10, 20, 30):
    timer.start_data(), timer.start_step(), timer.dispatched(), timer.end_step()
    timer.row(global_batch=8, step=step)
  (got,) = watch.pending
  assert (got["step"], got["value"], got["threshold"], got["rows"], got["processes"]) == (
      20, pytest.approx(1.54), 1.5, 2, [1])
  assert "1.5x the median 0.100 s" in seen[0] and type(seen[0]) is str
  assert "straggler 1.54 > threshold 1.5" in incidents.describe(watch._row(got))


@pytest.mark.parametrize("given, says", [
    ({"spike_z": 0.0}, "incidents.spike_z"),
    ({"eval_margin": -1}, "incidents.eval_margin"),
    ({"throughput_factor": 1.0}, "incidents.throughput_factor"),
    ({"loss_spikes": "warn"}, "unknown signal or setting"),
    ({"loss_spike": "rewind"}, "valid responses: off, warn, skip, rollback, stop"),
    ({"eval_regression": "skip"}, "`skip` drops one batch"),
])
def test_bad_incident_settings(given, says):
  config = ml_collections.ConfigDict({"checkpoint_every": 5, "incidents": given})
  with pytest.raises(ConfigError, match="config.incidents") as e:
    incidents.settings_from_config(config)
  assert says in str(e.value)


def test_rollback_without_checkpoints_is_refused():
  config = ml_collections.ConfigDict({"checkpoint_every": 0,
                                      "incidents": {"grad_norm_spike": "rollback"}})
  with pytest.raises(ConfigError, match="checkpoint_every is 0"):
    incidents.settings_from_config(config)


# -- through the command line --------------------------------------------------------


@pytest.mark.parametrize("flag, says", [
    ("--config.incidents.spike_z=0", "`config.incidents.spike_z`=0"),
    ("--config.data.skip=9:5", "`config.data.skip`='9:5'"),
    # Slow: the library's checks of the same values are in the default run (above).
    pytest.param("--config.data.skip=1:4,3:6", "overlap", marks=pytest.mark.slow),
    pytest.param("--config.incidents.loss_spike=retry", "valid responses",
                 marks=pytest.mark.slow),
    pytest.param("--config.checkpoint_every=0", "checkpoint_every is 0", marks=pytest.mark.slow),
])
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, flag, says):
  workdir = tmp_path / "run"
  out = jobs.train_forked(SMOKE, "--config.incidents.loss_spike=rollback", flag,
                          f"--workdir={workdir}")
  assert out.returncode == 2, out.stderr[-2000:]
  lines = [x for x in out.stderr.splitlines() if x.strip()]
  assert len(lines) == 1 and says in lines[0], lines
  assert not workdir.exists()


def test_unknown_signal_on_the_command_line_is_bad_input(tmp_path):
  out = jobs.train_forked(SMOKE, "--config.incidents.loss_spikes=warn",
                          f"--workdir={tmp_path / 'r'}")
  assert out.returncode == 2 and "loss_spikes" in out.stderr, out.stderr[-2000:]
  assert "Traceback" not in out.stderr and not (tmp_path / "r").exists()


@pytest.fixture(scope="module")
def rolled_back(tmp_path_factory):
  """A corrupted 1 x 8 run answered by rollback: (workdir, output)."""
  workdir = tmp_path_factory.mktemp("rollback") / "run"
  # Logged every 8 steps, saved every 10 (defer_reads=auto: on): steps wait to be judged at
  # the next logged or saved step. The spike at step 25 is judged at the save step 30, before
  # the save; the second one (step 21 after the rollback trains on batch 26) at step 24.
  flags = [f for f in CORRUPT if not f.startswith("--config.checkpoint_every=")]
  out = jobs.train_forked(*flags, *ROLLBACK, "--config.log_every=8",
                          "--config.checkpoint_every=10",
                          f"--workdir={workdir}")
  assert out.returncode == 0, out.stderr[-3000:]
  return workdir, out


def test_rollback_ends_bit_identical_to_a_run_that_skips_the_logged_batches(rolled_back,
                                                                           tmp_path):
  workdir, out = rolled_back
  log = _log(workdir)
  rollbacks = [r for r in log if r["action"] == "rollback"]
  # The spike at step 25 rolls back to checkpoint 20 and skips 21..25; the corrupted batch 26
  # spikes again (at step 21) and its rollback skips 26..29 (skip_batches=4 from batch 26).
  assert [(r["step"], r["signal"], r["checkpoint_restored"], r["batches_skipped"])
          for r in rollbacks] == [(25, "loss_spike", 20, [21, 25]), (21, "loss_spike", 20, [26, 29])]
  # Judged late (the same decisions as at once); step 30 judged before its save (no
  # checkpoint 30 to set aside).
  assert [(r["judged_at_step"], r["checkpoints_set_aside"]) for r in rollbacks] == [
      (30, []), (24, [])]
  assert "rolled back to checkpoint 20, skipping batches 21..25" in out.stderr
  skip = data_skip.format_skip(data_skip.BatchSchedule(r["batches_skipped"] for r in rollbacks)
                               .ranges)
  assert skip == "21:29"
  replay = jobs.train_forked(*CORRUPT[:4], f"--config.data.skip={skip}",
                             f"--workdir={tmp_path / 'r'}")
  assert replay.returncode == 0, replay.stderr[-3000:]
  assert jobs.summary(tmp_path / "r")["params_sha256"] == jobs.summary(workdir)["params_sha256"]
  assert not (tmp_path / "r" / incidents.LOG_NAME).exists()  # a clean run: no incident


def test_rollback_summary_and_tensorboard_markers(rolled_back):
  workdir, _ = rolled_back
  counts = jobs.summary(workdir)["incidents"]
  assert counts["rollbacks"] == 2 and counts["by_signal"]["loss_spike"] == 2
  with open(workdir / "metrics.jsonl") as f:
    rows = [json.loads(x) for x in f]
  assert [r["step"] for r in rows if "incident/loss_spike" in r] == [25, 21]
  from jaxcoll.observe import run_report  # noqa: PLC0415

  run = run_report.load_run(str(workdir))
  assert [(r["step"], r["action"]) for r in run.incidents if r["signal"] == "loss_spike"] == [
      (25, "rollback"), (21, "rollback")]
  assert "incidents: 4 (loss_spike rollback at 25, grad_norm_spike warn at 25," in (
      run_report.summarize(run))


def test_rollback_marks_the_abandoned_rows_and_the_report_plots_the_kept_steps(rolled_back):
  """metrics.jsonl keeps the rows of the steps a rollback abandoned, marked; the report and
  TensorBoard show the trajectory the run went on with (no zigzag)."""
  workdir, _ = rolled_back
  rows = [r for r in _read_jsonl(workdir / "metrics.jsonl") if "loss" in r]
  abandoned = [(r["step"], r["abandoned_by_rollback"]) for r in rows if r.get("abandoned")]
  # Logged every 8 steps: 24 before the spike at 25 (judged at 30); then step 21's spike,
  # judged at step 24, after row 24 was logged.
  assert abandoned == [(24, 1), (24, 2)]
  kept = [r["step"] for r in rows if not r.get("abandoned")]
  assert kept == list(range(8, 41, 8))  # one row a logged step: the kept trajectory
  from jaxcoll.observe import run_report  # noqa: PLC0415

  run = run_report.load_run(str(workdir))
  assert [r["step"] for r in run.train] == kept
  assert sorted(r["step"] for r in run.abandoned) == [24, 24]  # 30 was never saved
  assert "abandoned rows: 2 (steps after the checkpoint of rollback 1, 2," in (
      run_report.summarize(run))
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "observe"))
  from test_run_report import read_run  # noqa: PLC0415

  events = read_run(workdir / "tensorboard")
  starts = [e.step for _, e in events
            if e.HasField("session_log") and e.session_log.status == e.session_log.START]
  assert starts == [21, 21]  # TensorBoard's purge of the abandoned steps, once per rollback
  marker = [i for i, (_, e) in enumerate(events)
            if any(v.tag == "incident/loss_spike" and e.step == 25 for v in e.summary.value)]
  assert marker and marker[-1] > [i for i, (_, e) in enumerate(events)
                                  if e.HasField("session_log")][-1]  # kept past the purge


def _feed(watch, losses, *, first=1, judged=(), grads=None):
  """after_step for each loss from step ``first``; at once only at the steps in ``judged``."""
  for step, loss in enumerate(losses, start=first):
    grad = 1.0 if grads is None else grads[step - first]
    watch.after_step(step, {"loss": loss, "grad_norm": grad}, batch=100 + step,
                     defer=step not in judged)


def test_waiting_steps_are_judged_at_the_next_judged_step_in_order(tmp_path):
  watch = _watch(tmp_path, spike_min_steps=3)  # warn; defer_reads=auto: on (CPU included)
  assert watch.defers
  _feed(watch, [1.0, 1.01, 0.99, 50.0], grads=[1.0, 2.0, 3.0, 4.0])
  assert watch.pending == [] and list(watch._loss.values) == []  # nothing read yet
  _feed(watch, [1.02], first=5, judged={5}, grads=[5.0])  # a logged step: steps 1..5, in order
  assert list(watch._grad.values) == [1.0, 2.0, 3.0, 4.0, 5.0]
  assert list(watch._loss.values) == [1.0, 1.01, 0.99, 1.02]  # the spike kept out
  assert [(p["step"], p["signal"], p["batch"]) for p in watch.pending] == [(4, "loss_spike", 104)]
  _respond(watch, 5, Input())
  (row,) = incidents.read_log(str(tmp_path))
  assert (row["step"], row["judged_at_step"], row["action"]) == (4, 5, "warn")
  off = _watch(tmp_path / "off", spike_min_steps=3, defer_reads="off")
  _feed(off, [1.0, 1.01])
  assert not off.defers and list(off._loss.values) == [1.0, 1.01]  # at once, every step
  assert not _watch(tmp_path, loss_spike="skip", defer_reads="on").defers  # skip: at once
  with pytest.raises(ConfigError, match="incidents.defer_reads"):
    _watch(tmp_path, defer_reads="maybe")


def test_a_rollback_abandons_the_waiting_steps_after_the_incident(tmp_path):
  """A spike at step 12, judged at step 15: steps 13..15 are never judged (the rollback
  abandons them, as judging at once would never have run them); it restarts from step 12's
  target (checkpoint 10), skipping batches 11..12 as an answer at step 12 would."""
  watch = _watch(tmp_path, loss_spike="rollback", spike_min_steps=3)
  _feed(watch, [1.0] * 11 + [50.0, 60.0, 70.0], grads=[float(g) for g in range(1, 15)])
  _feed(watch, [80.0], first=15, judged={15}, grads=[15.0])
  assert [p["step"] for p in watch.pending] == [12]
  assert list(watch._grad.values) == [float(g) for g in range(1, 13)]  # not 13..15
  assert 60.0 not in watch._loss.values and watch._waiting == []
  inputs = Input()
  assert _respond(watch, 15, inputs) == ("state 10", 10)
  (row,) = incidents.read_log(str(tmp_path))
  assert (row["step"], row["judged_at_step"], row["checkpoint_restored"],
          row["batches_skipped"]) == (12, 15, 10, [11, 12])
  assert inputs.schedule.ranges == [(11, 12)]


def test_a_flush_on_a_stop_signal_judges_the_waiting_steps_before_a_row_incident(tmp_path):
  """A stop signal at step 12 (not a judged step): its row's throughput incident is pending
  when the loop flushes; the waiting spike at step 11 is judged anyway, and answered first."""
  watch = _watch(tmp_path, loss_spike="rollback", throughput_regression="rollback",
                 spike_min_steps=3)
  _feed(watch, [1.0] * 10, judged={10})
  _feed(watch, [50.0, 1.0], first=11)
  watch._flag(12, "throughput_regression", 9.0, 3.0)
  watch.flush()
  assert [p["step"] for p in watch.pending] == [12, 11]  # step 12's loss: abandoned
  assert _respond(watch, 12, Input()) == ("state 10", 10)
  rows = incidents.read_log(str(tmp_path))
  assert [(r["step"], r["signal"], r["action"], r["checkpoint_restored"], r.get("answered_with"))
          for r in rows] == [(12, "throughput_regression", "rollback", None, "loss_spike"),
                             (11, "loss_spike", "rollback", 10, None)]
  assert "answered by the loss_spike incident's response" in incidents.describe(rows[0])
  assert watch.summary()["incidents"]["rollbacks"] == 1  # one rollback, two rows


def test_two_rollback_signals_at_one_step_make_one_rollback(tmp_path):
  """A corrupted batch spikes the loss and the gradient norm, both answered by rollback: one
  rollback; the second row names the first's response (it crashed the console line)."""
  watch = _watch(tmp_path, loss_spike="rollback", grad_norm_spike="rollback")
  watch._flag(12, "loss_spike", 9.0, 2.0)
  watch._flag(12, "grad_norm_spike", 90.0, 2.0)
  assert _respond(watch, 12, Input()) == ("state 10", 10)
  rows = incidents.read_log(str(tmp_path))
  assert [(r["signal"], r["checkpoint_restored"], r.get("answered_with")) for r in rows] == [
      ("loss_spike", 10, None), ("grad_norm_spike", None, "loss_spike")]
  assert watch.summary()["incidents"]["rollbacks"] == 1 and watch.rollbacks == 1


def test_a_deferred_stop_names_the_steps_its_final_checkpoint_holds(tmp_path):
  watch = _watch(tmp_path, grad_norm_spike="stop", spike_min_steps=3)
  _feed(watch, [1.0] * 7, grads=[1.0, 1.0, 1.0, 1.0, 90.0, 1.0, 1.0], judged={7})
  _respond(watch, 7, Input())
  assert watch.stopping["step"] == 5 and watch.stopping["stopped_after_step"] == 7
  message = str(watch.stop_error(7, saved=True))
  assert "the incident is step 5's, judged at step 7" in message
  assert "the final checkpoint is step 7's, steps 6..7 included" in message
  assert "included" not in str(watch.stop_error(7, saved=False))


def test_at_most_wait_max_minus_1_steps_wait(tmp_path):
  """A log_every larger than WAIT_MAX: the WAIT_MAX-th waiting step is judged with the others."""
  watch = _watch(tmp_path, spike_min_steps=3)
  n = incidents.WAIT_MAX
  _feed(watch, [1.0] * (n - 1))
  assert len(watch._waiting) == n - 1 and not watch._loss.values
  _feed(watch, [1.0], first=n)  # defer=True, but the cap judges it and the waiting ones
  assert watch._waiting == [] and len(watch._loss.values) == n


def test_waiting_jax_arrays_are_read_from_one_device(tmp_path):
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  watch = _watch(tmp_path, spike_min_steps=3, defer_reads="on")
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  for step in (1, 2, 3):
    metrics = {k: jax.device_put(jnp.float32(v * step), replicated)
               for k, v in (("loss", 0.5), ("grad_norm", 2.0))}
    watch.after_step(step, metrics, defer=step < 3)
  assert list(watch._loss.values) == [0.5, 1.0, 1.5]
  assert list(watch._grad.values) == [2.0, 4.0, 6.0]
  assert incidents.judged_at_once(5, steps=9, log_every=5) and not incidents.judged_at_once(
      4, steps=9, log_every=5, checkpoint_every=3)


# An eval that really regresses: batches 16..22 corrupted (x100 inputs, shuffled labels) make
# the eval loss after step 20 worse than the best (step 15's) by more than eval_margin.
EVAL_REGRESSES = [SMOKE, "--config.steps=30", "--config.checkpoint_every=5",
                  "--config.eval_every=5", "--config.algorithm=ring",
                  "--config.incidents.loss_spike=off", "--config.incidents.grad_norm_spike=off",
                  "--config.incidents.eval_margin=0.02"]


def test_eval_regression_rollback_end_to_end(tmp_path):
  workdir = tmp_path / "run"
  out = jobs.train_forked(*EVAL_REGRESSES, "--config.corrupt_batches=16:22",
                          "--config.incidents.eval_regression=rollback",
                          "--config.incidents.skip_batches=7", f"--workdir={workdir}")
  assert out.returncode == 0, out.stderr[-3000:]
  (row,) = _log(workdir)
  assert (row["step"], row["signal"], row["action"], row["checkpoint_restored"],
          row["batches_skipped"], row["checkpoints_set_aside"]) == (
      20, "eval_regression", "rollback", 15, [16, 22], [20])
  assert row["value"] > row["threshold"] == pytest.approx(row["best"] * 1.02)
  assert "eval_regression" in out.stderr and "rolled back to checkpoint 15" in out.stderr
  assert jobs.summary(workdir)["incidents"]["by_signal"] == {"eval_regression": 1}
  evals = [r for r in _read_jsonl(workdir / "metrics.jsonl") if "eval_loss" in r]
  assert [(r["step"], bool(r.get("abandoned"))) for r in evals] == [
      (5, False), (10, False), (15, False), (20, True), (20, False), (25, False), (30, False)]
  kept = [r["eval_loss"] for r in evals if not r.get("abandoned")]
  assert kept[3] < kept[2]  # past the bad stretch the eval improves again
  # The replayed steps' lines no longer carry the abandoned eval of step 20.
  replayed = out.stderr.split("rolled back to checkpoint 15")[1].split("step 20/30 eval_")[0]
  assert "step 16/30" in replayed and "(eval at step 20)" not in replayed, replayed
  assert "(eval at step 15)" in replayed


@pytest.mark.slow  # ~40 s; fast cover: test_eval_regression_rollback_end_to_end
def test_eval_regression_rollback_equals_a_run_that_skips_the_batches(tmp_path):
  out = jobs.train_forked(*EVAL_REGRESSES, "--config.corrupt_batches=16:22",
                          "--config.incidents.eval_regression=rollback",
                          "--config.incidents.skip_batches=7", f"--workdir={tmp_path / 'a'}")
  assert out.returncode == 0, out.stderr[-3000:]
  ref = jobs.train_forked(*EVAL_REGRESSES, "--config.data.skip=16:22",
                          f"--workdir={tmp_path / 'b'}")
  assert ref.returncode == 0, ref.stderr[-3000:]
  assert (jobs.summary(tmp_path / "a")["params_sha256"]
          == jobs.summary(tmp_path / "b")["params_sha256"])


@pytest.mark.slow  # ~25 s
@pytest.mark.parametrize("action", ["warn", "stop"])
def test_eval_regression_warn_and_stop_end_to_end(tmp_path, action):
  workdir = tmp_path / "run"
  out = jobs.train_forked(*EVAL_REGRESSES, "--config.corrupt_batches=16:22",
                          f"--config.incidents.eval_regression={action}", f"--workdir={workdir}")
  assert out.returncode == (0 if action == "warn" else incidents.EXIT_INCIDENT_STOP), (
      out.stderr[-3000:])
  first = _log(workdir)[0]
  assert (first["step"], first["signal"], first["action"]) == (20, "eval_regression", action)
  if action == "stop":  # the final checkpoint is step 20's, saved before its eval
    assert "stopped by incident eval_regression at step 20" in out.stderr
    assert os.path.isdir(os.path.join(workdir, "checkpoints", "20"))
    assert jobs.summary(workdir)["incidents"]["by_action"] == {"stop": 1}


def test_data_skip_with_allow_changed_files_is_bad_input(tmp_path):
  out = jobs.train_forked(SMOKE, "--config.data.train=/nonexistent/train-*.parquet",
                          "--config.data.skip=2:3", "--config.data.allow_changed_files=True",
                          f"--workdir={tmp_path / 'r'}")
  assert out.returncode == 2 and "config.data.skip" in out.stderr, out.stderr[-2000:]
  assert "allow_changed_files" in out.stderr and "Traceback" not in out.stderr
  assert not (tmp_path / "r").exists()


# Slow (~45 s): the default run has the 1 x 8 defining test above, and 1 x 8 == 2 x 4 training
# (test_experiments' test_two_processes_match_one_process).
@pytest.mark.slow
def test_rollback_2x4_processes_agree_with_1x8(rolled_back, tmp_path):
  workdir, _ = rolled_back
  two = jobs.launch(sys.executable, "-m", "experiments.train", *CORRUPT, *ROLLBACK,
                    f"--workdir={tmp_path / 'two'}")
  assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
  a, b = jobs.summary(workdir), jobs.summary(tmp_path / "two")
  assert (a["num_processes"], b["num_processes"]) == (1, 2)
  assert a["params_sha256"] == b["params_sha256"]
  assert [(r["step"], r["batches_skipped"], r["processes"]) for r in _log(tmp_path / "two")
          if r["action"] == "rollback"] == [(25, [21, 25], [0, 1]), (21, [26, 29], [0, 1])]


@pytest.mark.slow  # ~30 s; fast cover: the skip path of Watch.respond (test_respond_skip...)
def test_skip_response_keeps_the_state_before_the_step(tmp_path):
  """Skipping batch 25 at step 25 == a run one step shorter with data.skip=25:25."""
  one = [SMOKE, "--config.algorithm=ring", "--config.incidents.spike_min_steps=10",
         "--config.checkpoint_every=0"]
  out = jobs.train_forked(*one, "--config.steps=30", "--config.corrupt_batches=25:25",
                          "--config.incidents.loss_spike=skip", f"--workdir={tmp_path / 'a'}")
  assert out.returncode == 0, out.stderr[-3000:]
  (row, *_) = [r for r in _log(tmp_path / "a") if r["signal"] == "loss_spike"]
  assert (row["step"], row["action"], row["batches_skipped"]) == (25, "skip", [25, 25])
  ref = jobs.train_forked(*one, "--config.steps=29", "--config.data.skip=25:25",
                          f"--workdir={tmp_path / 'b'}")
  assert ref.returncode == 0, ref.stderr[-3000:]
  assert (jobs.summary(tmp_path / "a")["params_sha256"]
          == jobs.summary(tmp_path / "b")["params_sha256"])


def test_stop_response_exit_5_marked_checkpoint_and_the_log_survives_a_resume(tmp_path):
  workdir = tmp_path / "run"
  flags = [*CORRUPT, "--config.incidents.grad_norm_spike=stop", f"--workdir={workdir}"]
  out = jobs.train_forked(*flags)
  assert out.returncode == incidents.EXIT_INCIDENT_STOP, out.stderr[-3000:]
  assert "stopped by incident grad_norm_spike at step 25" in out.stderr
  meta = os.path.join(workdir, "checkpoints", "25", "meta", "metadata")
  with open(meta) as f:
    assert json.load(f)["extra"]["incident_window"] is True
  before = _log(workdir)
  assert [(r["step"], r["signal"], r["action"]) for r in before] == [
      (25, "loss_spike", "warn"), (25, "grad_norm_spike", "stop")]
  summary = jobs.summary(workdir)  # a stopped run's counts too, at the top and in its attempt
  assert summary["incidents"]["by_action"] == {"warn": 1, "stop": 1}
  assert summary["attempts"][-1]["status"] == "stopped"
  assert summary["attempts"][-1]["incidents"]["total"] == 2
  # Resumed from checkpoint 25 (the user's decision): the next corrupted batch stops it again;
  # the log keeps the first attempt's incidents.
  again = jobs.train_forked(*flags)
  assert again.returncode == incidents.EXIT_INCIDENT_STOP, again.stderr[-3000:]
  after = _log(workdir)
  assert after[:2] == before and after[-1]["step"] == 26
  assert after[-1]["attempt_start_step"] == 25
  assert jobs.summary(workdir)["incidents"]["total"] == len(after)


@pytest.mark.slow  # ~15 s; fast cover: test_max_rollbacks_budget_turns_rollback_into_stop
def test_max_rollbacks_then_stop(tmp_path):
  out = jobs.train_forked(*CORRUPT, "--config.incidents.loss_spike=rollback",
                          "--config.incidents.max_rollbacks=1", f"--workdir={tmp_path / 'run'}")
  assert out.returncode == incidents.EXIT_INCIDENT_STOP, out.stderr[-3000:]
  actions = [(r["step"], r["action"], r.get("why")) for r in _log(tmp_path / "run")
             if r["signal"] == "loss_spike"]
  assert actions == [(25, "rollback", None), (21, "stop", "max_rollbacks (1) reached")]


def test_clean_default_run_has_no_incident(tmp_path):
  """No false alarm with the default thresholds over 100 steps of the default model."""
  out = jobs.train_forked(SMOKE, "--config.steps=100", "--config.checkpoint_every=0",
                          f"--workdir={tmp_path / 'run'}")
  assert out.returncode == 0, out.stderr[-3000:]
  assert not (tmp_path / "run" / incidents.LOG_NAME).exists()
  assert jobs.summary(tmp_path / "run")["incidents"]["total"] == 0


@pytest.mark.parametrize("shard_by", ["record", "file"])
def test_data_skip_on_files_trains_on_the_batches_after_the_range(tmp_path, shard_by):
  """Step n of a run with data.skip=2:3 gets the batch step n+2 of a run without (n >= 2)."""
  import jax  # noqa: PLC0415

  from configs import default  # noqa: PLC0415
  from jaxcoll.data import sources  # noqa: PLC0415
  from jaxcoll.run import inputs, loop  # noqa: PLC0415

  config = default.get_config("smoke")
  workload = inputs.make_workload(config)
  rows = workload.dataset.examples(np.arange(64))
  sources.write_shards(rows, str(tmp_path), num_shards=2, prefix="train")
  config.data.train = str(tmp_path / "train-*.parquet")
  config.data.shard_by = shard_by
  mesh, axis = loop.build_mesh(config)
  plain = inputs.TrainInput(config, workload, mesh, axis)
  plain.restore(0, None)
  want = [jax.device_get(plain.batch(step)) for step in range(6)]
  config.data.skip = "2:3"
  skipping = inputs.TrainInput(config, workload, mesh, axis)
  skipping.restore(0, None)
  got = [jax.device_get(skipping.batch(step)) for step in range(4)]
  for step, index in enumerate([0, 3, 4, 5]):  # batches 1, 4, 5, 6 (0-based 0, 3, 4, 5)
    for key in want[index]:
      np.testing.assert_array_equal(got[step][key], want[index][key])
  # A rollback adds a range on the fly; the checkpoint's extra carries it to a resume.
  skipping.skip(6, 6)
  assert skipping.state()["data_skipped_by_incidents"] == [[6, 6]]
  resumed = inputs.TrainInput(config, workload, mesh, axis)
  resumed.restore(2, {"data_skipped_by_incidents": [[6, 6]]})
  assert [resumed.batch_number(n) for n in (3, 4)] == [5, 7]


def _respond(watch, step, inputs, kept=None):
  return watch.respond(step, f"state after {step}", kept, ckpt=Checkpoints(), trainer=None,
                       train_input=inputs, init=lambda: "initial state")


def test_respond_skip_keeps_the_state_before_the_step(tmp_path):
  watch = _watch(tmp_path, loss_spike="skip", spike_min_steps=3)
  assert watch.keeps
  for step, loss in enumerate([1.0, 1.0, 1.0, 50.0], start=1):
    watch.after_step(step, {"loss": loss, "grad_norm": 1.0}, batch=step)
  state, restart = _respond(watch, 4, Input(), kept="state before 4")
  assert (state, restart) == ("state before 4", None)
  (row,) = incidents.read_log(str(tmp_path))
  assert (row["signal"], row["action"], row["batches_skipped"]) == ("loss_spike", "skip", [4, 4])


def test_a_checkpoint_saved_just_before_a_flag_is_no_rollback_target(tmp_path):
  """An eval regression is flagged after its step's save: that checkpoint (10) is not
  marked in its metadata, but this run knows the flag and skips it as a target."""
  watch = _watch(tmp_path, eval_regression="warn", grad_norm_spike="rollback")
  watch.after_eval(5, {"eval_loss": 1.0})
  watch.after_eval(10, {"eval_loss": 2.0})  # flagged at 10, after checkpoint 10 was saved
  watch.pending = []
  watch._flag(12, "grad_norm_spike", 9.0, 2.0)
  ckpt = Checkpoints()
  ckpt.directory = str(tmp_path / "checkpoints")
  for c in ("5", "10"):
    os.makedirs(os.path.join(ckpt.directory, c))
  assert watch.respond(12, "state after 12", None, ckpt=ckpt, trainer=None,
                       train_input=Input(), init=lambda: "initial") == ("state 5", 5)
  (row,) = [r for r in incidents.read_log(str(tmp_path)) if r["action"] == "rollback"]
  assert row["checkpoint_restored"] == 5 and row["checkpoints_set_aside"] == [10]


def test_max_rollbacks_budget_turns_rollback_into_stop(tmp_path):
  watch = _watch(tmp_path, grad_norm_spike="rollback", max_rollbacks=1, skip_batches=3)
  inputs = Input()
  watch._flag(12, "grad_norm_spike", 9.0, 2.0)
  assert _respond(watch, 12, inputs) == ("state 10", 10)
  assert inputs.schedule.ranges == [(11, 13)]  # batches 11..12, and 3 of them at least
  watch._flag(11, "grad_norm_spike", 9.0, 2.0)
  assert _respond(watch, 11, inputs) == ("state after 11", None)
  assert watch.stopping["why"] == "max_rollbacks (1) reached" and watch.may_save
  rows = incidents.read_log(str(tmp_path))
  assert [(r["step"], r["action"], r["checkpoint_restored"]) for r in rows] == [
      (12, "rollback", 10), (11, "stop", None)]
  assert rows[0]["data_skip"] == "11:13" and watch.checkpoint_extra(11)["incident_window"]


@pytest.mark.slow  # ~2 min: two 2-process runs on files
def test_rollback_on_files_shard_by_file_2x4_equals_data_skip(tmp_path):
  from configs import default  # noqa: PLC0415
  from jaxcoll.data import sources  # noqa: PLC0415
  from jaxcoll.run import inputs  # noqa: PLC0415

  workload = inputs.make_workload(default.get_config("smoke"))
  sources.write_shards(workload.dataset.examples(np.arange(2048)), str(tmp_path / "shards"),
                       num_shards=4, prefix="train")
  files = [f"--config.data.train={tmp_path / 'shards' / 'train-*.parquet'}",
           "--config.data.shard_by=file"]
  cmd = [sys.executable, "-m", "experiments.train", *CORRUPT, *files]
  rolled = jobs.launch(*cmd, *ROLLBACK, f"--workdir={tmp_path / 'rolled'}")
  assert rolled.returncode == 0, rolled.stdout[-3000:] + rolled.stderr[-3000:]
  skipped = [r["batches_skipped"] for r in _log(tmp_path / "rolled") if r["action"] == "rollback"]
  assert skipped and skipped[0][0] == 21
  skip = data_skip.format_skip(data_skip.BatchSchedule(skipped).ranges)
  replay = jobs.launch(sys.executable, "-m", "experiments.train", *CORRUPT[:4], *files,
                       f"--config.data.skip={skip}", f"--workdir={tmp_path / 'replay'}")
  assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-3000:]
  assert (jobs.summary(tmp_path / "rolled")["params_sha256"]
          == jobs.summary(tmp_path / "replay")["params_sha256"])


def test_throughput_step_times_ride_the_timers_allgather(tmp_path, monkeypatch):
  from jax.experimental import multihost_utils  # noqa: PLC0415

  calls = []

  def allgather(x):  # 2 processes: this one and a peer 3x slower
    calls.append(x)
    return np.stack([x, 3 * x])

  monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
  config = ml_collections.ConfigDict({"checkpoint_every": 5, "incidents": {}})
  watch = incidents.Watch.from_config(config, str(tmp_path), is_chief=True, process_count=2,
                                      gather=lambda own: pytest.fail("a second allgather"))

  class Timer:
    step_time_s = 0.5

  gather = watch.row_gather(lambda: Timer)
  assert gather(0.1) == pytest.approx([0.1, 0.3]) and len(calls) == 1
  watch.after_row(10, {"step_time_s": 0.5})
  assert watch._rows == [1.0]  # the median of 0.5 and 1.5: every process's step time
