"""The launcher and jaxcoll.distributed's start-up, with real processes.

Every subprocess runs under a timeout, so a broken launcher fails the test
instead of hanging the suite. Commands other than the never-coming-peer test
are tiny Python scripts that do not import JAX.
"""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jobs
import pytest

from jaxcoll.runtime import distributed, launch

PY = sys.executable
LIMIT_S = 60  # the longest any launcher run below may take


def _launch(*args, timeout=LIMIT_S) -> subprocess.CompletedProcess:
  # Forked from a warm Python (jobs.forked: ~1.2 CPU-s less); the real starts of the launcher:
  # the jobs.timed / jobs.started tests below.
  return jobs.forked([PY, "-m", "jaxcoll.launch", *args], devices=1, timeout=timeout)


def _script(code: str) -> list[str]:
  return [PY, "-c", textwrap.dedent(code)]


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  # A zombie (exited, not yet reaped by its parent) counts as gone.
  try:
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
  except OSError:
    return False


def _wait_gone(pid: int, timeout: float = 5.0) -> bool:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if not _alive(pid):
      return True
    time.sleep(0.05)
  return False


def _children(proc, tmp_path) -> list[int]:
  """The pids the two children of ``proc`` write to ``tmp_path``/p0 and p1."""
  deadline = time.monotonic() + LIMIT_S
  while not all((tmp_path / f"p{i}").exists() for i in range(2)):
    assert time.monotonic() < deadline and proc.poll() is None, "children never started"
    time.sleep(0.05)
  time.sleep(0.1)  # the pid files are complete
  return [int((tmp_path / f"p{i}").read_text()) for i in range(2)]


# ---------------------------------------------------------------- launcher


def test_output_is_prefixed_and_env_is_set():
  cmd = _script("""
      import os, sys
      e = os.environ
      print("hello", e["JAXCOLL_PROCESS_ID"], e["JAXCOLL_NUM_PROCESSES"],
            e["JAXCOLL_CPU_DEVICES"], e["JAXCOLL_COORDINATOR"], e["JAXCOLL_RESTART"])
      print("second line")
      print("to stderr", file=sys.stderr)
  """)
  r = _launch("--num_processes=3", "--devices_per_process=2", "--", *cmd)
  assert r.returncode == 0, r.stderr
  lines = r.stdout.splitlines()
  hellos = sorted(line for line in lines if " hello " in line)
  assert len(hellos) == 3
  coordinators = set()
  for i, line in enumerate(hellos):
    m = re.fullmatch(rf"\[p{i}\] hello {i} 3 2 (127\.0\.0\.1:\d+) 0", line)
    assert m, line
    coordinators.add(m.group(1))
  assert len(coordinators) == 1  # one job, one coordinator
  assert sorted(line for line in lines if "second" in line) == [
    f"[p{i}] second line" for i in range(3)
  ]
  assert sorted(line for line in r.stderr.splitlines() if "to stderr" in line) == [
    f"[p{i}] to stderr" for i in range(3)
  ]


def test_one_failure_stops_the_others(tmp_path):
  # p0 ignores SIGTERM and sleeps forever: it needs the SIGKILL after --grace_s.
  # p1 waits until p0 is up, then fails with status 3.
  cmd = _script(f"""
      import os, signal, sys, time
      pid_file = {str(tmp_path / "p0.pid")!r}
      if os.environ["JAXCOLL_PROCESS_ID"] == "0":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with open(pid_file + ".tmp", "w") as f:
          f.write(str(os.getpid()))
        os.rename(pid_file + ".tmp", pid_file)
        time.sleep(1000)
      while not os.path.exists(pid_file):
        time.sleep(0.02)
      print("failing at", time.monotonic(), flush=True)  # CLOCK_MONOTONIC: every process's
      sys.exit(3)
  """)
  r = jobs.timed([PY, "-m", "jaxcoll.launch", "--num_processes=2", "--devices_per_process=1",
                  "--grace_s=1", "--", *cmd], devices=1, timeout=LIMIT_S)
  assert r.returncode == 3, r.stderr
  failed = float(next(line for line in r.stdout.splitlines() if "[p1] failing at" in line
                      ).split()[-1])
  # Timed from p1's failure, not from the start-up (Python and jaxcoll's
  # imports, many seconds on a loaded machine): the sleeper got its --grace_s
  # (1 s) after SIGTERM, then SIGKILL, and the launcher ended soon after.
  elapsed = r.ended - failed
  assert 1 <= elapsed < 1 + 20, f"launcher took {elapsed:.1f} s to stop the job"
  assert "process 1 exited with status 3" in r.stderr
  sleeper = int((tmp_path / "p0.pid").read_text())
  assert _wait_gone(sleeper), "the sleeping process survived the launcher"


def test_restart_after_failure(tmp_path):
  cmd = _script("""
      import os, sys
      print("attempt", os.environ["JAXCOLL_RESTART"], os.environ["JAXCOLL_COORDINATOR"])
      if os.environ["JAXCOLL_RESTART"] == "0" and os.environ["JAXCOLL_PROCESS_ID"] == "1":
        sys.exit(5)
  """)
  r = _launch(
    "--num_processes=2", "--devices_per_process=1", "--max_restarts=1", "--grace_s=1", "--", *cmd
  )
  assert r.returncode == 0, r.stderr
  assert "restart 1/1" in r.stderr
  ports = {}
  for line in r.stdout.splitlines():
    m = re.fullmatch(r"\[p1\] attempt (\d) 127\.0\.0\.1:(\d+)", line)
    if m:
      ports[m.group(1)] = m.group(2)
  assert set(ports) == {"0", "1"}, r.stdout
  assert ports["0"] != ports["1"], "a restart must use a new port"

  # Without restarts the first failure is final.
  r = _launch("--num_processes=2", "--devices_per_process=1", "--grace_s=1", "--", *cmd)
  assert r.returncode == 5


def test_restarts_run_out():
  cmd = _script("import sys; sys.exit(4)")
  r = _launch(
    "--num_processes=2", "--devices_per_process=1", "--max_restarts=2", "--grace_s=1", "--", *cmd
  )
  assert r.returncode == 4
  assert "restart 2/2" in r.stderr
  assert "restart 3" not in r.stderr


def test_timeout_stops_the_job():
  cmd = _script("import time; print('started', flush=True); time.sleep(1000)")
  r = jobs.timed([PY, "-m", "jaxcoll.launch", "--num_processes=2", "--devices_per_process=1",
                  "--timeout_s=1", "--grace_s=1", "--", *cmd], devices=1, timeout=LIMIT_S)
  assert r.returncode == launch.EXIT_TIMEOUT
  # From the children's start (not the launcher's imports): 1 s, the grace, the end.
  assert r.ended - r.seen("started") < 1 + 1 + 20
  assert "--timeout_s ran out" in r.stderr


def test_sigterm_to_launcher_stops_children(tmp_path):
  cmd = _script(f"""
      import os, time
      with open({str(tmp_path)!r} + "/p" + os.environ["JAXCOLL_PROCESS_ID"], "w") as f:
        f.write(str(os.getpid()))
      time.sleep(1000)
  """)
  with jobs.started(jobs.launch_cmd(*cmd, devices=1, launcher_flags=["--grace_s=1"]),
                    devices=1, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
    pids = _children(proc, tmp_path)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=LIMIT_S)
  assert proc.returncode == 128 + signal.SIGTERM, err
  assert all(_wait_gone(pid) for pid in pids)


def test_sighup_to_launcher_is_passed_on_as_sigterm(tmp_path):
  """A closed terminal: the launcher stops the job in order, as for SIGTERM
  (each child gets SIGTERM, so a training job saves a final step), and exits 129."""
  cmd = _script(f"""
      import os, signal, sys, time
      me = {str(tmp_path)!r} + "/p" + os.environ["JAXCOLL_PROCESS_ID"]
      def got(signum, frame):
        with open(me + ".signal", "w") as f:
          f.write(signal.Signals(signum).name)
        sys.exit(0)
      signal.signal(signal.SIGTERM, got)
      with open(me, "w") as f:
        f.write(str(os.getpid()))
      time.sleep(1000)
  """)
  with jobs.started(jobs.launch_cmd(*cmd, devices=1, launcher_flags=["--grace_s=30"]),
                    devices=1, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
    pids = _children(proc, tmp_path)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=LIMIT_S)
  assert proc.returncode == 128 + signal.SIGHUP, err
  assert [(tmp_path / f"p{i}.signal").read_text() for i in range(2)] == ["SIGTERM"] * 2
  assert "received SIGHUP" in err and "Traceback" not in err
  assert all(_wait_gone(pid) for pid in pids)


def test_workers_die_with_a_sigkilled_launcher(tmp_path):
  """Issue 12.5: SIGKILL of the launcher left its workers training."""
  cmd = _script(f"""
      import os, time
      with open({str(tmp_path)!r} + "/p" + os.environ["JAXCOLL_PROCESS_ID"], "w") as f:
        f.write(str(os.getpid()))
      time.sleep(1000)
  """)
  try:
    with jobs.started(jobs.launch_cmd(*cmd, devices=1), devices=1, stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL) as proc:
      pids = _children(proc, tmp_path)
      proc.kill()
      proc.wait(timeout=10)
    assert all(_wait_gone(pid) for pid in pids), "a worker outlived its SIGKILLed launcher"
  finally:
    for name in ("p0", "p1"):
      path = tmp_path / name
      if path.exists() and _alive(int(path.read_text() or 0)):
        os.kill(int(path.read_text()), signal.SIGKILL)


def test_bad_input_exit_2_is_not_restarted():
  """Issue 12.8: a deterministic exit 2 would fail the same way again."""
  cmd = _script("import os, sys; print('attempt', os.environ['JAXCOLL_RESTART']); sys.exit(2)")
  r = _launch(
    "--num_processes=2", "--devices_per_process=1", "--max_restarts=2", "--grace_s=1", "--", *cmd
  )
  assert r.returncode == 2
  assert "restart 1" not in r.stderr and "not restarting" in r.stderr
  assert "attempt 1" not in r.stdout


def _busy_port():
  s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  s.bind(("127.0.0.1", 0))
  s.listen(1)
  return s


@pytest.mark.parametrize(
  "args, needle",
  [
    (["--num_processes=0", "--devices_per_process=1", "--", "true"], "--num_processes"),
    (["--num_processes=2", "--devices_per_process=0", "--", "true"], "--devices_per_process"),
    (["--num_processes=two", "--devices_per_process=1", "--", "true"], "--num_processes"),
    (["--devices_per_process=1", "--", "true"], "--num_processes"),
    (["--num_processes=2", "--devices_per_process=1"], "no command"),
    (["--num_processes=2", "--devices_per_process=1", "--"], "no command"),
    (
      ["--num_processes=2", "--devices_per_process=1", "--max_restarts=-1", "--", "true"],
      "--max_restarts",
    ),
    (
      ["--num_processes=1", "--devices_per_process=1", "--", "/no/such/program"],
      "/no/such/program",
    ),
    ("busy_port", "--port"),
  ],
  ids=[
    "zero_processes",
    "zero_devices",
    "not_an_int",
    "missing_flag",
    "no_separator",
    "empty_command",
    "negative_restarts",
    "missing_program",
    "port_in_use",
  ],
)
def test_bad_input_exits_2_with_one_line(args, needle, capsys, request):
  """In this process (``launch.main``: the command's code, without the seconds
  of starting Python and jaxcoll) but for two cases run as the command itself:
  argparse's own error path and a program that cannot be started."""
  in_a_subprocess = request.node.callspec.id in ("missing_flag", "missing_program")
  with contextlib.ExitStack() as stack:
    if args == "busy_port":
      port = stack.enter_context(_busy_port()).getsockname()[1]
      args = [f"--port={port}", "--num_processes=2", "--devices_per_process=1", "--", "true"]
      needle = f"`--port` {port}"
    if in_a_subprocess:
      r = _launch(*args)
    else:
      status = launch.main(args)
      r = subprocess.CompletedProcess(args, status, *capsys.readouterr())
  assert r.stdout == ""
  line = jobs.one_line(r, 2, prefix="jaxcoll.launch: error: ")
  assert needle in line and "Traceback" not in r.stderr


def test_parse_args_keeps_the_command_verbatim():
  args, command = launch.parse_args(
    ["--num_processes=2", "--devices_per_process=4", "--", "python", "-m", "x", "--", "--y=1"]
  )
  assert (args.num_processes, args.devices_per_process, args.max_restarts) == (2, 4, 0)
  assert command == ["python", "-m", "x", "--", "--y=1"]


def test_free_port_is_loopback_and_free():
  port = launch.free_port()
  assert launch.port_is_free(port)
  env = launch.process_env(
    {}, port=port, num_processes=2, process_id=1, devices_per_process=4, restart=0, init_timeout_s=5
  )
  assert env["JAXCOLL_COORDINATOR"] == f"127.0.0.1:{port}"
  assert env["JAXCOLL_INIT_TIMEOUT_S"] == "5"


# ------------------------------------------------------------ distributed


def test_peer_that_never_comes_fails_within_the_timeout():
  port = launch.free_port()
  code = ("from jaxcoll import distributed; print('imported', flush=True); "
          "distributed.initialize(); print('joined')")
  r = jobs.timed([PY, "-c", code], devices=1, timeout=LIMIT_S,
                 JAXCOLL_COORDINATOR=f"127.0.0.1:{port}", JAXCOLL_NUM_PROCESSES="2",
                 JAXCOLL_PROCESS_ID="0", JAXCOLL_INIT_TIMEOUT_S="3")
  assert r.returncode == distributed.INIT_TIMEOUT_EXIT_CODE, r.stderr[-2000:]
  assert "joined" not in r.stdout
  assert "process 0 of 2 (127.0.0.1:" in r.stderr
  assert "did not start within 3 s" in r.stderr
  # Names where the settings came from (issue 12.12).
  assert "settings from JAXCOLL_COORDINATOR, JAXCOLL_NUM_PROCESSES=2, JAXCOLL_PROCESS_ID=0" in (
    r.stderr)
  assert "Traceback" not in r.stderr
  # 3 s of waiting, timed from the end of the imports (seconds on a busy machine).
  elapsed = r.ended - r.seen("imported")
  assert elapsed < 3 + 20, f"took {elapsed:.1f} s"


# `fresh` (tests/conftest.py): a clean environment and no remembered ClusterInfo.


def test_single_process_is_a_no_op_and_idempotent(fresh):
  fresh.setenv("JAXCOLL_RESTART", "2")
  info = distributed.initialize()
  assert (info.process_id, info.num_processes, info.method) == (0, 1, "single")
  assert info.restart == 2 and not info.is_multiprocess
  assert info.cpu_devices == int(os.environ["JAXCOLL_CPU_DEVICES"])
  assert distributed.initialize() is info
  assert distributed.cluster_info() is info


@pytest.mark.parametrize(
  "env, needle",
  [
    ({"JAXCOLL_NUM_PROCESSES": "zero"}, "`JAXCOLL_NUM_PROCESSES` must be an integer >= 1"),
    ({"JAXCOLL_NUM_PROCESSES": "0"}, "`JAXCOLL_NUM_PROCESSES` must be an integer >= 1"),
    (
      {
        "JAXCOLL_COORDINATOR": "127.0.0.1:1",
        "JAXCOLL_NUM_PROCESSES": "2",
        "JAXCOLL_PROCESS_ID": "-1",
      },
      "`JAXCOLL_PROCESS_ID` must be an integer >= 0",
    ),
    (
      {
        "JAXCOLL_COORDINATOR": "127.0.0.1:1",
        "JAXCOLL_NUM_PROCESSES": "2",
        "JAXCOLL_PROCESS_ID": "2",
      },
      "`JAXCOLL_PROCESS_ID` must be in 0..1",
    ),
    (
      {"JAXCOLL_COORDINATOR": "127.0.0.1", "JAXCOLL_NUM_PROCESSES": "2", "JAXCOLL_PROCESS_ID": "0"},
      "`JAXCOLL_COORDINATOR` must be host:port",
    ),
    (
      {
        "JAXCOLL_COORDINATOR": "host:99999",
        "JAXCOLL_NUM_PROCESSES": "2",
        "JAXCOLL_PROCESS_ID": "0",
      },
      "`JAXCOLL_COORDINATOR` must be host:port",
    ),
    ({"JAXCOLL_NUM_PROCESSES": "2"}, "JAXCOLL_COORDINATOR, JAXCOLL_PROCESS_ID not set"),
    ({"JAXCOLL_INIT_TIMEOUT_S": "-5"}, "`JAXCOLL_INIT_TIMEOUT_S` must be a positive"),
    ({"JAXCOLL_RESTART": "x"}, "`JAXCOLL_RESTART` must be an integer >= 0"),
  ],
  ids=[
    "num_not_int",
    "num_zero",
    "id_negative",
    "id_too_big",
    "no_port",
    "port_range",
    "incomplete",
    "bad_timeout",
    "bad_restart",
  ],
)
def test_bad_environment_raises_value_error(fresh, env, needle):
  for name, value in env.items():
    fresh.setenv(name, value)
  with pytest.raises(ValueError, match=re.escape(needle)):
    distributed.initialize()
  assert distributed.cluster_info() is None


@pytest.mark.parametrize("bad", [0, -1.0, "soon", float("inf"), True])
def test_bad_timeout_argument(fresh, bad):
  with pytest.raises(ValueError, match="`timeout_s` must be a positive number"):
    distributed.initialize(timeout_s=bad)


def test_too_late_after_the_backend_started(fresh):
  import jax

  jax.devices()  # the backend of this test process is up
  fresh.setenv("JAXCOLL_COORDINATOR", "127.0.0.1:1")
  fresh.setenv("JAXCOLL_NUM_PROCESSES", "2")
  fresh.setenv("JAXCOLL_PROCESS_ID", "0")
  with pytest.raises(RuntimeError, match="before any JAX computation"):
    distributed.initialize()


SLURM_STEP = {
  "SLURM_JOB_ID": "7",
  "SLURM_STEP_NODELIST": "n[1-2]",
  "SLURM_NTASKS": "4",
  "SLURM_PROCID": "2",
  "SLURM_LOCALID": "0",
}
# Open MPI 4 (what `mpirun` of openmpi-bin 4.1 sets): the URI JAX reads.
OMPI4 = {
  "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911",
  "OMPI_COMM_WORLD_SIZE": "3",
  "OMPI_COMM_WORLD_RANK": "1",
  "OMPI_COMM_WORLD_LOCAL_RANK": "1",
}
# JAX's port rule for that URI: job id // 2**12 % 2**12 + 61440.
OMPI4_COORDINATOR = f"10.96.0.1:{1531576320 // 2**12 % 2**12 + 61440}"


@pytest.mark.parametrize(
  "env, want",
  [
    (SLURM_STEP, ("slurm", "n1:61447", 4, 2)),
    ({**SLURM_STEP, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, None),
    ({"SLURM_JOB_ID": "7"}, None),  # an allocation, not a job step (no srun)
    (OMPI4, ("ompi", OMPI4_COORDINATOR, 3, 1)),
    # mpirun inside a multi-task srun step: Open MPI first, as JAX (issue 12.10).
    ({**SLURM_STEP, **OMPI4}, ("ompi", OMPI4_COORDINATOR, 3, 1)),
    # Open MPI 5: no URI; the coordinator comes from JAXCOLL_COORDINATOR (issue 12.9).
    (
      {"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "1",
       "JAXCOLL_COORDINATOR": "node0:12345"},
      ("ompi", "node0:12345", 3, 1),
    ),
    ({"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}, None),
    ({}, None),
  ],
  ids=["slurm", "slurm_one_task", "slurm_salloc", "ompi", "ompi_inside_srun", "ompi5",
       "ompi_one_rank", "none"],
)
def test_cluster_detection_matches_jax(fresh, env, want):
  for name, value in env.items():
    fresh.setenv(name, value)
  found = distributed.settings()
  got = None if found is None else (
    found.method, found.coordinator, found.num_processes, found.process_id)
  assert got == want


def test_open_mpi_5_without_coordinator_names_what_to_set(fresh):
  fresh.setenv("OMPI_COMM_WORLD_SIZE", "2")
  fresh.setenv("OMPI_COMM_WORLD_RANK", "0")
  with pytest.raises(ValueError, match=r"Open MPI 5.*set JAXCOLL_COORDINATOR=<host of rank 0>"):
    distributed.initialize()


@pytest.mark.parametrize("env", [SLURM_STEP, OMPI4], ids=["slurm", "ompi"])
def test_detected_cluster_keeps_every_local_device_visible(fresh, env):
  """Issue 12.11: JAX's own detection would set local_device_ids=[local rank]."""
  for name, value in env.items():
    fresh.setenv(name, value)
  found = distributed.settings()
  kwargs = distributed.jax_arguments(found, init_timeout_s=30, heartbeat_s=100)
  assert kwargs["cluster_detection_method"] == "deactivate"
  assert "local_device_ids" not in kwargs
  assert (kwargs["coordinator_address"], kwargs["num_processes"], kwargs["process_id"]) == (
    found.coordinator, found.num_processes, found.process_id)


def test_taken_coordinator_port_is_one_line_and_exit_2(tmp_path):
  """Issue 12.8: the env recipe on a taken port segfaulted process 0."""
  with socket.socket() as busy:
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    out = jobs.train_forked("--config=configs/default.py:smoke", f"--workdir={tmp_path}",
                            devices=4, timeout=120, JAXCOLL_COORDINATOR=f"127.0.0.1:{port}",
                            JAXCOLL_NUM_PROCESSES="2", JAXCOLL_PROCESS_ID="0")
  assert out.returncode == 2, out.stderr[-2000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and f"coordinator port {port}" in lines[0] and "in use" in lines[0]
  assert not os.listdir(tmp_path)


def test_python_in_the_command_is_the_launchers_interpreter():
  out = _launch("--num_processes=1", "--devices_per_process=1", "--",
                "sh", "-c", "command -v python")
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == f"[p0] {os.path.join(os.path.dirname(PY), 'python')}"


def test_all_output_reaches_a_slow_reader(tmp_path):
  """The launcher waits for every line to be copied before it exits."""
  reader = tmp_path / "slow_reader.py"
  reader.write_text(
      "import sys, time\n"
      "n = 0\n"
      "for line in sys.stdin:\n"
      "  n += 1\n"
      "  if n % 500 == 0: time.sleep(0.5)\n"
      "print(n, line.strip())\n"
  )
  emit = _script("for i in range(3000): print(i)\nprint('END')")
  with jobs.started(jobs.launch_cmd(*emit, processes=1, devices=1), devices=1,
                    stdout=subprocess.PIPE) as launcher:
    out = subprocess.run([PY, str(reader)], stdin=launcher.stdout, capture_output=True,
                         text=True, timeout=LIMIT_S, check=False)
    launcher.stdout.close()
    assert launcher.wait(timeout=LIMIT_S) == 0
  assert out.stdout.strip() == "3001 [p0] END"


def test_main_called_again_runs_its_job_and_gives_the_callers_handlers_back():
  """A stop of an earlier ``launch.main`` in the same process (kept for a stop Python
  dropped) made every later ``main`` return 130 without running its job; and main left
  its own SIGINT/SIGTERM/SIGHUP handlers installed in the caller."""

  launch._received.append(signal.SIGINT)  # what a stopped earlier main() leaves
  before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
  status = launch.main(["--num_processes=1", "--devices_per_process=1", "--",
                        sys.executable, "-c", "pass"])
  assert status == 0
  assert {s: signal.getsignal(s) for s in before} == before
