"""tests/train's one launched job, 2 processes x 4 devices over gloo (a launch costs
two JAX start-ups and a rendezvous): _two_process_worker.py runs test_trainer's
init from processes with different params, then test_checkpoint's ZeRO-3 save from
two processes; each part prints ``RESULT <part> {json}`` and one test below reads it."""

import json
import os
import sys
from pathlib import Path

import jax
import jobs
import numpy as np
import optax
import pytest
from mlp_task import init_mlp, mse

import jaxcoll

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_two_process_worker.py")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
  """(the finished launch, the directory its checkpoint part wrote)."""
  directory = tmp_path_factory.mktemp("two_process_job")
  out = jobs.launch(sys.executable, WORKER, str(directory), processes=2, devices=4,
                    launcher_flags=("--init_timeout_s=60", "--timeout_s=200", "--grace_s=2"),
                    timeout=240)
  return out, directory


def _results(out, part: str) -> list[dict]:
  needle = f"RESULT {part} "
  return [json.loads(line.split(needle, 1)[1]) for line in out.stdout.splitlines()
          if needle in line]


def _from_both_processes(job, what: str) -> list[dict]:
  """The job ended well and both processes reported ``what``: their results."""
  r, _ = job
  log = (r.stdout + r.stderr)[-6000:]
  assert r.returncode == 0, log
  results = _results(r, what)
  assert sorted(x["process"] for x in results) == [0, 1], log
  return results


def test_init_takes_device_0_values_from_processes_with_different_jax_params(job):
  """2 processes x 4 devices pass different jax-array params; both start from process 0's."""
  results = _from_both_processes(job, "init")
  expected = float(np.asarray(init_mlp(seed=0)["layer0"]["b"])[0])
  for x in results:
    assert x["replica_problems"] == []
    assert x["b0"] == {"DP(auto)": expected, "ZeRO-3": expected}


def test_save_from_two_processes_restore_in_one(job):
  """ZeRO-3 over 2 processes x 4 devices, restored as DP on 1 x 8 (and 2 x 4)."""
  from jaxcoll.train.checkpoint import Checkpointer  # noqa: PLC0415

  results = _from_both_processes(job, "checkpoint")
  directory = job[1]
  assert all(x["devices"] == 8 and x["processes"] == 2 for x in results)

  trainer = jaxcoll.Trainer(mse, optax.adam(1e-2), jaxcoll.devices.flat_mesh(8),
                            jaxcoll.DataParallel())
  trainer.init(init_mlp())
  with Checkpointer(Path(directory) / "ckpt") as ckpt:
    state, position, extra = ckpt.restore(trainer)
  assert position == 3 and extra == {"saved_by": "2x4"}
  expected = np.load(Path(directory) / "params.npz")
  restored = jax.tree.map(np.asarray, trainer.params(state))
  for name in ("layer0", "layer1", "layer2"):
    for leaf in ("w", "b"):
      np.testing.assert_array_equal(restored[name][leaf], expected[f"{name}.{leaf}"])
