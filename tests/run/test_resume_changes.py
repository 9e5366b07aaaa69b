"""What a user does to a workdir between two runs, and the one line each gets: a config
changed since the checkpoint was saved (named, not refused), a read-only workdir that holds
a run (refused, nothing changed, the fix is not "another directory"), the checkpoints deleted
(a restart from step 0, said, with the run's rows kept)."""

import errno
import json
import logging
import os
import shutil

import jobs
import pytest

from jaxcoll.run import loop
from jaxcoll.train import checkpoint


def _config(**changes):
  from configs import default  # noqa: PLC0415

  config = default.get_config("smoke")
  config.steps, config.checkpoint_every, config.log_every, config.algorithm = 4, 2, 2, "ring"
  for key, value in changes.items():
    config[key] = value
  return config


def test_config_changes_names_what_changes_training_not_bookkeeping():
  saved = _config().to_dict()
  assert loop.config_changes(saved, _config(steps=9, log_every=1, keep_checkpoints=7,
                                            strategy="zero2", eval_every=3)) == []
  changed = _config(learning_rate=0.5, global_batch_size=64)
  changed.data.skip = "3:4"
  changed.incidents.loss_spike = "skip"
  assert sorted(loop.config_changes(saved, changed)) == [
      "data.skip '' -> '3:4'", "global_batch_size 32 -> 64",
      "incidents.loss_spike 'warn' -> 'skip'", "learning_rate 0.003 -> 0.5"]
  # `steps` is the length of a decaying schedule: then it changes the rates.
  assert loop.config_changes(_config(schedule="cosine").to_dict(),
                             _config(schedule="cosine", steps=9)) == ["steps 4 -> 9"]
  # NaN equals NaN (corrupt_scale=nan), and a field the checkpoint's version lacked is skipped.
  nan = _config(corrupt_scale=float("nan"))
  assert loop.config_changes(nan.to_dict(), nan) == []
  assert loop.config_changes({"seed": 0}, _config(seed=0, learning_rate=9.0)) == []
  assert loop.config_changes(None, _config()) == []


def test_a_resume_with_a_changed_config_names_the_fields_in_one_line(tmp_path, caplog):
  """Resumed with another learning rate: before, nothing said that the resumed run is not the
  one the checkpoint began."""
  loop.train_and_evaluate(_config(), str(tmp_path))
  with caplog.at_level(logging.WARNING):
    loop.train_and_evaluate(_config(steps=6, learning_rate=0.01), str(tmp_path))
  lines = [r.getMessage() for r in caplog.records if "config changed" in r.getMessage()]
  assert lines == ["config changed since checkpoint 4 was saved: learning_rate 0.003 -> 0.01; "
                   "the resumed run trains as this config says, not as the run that wrote it "
                   "(pass the old values to continue that run unchanged)"]
  caplog.clear()
  with caplog.at_level(logging.WARNING):  # only more steps: nothing to say
    loop.train_and_evaluate(_config(steps=8, learning_rate=0.01), str(tmp_path))
  assert not [r for r in caplog.records if "config changed" in r.getMessage()]


@pytest.mark.parametrize("holds", [True, False], ids=["with-a-run", "empty"])
def test_a_read_only_workdir_is_one_line_and_the_fix_fits(holds, tmp_path, monkeypatch):
  """A read-only workdir that holds a run was told to "pass a directory this process can
  create and write": a fresh start elsewhere. Now it is told that nothing was changed and to
  make it writable (or copy it). (Root writes through chmod, so the probe's open is refused.)"""
  workdir = tmp_path / "run"
  workdir.mkdir()
  if holds:
    (workdir / "checkpoints").mkdir()
  real_open = open

  def read_only(path, *args, **kwargs):
    if ".jaxcoll-write-test-" in os.fspath(path):
      raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))
    return real_open(path, *args, **kwargs)

  monkeypatch.setattr("builtins.open", read_only)
  with pytest.raises(ValueError) as e:
    checkpoint.check_writable(str(workdir), "--workdir")
  line = str(e.value)
  assert "\n" not in line and "Read-only file system" in line
  if holds:
    assert "holds files (checkpoints): nothing in it was changed" in line
    assert "Make it writable" in line and "pass a directory" not in line
  else:
    assert "pass a directory this process can create and write" in line
  assert sorted(os.listdir(workdir)) == (["checkpoints"] if holds else [])


def test_deleted_checkpoints_restart_from_zero_in_one_line_keeping_the_rows(tmp_path):
  """checkpoints/ removed by hand after a run reached step 6: the rerun said nothing and
  replaced the rows of metrics.jsonl. Now one warning line names the workdir, the step the
  run reached, that it starts from 0 and how to start fresh on purpose; the old rows are kept
  aside, summary.json keeps the first attempt."""
  workdir = tmp_path / "run"
  first = jobs.train_forked(jobs.SMOKE, f"--workdir={workdir}")
  assert first.returncode == 0, first.stderr[-2000:]
  rows = (workdir / "metrics.jsonl").read_text()
  shutil.rmtree(workdir / "checkpoints")
  again = jobs.train_forked(jobs.SMOKE, f"--workdir={workdir}")
  assert again.returncode == 0, again.stderr[-2000:]
  lines = [line for line in again.stderr.splitlines() if "a previous run there" in line]
  assert len(lines) == 1, again.stderr[-3000:]
  (line,) = lines
  assert f"--workdir {workdir}: a previous run there reached step 6" in line
  assert "its checkpoints (up to step 6) are gone from checkpoints/" in line
  assert "starting again from step 0" in line and "pass a new --workdir" in line
  assert "Traceback" not in again.stderr
  (aside,) = [n for n in os.listdir(workdir) if n.startswith("metrics.jsonl.before-restart-")]
  assert aside in line and (workdir / aside).read_text() == rows
  summary = json.loads((workdir / "summary.json").read_text())
  assert [(a["start_step"], a["status"]) for a in summary["attempts"]] == [
      (0, "completed"), (0, "completed")]


def test_a_restart_from_zero_is_not_news_after_a_rollback_to_the_initial_state(tmp_path, caplog):
  """Rows up to step 7, no checkpoint row: a run killed before its first checkpoint is said to
  restart from 0 (it saved none), unless the newest recorded rollback restored the initial
  state (then step 0 is where the run is; the resume line names the rollback)."""
  import ml_collections  # noqa: PLC0415

  from jaxcoll.run import incidents  # noqa: PLC0415

  (tmp_path / "metrics.jsonl").write_text("".join(
      json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 8)))
  watch = incidents.Watch.from_config(ml_collections.ConfigDict({"incidents": {}}),
                                      str(tmp_path), is_chief=True)
  with caplog.at_level(logging.WARNING):
    loop._note_restart_from_zero(str(tmp_path), watch)
  (line,) = [r.getMessage() for r in caplog.records]
  assert "reached step 7 but it saved no checkpoint" in line
  caplog.clear()
  watch._state["rollbacks"] = [{"rollback": 1, "checkpoint_restored": 0}]
  with caplog.at_level(logging.WARNING):
    loop._note_restart_from_zero(str(tmp_path), watch)
  assert not caplog.records
