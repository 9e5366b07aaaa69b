"""Collectives across real processes: 2 processes x 4 CPU devices over gloo.

One launcher run (start-up of two JAX processes costs seconds) of
tests/_mp_worker.py, which checks every collective and algorithm against
``jaxcoll.collectives.reference`` on the ``("node", "local")`` mesh (node =
process) and on the flat ``("data",)`` mesh, and prints one JSON line.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 4


def test_collectives_across_processes():
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAXCOLL_")}
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "jaxcoll.launch",
      f"--num_processes={NUM_PROCESSES}",
      f"--devices_per_process={DEVICES_PER_PROCESS}",
      "--init_timeout_s=60",
      "--timeout_s=150",
      "--grace_s=2",
      "--",
      sys.executable,
      str(ROOT / "tests" / "_mp_worker.py"),
    ],
    check=False,
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=180,
  )
  log = (r.stdout + r.stderr)[-6000:]
  assert r.returncode == 0, log
  results = {}
  for line in r.stdout.splitlines():
    prefix, _, rest = line.partition(" ")
    if rest.startswith("RESULT "):
      result = json.loads(rest[len("RESULT ") :])
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
