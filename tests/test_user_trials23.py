"""Cases a user brought that no other test had tried (engineer trial23): eval-only and the run
report on runs of their own (resumed with a changed learning rate or eval cadence, ZeRO-3
evaluated as DP on 4 devices, stopped by SIGTERM, a damaged newest checkpoint, launched as 2
processes) and the flags a user tries on them. Each test of a fix fails without it."""

import os
import sys

import jobs
import pytest

from jaxcoll.observe import run_report


@pytest.mark.parametrize("inner", ["checkpoints", "checkpoints/4"])
def test_a_workdir_that_is_a_run_s_checkpoints_directory_names_the_run(inner, tmp_path):
  """`jaxcoll eval --workdir=RUN/checkpoints` (or `RUN/checkpoints/4`, one checkpoint, as
  `ls` shows them): the line said that path "has no checkpoints/ directory" and to pass the
  workdir of a run that saved checkpoints, "e.g. after python -m experiments.train
  --workdir=RUN/checkpoints", a new run trained inside the old run's checkpoints. Now it says
  what the path is and the flags that evaluate it (`--workdir=RUN --step=4`); the report's
  line ("has no metrics.jsonl") names the run too. Nothing is written there."""
  run = tmp_path / "run"
  (run / "checkpoints" / "4").mkdir(parents=True)
  (run / "metrics.jsonl").write_text('{"step": 4, "loss": 1.0}\n')
  given = str(run / inner)
  line = jobs.one_line(jobs.forked([sys.executable, "-m", "experiments.eval",
                                    f"--workdir={given}"]), prefix="eval: error: ")
  what, step = (("the checkpoints/ directory", "") if inner == "checkpoints"
                else ("checkpoint 4", " --step=4"))
  assert line == (f"eval: error: `--workdir` '{given}' is {what} of the run {run}, not a run's "
                  f"workdir; pass --workdir={run}{step}."), line
  with pytest.raises(ValueError) as e:
    run_report.load_run(given)
  assert str(e.value) == (f"`--workdir` '{given}' is {what} of the run {run}, not a run's "
                          f"workdir; pass --workdir={run}."), e.value
  assert sorted(os.listdir(run)) == ["checkpoints", "metrics.jsonl"]
  assert os.listdir(run / "checkpoints") == ["4"] and os.listdir(run / "checkpoints" / "4") == []


def test_a_damaged_newest_checkpoint_is_said_damaged_once(tmp_path):
  """A workdir whose newest checkpoint's arrays were damaged (bytes overwritten): the eval
  named the step twice and the damage twice, `checkpoint D/4 is damaged (`step` 4: the
  checkpoint D/4 is damaged: its arrays cannot be read (...)); evaluating an older one`, and
  with `--step=4`, `--step`=4: `step` 4: the checkpoint .... Now each says it once; step 2 is
  evaluated, and `--step=4` is one line, exit 2."""
  workdir = tmp_path / "run"
  out = jobs.train_forked("--config=configs/minimal.py:smoke", "--config.checkpoint_every=2",
                          f"--workdir={workdir}")
  assert out.returncode == 0, out.stderr[-3000:]
  for root, _, files in os.walk(workdir / "checkpoints" / "4" / "state"):
    for name in files if os.path.basename(root) == "d" else ():  # the array data files
      with open(os.path.join(root, name), "r+b") as f:
        f.seek(f.seek(0, os.SEEK_END) // 2)
        f.write(bytes(range(256)) * 4)
  out = jobs.forked([sys.executable, "-m", "experiments.eval", f"--workdir={workdir}",
                     f"--out_dir={tmp_path}"])
  assert out.returncode == 0 and out.stdout.startswith("step 2: "), out.stderr[-3000:]
  said = [ln for ln in out.stderr.splitlines() if "is damaged" in ln]
  assert len(said) == 1, out.stderr[-3000:]
  assert said[0].count("is damaged") == 1 and "`step` 4" not in said[0], said[0]
  assert f"the checkpoint {workdir}/checkpoints/4 is damaged: its arrays cannot be read" in said[0]
  assert said[0].endswith("; evaluating an older one"), said[0]
  line = jobs.one_line(jobs.forked([sys.executable, "-m", "experiments.eval",
                                    f"--workdir={workdir}", "--step=4", f"--out_dir={tmp_path}"]),
                       prefix="eval: error: ")
  assert line.startswith(f"eval: error: `--step`=4: the checkpoint {workdir}/checkpoints/4 is "
                         "damaged: its arrays cannot be read"), line
  assert line.endswith(" Omit --step to evaluate the newest intact checkpoint."), line


def test_the_report_does_not_name_a_step_without_its_state_as_where_a_resume_starts(tmp_path):
  """`rm -rf checkpoints/6/state` (the item a resume restores): the report said "checkpoints
  on disk: 2, 4, 6 (newest 6: a resume starts there)", but the resume skips 6 as damaged
  (`CorruptCheckpointWarning: ... its state/ directory is gone`) and starts at 4. Now 6 is
  named damaged and 4 is where a resume starts."""
  from jaxcoll import disk  # noqa: PLC0415

  for step in (2, 4, 6):
    (tmp_path / "checkpoints" / str(step) / "state").mkdir(parents=True)
    (tmp_path / "checkpoints" / str(step) / disk.COMMIT_SUCCESS_FILE).write_text("")
  assert run_report.checkpoints_on_disk(str(tmp_path)) == (
      "checkpoints on disk: 2, 4, 6 (newest 6: a resume starts there)")
  os.rmdir(tmp_path / "checkpoints" / "6" / "state")
  assert run_report.checkpoints_on_disk(str(tmp_path)) == (
      "checkpoints on disk: 2, 4 (newest 4: a resume starts there); damaged: 6 (its state/ "
      "directory is gone: a resume skips it)")
