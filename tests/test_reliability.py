"""Faults and bad input: restart with nothing lost, no hangs, guarded steps,
desync detection, and one-line errors (exit 2) that leave the workdir as it was.

Each case here is a row of README's "Faults and bad input" table.
"""

import hashlib
import json
import os
import subprocess
import sys
import time

import jobs
import pytest

from jaxcoll.train import loop, watchdog

SMOKE = "--config=configs/default.py:smoke"
_train = jobs.train
_summary = jobs.summary


def _launch(*args):
  return jobs.run([sys.executable, "-m", "jaxcoll.launch", *args], devices=4)


def _tree_digest(path):
  """Names, sizes and contents of every file under ``path``."""
  sha = hashlib.sha256()
  for root, dirs, files in sorted(os.walk(path)):
    dirs.sort()
    for name in sorted(files):
      full = os.path.join(root, name)
      sha.update(full.encode())
      with open(full, "rb") as f:
        sha.update(f.read())
  return sha.hexdigest()


def test_restart_after_lost_process_ends_like_uninterrupted_run(tmp_path):
  """Process 0 of 2 dies at step 7; the launcher restarts the job, which resumes."""
  flags = [SMOKE, "--config.steps=9", "--config.checkpoint_every=3"]
  cmd = [sys.executable, "-m", "experiments.train", *flags]
  base = ["--num_processes=2", "--devices_per_process=4"]
  straight = _launch(*base, "--", *cmd, f"--workdir={tmp_path / 'straight'}")
  assert straight.returncode == 0, straight.stderr[-2000:]
  failing = _launch(*base, "--max_restarts=1", "--", *cmd, "--config.fail_at_step=7",
                    f"--workdir={tmp_path / 'failing'}")
  assert failing.returncode == 0, failing.stdout[-2000:] + failing.stderr[-2000:]
  assert "restart" in (failing.stdout + failing.stderr).lower()
  resumed = _summary(tmp_path / "failing")
  assert resumed["start_step"] in (3, 6)
  assert resumed["params_sha256"] == _summary(tmp_path / "straight")["params_sha256"]


def test_watchdog_ends_a_hung_run(tmp_path):
  t0 = time.monotonic()
  out = _train(SMOKE, "--config.hang_at_step=4", "--config.watchdog_s=3",
               f"--workdir={tmp_path}")
  assert out.returncode == watchdog.EXIT_WATCHDOG
  assert "no training step finished for 3 s (last finished step: 3)" in out.stderr
  assert time.monotonic() - t0 < 120


def test_nan_skip_counts_and_trains_on(tmp_path):
  out = _train(SMOKE, "--config.nan_policy=skip", "--config.nan_at_step=3",
               f"--workdir={tmp_path}")
  assert out.returncode == 0, out.stderr[-2000:]
  assert _summary(tmp_path)["skipped_steps"] == 1
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [r["skipped_steps"] for r in rows] == [0, 1, 1]


def test_nan_raise_stops_with_the_step_number(tmp_path):
  out = _train(SMOKE, "--config.nan_policy=raise", "--config.nan_at_step=3",
               f"--workdir={tmp_path}")
  assert out.returncode == 3
  assert "Non-finite gradients at step 3" in out.stderr.strip().splitlines()[-1]


def test_desync_stops_naming_step_and_leaf(tmp_path):
  out = _train(SMOKE, "--config.check_every=2", "--config.desync_at_step=3",
               f"--workdir={tmp_path}")
  assert out.returncode == 4
  last = out.stderr.strip().splitlines()[-1]
  assert "replicas diverged at step 4" in last and "Dense_0" in last and "devices [7]" in last
  assert not (tmp_path / "summary.json").exists()


BAD_INPUT = [
    ("batch", ["--config.global_batch_size=30"], "30 is not divisible by data-parallel size 8"),
    ("mesh", ["--config.mesh_shape=3,2"], "product is 8"),
    ("config_key", ["--config.learning_rat=0.1"], "unknown config field 'learning_rat'"),
    ("strategy", ["--config.strategy=fsdp"], "valid strategies: dp, zero1"),
    ("zero_stage", ["--config.strategy=zero4"], "ZeRO has stages 0-3"),
    ("algorithm", ["--config.algorithm=rign"], "Valid names"),
    ("model", ["--config.model=vgg"], "valid models: mlp"),
    ("config_file", ["--config=configs/nope.py"], "--config"),
    ("workdir", ["--workdir=/proc/version/run"], "is not a writable directory"),
]


@pytest.mark.parametrize("flags,message", [b[1:] for b in BAD_INPUT], ids=[b[0] for b in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_2(flags, message, tmp_path):
  workdir = [] if any(f.startswith("--workdir") for f in flags) else [f"--workdir={tmp_path}"]
  out = _train(SMOKE, *flags, *workdir)
  assert out.returncode == 2, out.stderr[-2000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("train: error: "), out.stderr
  assert message in lines[0]
  assert not os.listdir(tmp_path)  # nothing written


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A finished smoke run with one kept checkpoint."""
  workdir = tmp_path_factory.mktemp("trained")
  out = _train(SMOKE, "--config.keep_checkpoints=1", f"--workdir={workdir}")
  assert out.returncode == 0, out.stderr[-2000:]
  return workdir


def test_checkpoint_of_another_model_is_refused_untouched(trained, tmp_path):
  before = _tree_digest(trained)
  out = _train(SMOKE, "--config.model_overrides.widths=(64,)", "--config.steps=8",
               f"--workdir={trained}")
  assert out.returncode == 2
  line = out.stderr.strip().splitlines()[-1]
  assert line.startswith("train: error: ") and "shape" in line
  assert _tree_digest(trained) == before


def test_corrupted_checkpoint_is_refused_untouched(trained, tmp_path):
  workdir = tmp_path / "copy"
  subprocess.run(["cp", "-r", str(trained), str(workdir)], check=True)
  step_dir = workdir / "checkpoints" / "6"
  for root, _, files in os.walk(step_dir / "state"):
    for name in files:
      if "manifest" in name or name.endswith(".ocdbt") or "d" in os.path.basename(root):
        with open(os.path.join(root, name), "r+b") as f:
          f.truncate(max(os.path.getsize(os.path.join(root, name)) // 2, 1))
  before = _tree_digest(workdir)
  out = _train(SMOKE, "--config.steps=8", f"--workdir={workdir}")
  assert out.returncode == 2, out.stderr[-2000:]
  assert "train: error: " in out.stderr and "checkpoint" in out.stderr.lower()
  assert _tree_digest(workdir) == before


def test_injected_fault_exit_code_is_distinct():
  assert len({loop.EXIT_INJECTED_FAULT, watchdog.EXIT_WATCHDOG, 2, 3, 4}) == 5
