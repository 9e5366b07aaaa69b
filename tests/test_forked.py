"""tests/jobs.py's ``forked``: a run forked from a warm Python ends as the
real command line does (a bad input's status, stdout and stderr; a training
run's params), in a process of its own, and the server it forks from ends
with the pytest process."""

import json
import os
import select
import signal
import subprocess
import sys
import time

import jobs
import pytest

BAD = (jobs.SMOKE, "--config.global_batch_size=30")


def test_forked_bad_input_ends_as_the_real_command_line(tmp_path):
  real = jobs.train(*BAD, f"--workdir={tmp_path / 'real'}")
  forked = jobs.train_forked(*BAD, f"--workdir={tmp_path / 'real'}")
  assert real.returncode == 2, real.stderr[-2000:]
  assert (forked.returncode, forked.stdout, forked.stderr) == (
      real.returncode, real.stdout, real.stderr)
  assert "not divisible by data-parallel size 8" in forked.stderr
  assert not (tmp_path / "real").exists()


def test_forked_training_run_ends_with_the_real_command_lines_params(tmp_path):
  flags = (jobs.SMOKE, "--config.steps=2", "--config.checkpoint_every=0")
  real = jobs.train(*flags, f"--workdir={tmp_path / 'real'}")
  forked = jobs.train_forked(*flags, f"--workdir={tmp_path / 'forked'}")
  assert (real.returncode, forked.returncode) == (0, 0), forked.stderr[-2000:]
  sha = jobs.summary(tmp_path / "real")["params_sha256"]
  assert jobs.summary(tmp_path / "forked")["params_sha256"] == sha
  assert f"params sha256 {sha[:16]}..." in forked.stdout


def test_forked_child_has_its_own_process_argv_cwd_and_environment(tmp_path):
  (tmp_path / "probe.py").write_text(
      "import json, logging, os, sys\nimport numpy as np\n"
      "print(json.dumps([os.getpid(), os.getppid(), os.getcwd(),"
      " sys.argv[1:], sys.path[0], os.environ['JAXCOLL_CPU_DEVICES'],"
      " 'jaxcoll' in sys.modules, len(logging.root.handlers), np.random.random()]))\n"
      "sys.exit(3)\n")
  cmd = [sys.executable, "-m", "probe", "--a=1", "b"]
  out = jobs.forked(cmd, cwd=tmp_path, devices=4, timeout=60)
  assert out.returncode == 3, out.stderr
  pid, ppid, cwd, argv, path0, devices, imported, handlers, rand = json.loads(out.stdout)
  assert pid != os.getpid() and ppid == jobs._SERVER["server"].proc.pid
  # A new process's logging (no handler on the root logger: orbax's import in the server
  # gave it one) and its own random state (not the server's, the same in every child).
  assert (cwd, argv, path0, devices, imported, handlers) == (
      str(tmp_path), ["--a=1", "b"], str(tmp_path), "4", False, 0)
  again = jobs.forked(cmd, cwd=tmp_path, devices=4, timeout=60)
  assert json.loads(again.stdout)[-1] != rand
  with pytest.raises(subprocess.TimeoutExpired):
    jobs.forked([sys.executable, "-m", "time_sleep_forever"], cwd=_sleeper(tmp_path), timeout=2)
  assert jobs.forked(cmd, cwd=tmp_path, timeout=60).returncode == 3  # still serving


def _sleeper(tmp_path):
  (tmp_path / "time_sleep_forever.py").write_text("import time\ntime.sleep(600)\n")
  return tmp_path


def test_one_server_serves_every_test_of_a_pytest_process(monkeypatch):
  """PYTEST_CURRENT_TEST (pytest sets it anew for every test) does not start a
  new server: it made every test pay the ~2.5 CPU-s start-up it should save."""
  bogus = [sys.executable, "-m", "experiments.train", "--bogus"]
  assert jobs.forked(bogus, timeout=60).returncode == 2
  starts = list(jobs._SERVER_STARTS)
  assert starts[-1] == jobs._SERVER["server"].proc.pid
  monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/test_forked.py::the_next_test (call)")
  assert jobs.forked(bogus, timeout=60).returncode == 2
  assert jobs._SERVER_STARTS == starts
  monkeypatch.setenv("JAX_ENABLE_X64", "1")  # one the server's imports read: a new server
  assert jobs.forked(bogus, timeout=60).returncode == 2
  assert len(jobs._SERVER_STARTS) == len(starts) + 1


def test_fork_server_ends_when_closed():
  jobs.forked([sys.executable, "-m", "experiments.train", "--bogus"], timeout=60)
  server = jobs._SERVER["server"].proc
  jobs.close_fork_server()
  assert server.poll() is not None and "server" not in jobs._SERVER


def test_fork_server_removes_its_directory_when_its_stdin_closes():
  """As when the pytest worker is killed without closing it."""
  server = jobs._ForkServer()
  server.proc.stdin.close()
  assert server.proc.wait(timeout=60) == 0
  assert not os.path.exists(server.tmp)
  server.proc.stdout.close()
  server.err.close()


def test_forked_code_runs_as_python_dash_c(tmp_path):
  """``[python, -c, CODE, ARGS]``: argv ``["-c", ARGS]``, the working directory first on the
  path (as ''), ``__name__ == "__main__"``; an uncaught exception is a traceback and
  status 1, as the real ``python -c``'s."""
  code = ("import json, os, sys\nprint(json.dumps([os.getppid(), os.getcwd(), sys.argv,"
          " sys.path[0], __name__]))\nsys.exit(3)\n")
  out = jobs.forked([sys.executable, "-c", code, "--a=1", "b"], cwd=tmp_path, timeout=60)
  assert out.returncode == 3, out.stderr
  ppid, cwd, argv, path0, name = json.loads(out.stdout)
  assert ppid == jobs._SERVER["server"].proc.pid
  assert (cwd, argv, path0, name) == (str(tmp_path), ["-c", "--a=1", "b"], "", "__main__")
  raises = [sys.executable, "-c", "raise RuntimeError('boom')"]
  real, forked = jobs.run(raises, timeout=60), jobs.forked(raises, timeout=60)
  assert (forked.returncode, forked.stderr) == (real.returncode, real.stderr) == (1, (
      'Traceback (most recent call last):\n  File "<string>", line 1, in <module>\n'
      "RuntimeError: boom\n"))


@pytest.mark.parametrize("warm_workers", [False, True])
def test_a_forked_launcher_that_times_out_takes_its_children_with_it(tmp_path, warm_workers):
  """The timeout's SIGKILL of a forked launcher ends its children (PR_SET_PDEATHSIG), as a
  real launcher's does, warm ones too: none is left running."""
  code = (f"import os, time\nopen({str(tmp_path)!r} + '/p' + os.environ['JAXCOLL_PROCESS_ID'],"
          " 'w').write(str(os.getpid()))\ntime.sleep(600)\n")
  with pytest.raises(subprocess.TimeoutExpired):
    jobs.forked(jobs.launch_cmd(sys.executable, "-c", code, devices=1), devices=1, timeout=8,
                warm_workers=warm_workers)
  pids = [int((tmp_path / f"p{i}").read_text()) for i in range(2)]
  deadline = time.monotonic() + 10
  while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not any(_running(pid) for pid in pids), pids


def _running(pid):
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split()[2] != "Z"  # a zombie has ended
  except OSError:
    return False


# What a process of a launched job sees of its start: argv, cwd, path, environment, parent,
# session, death signal, signal handlers, descriptors, standard streams, JAX's devices.
_WORKER_PROBE = r"""
import ctypes, json, os, signal, sys
import jax
import jaxcoll  # as every command of a launched job does (JAXCOLL_CPU_DEVICES)
pdeathsig = ctypes.c_int()
ctypes.CDLL(None).prctl(2, ctypes.byref(pdeathsig), 0, 0, 0)  # PR_GET_PDEATHSIG
handlers = {}
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ,
          signal.SIGCHLD, signal.SIGUSR1):
  h = signal.getsignal(s)
  handlers[s.name] = "default_int_handler" if h is signal.default_int_handler else str(h)
streams = {name: [getattr(sys, name).line_buffering, getattr(sys, name).write_through,
                  type(getattr(sys, name).buffer).__name__, getattr(sys, name).encoding,
                  getattr(sys, name).errors, getattr(sys, name).name,
                  getattr(sys, name) is getattr(sys, "__%s__" % name),
                  os.path.realpath("/proc/self/fd/%d" % getattr(sys, name).fileno())[:5]]
           for name in ("stdin", "stdout", "stderr")}
import logging
import absl.logging
logs = [[type(h).__name__ + ("=stderr" if getattr(h, "stream", None) is sys.stderr else "")
         for h in getattr(x, "handlers", [x])]
        for x in (logging.root, absl.logging.get_absl_handler().python_handler)]
env = {k: v for k, v in os.environ.items() if k != "JAXCOLL_COORDINATOR"}
env.pop("PYTEST_CURRENT_TEST", None)
ctypes.CDLL(None).printf(b"C-LEVEL ")  # C's stdout: unbuffered (-u) reaches the pipe first
print(json.dumps({
    "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
    "env": env, "ppid": os.getppid(), "session_leader": os.getsid(0) == os.getpid(),
    "pdeathsig": pdeathsig.value, "signals": handlers, "fds": sorted(os.listdir("/proc/self/fd")),
    "streams": streams, "logging": logs, "devices": jax.device_count(),
    "command": jaxcoll._COMMAND,
}))
print("a line on stderr", file=sys.stderr)
sys.exit(int(os.environ["JAXCOLL_PROCESS_ID"]) * 5)
"""


def _probed(tmp_path, how: str, warm: bool):
  """The probe's rows ({"[p0]": ..., "[p1]": ...}) from a 2 x 2 job of ``python HOW``."""
  (tmp_path / "probe.py").write_text(_WORKER_PROBE)
  what = {"-m": ["-m", "probe"], "-c": ["-c", _WORKER_PROBE],
          "script": [str(tmp_path / "probe.py")]}[how]
  cmd = jobs.launch_cmd(sys.executable, *what, "--flag=1", processes=2, devices=2)
  # The launcher's JAX is set up for 8 devices: a warm process sets its 2 up again.
  out = jobs.forked(cmd, cwd=tmp_path, devices=8, timeout=120, warm_workers=warm)
  assert out.returncode == 5, out.stderr[-3000:]  # process 1's
  assert "process 1 exited with status 5" in out.stderr
  assert "[p0] a line on stderr" in out.stderr and "[p1] a line on stderr" in out.stderr
  rows = dict(line.split(" ", 1) for line in out.stdout.splitlines())
  assert sorted(rows) == ["[p0]", "[p1]"], out.stdout[-3000:]
  assert all(text.startswith("C-LEVEL {") for text in rows.values()), out.stdout[-3000:]
  rows = {p: json.loads(text.removeprefix("C-LEVEL ")) for p, text in rows.items()}
  assert rows["[p0]"].pop("ppid") == rows["[p1]"].pop("ppid") != jobs._SERVER["server"].proc.pid
  return rows


def test_a_warm_worker_of_the_launcher_starts_as_a_real_one(tmp_path, monkeypatch):
  """jobs.launch(warm_workers=True): each process of the job is a fork of the (forked)
  launcher; it sees what a real start of its command sees (``python -m MODULE``; ``-c CODE``
  and ``SCRIPT`` differ from it only in argv, sys.path[0], as Python's own start makes them).
  The launcher's standard streams are buffered, its processes' not (the launcher gives them
  PYTHONUNBUFFERED=1): a warm one makes its own."""
  monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
  real = _probed(tmp_path, "-m", warm=False)
  row = real["[p1]"]
  assert (row["argv"], row["path0"], row["devices"], row["env"]["JAXCOLL_CPU_DEVICES"],
          row["session_leader"], row["pdeathsig"], row["fds"], row["signals"]["SIGINT"],
          row["logging"]) == (
      [str(tmp_path / "probe.py"), "--flag=1"], str(tmp_path), 2, "2", True, signal.SIGKILL,
      ["0", "1", "2", "3"], "default_int_handler", [[], ["PythonHandler=stderr"]])
  assert row["streams"]["stdout"][:3] == [False, True, "FileIO"]  # unbuffered
  for how, argv0, path0 in (("-m", *row["argv"][:1], row["path0"]), ("-c", "-c", ""),
                            ("script", str(tmp_path / "probe.py"), str(tmp_path))):
    warm = _probed(tmp_path, how, warm=True)
    for p, row in warm.items():
      assert (row.pop("argv"), row.pop("path0")) == ([argv0, "--flag=1"], path0)
      for key, value in row.items():
        assert value == real[p][key], (how, p, key)


def test_answers_that_arrive_together_are_both_read_at_once():
  """The server answers a run's pid, then its exit status; when both are in the pipe before
  the first is read (a run that ends at once, a loaded machine), the status was left in the
  text reader's buffer and the wait for it lasted the whole timeout."""
  cmd = [sys.executable, "-c", "pass"]
  server = jobs._server_for(cmd, jobs.clean_env())
  out = os.path.join(server.tmp, "stdout")
  server.proc.stdin.write(json.dumps({"argv": cmd, "cwd": jobs.REPO, "env": jobs.clean_env(),
                                      "stdout": out, "stderr": out}) + "\n")
  server.proc.stdin.flush()
  select.select([server.proc.stdout], [], [], 60)
  time.sleep(1.0)  # the run has ended: its pid and status are both in the pipe
  t0 = time.monotonic()
  assert server._answer(t0 + 5) > 0 and server._answer(t0 + 5) == 0
