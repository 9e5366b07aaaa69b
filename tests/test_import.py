"""`import jaxcoll` without JAXCOLL_CPU_DEVICES does no global work."""

import json
import subprocess
import sys

import jobs

from jaxcoll.collectives import algorithms

_SCRIPT = r"""
import json
import jax
import jax._src.xla_bridge as xb
before = dict(jax.config.values)
import jaxcoll
from jaxcoll.comm_model import tuning
from jaxcoll.collectives import _dispatch
report = {
    "changed": sorted(k for k in set(before) | set(jax.config.values)
                      if before.get(k) != jax.config.values.get(k)),
    "backend_started": xb.backends_are_initialized(),
    "chooser_installed": _dispatch._auto_chooser is not _dispatch._DEFAULT,
    "default_is_tuning": _dispatch._default_chooser is tuning.choose,
    "table_loaded": tuning._active is not tuning._UNSET,
}
try:
  jaxcoll.devices.flat_mesh(8)
except ValueError as e:
  report["error"] = str(e)
# `auto` resolves the chooser and the shipped table on first use.
report["auto"] = _dispatch.choose_algorithm(
    "all_reduce", 1 << 20, _dispatch.Group(("data",), (8,)), "float32")
report["table_loaded_after_auto"] = tuning._active is not tuning._UNSET
print(json.dumps(report))
"""


def test_import_changes_nothing_global_and_resolves_auto_on_first_use():
  env = jobs.clean_env()
  del env["JAXCOLL_CPU_DEVICES"]
  out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                       text=True, timeout=120, check=False, cwd=jobs.REPO)
  assert out.returncode == 0, out.stderr
  report = json.loads(out.stdout.strip().splitlines()[-1])
  assert report["changed"] == []
  assert report["backend_started"] is False
  assert report["chooser_installed"] is False
  assert report["default_is_tuning"] is True
  assert report["table_loaded"] is False
  assert report["error"].startswith("`num_devices` must be in 1..1")
  assert "JAXCOLL_CPU_DEVICES=8" in report["error"]
  assert "jaxcoll.devices.simulate_cpu_devices(8)" in report["error"]
  assert report["auto"] in algorithms("all_reduce")
  assert report["table_loaded_after_auto"] is True

