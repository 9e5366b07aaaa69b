"""`jaxcoll <command>` and `--config=NAME` in a checkout (issue 23); the
installed wheel: test_install.py."""

import os
import subprocess
import sys

import jobs
import pytest

from experiments import _cli
from jaxcoll import cli


def test_shipped_config_names_resolve_to_their_files(tmp_path):
  configs = os.path.join(jobs.REPO, "configs")
  argv = ["train", "--config=resnet_dp8:smoke", "--config.steps=3", "--config=configs/minimal.py",
          "--config=minimal.py:smoke,files", "--config", "default:smoke"]
  os.chdir(tmp_path)  # not the checkout: configs/minimal.py is not a file here
  try:
    _cli.resolve_config_name(configs, argv)
    for bad in ("nope", "/abs/missing.py", "base", "configs/__init__.py"):
      with pytest.raises(ValueError, match=r"no such file, nor a shipped config; shipped "
                         r"configs: .*default, .*minimal"):
        _cli.resolve_config_name(configs, [f"--config={bad}"])
  finally:
    os.chdir(jobs.REPO)
  assert argv == ["train", f"--config={configs}/resnet_dp8.py:smoke", "--config.steps=3",
                  f"--config={configs}/minimal.py", f"--config={configs}/minimal.py:smoke,files",
                  "--config", f"{configs}/default.py:smoke"]  # absl reads this form too
  given = tmp_path / "mine.py"
  given.write_text("")
  argv = [f"--config={given}:x"]
  _cli.resolve_config_name(configs, argv)
  assert argv == [f"--config={given}:x"]  # a file of yours stays yours


def test_commands_and_configs_are_listed():
  assert cli.root() == jobs.REPO  # a checkout runs its own experiments/
  assert set(cli.config_names()) == {
      f[:-3] for f in os.listdir(os.path.join(jobs.REPO, "configs"))
      if f.endswith(".py") and f not in ("base.py", "__init__.py")}
  for module, _ in cli.COMMANDS.values():
    assert os.path.isfile(os.path.join(jobs.REPO, "experiments", f"{module}.py")), module


def _jaxcoll(*args, cwd, run=jobs.run):
  return run([sys.executable, "-m", "jaxcoll.cli", *args], cwd=cwd)


def test_jaxcoll_command_runs_from_another_directory_and_bad_input_is_exit_2(tmp_path):
  unknown = _jaxcoll("trian", cwd=tmp_path)
  assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1, unknown.stderr
  assert "unknown command 'trian'" in unknown.stderr and "train" in unknown.stderr
  missing = _jaxcoll("train", "--config=no_such_config", "--workdir=w", cwd=tmp_path,
                     run=jobs.forked)  # the first one started a real Python
  assert missing.returncode == 2, missing.stderr[-3000:]
  assert missing.stderr.count("\n") == 1 and "no_such_config" in missing.stderr
  assert "no such file, nor a shipped config; shipped configs: " in missing.stderr
  assert "minimal" in missing.stderr
  assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("args", [["--help"]])
def test_usage_lists_the_commands(args):
  out = subprocess.run([sys.executable, "-c", "import sys; from jaxcoll import cli; "
                        "sys.exit(cli.main(sys.argv[1:]))", *args],
                       capture_output=True, text=True, timeout=120, env=jobs.clean_env())
  assert out.returncode == (0 if args else 2)
  assert "train" in out.stdout and "launch" in out.stdout and "configs" in out.stdout


@pytest.mark.parametrize("args", [["report", "--help"], ["eval", "--helpfull"]])
def test_a_commands_help_prints_its_flags_and_exits_0(args, tmp_path):
  # absl prints --help and exits 1: `jaxcoll train --help && ...` failed, where `jaxcoll --help`
  # and `jaxcoll launch --help` exit 0.
  out = _jaxcoll(*args, cwd=tmp_path)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "--workdir" in out.stdout and "--out_dir" in out.stdout
  assert not out.stderr.strip()


def test_help_is_a_flag_only_before_the_double_dash():
  assert _cli.asks_for_help(["train", "--config=x", "--help"])
  assert _cli.asks_for_help(["train", "-?"])
  assert not _cli.asks_for_help(["train", "--helper"])
  assert not _cli.asks_for_help(["train", "--", "--help"])
