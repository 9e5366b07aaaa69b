"""Incidents and data.skip (issue 22) on cases the first tests did not cover.

Each test here guards a fix found by trying the feature as a user would
(issue 22's closing note): it fails without the fix.
"""

import numpy as np
import pytest

import jobs
from incident_fakes import Checkpoints, Input

from jaxcoll.run import incidents


def _log(workdir):
  return incidents.read_log(str(workdir))


# -- data.skip on files: the position a resume or a rollback continues from ------------


@pytest.fixture(scope="module")
def files_setup(tmp_path_factory):
  """The default smoke model's rows in 2 Parquet files, and its config and mesh."""
  import jax  # noqa: PLC0415

  from configs import default  # noqa: PLC0415
  from jaxcoll.data import sources  # noqa: PLC0415
  from jaxcoll.run import inputs, loop  # noqa: PLC0415

  directory = tmp_path_factory.mktemp("shards")
  config = default.get_config("smoke")
  workload = inputs.make_workload(config)
  sources.write_shards(workload.dataset.examples(np.arange(320)), str(directory), num_shards=2,
                       prefix="train")
  config.data.train = str(directory / "train-*.parquet")
  mesh, axis = loop.build_mesh(config)

  def make(shard_by, skip=""):
    c = config.copy_and_resolve_references()
    c.data.shard_by, c.data.skip = shard_by, skip
    return inputs.TrainInput(c, workload, mesh, axis)

  def fetch(train_input, step):
    return jax.device_get(train_input.batch(step))

  return make, fetch


def _same(a, b):
  return all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("shard_by", ["record", "file"])
def test_files_resume_right_before_a_skipped_range_reads_past_it(files_setup, shard_by):
  """A checkpoint at step 2 with data.skip=3:4: step 3 trains on batch 5, also after a resume
  (before the fix the resumed iterator went on from its saved position, batch 3)."""
  make, fetch = files_setup
  plain = make(shard_by)
  plain.restore(0, None)
  want = [fetch(plain, step) for step in range(8)]  # 0-based batches 0..7
  run = make(shard_by, "3:4")
  run.restore(0, None)
  first = [fetch(run, step) for step in range(2)]
  assert _same(first[0], want[0]) and _same(first[1], want[1])
  saved = run.state()  # what checkpoint 2 keeps
  resumed = make(shard_by, "3:4")
  resumed.restore(2, saved)
  assert _same(fetch(resumed, 2), want[4])  # step 3 -> batch 5 (0-based 4)
  assert _same(fetch(resumed, 3), want[5])


@pytest.mark.parametrize("shard_by", ["record", "file"])
def test_files_second_rollback_to_the_same_checkpoint_skips_both_ranges(files_setup, shard_by):
  """A rollback to checkpoint 2 skipped 3..4; a second rollback to checkpoint 2 skips 5..6:
  step 3 then trains on batch 7 (before the fix it read batch 5 while the log and the
  fault injector called it batch 7)."""
  make, fetch = files_setup
  plain = make(shard_by)
  plain.restore(0, None)
  want = [fetch(plain, step) for step in range(8)]
  run = make(shard_by)
  run.restore(0, None)
  fetch(run, 0), fetch(run, 1)
  checkpoint_2 = run.state()
  fetch(run, 2), fetch(run, 3)
  # the first rollback (as Watch._rollback does it): restore 2, then skip 3..4
  run.restore(2, checkpoint_2)
  run.skip(3, 4)
  assert _same(fetch(run, 2), want[4])
  # the second: restore 2 again (whose extra does not hold 3..4), skip 5..6
  run.restore(2, checkpoint_2)
  run.skip(5, 6)
  assert run.batch_number(3) == 7
  assert _same(fetch(run, 2), want[6])
  assert _same(fetch(run, 3), want[7])


# -- bad input ------------------------------------------------------------------------


@pytest.mark.parametrize("value, says", [
    ("5:-1", "batches count from 1; use --config.data.skip=1:5."),  # was "write it -1:5"
    ("3:0", "use --config.data.skip=1:3."),
])
def test_a_backwards_range_below_1_names_a_valid_fix(value, says):
  from jaxcoll.run import data_skip  # noqa: PLC0415
  from jaxcoll.run.config_error import ConfigError  # noqa: PLC0415

  with pytest.raises(ConfigError) as e:
    data_skip.parse_skip(value)
  assert says in str(e.value).replace(" (batch n is the one step n trains on)", "")


# -- the detectors after a rollback ----------------------------------------------------


def test_a_rollback_puts_the_detectors_back_as_they_were_at_the_checkpoint(tmp_path):
  """After a rollback to checkpoint 10 the windows hold steps 1..10's values (not also the
  abandoned 11's), and the replayed step 12's checkpoint is not marked as taken in an anomaly
  window (before the fix it was: the abandoned step 12's flag was still in flagged_steps, so
  a later rollback passed over a good checkpoint)."""
  watch = incidents.Watch(dict(incidents.DEFAULTS, loss_spike="rollback", spike_min_steps=3),
                          str(tmp_path), is_chief=True)
  ckpt, inputs = Checkpoints({}), Input()
  losses = [2.0, 1.9, 1.8, 1.7, 1.6, 1.55, 1.5, 1.45, 1.4, 1.35]
  for step, loss in enumerate(losses, start=1):
    watch.after_step(step, {"loss": loss, "grad_norm": 1.0}, batch=step)
  ckpt.extras[10] = watch.checkpoint_extra(10)
  at_10 = list(watch._loss.values)
  watch.after_step(11, {"loss": 1.3, "grad_norm": 1.0}, batch=11)
  watch.after_step(12, {"loss": 90.0, "grad_norm": 1.0}, batch=12)
  assert [i["signal"] for i in watch.pending] == ["loss_spike"]
  state, restart = watch.respond(12, "state after 12", None, ckpt=ckpt, trainer=None,
                                 train_input=inputs, init=lambda: "initial")
  assert (state, restart) == ("state 10", 10) and inputs.schedule.ranges == [(11, 12)]
  assert list(watch._loss.values) == at_10 and list(watch._grad.values) == [1.0] * 10
  for step in (11, 12):  # the replay, on batches 13 and 14
    watch.after_step(step, {"loss": 1.3, "grad_norm": 1.0}, batch=inputs.batch_number(step))
  assert not watch.pending
  assert "incident_window" not in watch.checkpoint_extra(12)
  assert watch.checkpoint_extra(12)["incident_detectors"]["rollbacks"] == 1


# -- data.skip changed at a resume --------------------------------------------------------


@pytest.mark.parametrize("skip, fits", [
    ("3:4", True),  # the same ranges
    ("3:4,30:31", True),  # a range after the trained batches: the remedy on purpose
    ("", False),  # drops 3:4: steps 11.. would train on batches 11, 12 again
    ("3:4,9:10", False),  # 9:10 was trained (batch 12 is step 10's)
    ("3:5", False),
])
def test_a_resume_may_change_data_skip_only_after_the_trained_batches(skip, fits):
  """The checkpoint at step 10 ran with data.skip=3:4 (batches 1..12 trained)."""
  from configs import default  # noqa: PLC0415
  from jaxcoll.run import inputs, loop  # noqa: PLC0415
  from jaxcoll.run.config_error import ConfigError  # noqa: PLC0415

  config = default.get_config("smoke")
  config.data.skip = skip
  workload = inputs.make_workload(config)
  mesh, axis = loop.build_mesh(config)
  extra = {"config": {"data": {"skip": "3:4"}}}
  resumed = inputs.TrainInput(config, workload, mesh, axis)
  if fits:
    resumed.restore(10, extra)
    return
  with pytest.raises(ConfigError) as e:
    resumed.restore(10, extra)
  message = str(e.value)
  assert "`config.data.skip`" in message and "batches 1..12" in message
  assert "use --config.data.skip='3:4" in message and "\n" not in message


@pytest.mark.slow  # two CLI runs (~20 s quiet, 60 s loaded); the fast sibling is the one above
def test_a_resume_with_data_skip_over_trained_batches_is_bad_input(tmp_path):
  """CLI: one line, exit 2, the workdir as it was (summary, checkpoints, metrics)."""
  import os  # noqa: PLC0415

  workdir = tmp_path / "run"
  first = jobs.train_forked(jobs.SMOKE, "--config.steps=4", "--config.checkpoint_every=2",
                            f"--workdir={workdir}")
  assert first.returncode == 0, first.stderr[-2000:]

  def listing():
    return sorted((str(p.relative_to(workdir)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in workdir.rglob("*") if p.is_file())

  before = listing()
  out = jobs.train_forked(jobs.SMOKE, "--config.steps=8", "--config.checkpoint_every=2",
                          "--config.data.skip=2:5", f"--workdir={workdir}")
  line = jobs.one_line(out)
  assert "data.skip" in line and "batches 1..4" in line and "use --config.data.skip='5:5'" in line
  assert listing() == before, os.listdir(workdir)


# -- the run report after a rollback ----------------------------------------------------


def test_the_report_legend_does_not_cover_the_title(tmp_path, monkeypatch):
  """The figure legend (with its rollback entry, 4 columns) sat in the title's row at the
  top right and hid the end of a long title (the workdir and the layout)."""
  import json  # noqa: PLC0415

  pytest.importorskip("matplotlib")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  from jaxcoll.observe import run_report  # noqa: PLC0415

  workdir = tmp_path / ("a_long_experiment_directory_name_" * 2)
  workdir.mkdir()
  with open(workdir / "metrics.jsonl", "w") as f:
    for step in range(2, 21, 2):
      f.write(json.dumps({"step": step, "loss": 2.0 - step / 40, "grad_norm": 1.0,
                          "step_time_s": 0.01, "examples_per_s": 3000.0}) + "\n")
  with open(workdir / "summary.json", "w") as f:
    json.dump({"config": {"model": "mlp", "strategy": "dp", "algorithm": "ring"},
               "num_devices": 8, "num_processes": 1}, f)
  boxes = []  # the title's and the legend's, as drawn (taken before the figure closes)
  close = plt.close

  def measure(fig=None):
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    boxes.append((fig._suptitle.get_window_extent(renderer),  # noqa: SLF001
                  legend.get_window_extent(renderer)))
    close(fig)

  monkeypatch.setattr(plt, "close", measure)
  run_report.draw(run_report.load_run(str(workdir)), str(tmp_path / "report.png"))
  ((title, box),) = boxes
  overlap_x = min(title.x1, box.x1) - max(title.x0, box.x0)
  overlap_y = min(title.y1, box.y1) - max(title.y0, box.y0)
  assert overlap_x <= 0 or overlap_y <= 0, (title, box)


# -- rollback_steps the kept checkpoints cannot reach -------------------------------------


def _settings(**given):
  import ml_collections  # noqa: PLC0415

  top = {k: given.pop(k) for k in ("checkpoint_every", "keep_checkpoints", "eval_every")
         if k in given}
  return incidents.settings_from_config(ml_collections.ConfigDict({**top, "incidents": given}))


@pytest.mark.parametrize("given, says", [
    # 12 > (2 - 1) x 5 + 1: before the fix a spike at step 25 rolled back to step 0 and
    # skipped batches 1..25 (checkpoints 15 and 20 kept, neither 12 steps back)
    (dict(keep_checkpoints=2, rollback_steps=12), "keep_checkpoints=4 or "
     "--config.incidents.rollback_steps=6."),
    (dict(keep_checkpoints=3, rollback_steps=12), "rollback_steps=11."),
    # an eval's own step is saved before its regression is known: with one kept, no target
    (dict(keep_checkpoints=1, eval_regression="rollback", loss_spike="warn"),
     "set --config.keep_checkpoints=2."),
])
def test_rollback_steps_past_the_kept_checkpoints_is_bad_input(given, says):
  from jaxcoll.run.config_error import ConfigError  # noqa: PLC0415

  given = {"checkpoint_every": 5, "loss_spike": "rollback", **given}
  with pytest.raises(ConfigError, match="config.incidents.rollback_steps") as e:
    _settings(**given)
  assert says in str(e.value) and "restarts from step 0" in str(e.value)


@pytest.mark.parametrize("given", [
    dict(keep_checkpoints=3, rollback_steps=11),  # (3 - 1) x 5 + 1
    dict(keep_checkpoints=1, rollback_steps=1),  # the newest checkpoint is >= 1 step back
    dict(keep_checkpoints=2, eval_regression="rollback", rollback_steps=5),
    dict(keep_checkpoints=1, rollback_steps=50, loss_spike="warn"),  # no rollback: no limit
])
def test_rollback_steps_the_kept_checkpoints_reach_are_fine(given):
  given = {"checkpoint_every": 5, "loss_spike": "rollback", **given}
  assert _settings(**given)["rollback_steps"] == given.get("rollback_steps", 1)


def test_a_skip_range_past_int64_examples_is_bad_input():
  """Before the fix: an OverflowError traceback at step 3, after the run had started."""
  from jaxcoll.run import config as run_config  # noqa: PLC0415
  from jaxcoll.run.config_error import ConfigError  # noqa: PLC0415

  gbs, steps = 32, 6
  past = (2**63 - 1) // gbs - steps - 1
  fine = run_config.RunConfig(steps=steps, global_batch_size=gbs,
                              data=run_config.DataConfig(skip=f"3:{past}"))
  assert fine.data.skip == f"3:{past}"
  with pytest.raises(ConfigError, match=r"config.data.skip.*past any data set.*up to "
                     f"{past} at most"):
    run_config.RunConfig(steps=steps, global_batch_size=gbs,
                         data=run_config.DataConfig(skip="3:99999999999999999999"))
