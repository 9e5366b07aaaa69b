"""Running jaxcoll as users do, in subprocesses: the trainer CLI and the
multi-process launcher. Every call has a timeout, so nothing can hang a test,
and a process a helper started is killed and reaped before it returns.

- ``run`` / ``train`` / ``launch``: run to the end, output captured.
- ``one_line``: the exit status and the ONE stderr line that bad input gets.
- ``stop_with``: start a run, send a signal once it has logged a row, collect.
- ``timed``: run to the end and note when each output line arrived, so a
  test bounds the time between two events of the run, not the start-up of
  Python and JAX (seconds, and many more on a loaded machine).
- ``forked`` / ``train_forked``: like ``run`` / ``train`` for a one-process
  ``python -m MODULE`` (or ``python -c CODE``) command, the launcher's too (``launch``),
  forked from a warm Python that has imported
  JAX, flax, optax, orbax, absl: a bad-input run costs ~0.2 CPU-s instead of
  ~2.6, a 4-step smoke run ~2.1 instead of ~4.6 (the start-up of Python and
  its imports); same module, argv, cwd, environment, exit status and output.
"""

import contextlib
import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = "--config=configs/default.py:smoke"
# JAX's persistent compilation cache for the subprocesses (conftest points it
# at the pytest process's own cache directory, one per xdist worker: JAX writes
# an entry without a lock). Dozens of runs compile the same smoke programs; a hit
# loads the very executable a compile would make, so every result is the same
# (a smoke run: 8.7 s -> 3.4 s of CPU). Pass JAX_COMPILATION_CACHE_DIR="" for a
# run whose measure includes compiling (its memory, its time).
XLA_CACHE: str | None = None


def clean_env(devices: int = 8, **extra: str) -> dict[str, str]:
  """This environment without JAXCOLL_* settings, with the repo and the shared test helpers
  (``tests/``: jobs, mlp_task) importable."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAXCOLL_")}
  env["PYTHONPATH"] = os.pathsep.join(
      filter(None, [REPO, os.path.join(REPO, "tests"), env.get("PYTHONPATH")]))
  if XLA_CACHE and "JAX_COMPILATION_CACHE_DIR" not in env:
    env["JAX_COMPILATION_CACHE_DIR"] = XLA_CACHE
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # the small ones too
  env.update({"JAXCOLL_CPU_DEVICES": str(devices)}, **extra)
  return env


def run(cmd, *, devices=8, cwd=REPO, timeout=300, **env) -> subprocess.CompletedProcess:
  return subprocess.run(
      cmd, cwd=cwd, env=clean_env(devices, **env), capture_output=True, text=True,
      timeout=timeout, check=False,
  )


def train_cmd(*flags) -> list[str]:
  return [sys.executable, "-m", "experiments.train", *flags]


def launch_cmd(*cmd, processes=2, devices=4, launcher_flags=()) -> list[str]:
  return [sys.executable, "-m", "jaxcoll.launch", f"--num_processes={processes}",
          f"--devices_per_process={devices}", *launcher_flags, "--", *cmd]


def train(*flags, devices=8, cwd=REPO, timeout=300, **env) -> subprocess.CompletedProcess:
  """``python -m experiments.train FLAGS`` on ``devices`` emulated devices."""
  return run(train_cmd(*flags), devices=devices, cwd=cwd, timeout=timeout, **env)


def launch(*cmd, processes=2, devices=4, launcher_flags=(), timeout=300, warm_workers=True):
  """``python -m jaxcoll.launch`` of ``cmd`` as ``processes`` x ``devices``, the launcher
  forked from a warm Python (``forked``), and its processes forked from the launcher
  (``warm_workers``, see ``forked``; False: real starts of ``cmd``)."""
  return forked(launch_cmd(*cmd, processes=processes, devices=devices,
                           launcher_flags=launcher_flags), devices=devices, timeout=timeout,
                warm_workers=warm_workers)


def by_hand(cmd, per_process, *, timeout=120) -> list[tuple[int, str, str, float]]:
  """The processes of one job started by hand, as the env recipe does (no launcher):
  ``per_process[pid] = (devices, env, extra_flags)``, each given ``JAXCOLL_COORDINATOR``,
  ``JAXCOLL_NUM_PROCESSES`` = ``len(per_process)``, its ``JAXCOLL_PROCESS_ID`` and a 60 s
  ``JAXCOLL_INIT_TIMEOUT_S`` (its own ``env`` overrides them). Per process: (status,
  stdout, stderr, seconds from the first start to its end); all are reaped."""
  from jaxcoll.runtime import launch as launch_lib  # noqa: PLC0415  (imports JAX)

  port, procs, t0 = launch_lib.free_port(), [], time.monotonic()
  try:
    for pid, (devices, own, flags) in enumerate(per_process):
      env = {"JAXCOLL_COORDINATOR": f"127.0.0.1:{port}",
             "JAXCOLL_NUM_PROCESSES": str(len(per_process)),
             "JAXCOLL_PROCESS_ID": str(pid), "JAXCOLL_INIT_TIMEOUT_S": "60", **own}
      procs.append(subprocess.Popen([*cmd, *flags], cwd=REPO, env=clean_env(devices, **env),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=timeout) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return [(p.returncode, out, err, time.monotonic() - t0)
          for p, (out, err) in zip(procs, outs, strict=True)]


def say_result(text: str) -> None:
  """Print ``RESULT text`` on stdout in ONE write (the line a worker of a launched job reports).

  A launched worker's stdout is unbuffered (the launcher sets PYTHONUNBUFFERED), so print()
  writes its text and its newline apart, and gloo's C++ log line from another thread landed
  between them: 'RESULT {...}[Gloo] Rank 1 is connected to 1 peer ranks...' (a JSON error in
  test_sources, 1 run in a few)."""
  sys.stdout.write(f"RESULT {text}\n")
  sys.stdout.flush()


def summary(workdir) -> dict:
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f)


def one_line(out: subprocess.CompletedProcess, status: int = 2, prefix: str = "") -> str:
  """The house rule for bad input: exit ``status``, ONE line on stderr (starting with
  ``prefix``), no traceback. Returns that line."""
  assert out.returncode == status, out.stderr[-3000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(prefix), out.stderr[-3000:]
  return lines[0]


class _ForkServer:
  """``tests/_fork_server.py`` in the environment of ``clean_env()``: one per
  pytest process, started at the first ``forked`` call, ended by conftest (or
  by its stdin closing when this process ends)."""

  def __init__(self):
    self.env = clean_env()
    self.tmp = tempfile.mkdtemp(prefix="jaxcoll-test-fork-")
    self.err = open(os.path.join(self.tmp, "server.err"), "w")  # noqa: SIM115
    self.proc = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "tests", "_fork_server.py"), self.tmp], cwd=REPO,
        env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True)
    self._lines = b""

  def _answer(self, deadline) -> int:
    """The server's next line (read from the pipe itself: a pid and an exit status that
    arrived together stayed in the text reader's buffer, and select waited for the second
    one until the deadline)."""
    while b"\n" not in self._lines:
      ready, _, _ = select.select([self.proc.stdout], [], [],
                                  max(0.0, deadline - time.monotonic()))
      if not ready:
        raise TimeoutError
      chunk = os.read(self.proc.stdout.fileno(), 4096)
      if not chunk:
        with open(os.path.join(self.tmp, "server.err")) as f:
          raise RuntimeError(f"tests/_fork_server.py ended: {f.read()[-3000:]}")
      self._lines += chunk
    line, self._lines = self._lines.split(b"\n", 1)
    return int(line)

  def _answered(self) -> bool:
    return b"\n" in self._lines or bool(select.select([self.proc.stdout], [], [], 0)[0])

  def start(self, cmd, *, cwd, env, warm_workers=False) -> "_Forked":
    out, err = (os.path.join(self.tmp, name) for name in ("stdout", "stderr"))
    self.proc.stdin.write(json.dumps(
        {"argv": list(cmd), "cwd": str(cwd), "env": env, "stdout": out, "stderr": err,
         "warm_workers": warm_workers,
         "sigint_ignored": signal.getsignal(signal.SIGINT) is signal.SIG_IGN}) + "\n")
    self.proc.stdin.flush()
    pid = self._answer(time.monotonic() + 60)
    assert pid > 0, f"the fork server answered {pid} for a pid: its answers are out of step"
    return _Forked(self, cmd, pid, out, err)

  @contextlib.contextmanager
  def started(self, cmd, *, cwd, env, warm_workers=False):
    """``start``, killed and reaped on the way out if it is still running (as ``started``)."""
    proc = self.start(cmd, cwd=cwd, env=env, warm_workers=warm_workers)
    try:
      yield proc
    finally:
      if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)

  def run(self, cmd, *, cwd, env, timeout, warm_workers=False) -> subprocess.CompletedProcess:
    # The server's start-up (the first call) is not the run's time.
    return self.start(cmd, cwd=cwd, env=env, warm_workers=warm_workers).wait(timeout)

  def close(self) -> None:
    self.proc.stdin.close()
    try:
      self.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()
    self.proc.stdout.close()
    self.err.close()
    import shutil  # noqa: PLC0415

    shutil.rmtree(self.tmp, ignore_errors=True)


class _Forked:
  """A command the fork server runs (one at a time; ``_ForkServer.start``), as much of
  ``subprocess.Popen`` as ``stop_with`` uses: ``pid``, ``poll``, ``send_signal``,
  ``communicate``, and ``wait``, which returns its ``CompletedProcess``."""

  def __init__(self, server: _ForkServer, cmd, pid: int, out: str, err: str):
    self.server, self.cmd, self.pid, self.out, self.err = server, cmd, pid, out, err
    self.returncode: int | None = None

  def poll(self) -> int | None:
    if self.returncode is None and self.server._answered():
      self.returncode = self.server._answer(time.monotonic() + 60)
    return self.returncode

  def send_signal(self, signum: int) -> None:
    if self.poll() is None:
      with contextlib.suppress(ProcessLookupError):  # it ended (and was reaped) just now
        os.kill(self.pid, signum)

  def communicate(self, timeout) -> tuple[str, str]:
    """``(stdout, stderr)`` once it has ended (``wait``), as ``Popen.communicate`` returns."""
    out = self.wait(timeout)
    return out.stdout, out.stderr

  def wait(self, timeout) -> subprocess.CompletedProcess:
    if self.returncode is None:
      try:
        self.returncode = self.server._answer(time.monotonic() + timeout)
      except TimeoutError:
        with contextlib.suppress(ProcessLookupError):  # it ended at the deadline
          os.kill(self.pid, 9)
        self.returncode = self.server._answer(time.monotonic() + 60)
        raise subprocess.TimeoutExpired(self.cmd, timeout) from None
    with open(self.out) as fo, open(self.err) as fe:
      return subprocess.CompletedProcess(self.cmd, self.returncode, fo.read(), fe.read())


_SERVER: dict[str, _ForkServer] = {}  # "server": this process's, once started
_SERVER_STARTS: list[int] = []  # the pid of every server this process started


def _read_at_import(env: dict[str, str]) -> dict[str, str]:
  """What of ``env`` the server's imports may have read: all but JAXCOLL_*
  (read by jaxcoll, which each child imports itself) and pytest's
  PYTEST_CURRENT_TEST (new at every test; each child gets its own value)."""
  return {k: v for k, v in env.items()
          if not k.startswith("JAXCOLL_") and k != "PYTEST_CURRENT_TEST"}


def forked(cmd, *, devices=8, cwd=REPO, timeout=300, warm_workers=False,
           **env) -> subprocess.CompletedProcess:
  """``run(cmd)`` for ``cmd = [sys.executable, "-m", MODULE, ...]`` (or ``"-c", CODE``),
  forked from a warm Python: the same module or code, argv, cwd and environment, in a process
  of its own (exit status, stdout, stderr as ``run``'s), without the ~2 CPU-s
  of starting Python and importing JAX. For runs that end before doing real
  work (bad input), one-process runs and the launcher (~1.2 CPU-s less: it imports
  jaxcoll, so JAX; a timeout's SIGKILL of it ends its children too, PR_SET_PDEATHSIG:
  tests/runtime/test_launch.py::test_workers_die_with_a_sigkilled_launcher); a run in
  another environment than ``clean_env()``'s (other than JAXCOLL_* variables,
  ``devices``) starts a real Python instead. ``warm_workers`` (the launcher's command,
  ``python -m jaxcoll.launch``): each process of its job that runs this Python
  (``python -m MODULE``, ``-c CODE``, ``SCRIPT``) is forked from the launcher, which has
  imported JAX and jaxcoll, instead of started anew (~2.5 CPU-s less each; the same argv,
  cwd, environment, pipes, session, signals and death signal: tests/_fork_server.py's
  _WarmPopen; tests/test_forked.py checks them against real starts): for jobs of
  programs that import jaxcoll."""
  full = clean_env(devices, **env)
  server = _server_for(cmd, full)
  if server is None:
    return run(cmd, devices=devices, cwd=cwd, timeout=timeout, **env)
  return server.run(cmd, cwd=cwd, env=full, timeout=timeout, warm_workers=warm_workers)


def _server_for(cmd, full: dict[str, str]) -> _ForkServer | None:
  """The fork server that can run ``cmd`` in the environment ``full``, or None."""
  if (list(cmd[:1]) != [sys.executable] or len(cmd) < 3 or cmd[1] not in ("-m", "-c")
      or _read_at_import(full) != _read_at_import(clean_env())):
    return None
  if "server" in _SERVER and _read_at_import(_SERVER["server"].env) != _read_at_import(full):
    close_fork_server()  # os.environ changed (monkeypatch.setenv)
  if "server" not in _SERVER:
    _SERVER["server"] = _ForkServer()
    _SERVER_STARTS.append(_SERVER["server"].proc.pid)
  return _SERVER["server"]


def train_forked(*flags, devices=8, cwd=REPO, timeout=300, **env) -> subprocess.CompletedProcess:
  """``train(*flags)`` through ``forked``: for bad input, which ends before training."""
  return forked(train_cmd(*flags), devices=devices, cwd=cwd, timeout=timeout, **env)


def close_fork_server() -> None:
  if "server" in _SERVER:
    _SERVER.pop("server").close()


@contextlib.contextmanager
def started(cmd, *, devices=8, cwd=REPO, **popen):
  """``subprocess.Popen`` of ``cmd`` (environment of ``clean_env``, text mode),
  killed and reaped on the way out if it is still running."""
  env = clean_env(devices, **popen.pop("env", {}))
  proc = subprocess.Popen(cmd, cwd=cwd, env=env, text=True, **popen)
  try:
    yield proc
  finally:
    if proc.poll() is None:
      proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
      if stream is not None:
        stream.close()


def wait_for_rows(proc, workdir, limit_s=240) -> None:
  """Until ``workdir``'s metrics.jsonl has a row (training has begun)."""
  path = os.path.join(workdir, "metrics.jsonl")
  deadline = time.monotonic() + limit_s
  while not os.path.exists(path) or not os.path.getsize(path):
    assert proc.poll() is None, f"the run ended ({proc.returncode}) before its first row"
    assert time.monotonic() < deadline, f"no row in {limit_s} s: training never started"
    time.sleep(0.1)


def stop_with(cmd, signum, *, workdir, devices=8, timeout=90, forked=False,
              warm_workers=False) -> tuple[int, str, float]:
  """Starts ``cmd`` (a run that logs rows into ``workdir``), sends it ``signum``
  once its first row is written and waits up to ``timeout`` s for it to end.
  Returns (exit status, stderr, seconds from the signal to the end). ``forked``: started
  as ``forked`` starts it (and ``warm_workers``), where it can."""
  server = _server_for(cmd, clean_env(devices)) if forked else None
  with (started(cmd, devices=devices, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if server is None else
        server.started(cmd, cwd=REPO, env=clean_env(devices), warm_workers=warm_workers)) as proc:
    wait_for_rows(proc, workdir)
    proc.send_signal(signum)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err, time.monotonic() - t0


def stopped_steps(stderr: str, signal_name: str = "SIGTERM") -> dict[str, str]:
  """``{"[p0]": step, ...}``: the step each process of a launched job says it
  stopped after ("[pN] train: stopped by SIGTERM after step K; ...")."""
  needle = f"stopped by {signal_name} after step "
  return {line.split("]")[0] + "]": line.split(needle)[1].split(";")[0]
          for line in stderr.splitlines() if needle in line}


@dataclasses.dataclass
class Timed:
  """A finished run and when (``time.monotonic()``) each line of its output
  arrived and the process ended."""

  returncode: int
  stdout: str
  stderr: str
  lines: list[tuple[float, str]]  # (arrival, line) of stdout and stderr, in arrival order
  ended: float

  def seen(self, text: str) -> float:
    """When the first line holding ``text`` arrived."""
    for t, line in self.lines:
      if text in line:
        return t
    raise AssertionError(f"no line holds {text!r}:\n{self.stdout[-2000:]}\n{self.stderr[-2000:]}")


def timed(cmd, *, devices=8, cwd=REPO, timeout=120, **env) -> Timed:
  """Runs ``cmd`` to the end like ``run``, noting when each line arrived."""
  lines, outs, lock = [], {}, threading.Lock()

  def pump(name, stream):
    got = []
    for line in stream:
      with lock:
        lines.append((time.monotonic(), line.rstrip("\n")))
      got.append(line)
    outs[name] = "".join(got)

  with started(cmd, devices=devices, cwd=cwd, env=env, stdout=subprocess.PIPE,
               stderr=subprocess.PIPE) as proc:
    pumps = [threading.Thread(target=pump, args=(name, stream), daemon=True)
             for name, stream in (("stdout", proc.stdout), ("stderr", proc.stderr))]
    for p in pumps:
      p.start()
    try:
      proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      proc.kill()
      raise
    ended = time.monotonic()
    for p in pumps:  # the pipes end with the last writer (a child's child, too)
      p.join(timeout=30)
  return Timed(proc.returncode, outs.get("stdout", ""), outs.get("stderr", ""), lines, ended)
