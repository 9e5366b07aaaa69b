"""Eval-only (`python -m experiments.eval`, jaxcoll/run/eval_only.py): a checkpoint
evaluated without training equals the in-training eval of that step by value, on
another layout too; nothing the run wrote changes (checkpoints, metrics.jsonl,
summary.json) and a later resume is unaffected; a read-only workdir prints the result;
untrusted checkpoints are skipped; bad input is one line, exit 2."""

import hashlib
import json
import os
import shutil
import sys

import jobs
import numpy as np
import pytest

from jaxcoll.observe import metrics, run_report

_EXAMPLES = 37  # the synthetic eval set: not a multiple of the eval batch (a masked tail)


def _eval(*flags, devices=8, **env):
  return jobs.forked([sys.executable, "-m", "experiments.eval", *flags], devices=devices,
                     **env)


def _snapshot(workdir) -> dict[str, tuple[int, int, str]]:
  """Every file under ``workdir`` but evals.jsonl: (size, mtime_ns, sha256)."""
  found = {}
  for root, _, files in os.walk(workdir):
    for name in files:
      path = os.path.join(root, name)
      if name == metrics.EVALS_NAME:
        continue
      with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
      st = os.stat(path)
      found[os.path.relpath(path, workdir)] = (st.st_size, st.st_mtime_ns, digest)
  return found


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """default.py:smoke (DP on 8 devices, checkpoints at 3 and 6) with an eval at 3 and 6."""
  workdir = tmp_path_factory.mktemp("eval_only") / "run"
  out = jobs.train_forked(jobs.SMOKE, "--config.eval_every=3",
                          f"--config.data.eval_examples={_EXAMPLES}",
                          "--config.data.eval_batch_size=16", f"--workdir={workdir}")
  assert out.returncode == 0, out.stderr[-3000:]
  evals = {r["step"]: r for r in metrics.read_metrics(str(workdir)) if "eval_loss" in r}
  assert sorted(evals) == [3, 6]
  return workdir, evals


def _copy(trained, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(trained[0], workdir)
  for name in os.listdir(workdir):  # a copy made now: only evals.jsonl's rows are new
    if name == metrics.EVALS_NAME:
      os.remove(workdir / name)
  return workdir


def test_eval_only_equals_the_in_training_eval_and_changes_nothing(trained, tmp_path):
  workdir, evals = _copy(trained, tmp_path), trained[1]
  before = _snapshot(workdir)
  same = _eval(f"--workdir={workdir}", "--step=3")  # the layout that trained it
  assert same.returncode == 0, same.stderr[-3000:]
  assert same.stdout.startswith("step 3: eval_loss=")
  assert f"({_EXAMPLES} examples: synthetic; DP(auto) on 8 devices" in same.stdout
  other = _eval(f"--workdir={workdir}", "--config.strategy=zero3", devices=4)  # newest: 6
  assert other.returncode == 0, other.stderr[-3000:]
  # An eval batch of global_batch_size (32) on 6 devices: rounded up to 36, one warning line.
  six = _eval(f"--workdir={workdir}", "--config.data.eval_batch_size=0", devices=6)
  assert six.returncode == 0, six.stderr[-3000:]
  assert "evaluating in batches of 36" in six.stderr
  rows = metrics.read_eval_rows(str(workdir))
  assert [(r["step"], r["strategy"], r["num_devices"]) for r in rows] == [
      (3, "DP(auto)", 8), (6, "ZeRO-3", 4), (6, "DP(auto)", 6)]
  for key in ("eval_loss", "eval_accuracy", "eval_examples"):  # the same code, the same values
    assert rows[0][key] == evals[3][key], key
    for row in rows[1:]:  # another layout: another reduction order
      assert row[key] == pytest.approx(evals[6][key], rel=1e-6), key
  assert rows[1]["params_sha256"] == jobs.summary(workdir)["params_sha256"]  # the final params
  assert _snapshot(workdir) == before  # checkpoints, metrics.jsonl, summary.json: untouched
  text = run_report.summarize(run_report.load_run(str(workdir)))
  assert "eval-only (experiments.eval): 3 rows; latest: " in text
  assert "at checkpoint 6 (37 examples: synthetic, DP(auto) on 6 devices)" in text
  # A later resume relies on metrics.jsonl and summary.json: it trains on as if no eval ran.
  again = jobs.train_forked(jobs.SMOKE, "--config.eval_every=3",
                            f"--config.data.eval_examples={_EXAMPLES}",
                            "--config.data.eval_batch_size=16", "--config.steps=9",
                            f"--workdir={workdir}")
  assert again.returncode == 0, again.stderr[-3000:]
  assert [a["end_step"] for a in jobs.summary(workdir)["attempts"]] == [6, 9]
  assert metrics.read_eval_rows(str(workdir)) == rows


def test_eval_files_given_on_the_command_line(trained, tmp_path):
  """--config.data.eval=GLOB on a run that evaluated its synthetic set: shards of that very
  set give that step's figures exactly (the same rows, the same code)."""
  shards = tmp_path / "shards"
  made = jobs.forked([sys.executable, "-m", "experiments.make_shards", jobs.SMOKE,
                      "--split=eval", f"--examples={_EXAMPLES}", "--num_shards=2",
                      f"--out={shards}"], devices=1)
  assert made.returncode == 0, made.stderr[-2000:]
  workdir = _copy(trained, tmp_path)
  out = _eval(f"--workdir={workdir}", f"--config.data.eval={shards}/eval-*.parquet",
              f"--out_dir={tmp_path / 'evals'}")
  assert out.returncode == 0, out.stderr[-3000:]
  (row,) = metrics.read_eval_rows(str(tmp_path / "evals"))
  assert row["eval_data"] == f"{shards}/eval-*.parquet" and row["step"] == 6
  for key in ("eval_loss", "eval_accuracy", "eval_examples"):
    assert row[key] == trained[1][6][key], key
  assert not (workdir / metrics.EVALS_NAME).exists()  # --out_dir: nothing in the workdir


def test_eval_only_on_zero3_runs_on_the_sharded_state(trained, monkeypatch):
  """In process: under ZeRO-3 the eval gets the trainer and its sharded state (each
  device 1/8 of every parameter that divides), never full params."""
  from jaxcoll.run import eval_only, evaluate  # noqa: PLC0415
  from jaxcoll.train.trainer import Trainer  # noqa: PLC0415

  seen = {}
  real_run = evaluate.Evaluator.run

  def watched(self, params=None, *, trainer=None, state=None):
    seen.update(params=params, state=state, trainer=trainer)
    return real_run(self, params, trainer=trainer, state=state)

  def refuse(self, state):
    raise AssertionError("Trainer.params: the full model was assembled")

  monkeypatch.setattr(evaluate.Evaluator, "run", watched)
  monkeypatch.setattr(Trainer, "params", refuse)
  row = eval_only.evaluate_checkpoint(str(trained[0]), step=6, overrides={"strategy": "zero3"})
  assert seen["params"] is None and seen["trainer"].strategy.name == "ZeRO-3"
  assert row["eval_loss"] == pytest.approx(trained[1][6]["eval_loss"], rel=1e-6)
  leaves = [x for x in __import__("jax").tree.leaves(seen["state"].params) if x.size >= 8]
  assert leaves and all(
      x.addressable_shards[0].data.size * 8 == np.prod(x.shape) for x in leaves)


def test_a_read_only_workdir_prints_the_result_and_records_it_elsewhere(trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  before = _snapshot(workdir)
  out = jobs.forked([sys.executable, "-m", "_eval_read_only", f"--workdir={workdir}"],
                    JAXCOLL_TEST_READ_ONLY_DIR=str(workdir))
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.startswith("step 6: eval_loss=")
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("eval: not recorded: cannot write "), lines
  assert "Read-only file system" in lines[0] and "--out_dir=" in lines[0]
  assert not (workdir / metrics.EVALS_NAME).exists() and _snapshot(workdir) == before
  elsewhere = tmp_path / "elsewhere"
  out = jobs.forked([sys.executable, "-m", "_eval_read_only", f"--workdir={workdir}",
                     f"--out_dir={elsewhere}"], JAXCOLL_TEST_READ_ONLY_DIR=str(workdir))
  assert out.returncode == 0, out.stderr[-3000:]
  assert [r["step"] for r in metrics.read_eval_rows(str(elsewhere))] == [6]
  run = run_report.load_run(str(workdir), eval_dirs=[str(elsewhere)])  # report --out_dir
  assert [r["step"] for r in run.eval_only] == [6]


def test_untrusted_checkpoints_are_skipped_or_refused(trained, tmp_path):
  """A checkpoint a recorded rollback abandoned, or one whose arrays are damaged, is
  never evaluated: the newest trusted one is, and asking for it is one line."""
  workdir = _copy(trained, tmp_path)
  state = {"format": 1, "flags": [], "skips": [], "rollbacks": [
      {"rollback": 1, "step": 6, "checkpoint_restored": 3, "batches_skipped": [4, 6]}]}
  (workdir / "incident_state.json").write_text(json.dumps(state))
  out = _eval(f"--workdir={workdir}")
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.startswith("step 3: ") and "checkpoint" in out.stderr
  assert "/6 is not trusted (a recorded rollback abandoned it" in out.stderr
  line = jobs.one_line(_eval(f"--workdir={workdir}", "--step=6"), prefix="eval: error: ")
  assert "`--step`=6" in line and "not trusted" in line and "trusted checkpoints: steps [3]" in line
  os.remove(workdir / "incident_state.json")
  for root, _, files in os.walk(workdir / "checkpoints" / "6" / "state"):
    for name in files if os.path.basename(root) == "d" else ():  # the array data files
      with open(os.path.join(root, name), "r+b") as f:
        f.seek(f.seek(0, os.SEEK_END) // 2)
        f.write(bytes(range(256)) * 4)
  out = _eval(f"--workdir={workdir}")
  assert out.returncode == 0 and out.stdout.startswith("step 3: "), out.stderr[-3000:]
  assert "/6 is damaged" in out.stderr and "evaluating an older one" in out.stderr
  line = jobs.one_line(_eval(f"--workdir={workdir}", "--step=6"), prefix="eval: error: ")
  assert "`--step`=6" in line and "damaged" in line


def test_a_checkpoint_pruned_while_it_is_read_is_named(trained, tmp_path, monkeypatch, caplog):
  """A training job in the same workdir may prune the checkpoint being read (eval-only takes
  no lock): that is said as such, not as damage; the default falls back to an older one."""
  from jaxcoll.run import eval_only  # noqa: PLC0415
  from jaxcoll.train import checkpoint  # noqa: PLC0415

  workdir = _copy(trained, tmp_path)
  real = checkpoint.Checkpointer._try_restore

  def pruned_meanwhile(self, step, *args, **kwargs):
    if step == 6:
      shutil.rmtree(workdir / "checkpoints" / "6")
    return real(self, step, *args, **kwargs)

  monkeypatch.setattr(checkpoint.Checkpointer, "_try_restore", pruned_meanwhile)
  with caplog.at_level("WARNING"):
    row = eval_only.evaluate_checkpoint(str(workdir))
  assert row["step"] == 3 and row["eval_loss"] == trained[1][3]["eval_loss"]
  assert any("/6 was removed while it was read (a training job" in r.getMessage()
             for r in caplog.records)
  shutil.copytree(trained[0] / "checkpoints" / "6", workdir / "checkpoints" / "6")
  with pytest.raises(eval_only.ConfigError, match=r"`--step`=6: .* was removed while it was "
                     r"read .*; pass a newer --step\."):
    eval_only.evaluate_checkpoint(str(workdir), step=6)


def test_bad_input_is_one_line(trained, tmp_path):
  workdir = trained[0]
  (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
  cases = [
      ([f"--workdir={tmp_path / 'nope'}"], ["is not a directory"]),
      ([f"--workdir={tmp_path}"], ["has no checkpoints/ directory"]),
      ([f"--workdir={tmp_path / 'empty'}"], ["has no committed checkpoint"]),
      ([], ["`--workdir` is required"]),
      ([f"--workdir={workdir}", "--step=4"],
       ["`--step`=4: there is no checkpoint of that step in ", "its checkpoints are steps [3, 6]"]),
      ([f"--workdir={workdir}", "--step=-1"], ["`--step`=-1"]),
      ([f"--workdir={workdir}", f"--config.data.eval={tmp_path}/none-*.parquet"],
       ["matches no file"]),
      ([f"--workdir={workdir}", "--config.model_overrides.input_dim=16"],
       ["does not match this config's model and optimizer",
        "params']['Dense_0']['kernel']: shape (32, 128), but the model has shape (16, 128)",
        "the checkpoint's run had model='mlp'"]),
      ([f"--workdir={workdir}", "--config=configs/minimal.py"],
       ["does not match this config's model and optimizer"]),
  ]
  for flags, wants in cases:
    line = jobs.one_line(_eval(*flags), prefix="eval: error: ")
    assert all(want in line for want in wants), (flags, line)
  # The user story: eval data added to train on a finished run is "nothing to do" (its
  # contract), and that line now names the command that evaluates.
  again = jobs.train_forked(jobs.SMOKE, f"--config.data.eval={tmp_path}/x-*.parquet",
                            f"--workdir={workdir}")
  assert again.returncode == 0 and "nothing to do: already at step 6" in again.stderr
  assert f"evaluate a checkpoint with python -m experiments.eval --workdir={workdir}" in (
      " ".join(again.stderr.split()))


@pytest.mark.slow
def test_two_processes_evaluate_as_one(trained, tmp_path):
  """2 processes x 4 devices, ZeRO-3: each reads its own part of the checkpoint and its own
  eval rows; the figures are the in-training eval's (process 0 records one row)."""
  workdir = _copy(trained, tmp_path)
  out = jobs.launch(sys.executable, "-m", "experiments.eval", f"--workdir={workdir}",
                    "--config.strategy=zero3")
  assert out.returncode == 0, out.stderr[-3000:]
  (row,) = metrics.read_eval_rows(str(workdir))
  assert (row["num_processes"], row["num_devices"], row["strategy"]) == (2, 8, "ZeRO-3")
  for key in ("eval_loss", "eval_accuracy", "eval_examples"):
    assert row[key] == pytest.approx(trained[1][6][key], rel=1e-6), key


def test_the_workdir_in_a_hint_is_shell_quoted(tmp_path, caplog):
  # A --workdir with a space: the hints' commands (`python -m experiments.eval
  # --workdir=/tmp/my run`) split it in two when pasted into a shell.
  import shlex

  from jaxcoll.run import attempts, eval_only

  workdir = str(tmp_path / "my run")
  os.makedirs(workdir)
  with pytest.raises(eval_only.ConfigError) as info:
    eval_only.evaluate_checkpoint(workdir)
  hint = str(info.value).split("e.g. after ")[1].rstrip(".")
  assert shlex.split(hint)[-1] == f"--workdir={workdir}"
  with caplog.at_level("INFO", logger=attempts.log.name):
    attempts.announce_nothing_to_do(step=6, steps=6, workdir=workdir)
  said = caplog.records[-1].getMessage().split("evaluate a checkpoint with ")[1]
  assert shlex.split(said) == ["python", "-m", "experiments.eval", f"--workdir={workdir}"]
