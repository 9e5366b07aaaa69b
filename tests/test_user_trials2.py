"""Cases found by trying jaxcoll as a user would (engineer trial2): each test fails without
its fix."""

import os

import pytest

from jaxcoll.runtime import distributed

SLURM_STEP = {
  "SLURM_JOB_ID": "42",
  "SLURM_STEP_NODELIST": "gpu-a[1,3-4],gpu-b7",
  "SLURM_NTASKS": "4",
  "SLURM_PROCID": "1",
  "SLURM_LOCALID": "0",
}


@pytest.fixture
def slurm(fresh):
  """A hand-set Slurm job step (no srun), nothing else of a cluster."""
  for name, value in SLURM_STEP.items():
    fresh.setenv(name, value)
  return fresh


def test_a_hand_set_slurm_step_is_read_as_jax_reads_it(slurm):
  found = distributed.settings()
  # JAX's rules: the first host of the node list, port 61440 + job id % 4096.
  assert (found.method, found.coordinator, found.num_processes, found.process_id) == (
    "slurm", "gpu-a1:61482", 4, 1)


@pytest.mark.parametrize(
  "name, value, message",
  [
    # Was accepted: a task id past the task count (JAXCOLL_* and Open MPI refuse it).
    ("SLURM_PROCID", "5", r"`SLURM_PROCID`=5 must be in 0\.\.3 \(SLURM_NTASKS=4\)"),
    # Was JAX's bare "invalid literal for int() with base 10: 'abc'".
    ("SLURM_JOB_ID", "abc", r"`SLURM_JOB_ID` must be an integer >= 0, got 'abc'"),
    # Was accepted as the coordinator ':61482'.
    ("SLURM_STEP_NODELIST", "", r"`SLURM_STEP_NODELIST` is empty"),
  ],
  ids=["procid_past_ntasks", "job_id_not_a_number", "empty_node_list"],
)
def test_bad_hand_set_slurm_variables_are_one_line_naming_them(slurm, name, value, message):
  slurm.setenv(name, value)
  with pytest.raises(ValueError, match=message):
    distributed.settings()


def test_a_worker_killed_by_a_signal_is_named_so_by_the_launcher(capfd):
  """Was "process 1 exited with status 137": a SIGKILLed worker (kill -9, the OOM killer)
  read like one that exited on its own."""
  import sys  # noqa: PLC0415

  from jaxcoll.runtime import launch  # noqa: PLC0415

  code = ("import os, signal, time\n"
          "if os.environ['JAXCOLL_PROCESS_ID'] == '1': os.kill(os.getpid(), signal.SIGKILL)\n"
          "time.sleep(60)\n")
  status = launch.main(["--num_processes=2", "--devices_per_process=1", "--grace_s=1",
                        "--", sys.executable, "-c", code])
  assert status == 137
  err = capfd.readouterr().err
  assert ("attempt 0 failed: process 1 was killed by SIGKILL (also what the kernel's OOM "
          "killer sends), status 137; stopping.") in err, err
  assert launch._ended(0, 3) == "process 0 exited with status 3"
  assert launch._ended(2, -15) == "process 2 was killed by SIGTERM, status 143"


# The --cluster sweep's whole-node checks are cases of tests/scale/test_step_model.py's
# _BAD_INPUT (one interpreter for all of them): importing experiments.simulate_training here
# would define absl's --preset a second time in a worker that imported experiments.simulate.


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
def test_the_benchmark_takes_nccl_tests_byte_dtypes_and_checks_them_exactly(dtype):
  """nccl-tests' `-d int8` / `-d uint8` were refused ("Unknown `dtype` 'int8'"); the
  collectives themselves take them. uint8 inputs (-5..5 stored as 251..5) wrap when summed:
  numpy's reference wraps alike, so the check stays exact."""
  import numpy as np  # noqa: PLC0415

  from jaxcoll.observe import bench  # noqa: PLC0415

  rows = bench.run_benchmark("all_reduce", ["ring", "tree"], [37], dtype=dtype, iters=1,
                             warmup_iters=0)
  assert [(r.dtype, r.size_bytes, r.count, r.wrong) for r in rows] == [(dtype, 37, 37, 0)] * 2
  assert bench.count_wrong(np.array([1, 2], dtype), np.array([1, 3], dtype), exact=True,
                           dtype=dtype) == 1


def test_the_report_of_a_killed_run_does_not_read_as_still_running(tmp_path):
  """A SIGKILLed job leaves summary.json's attempt "running" (and its jaxcoll.lock file):
  the report said "attempts: 1 (running)" as for a live job."""
  import json  # noqa: PLC0415

  from jaxcoll.observe import run_report  # noqa: PLC0415
  from jaxcoll.run.lock import WorkdirLock  # noqa: PLC0415

  (tmp_path / "metrics.jsonl").write_text(
      "".join(json.dumps({"step": s, "loss": 2.0 - s / 10, "step_time_s": 0.01}) + "\n"
              for s in (2, 4)))
  (tmp_path / "summary.json").write_text(json.dumps(
      {"attempts": [{"start_step": 0, "end_step": None, "status": "running"}]}))
  (tmp_path / "jaxcoll.lock").write_text('{"pid": 999999, "host": "gone"}')  # left by a kill
  note = "the last attempt is not running (no process holds jaxcoll.lock)"
  assert note in run_report.summarize(run_report.load_run(str(tmp_path)))
  with WorkdirLock(str(tmp_path)):  # a live job holds it: nothing added
    text = run_report.summarize(run_report.load_run(str(tmp_path)))
    assert "attempts: 1 (running)" in text and note not in text


_MEMORY_PLAN_RUNNER = """if True:
  import contextlib, io, json, sys
  from absl import flags
  from experiments import _cli, memory_plan as mp
  results = []
  for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    status = 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
      try:
        flags.FLAGS.unparse_flags()
        mp.main(_cli.flags_parser(mp._PROG)(["memory_plan", *args]))
      except SystemExit as e:
        status = e.code
    results.append({"status": status, "stderr": err.getvalue()})
  print(json.dumps(results))
"""

_FILES_ONLY_MODEL = '''
import flax.linen as nn, numpy as np, optax, jaxcoll
def loss(logits, batch):
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean(), {}
def make(width=37):
  return jaxcoll.models.from_flax(nn.Dense(5), loss, inputs=("features",),
      sample_batch={"features": np.zeros((1, 13), np.float32)}, label_classes={"label": 5})
'''


def test_memory_plan_bad_batch_and_a_files_only_model_are_one_line_exit_2(tmp_path):
  """Were tracebacks with exit 1 (a batch the devices do not divide; the README's own
  files-only model without --budget_mb) or advice to train on files (with --budget_mb);
  a files-only model is planned from --data (tests/test_user_trials.py)."""
  import json  # noqa: PLC0415
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415

  (tmp_path / "files_only_model.py").write_text(_FILES_ONLY_MODEL)
  cases = [
      ["--model=mlp", "--devices=6"],
      ["--budget_mb=64", "--family=mlp", "--devices=6"],
      ["--model=files_only_model:make", "--devices=2", "--batch_size=4"],
      ["--model=files_only_model:make", "--devices=2", "--batch_size=4", "--budget_mb=1",
       "--scale=model_overrides.width"],
  ]
  env = {**os.environ, "JAXCOLL_CPU_DEVICES": "6",
         "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
  r = subprocess.run([sys.executable, "-c", _MEMORY_PLAN_RUNNER, json.dumps(cases)],
                     capture_output=True, text=True, env=env, timeout=300, check=True)
  results = json.loads(r.stdout.strip().splitlines()[-1])
  batch = ("memory_plan: error: `--batch_size`=256 is not divisible by `--devices`=6; use e.g. "
           "--batch_size=252.")
  files = ("memory_plan: error: `--model`='files_only_model:make' has no synthetic data set: "
           "pass --data=GLOB")
  for result, want in zip(results, [batch, batch, files, files]):
    lines = [line for line in result["stderr"].splitlines() if line.strip()]
    assert result["status"] == 2 and len(lines) == 1 and lines[0].startswith(want), result
