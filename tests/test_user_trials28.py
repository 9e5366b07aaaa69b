"""Cases a user brought that no other test had tried (engineer trial28): the run report and
summary.json of runs a user killed, resumed or profiled, and data directories holding files
that are not read. Each test of a fix fails without it."""

import json
import os
import shutil

import pytest

from jaxcoll.observe import run_report
from jaxcoll.run import loop

# Orbax's asynchronous saves can complete into its closed event loop (harmless; see
# tests/train/test_checkpoint.py).
pytestmark = pytest.mark.filterwarnings(
  "ignore:(?s).*Event loop is closed:pytest.PytestUnraisableExceptionWarning"
)


def _config(**changes):
  from configs import default  # noqa: PLC0415

  config = default.get_config("smoke")
  config.steps, config.checkpoint_every, config.log_every = 4, 2, 1
  for key, value in changes.items():
    config[key] = value
  return config


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """A 4-step run traced at steps 2-3 (checkpoints 2 and 4), then resumed to 6 without a trace."""
  workdir = str(tmp_path_factory.mktemp("run") / "run")
  first = loop.train_and_evaluate(_config(profile_steps="2:3"), workdir)
  second = loop.train_and_evaluate(_config(steps=6), workdir)
  return workdir, first, second


# -- 1. a run without metrics rows ------------------------------------------------------------


@pytest.mark.parametrize("metrics_file", ["empty", "missing"])
def test_the_report_of_a_run_without_metrics_rows_says_what_is_there(
    metrics_file, finished_run, tmp_path):
  """A run killed before its first row, or a metrics.jsonl a full disk cut to nothing, was
  refused (`metrics.jsonl has no rows`, `has no metrics.jsonl`) though summary.json and the
  checkpoints were there. Now the report says no metrics were logged, and what the summary
  and the checkpoints hold (the resume point)."""
  workdir = str(tmp_path / "run")
  shutil.copytree(finished_run[0], workdir)
  path = os.path.join(workdir, "metrics.jsonl")
  if metrics_file == "empty":
    open(path, "w").close()
  else:
    os.remove(path)
  run = run_report.load_run(workdir)
  text = run_report.summarize(run)
  assert f"no metrics logged: metrics.jsonl is {metrics_file}" in text
  assert "steps: 6 (0 train rows" in text
  assert "checkpoints on disk: 2, 4, 6 (newest 6: a resume starts there)" in text
  assert "attempts: 2 (completed, completed); restarts at step: 4" in text
  pytest.importorskip("matplotlib")
  run_report.draw(run, str(tmp_path / "report.png"))  # empty panels, no error
  assert os.path.getsize(tmp_path / "report.png") > 0


def test_a_directory_that_is_no_run_is_still_refused(tmp_path):
  """Only a run's other files make a workdir without metrics rows a run."""
  with pytest.raises(ValueError, match="has no metrics.jsonl"):
    run_report.load_run(str(tmp_path))
  (tmp_path / "metrics.jsonl").write_text("")
  with pytest.raises(ValueError, match="has no rows"):
    run_report.load_run(str(tmp_path))


# -- 3. the measured communication share across attempts ---------------------------------------


def test_a_resume_without_a_trace_keeps_the_measured_comm_share(finished_run):
  """The profiled attempt's comm_share_measured left summary.json when a later attempt resumed
  without tracing: the run's one measured figure, lost. Now it stays, with the attempt and
  steps it was measured on, and the report says them."""
  workdir, first, second = finished_run
  assert first["comm_share_measured"] > 0
  assert first["comm_share_measured_from"] == {"attempt": 1, "steps": [2, 3]}
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  assert summary["comm_share_measured"] == first["comm_share_measured"]
  assert summary["comm_share_measured_from"] == {"attempt": 1, "steps": [2, 3]}
  assert second["comm_share_measured"] == first["comm_share_measured"]
  text = run_report.summarize(run_report.load_run(workdir))
  assert "comm share (measured from the trace): " in text
  assert "of the step (steps 2-3 of attempt 1)" in text


def test_a_new_measurement_replaces_the_kept_one(finished_run, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(finished_run[0], workdir)
  third = loop.train_and_evaluate(_config(steps=8, profile_steps="7:8"), workdir)
  assert third["comm_share_measured_from"] == {"attempt": 3, "steps": [7, 8]}


def test_a_summary_written_before_the_source_was_recorded_names_its_attempt(tmp_path):
  """summary.json of an older jaxcoll has the measured share without its source: it came
  from the attempt that wrote the top level, the last completed one."""
  from jaxcoll.run import attempts  # noqa: PLC0415

  attempts.write_summary(str(tmp_path), {
      "comm_share_measured": 0.25,
      "attempts": [{"status": "completed"}, {"status": "failed"}, {"status": "running"}]})
  kept = loop._measured_share(str(tmp_path), {}, attempt=None, profiler=None)
  assert kept == {"comm_share_measured": 0.25,
                  "comm_share_measured_from": {"attempt": 1, "steps": None}}


# -- 2. the resume point after a rollback a kill cut short -------------------------------------


def test_the_report_s_resume_point_is_the_resume_s_after_a_killed_rollback(tmp_path,
                                                                             monkeypatch):
  """Killed between a rollback's record (incident_state.json: rollback 1 to checkpoint 5) and
  its set-aside, checkpoint 10, of the abandoned stretch, stays in checkpoints/. The report
  said `newest 10: a resume starts there`; the resume sets 10 aside and restores 5. Now the
  report names 5, and 10 as abandoned."""
  from jaxcoll.run import hooks, incidents  # noqa: PLC0415

  class Killed(Exception):
    pass

  def killed(self, *args, **kwargs):
    raise Killed("killed in the set-aside")

  # Batch 12 corrupted: the loss spikes at step 12 and the rollback restores checkpoint 5
  # (rollback_steps=3), abandoning checkpoint 10 (tests/run/test_incidents_durable.py).
  config = _config(steps=16, checkpoint_every=5, log_every=4, algorithm="ring")
  config.incidents.loss_spike, config.incidents.rollback_steps = "rollback", 3
  config.incidents.spike_min_steps = 8
  workdir = str(tmp_path / "run")
  with monkeypatch.context() as m:
    m.setattr(incidents.Watch, "_move", killed)
    with pytest.raises(Killed):
      loop.train_and_evaluate(config, workdir, hooks=[hooks.CorruptBatches(12, 12)])
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["10", "5"]
  line = run_report.checkpoints_on_disk(workdir)
  assert line.startswith("checkpoints on disk: 5 (newest 5: a resume starts there); "
                         "abandoned: 10 (saved in the stretch that rollback 1 to checkpoint 5 "
                         "abandoned")
  resumed = loop.train_and_evaluate(config, workdir, hooks=[hooks.CorruptBatches(12, 12)])
  assert resumed["start_step"] == 5  # what the report said


# -- 4. files of a data directory that are not read --------------------------------------------


def _data_dir(tmp_path):
  import numpy as np  # noqa: PLC0415

  from jaxcoll.data import sources  # noqa: PLC0415

  d = tmp_path / "data"
  rows = {"inputs": np.zeros((12, 4), np.float32), "label": np.zeros(12, np.int32)}
  paths = sources.write_shards(rows, str(d), num_shards=3, prefix="train")
  os.rename(paths[1], d / "part-1.parquet.bak")  # Parquet, under a name that is not read
  os.rename(paths[2], d / "data.bin")
  for name in ("_SUCCESS", ".part-0.parquet.crc", "README.md", "part-0.crc", "NOTES",
               "dataset_info.json", "train.idx"):
    (d / name).write_text("x")
  return d, paths[0]


def test_a_data_directory_names_the_files_it_does_not_read_once(tmp_path, recwarn):
  """`--config.data.train=DIR` over a Parquet file and two Parquet files named .bak / .bin
  trained on the first alone, without a word (a third of the data). Now one warning names
  the two (and that they start with PAR1); the obvious non-data (_SUCCESS, .crc, README,
  hidden files) is not named; a second read of the directory does not warn again."""
  from jaxcoll.data import sources  # noqa: PLC0415
  from jaxcoll.errors import UnreadFilesWarning  # noqa: PLC0415

  d, kept = _data_dir(tmp_path)
  assert sources.expand(str(d)) == [kept]
  (warned,) = [w for w in recwarn if w.category is UnreadFilesWarning]
  text = str(warned.message)
  assert text.startswith(f"data directory {d}: 2 file(s) not read (data.bin, "
                         "part-1.parquet.bak): only .parquet files are read there (1 file(s)); "
                         "data.bin, part-1.parquet.bak start with Parquet's magic PAR1: "
                         "rename them")
  named = text.partition("(names starting")[0]
  for quiet in ("_SUCCESS", "crc", "README", "NOTES", "dataset_info", "idx"):
    assert quiet not in named
  recwarn.clear()
  assert sources.expand(str(d)) == [kept]
  assert not [w for w in recwarn if w.category is UnreadFilesWarning]


def test_a_data_directory_of_data_and_obvious_non_data_is_quiet(tmp_path, recwarn):
  from jaxcoll.data import sources  # noqa: PLC0415

  d, kept = _data_dir(tmp_path)
  os.remove(d / "data.bin")
  os.remove(d / "part-1.parquet.bak")
  assert sources.expand(str(d)) == [kept]
  assert not [w for w in recwarn if w.category.__name__ == "UnreadFilesWarning"]
