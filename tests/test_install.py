"""The runner is part of the installed package (issue 23): a wheel built from
this checkout, installed into a fresh virtual environment, gives console
scripts that run from any directory with the shipped configs by name."""

import json
import os
import shutil
import site
import subprocess
import sys

import jobs
import pytest

SOURCES = ("pyproject.toml", "setup.py", "README.md", "jaxcoll", "experiments", "configs")


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
  """A fresh venv with the wheel installed (--no-deps: its dependencies are
  this interpreter's, seen through a .pth file; nothing is downloaded)."""
  tmp = tmp_path_factory.mktemp("install")
  src = tmp / "src"
  src.mkdir()
  for name in SOURCES:  # a copy: building writes build/ next to the sources
    copy = shutil.copytree if os.path.isdir(os.path.join(jobs.REPO, name)) else shutil.copy
    kwargs = {"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}
    copy(os.path.join(jobs.REPO, name), src / name, **kwargs)
  built = subprocess.run(
      [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
       "-w", str(tmp / "wheel"), str(src)], capture_output=True, text=True, timeout=300)
  assert built.returncode == 0, built.stderr[-3000:]
  assert "deprecated" not in built.stderr.lower(), built.stderr[-3000:]  # SPDX license
  (wheel,) = (tmp / "wheel").iterdir()
  env = tmp / "venv"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True,
                 timeout=120)
  python = env / "bin" / "python"
  purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                            "['purelib'])"], capture_output=True, text=True, check=True).stdout
  installed = subprocess.run(
      [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
       "--no-index", str(wheel)], capture_output=True, text=True, timeout=300,
      env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
  assert installed.returncode == 0, installed.stderr[-3000:]
  # After the install, so that pip never sees (nor touches) this environment's jaxcoll.
  with open(os.path.join(purelib.strip(), "deps.pth"), "w") as f:
    f.write("\n".join(site.getsitepackages()) + "\n")
  return env


def _run(venv, *cmd, cwd):
  """``cmd`` with the venv's bin first on PATH, nothing of this checkout importable."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAXCOLL_")}
  env.pop("PYTHONPATH", None)
  env["XLA_FLAGS"] = ""  # XLA's default code generator, as users compile (tests/conftest.py)
  env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
  return subprocess.run([str(venv / "bin" / cmd[0]), *cmd[1:]], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=300, check=False)


def test_installed_train_runs_from_anywhere_with_a_shipped_config(venv, tmp_path):
  where = _run(venv, "python", "-c", "import jaxcoll; print(jaxcoll.__file__)", cwd=tmp_path)
  assert where.stdout.startswith(str(venv)), where.stdout + where.stderr  # not the checkout
  out = _run(venv, "jaxcoll-train", "--config=minimal:smoke", "--workdir=run", cwd=tmp_path)
  assert out.returncode == 0, out.stderr[-3000:]
  with open(tmp_path / "run" / "summary.json") as f:
    installed = json.load(f)
  # The same run as `python -m experiments.train` in the checkout.
  checkout = jobs.train("--config=configs/minimal.py:smoke", f"--workdir={tmp_path / 'ck'}",
                        XLA_FLAGS="")
  assert checkout.returncode == 0, checkout.stderr[-3000:]
  assert installed["params_sha256"] == jobs.summary(tmp_path / "ck")["params_sha256"]
  names = _run(venv, "jaxcoll", "configs", cwd=tmp_path).stdout.split()  # what --config=NAME takes
  assert names == sorted(names) and {"default", "minimal", "resnet_dp8"} <= set(names)
  assert "base" not in names


@pytest.mark.slow  # the fast sibling: test_installed_train_runs_from_anywhere_...
def test_installed_report_and_launch(venv, tmp_path):
  out = _run(venv, "jaxcoll-launch", "--num_processes=2", "--devices_per_process=4", "--",
             "jaxcoll-train", "--config=configs/minimal.py:smoke", "--workdir=run", cwd=tmp_path)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  with open(tmp_path / "run" / "summary.json") as f:
    assert json.load(f)["num_processes"] == 2
  report = _run(venv, "jaxcoll", "report", "--workdir=run", cwd=tmp_path)
  assert report.returncode == 0, report.stderr[-3000:]
  assert (tmp_path / "run" / "report.png").stat().st_size > 0


@pytest.mark.slow  # the fast sibling: test_cli.py's unknown command and config name
def test_installed_bad_input_is_one_line_and_exit_2(venv, tmp_path):
  unknown = _run(venv, "jaxcoll", "trian", cwd=tmp_path)
  assert unknown.returncode == 2 and len(unknown.stderr.strip().splitlines()) == 1
  assert "unknown command 'trian'" in unknown.stderr and "train" in unknown.stderr
  missing = _run(venv, "jaxcoll-train", "--config=no_such_config", "--workdir=w", cwd=tmp_path)
  assert missing.returncode == 2, missing.stderr[-3000:]
  assert len(missing.stderr.strip().splitlines()) == 1 and "no_such_config" in missing.stderr
  assert not (tmp_path / "w").exists()
  usage = _run(venv, "jaxcoll", cwd=tmp_path)
  assert usage.returncode == 2 and "train" in usage.stdout and "launch" in usage.stdout
