"""Cases a user brought that no other test had tried (engineer trial12): the run report,
Ctrl-C at start-up, config files and eval-only. Each test of a fix fails without it."""

import os
import signal
import subprocess
import sys
import time

import jobs
import pytest


def test_the_report_of_a_one_step_run_draws_its_points(tmp_path, monkeypatch):
  """A run of `--config.steps=1` has one train row: its loss, grad_norm and learning_rate
  panels (lines without markers) drew nothing, a legend over an empty panel."""
  pytest.importorskip("matplotlib")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  from jaxcoll.observe import metrics, run_report  # noqa: PLC0415

  w = metrics.MetricsWriter(str(tmp_path))
  w.write(1, {"loss": 2.4, "grad_norm": 1.4, "learning_rate": 1e-3, "step_time_s": 0.01,
              "examples_per_s": 1400, "data_time_s": 1e-5, "skipped_steps": 0})
  w.close()
  figures = []
  monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
  run_report.draw(run_report.load_run(str(tmp_path)), str(tmp_path / "r.png"))
  (fig,) = figures
  drawn = [line for ax in fig.axes for line in ax.get_lines() if len(line.get_xdata()) == 1]
  assert len(drawn) >= 6  # loss, grad_norm, learning_rate, step time, examples/s, data, skipped
  assert all(line.get_marker() not in ("None", "", None, " ") for line in drawn), [
      (line.get_label(), line.get_marker()) for line in drawn]


# Imported first by Python (PYTHONPATH): JAX's import says so on stderr and takes 30 s, so
# a Ctrl-C lands in it as it does on a slow disk (JAX's import: 1-2 s here).
_SLOW_JAX = '''
import sys, time
class _Slow:
  def find_spec(self, name, path=None, target=None):
    if name == "jax":
      sys.meta_path.remove(self)
      sys.stderr.write("importing jax\\n"); sys.stderr.flush()
      time.sleep(30)
    return None
sys.meta_path.insert(0, _Slow())
'''


def _ctrl_c_while_importing_jax(tmp_path, cmd):
  (tmp_path / "site").mkdir()
  (tmp_path / "site" / "sitecustomize.py").write_text(_SLOW_JAX)
  env = jobs.clean_env(2)
  env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), env["PYTHONPATH"]])
  proc = subprocess.Popen(cmd, cwd=jobs.REPO, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  try:
    assert proc.stderr.readline() == "importing jax\n"
    proc.send_signal(signal.SIGINT)
    err = proc.stderr.read()
    proc.wait(timeout=20)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  return proc.returncode, err


@pytest.mark.usefixtures("sigint_as_from_a_terminal")
def test_ctrl_c_while_the_launcher_imports_jax_is_one_line_and_exit_130(tmp_path):
  """Ctrl-C while `python -m jaxcoll.launch` imported JAX: a KeyboardInterrupt traceback
  (exit 1), or, landing in JAX's gc callback ('Exception ignored in _xla_gc_callback'),
  nothing: the launcher went on and ran the whole job, exit 0."""
  status, err = _ctrl_c_while_importing_jax(tmp_path, jobs.launch_cmd(
      sys.executable, "-c", "pass", processes=2, devices=1))
  assert status == 130 and err.strip() == (
      "jaxcoll.launch: interrupted by SIGINT while starting; nothing was started or "
      "written."), err


@pytest.mark.usefixtures("sigint_as_from_a_terminal")
def test_ctrl_c_while_eval_imports_jax_is_one_line_and_exit_130(tmp_path):
  """The same for `python -m experiments.eval` (and report, and the console scripts)."""
  status, err = _ctrl_c_while_importing_jax(
      tmp_path, [sys.executable, "-m", "experiments.eval", f"--workdir={tmp_path}"])
  assert status == 130 and err.strip() == (
      "eval: interrupted by SIGINT while starting; nothing was started or written."), err


def test_a_field_my_config_file_left_out_is_not_called_unknown(tmp_path):
  """A config file whose get_config() returns a ConfigDict of only the fields it changes
  (the rest take RunConfig's defaults, as the README says) trains; `--config.learning_rate=`
  on it was 'unknown config field 'learning_rate'', a field every run has."""
  (tmp_path / "mine.py").write_text(
      "import ml_collections\n"
      "def get_config():\n"
      "  return ml_collections.ConfigDict({'steps': 2, 'global_batch_size': 16,\n"
      "                                    'checkpoint_every': 0})\n")
  line = jobs.one_line(jobs.forked(jobs.train_cmd(
      f"--config={tmp_path / 'mine.py'}", "--config.learning_rate=0.01",
      f"--workdir={tmp_path / 'w'}")), prefix="train: error: ")
  assert "unknown config field" not in line, line
  assert ("`--config.learning_rate`: " in line and "without 'learning_rate' (a field of every "
          "run, default 0.001)" in line and "configs.base.base_config()" in line), line
  assert not (tmp_path / "w").exists()


def test_a_variant_for_a_get_config_that_takes_none_is_one_line_naming_the_fix(tmp_path):
  """`--config=mine.py:smoke` on `def get_config():` put config_flags' whole traceback
  into the one line ('Error whilst parsing config file: Traceback (most recent call last):
  File ... TypeError: get_config() takes 0 positional arguments but 1 was given')."""
  (tmp_path / "mine.py").write_text(
      "from configs import base\n"
      "def get_config():\n"
      "  return base.base_config()\n")
  line = jobs.one_line(jobs.forked(jobs.train_cmd(
      f"--config={tmp_path / 'mine.py'}:smoke", f"--workdir={tmp_path / 'w'}")),
      prefix="train: error: ")
  assert "Traceback" not in line and "File " not in line, line
  assert line == (f"train: error: `--config={tmp_path / 'mine.py'}:smoke`: "
                  f"{tmp_path / 'mine.py'}'s get_config() takes no variant, but `:smoke` gives "
                  "one; drop `:smoke`, or define get_config(variant=None) and handle variant "
                  "== 'smoke' there."), line


_STOP_IN_GC = '''
import gc, os, signal, sys, threading, time
from jaxcoll.runtime import launch
armed = []
threading.Timer(2.0, lambda: armed.append(1)).start()
def callback(phase, info):  # Ctrl-C arriving while the main thread runs a gc callback
  if armed and phase == "start" and threading.current_thread() is threading.main_thread():
    armed.clear()
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(100):  # the handler runs here, inside the callback
      pass
gc.callbacks.append(callback)
gc.set_threshold(1)
sys.exit(launch.main(["--num_processes=1", "--devices_per_process=1", "--timeout_s=60", "--",
                      sys.executable, "-c", "import time; time.sleep(60)"]))
'''


def test_ctrl_c_dropped_in_a_gc_callback_still_stops_the_launcher(tmp_path):
  """The launcher's stop handler raises; raised while the main thread ran a gc callback
  (JAX registers one), Python printed 'Exception ignored in: <function callback ...>' and
  dropped it, and the launcher, ignoring the stop signals from then on, ran the job on
  (to its end, or --timeout_s)."""
  t0 = time.monotonic()
  out = jobs.run([sys.executable, "-c", _STOP_IN_GC], devices=1, timeout=120)
  assert out.returncode == 130, out.stderr[-2000:]
  assert "[launch] received SIGINT; stopped every process." in out.stderr
  assert time.monotonic() - t0 < 30


def test_a_cost_model_share_above_the_whole_step_is_not_reported_as_a_share(tmp_path):
  """The README's incidents run (default.py:smoke, ring, 8 devices) reported `comm share
  (cost-model estimate): 132.8% of the step`: the cost model priced the collectives at
  4.7 ms of a 3.9 ms step, and the report printed it as a share."""
  import json  # noqa: PLC0415

  from jaxcoll.observe import metrics, run_report  # noqa: PLC0415

  w = metrics.MetricsWriter(str(tmp_path))
  for step in (1, 2, 3):
    w.write(step, {"loss": 2.0, "step_time_s": 0.0039, "examples_per_s": 60000})
  w.close()
  summary = {"steps": 3, "comm_time_estimate_s": 0.0047237, "comm_share_estimate": 1.3279}
  (tmp_path / "summary.json").write_text(json.dumps(summary))
  (line,) = [x for x in run_report.summarize(run_report.load_run(str(tmp_path))).splitlines()
             if x.startswith("comm share (cost-model estimate)")]
  assert line == ("comm share (cost-model estimate): 132.8% of the step: more than the whole "
                  "step, so the cost model's price of the step's collectives (0.004724 s) is "
                  "too high for this machine, not a share; trace steps "
                  "(--config.profile_steps=A:B) for the measured one"), line
  summary["comm_share_estimate"] = 0.05  # a share below the step: as it was
  (tmp_path / "summary.json").write_text(json.dumps(summary))
  assert "comm share (cost-model estimate): 5.0% of the step\n" in run_report.summarize(
      run_report.load_run(str(tmp_path))) + "\n"


def test_eval_of_a_run_whose_only_save_never_finished_says_so(tmp_path):
  """A run killed while its first checkpoint was being written (`fail_at_step=4` with
  `checkpoint_every=2`: `checkpoints/2.orbax-checkpoint-tmp`): `experiments.eval` told the
  user to pass a run that saved checkpoints, 'config.checkpoint_every > 0', which it had."""
  (tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp" / "state.orbax-checkpoint-tmp").mkdir(
      parents=True)
  line = jobs.one_line(jobs.forked([sys.executable, "-m", "experiments.eval",
                                    f"--workdir={tmp_path}"]), prefix="eval: error: ")
  assert line == (
      f"eval: error: `--workdir` '{tmp_path}' has no committed checkpoint in "
      f"{tmp_path / 'checkpoints'}: the save of step 2 never finished (cut short by the job's "
      f"end; never read); a run that goes on there (python -m experiments.train "
      f"--workdir={tmp_path}) starts again from step 0, or pass the --workdir of a run with a "
      "finished save."), line
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2.orbax-checkpoint-tmp"]
