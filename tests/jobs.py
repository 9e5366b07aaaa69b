"""Running jaxcoll as users do, in subprocesses: the trainer CLI and the
multi-process launcher. Every call has a timeout, so nothing can hang a test."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def clean_env(devices: int = 8, **extra: str) -> dict[str, str]:
  """This environment without JAXCOLL_* settings, with the repo and the shared test helpers
  (``tests/``: jobs, mlp_task) importable."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAXCOLL_")}
  env["PYTHONPATH"] = os.pathsep.join(
      filter(None, [REPO, os.path.join(REPO, "tests"), env.get("PYTHONPATH")]))
  env.update({"JAXCOLL_CPU_DEVICES": str(devices)}, **extra)
  return env


def run(cmd, *, devices=8, cwd=REPO, timeout=300, **env) -> subprocess.CompletedProcess:
  return subprocess.run(
      cmd, cwd=cwd, env=clean_env(devices, **env), capture_output=True, text=True,
      timeout=timeout, check=False,
  )


def train(*flags, devices=8, cwd=REPO, timeout=300, **env) -> subprocess.CompletedProcess:
  """``python -m experiments.train FLAGS`` on ``devices`` emulated devices."""
  return run([sys.executable, "-m", "experiments.train", *flags], devices=devices, cwd=cwd,
             timeout=timeout, **env)


def launch(*cmd, processes=2, devices=4, launcher_flags=(), timeout=300):
  """``python -m jaxcoll.launch`` of ``cmd`` as ``processes`` x ``devices``."""
  return run(
      [sys.executable, "-m", "jaxcoll.launch", f"--num_processes={processes}",
       f"--devices_per_process={devices}", *launcher_flags, "--", *cmd],
      devices=devices, timeout=timeout,
  )


def summary(workdir) -> dict:
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f)
