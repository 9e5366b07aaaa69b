"""Old module paths of the layout move still import: the same module, a warning where due."""

import importlib
import subprocess
import sys
import warnings

import jobs
import pytest

import jaxcoll
from jaxcoll import _moved


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_old_path_is_the_new_module(old):
  new = importlib.import_module(_moved.MOVED[old])
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    sys.modules.pop(old, None)
    module = importlib.import_module(old)
  assert module is new
  deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
  if old in _moved.KEPT:
    assert deprecations == []
  else:
    assert len(deprecations) >= 1
    assert _moved.MOVED[old] in str(deprecations[0].message)


def test_attribute_access_of_old_names():
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    assert jaxcoll.devices is importlib.import_module("jaxcoll.runtime.devices")
    assert jaxcoll.checkpoint is importlib.import_module("jaxcoll.train.checkpoint")
  with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
    jaxcoll.nonexistent  # noqa: B018


def test_python_m_jaxcoll_launch_still_runs():
  r = jobs.run([sys.executable, "-m", "jaxcoll.launch", "--help"], timeout=60)
  assert r.returncode == 0, r.stderr
  assert "--num_processes" in r.stdout
  assert "DeprecationWarning" not in r.stderr


def test_from_package_import_of_a_moved_runner_module_warns_in_a_fresh_process():
  script = ("import warnings; warnings.simplefilter('always')\n"
            "from jaxcoll.train import loop\n"
            "import jaxcoll.run.loop\n"
            "print(loop is jaxcoll.run.loop)")
  r = subprocess.run([sys.executable, "-c", script], env=jobs.clean_env(), cwd=jobs.REPO,
                     capture_output=True, text=True, timeout=120, check=False)
  assert r.returncode == 0, r.stderr
  assert r.stdout.strip() == "True"
  assert "`jaxcoll.train.loop` moved to `jaxcoll.run.loop`" in r.stderr
