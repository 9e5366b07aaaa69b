"""Cases found by trying jaxcoll's multi-process side as a cluster user would
(engineer trial6): each test fails without its fix."""

import json
import os
import re
import subprocess
import sys
import time
import types

import jobs
import pytest

from jaxcoll.observe import run_report
from jaxcoll.runtime import launch


def test_processes_with_unequal_device_counts_are_one_line_exit_2_on_each(tmp_path):
  """2 processes of 1 and 2 emulated devices (JAXCOLL_CPU_DEVICES differing between
  ranks, as `mpirun -np 1 -x JAXCOLL_CPU_DEVICES=2 ... : -np 1 -x ...=4` gives): JAX
  joined them, then each process ended in a traceback of jax's multihost_utils
  (`cannot reshape array of size 3 into shape (2,1)`) after the set-up had begun."""
  workdir = tmp_path / "run"
  cmd = jobs.train_cmd("--config=configs/minimal.py:smoke", f"--workdir={workdir}")
  outs = jobs.by_hand(cmd, [(1, {}, []), (2, {}, [])])
  for pid, (status, _, err, _) in enumerate(outs):
    line = jobs.one_line(subprocess.CompletedProcess(cmd, status, "", err), 2, "train: ")
    assert "unequal device counts (process 0: 1, process 1: 2;" in line, line
    assert f"JAXCOLL_PROCESS_ID={pid}" in line and "same JAXCOLL_CPU_DEVICES" in line, line
  assert not workdir.exists()  # refused before anything was written


def test_a_coordinator_host_that_does_not_resolve_is_one_line_at_once(tmp_path):
  """`JAXCOLL_COORDINATOR=nosuchhost.invalid:1234` (a typo in the host): the process
  waited out the whole start-up deadline (JAXCOLL_INIT_TIMEOUT_S, 300 s by default),
  then said only that not every process connected (exit 75)."""
  t0 = time.monotonic()
  out = jobs.train_forked(
      "--config=configs/minimal.py:smoke", f"--workdir={tmp_path / 'run'}", devices=1,
      JAXCOLL_COORDINATOR="nosuchhost.invalid:1234", JAXCOLL_NUM_PROCESSES="2",
      JAXCOLL_PROCESS_ID="1", JAXCOLL_INIT_TIMEOUT_S="40", timeout=120)
  line = jobs.one_line(out, 2, "train: error: the coordinator host 'nosuchhost.invalid'")
  assert "does not resolve" in line and "JAXCOLL_COORDINATOR=127.0.0.1:1234" in line, line
  assert time.monotonic() - t0 < 30  # not the 40 s start-up deadline
  assert not (tmp_path / "run").exists()


def test_the_report_names_the_checkpoints_on_disk_and_a_save_cut_short(tmp_path):
  """A 2-process job SIGKILLed while saving step 240 (its rows name a checkpoint at
  every 20 steps up to 240; keep_checkpoints=3 pruned the old ones): the report said
  "checkpoints: 12" and "resumes from the newest checkpoint" without saying which one
  is on disk: the row of step 240 is written when its save starts, and that save
  never finished (only checkpoints/240.orbax-checkpoint-tmp was left)."""
  rows = []
  for step in range(20, 260, 20):
    rows += [{"step": step, "loss": 1.0, "step_time_s": 0.01},
             {"step": step, "checkpoint_time_s": 0.1}]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (tmp_path / "summary.json").write_text(json.dumps(
      {"attempts": [{"start_step": 0, "end_step": None, "status": "running"}]}))
  ckpts = tmp_path / "checkpoints"
  for step in (180, 200, 220):  # orbax's committed steps: the marker and state/ inside
    (ckpts / str(step) / "state").mkdir(parents=True)
    (ckpts / str(step) / "commit_success.txt").write_text("")
  (ckpts / "240.orbax-checkpoint-tmp" / "state.orbax-checkpoint-tmp").mkdir(parents=True)
  (ckpts / "0220").mkdir()  # a copy so named is a stray, not a checkpoint
  text = run_report.summarize(run_report.load_run(str(tmp_path)))
  assert ("checkpoints on disk: 180, 200, 220 (newest 220: a resume starts there); "
          "not finished: 240 (") in text, text
  # After the next run's clean-up: no tmp directory, no "not finished".
  os.rmdir(ckpts / "240.orbax-checkpoint-tmp" / "state.orbax-checkpoint-tmp")
  os.rmdir(ckpts / "240.orbax-checkpoint-tmp")
  text = run_report.summarize(run_report.load_run(str(tmp_path)))
  assert "checkpoints on disk: 180, 200, 220 (newest 220: a resume starts there)" in (
      text.splitlines())



def _fake_devices(processes: int, each: int) -> list:
  return [types.SimpleNamespace(process_index=p, id=p * each + i)
          for p in range(processes) for i in range(each)]


@pytest.mark.parametrize(
    "processes, each, want",
    [
        # 8 devices over 2 processes: 4 each, not JAXCOLL_CPU_DEVICES=8 (16 devices).
        (2, 2, "over 2 processes, give each JAXCOLL_CPU_DEVICES=4 "
               "(python -m jaxcoll.launch --devices_per_process=4)"),
        # 3 x 2 devices and configs/hybrid_2x4.py's (2, 4): no per-process count fits.
        (3, 2, "8 devices do not split evenly over the job's 3 processes"),
        (1, 4, "set JAXCOLL_CPU_DEVICES=8 in the environment"),
    ],
    ids=["2_processes", "3_processes", "1_process"],
)
def test_too_few_devices_in_a_job_of_several_processes_says_the_per_process_count(
    processes, each, want):
  """`configs/hybrid_2x4.py` (mesh 2 x 4) launched as 3 processes x 2 devices said "set
  JAXCOLL_CPU_DEVICES=8", which each process would take for itself: 24 devices."""
  from jaxcoll.runtime import devices  # noqa: PLC0415

  fake = _fake_devices(processes, each)
  with pytest.raises(ValueError, match=re.escape(want)):
    devices.make_mesh((2, 4), ("node", "local"), devices=fake)
  with pytest.raises(ValueError, match=re.escape(want)):
    devices.flat_mesh(8, devices=fake)


_PEER = """if True:
  import os, signal, sys, time
  import jaxcoll
  info = jaxcoll.distributed.initialize()
  print("joined", flush=True)
  if info.process_id == 1:
    time.sleep(1)
    if sys.argv[1] == "kill":
      os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would
    if sys.argv[1] == "raise":
      raise RuntimeError("user code failed on process 1")
    sys.exit(0)  # a normal end, before process 0's
  # Process 0: in the real case, a collective that waits for process 1; after a normal
  # end of process 1 it goes on (3 s) and ends on its own.
  time.sleep(3 if sys.argv[1] == "exit" else 30)
  print("process 0 ended on its own", flush=True)
"""


@pytest.mark.parametrize("how", ["kill", "raise", pytest.param("exit", marks=pytest.mark.slow)])
def test_the_survivor_of_a_killed_peer_ends_at_once_not_after_the_watchdog(how):
  """2 processes started by hand (the plain multi-node recipe; `srun` without
  --kill-on-bad-exit), process 1 SIGKILLed: process 0 waited in its collective until the
  step watchdog, 600 s by default (gloo does not notice; JAX's heartbeat is longer on
  purpose). Now it ends within seconds naming process 1, exit 76. A peer whose code
  raises (`raise`): it printed its traceback, then sat in JAX's shutdown barrier (which
  waits for process 0, in its collective) until both ended in JAX's abort after 300 s;
  now it exits 1 after its traceback and process 0 follows. A peer that ends normally
  (`exit`) says goodbye first and ends nothing."""
  port = launch.free_port()
  procs = []
  try:
    for pid in (0, 1):
      env = {"JAXCOLL_COORDINATOR": f"127.0.0.1:{port}", "JAXCOLL_NUM_PROCESSES": "2",
             "JAXCOLL_PROCESS_ID": str(pid), "JAXCOLL_INIT_TIMEOUT_S": "60"}
      procs.append(subprocess.Popen([sys.executable, "-c", _PEER, how], cwd=jobs.REPO,
                                    env=jobs.clean_env(1, **env), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True))
    out1, err1 = procs[1].communicate(timeout=120)
    ended = time.monotonic()
    out0, err0 = procs[0].communicate(timeout=120)
    waited = time.monotonic() - ended
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  assert "joined" in out1
  if how == "kill":
    assert procs[1].returncode == -9
    assert procs[0].returncode == 76, out0 + err0[-3000:]
    assert waited < 15, waited  # not the 30 s the process would have slept (the watchdog's 600)
    assert ("jaxcoll.distributed: process 0 of 2: process 1 of 2 is gone (its connection "
            "closed without a goodbye") in err0, err0[-3000:]
    assert "ended on its own" not in out0
  elif how == "raise":
    assert procs[1].returncode == 1 and "RuntimeError: user code failed" in err1, err1[-3000:]
    assert "Fatal Python error" not in err1  # no JAX abort after the traceback
    assert procs[0].returncode == 76, out0 + err0[-3000:]
    assert waited < 15, waited
    assert "process 0 of 2: process 1 of 2 failed (an uncaught exception" in err0, err0[-3000:]
  else:
    assert procs[1].returncode == 0
    assert procs[0].returncode == 0, err0[-3000:]
    assert "ended on its own" in out0 and "is gone" not in err0


class _Ended:
  def __init__(self, returncode):
    self.returncode = returncode

  def poll(self):
    return self.returncode


def test_the_launcher_names_the_killed_process_not_the_survivor_that_it_ended():
  """Process 1 SIGKILLed, process 0 ending 76 (peer gone) within the same 50 ms poll:
  the launcher scanned in process order and said "process 0 exited with status 76"."""
  job = launch.Job.__new__(launch.Job)
  job.procs = [_Ended(76), _Ended(-9)]
  status, why = job.wait(deadline=None)
  assert status == 137 and why.startswith("process 1 was killed by SIGKILL"), why
  job.procs = [_Ended(76), _Ended(None)]  # the cause not seen yet: the survivor, after settling
  job.procs[1].poll = lambda: None
  assert job.wait(deadline=time.monotonic() + 5)[0] == 76


def test_the_digest_of_hybrid_zero3_on_one_process_is_that_of_its_params():
  """Hybrid ZeRO-3 (`configs/hybrid_2x4.py`) on one process of 8 devices: summary.json's
  params_global_norm / params_sha256 (11.6717, df8973c4...) were not those of the run's
  own params (its checkpoint, and the same config as 2 processes or on one device:
  11.7425): the digest read each replica's rows, so rows 0, 0, 1, 1, ... were hashed."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  import optax  # noqa: PLC0415

  import jaxcoll  # noqa: PLC0415
  from jaxcoll.run import loop  # noqa: PLC0415

  def loss(params, batch):
    return ((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2).mean()

  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(6, 5)).astype(np.float32),  # 30: rows of 8 (padded)
            "b": rng.normal(size=(5,)).astype(np.float32)}
  batch = {"x": rng.normal(size=(16, 6)).astype(np.float32),
           "y": rng.normal(size=(16, 5)).astype(np.float32)}
  mesh = jaxcoll.devices.node_local_mesh(2, 4)
  trainer = jaxcoll.Trainer(loss, optax.adam(1e-2), mesh,
                            jaxcoll.ZeRO(stage=3, axis="local", replica_axis="node"))
  state, _ = trainer.step(trainer.init(params), batch)
  full = jax.tree.map(np.asarray, trainer.params(state))
  assert trainer.params_digest(state) == (*loop.params_digest(full), [])
