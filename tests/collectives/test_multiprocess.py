"""Collectives across real processes: 2 processes x 4 CPU devices over gloo.

One launcher run (start-up of two JAX processes costs seconds) of
tests/_mp_worker.py, which checks every collective and algorithm against
``jaxcoll.collectives.reference`` on the ``("node", "local")`` mesh (node =
process) and on the flat ``("data",)`` mesh, and prints one JSON line.
"""

import json
import sys
from pathlib import Path

import jobs

ROOT = Path(__file__).resolve().parents[2]
NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 4


def test_collectives_across_processes():
  r = jobs.launch(
      sys.executable, str(ROOT / "tests" / "_mp_worker.py"),
      processes=NUM_PROCESSES, devices=DEVICES_PER_PROCESS,
      launcher_flags=("--init_timeout_s=60", "--timeout_s=150", "--grace_s=2"), timeout=180,
  )
  log = (r.stdout + r.stderr)[-6000:]
  assert r.returncode == 0, log
  results = {}
  for line in r.stdout.splitlines():
    prefix, _, rest = line.partition(" ")
    if "RESULT " in rest:  # after any C++ log fragment of the same process (jobs.say_result)
      result = json.loads(rest.split("RESULT ", 1)[1])
      assert prefix == f"[p{result['process_id']}]"
      results[result["process_id"]] = result
  assert sorted(results) == list(range(NUM_PROCESSES)), log
  for result in results.values():
    assert result["num_processes"] == NUM_PROCESSES
    assert result["method"] == "env"
    assert result["devices_per_process"] == DEVICES_PER_PROCESS
    assert result["global_devices"] == NUM_PROCESSES * DEVICES_PER_PROCESS
    assert result["mismatches"] == 0
    assert result["checks"] >= 200  # every case x every rank x both meshes
