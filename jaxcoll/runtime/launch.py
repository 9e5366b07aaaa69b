"""``python -m jaxcoll.launch``: run one multi-process JAX job on this machine.

Usage::

  python -m jaxcoll.launch --num_processes=2 --devices_per_process=4 \\
      [--max_restarts=1] [--port=12345] [--timeout_s=600] -- \\
      python -m experiments.train --config=configs/default.py --workdir=/tmp/w

Starts ``--num_processes`` copies of the command, as the hosts of a cluster
would be, each with::

  JAXCOLL_COORDINATOR=127.0.0.1:<port>   # process 0 serves it, loopback only
  JAXCOLL_NUM_PROCESSES=<P>  JAXCOLL_PROCESS_ID=<0..P-1>
  JAXCOLL_CPU_DEVICES=<D>    # the CPU simulation mode, D devices per process
  JAXCOLL_RESTART=<attempt>  # 0, then 1, 2, ... after restarts

so that ``jaxcoll.distributed.initialize()`` in the command joins them into
one job. Every output line is prefixed with its process (``[p0] ...``) and
written whole (never mixed with another's mid-line); gloo's connection
chatter is one line per process (``[p1] gloo: connected to 7 peer
rank(s) ...``). When a process fails, the others are stopped (SIGTERM, then SIGKILL after
``--grace_s``) and, with ``--max_restarts=R``, the whole job starts again on
a new port, up to R times (a process that exits 2, bad input, is not
restarted: it would fail the same way, nor is a job in which any process
exits 2 within ``_SETTLE_S`` of the first failure). SIGINT, SIGTERM,
SIGHUP (a closed terminal) and SIGUSR1 (a stop request) to the launcher stop the job the
same way: SIGTERM
to every process (each saves a final checkpoint), SIGKILL after
``--grace_s``; the launcher exits 128 + the signal. When the launcher's own
stdout or stderr closes (``... | head -n 3``, a closed terminal), the job goes
on and the lines for that stream are dropped (one line on the other stream
says so). Each process dies with the launcher
(``PR_SET_PDEATHSIG`` on Linux), even when the launcher is SIGKILLed. The
exit status is the final attempt's: 0 when every process succeeded, else
the first failing process's status (128 + N for a process killed by signal
N; 124 when ``--timeout_s`` ran out).
``--init_timeout_s`` sets the processes' ``JAXCOLL_INIT_TIMEOUT_S`` (their
start-up deadline, see :mod:`jaxcoll.distributed`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from jaxcoll.errors import EXIT_PARENT_GONE, EXIT_PEER_GONE
from jaxcoll.errors import EXIT_TIMEOUT as EXIT_TIMEOUT
from jaxcoll.errors import EXIT_USAGE as EXIT_USAGE
from jaxcoll.errors import UsageError as UsageError

HOST = "127.0.0.1"
_POLL_S = 0.05
# After the first process fails, how long the others may take to end on their
# own: a bad-input exit 2 from any of them (each process of a job reports bad
# input the same way) makes the attempt bad input, whichever process ended first.
_SETTLE_S = 1.0


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
try:
  _prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):  # pragma: no cover - no libc prctl
  _prctl = None


def _die_with_parent(parent: int):
  """A ``preexec_fn``: the child gets SIGKILL when ``parent`` ends."""

  def preexec() -> None:
    if _prctl is not None:
      _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
      os._exit(EXIT_PARENT_GONE)

  return preexec


class _Stop(Exception):
  """The launcher received SIGINT / SIGTERM / SIGHUP / SIGUSR1."""

  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum


class _OneLineParser(argparse.ArgumentParser):
  def error(self, message):
    raise UsageError(f"{message}; see `python -m jaxcoll.launch --help`.")


def _parser() -> argparse.ArgumentParser:
  p = _OneLineParser(
    prog="python -m jaxcoll.launch",
    allow_abbrev=False,
    description="Run CMD as a multi-process JAX job on this machine.",
    usage="%(prog)s --num_processes=P --devices_per_process=D [options] -- CMD...",
  )
  p.add_argument(
    "--num_processes",
    type=int,
    required=True,
    help="processes to start (the 'hosts' of the job), >= 1",
  )
  p.add_argument(
    "--devices_per_process",
    type=int,
    required=True,
    help="CPU devices each process emulates (JAXCOLL_CPU_DEVICES), >= 1",
  )
  p.add_argument(
    "--max_restarts",
    type=int,
    default=0,
    help="restart the whole job up to this many times after a failure",
  )
  p.add_argument(
    "--port",
    type=int,
    default=None,
    help="coordinator port on 127.0.0.1 (default: a free one, new each attempt)",
  )
  p.add_argument(
    "--timeout_s",
    type=float,
    default=None,
    help="wall-clock limit of each attempt; exit 124 when it runs out",
  )
  p.add_argument(
    "--init_timeout_s",
    type=float,
    default=None,
    help="JAXCOLL_INIT_TIMEOUT_S for the processes (start-up deadline)",
  )
  p.add_argument(
    "--grace_s",
    type=float,
    default=5.0,
    help="seconds between SIGTERM and SIGKILL when stopping processes",
  )
  return p


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
  """Splits ``argv`` at ``--`` and checks every value.

  Raises:
    UsageError: with a one-line message naming the bad value and the fix.
  """
  argv = list(argv)
  if "--" in argv:
    cut = argv.index("--")
    options, command = argv[:cut], argv[cut + 1 :]
  else:
    options, command = argv, []
    _, extra = _parser().parse_known_args(options)
    if extra and not extra[0].startswith("-"):  # `launch --num_processes=2 ... python x.py`
      at = len(options) - len(extra)
      raise UsageError(
        f"{shlex.join(extra)!r} looks like the command to run: put `--` before it, "
        f"`python -m jaxcoll.launch {shlex.join(options[:at])} -- {shlex.join(extra)}` (what "
        "follows `--` is the command, its own flags included).")
  args = _parser().parse_args(options)
  if args.num_processes < 1:
    raise UsageError(
      f"`--num_processes` must be >= 1, got {args.num_processes}; e.g. --num_processes=2."
    )
  if args.devices_per_process < 1:
    raise UsageError(
      f"`--devices_per_process` must be >= 1, got {args.devices_per_process}; "
      "e.g. --devices_per_process=4."
    )
  if args.max_restarts < 0:
    raise UsageError(
      f"`--max_restarts` must be >= 0, got {args.max_restarts}; e.g. --max_restarts=1."
    )
  for name in ("timeout_s", "init_timeout_s"):
    value = getattr(args, name)
    if value is not None and not value > 0:
      raise UsageError(f"`--{name}` must be a positive number of seconds, got {value}.")
  if not args.grace_s >= 0:
    raise UsageError(f"`--grace_s` must be >= 0 seconds, got {args.grace_s}.")
  if not command:
    raise UsageError(
      "no command given; put it after `--`, e.g. "
      "`python -m jaxcoll.launch --num_processes=2 --devices_per_process=4 "
      "-- python train.py`."
    )
  if args.port is not None:
    if not 1 <= args.port <= 65535:
      raise UsageError(f"`--port` must be in 1..65535, got {args.port}.")
    if not port_is_free(args.port):
      raise UsageError(
        f"`--port` {args.port} is already in use on {HOST}; choose another "
        "port or omit --port to pick a free one."
      )
  return args, command


def port_is_free(port: int) -> bool:
  """Whether a listener could bind ``127.0.0.1:port`` now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    # As the coordinator's gRPC server does, so that ports in TIME_WAIT from a
    # previous attempt count as free.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      s.bind((HOST, port))
      s.listen(1)
    except OSError:
      return False
  return True


def free_port() -> int:
  """A port on 127.0.0.1 that is free now (the OS picks it)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((HOST, 0))
    return s.getsockname()[1]


def process_env(
  base: dict[str, str],
  *,
  port: int,
  num_processes: int,
  process_id: int,
  devices_per_process: int,
  restart: int,
  init_timeout_s: float | None = None,
) -> dict[str, str]:
  """The environment of one process of the job."""
  env = dict(base)
  env.update(
    JAXCOLL_COORDINATOR=f"{HOST}:{port}",
    JAXCOLL_NUM_PROCESSES=str(num_processes),
    JAXCOLL_PROCESS_ID=str(process_id),
    JAXCOLL_CPU_DEVICES=str(devices_per_process),
    JAXCOLL_RESTART=str(restart),
  )
  if init_timeout_s is not None:
    env["JAXCOLL_INIT_TIMEOUT_S"] = f"{init_timeout_s:g}"
  env.setdefault("PYTHONUNBUFFERED", "1")  # lines arrive as they are printed
  # `python` in the command means the launcher's own interpreter (its venv),
  # as if that environment were activated.
  bin_dir = os.path.dirname(sys.executable)
  path = env.get("PATH", "")
  if path.split(os.pathsep)[0] != bin_dir:
    env["PATH"] = os.pathsep.join(filter(None, [bin_dir, path]))
  return env


# The connection chatter gloo prints (with std::cout, in pieces, from several
# threads, so pieces of two messages can share a line) for every context it
# connects: "[Gloo] Rank 4 is connected to 7 peer ranks. Expected number of
# connected peer ranks is : 7". A line made only of these pieces is chatter.
_GLOO_PIECES = re.compile(
  rb"\[Gloo\]|Rank|is connected to|peer ranks\.|Expected number of connected peer ranks is :"
  rb"|\d+|\s+"
)
_GLOO_WORDS = re.compile(rb"\[Gloo\]|is connected to \d+ peer ranks|connected peer ranks is :")
_GLOO_FULL = re.compile(
  rb"is connected to (\d+) peer ranks\. Expected number of connected peer ranks is : (\d+)"
)
_LINE_LIMIT = 1 << 20  # bytes held for one line before it is written anyway


class GlooChatter:
  """Collapses one process's gloo connection lines into a single line.

  The first line of chatter becomes ``gloo: connected to N peer rank(s)``;
  the rest of that process's chatter is dropped. A connection with fewer
  peers than expected, and any line with other text in it, pass unchanged.
  """

  def __init__(self):
    self._said = False
    self._lock = threading.Lock()

  def filter(self, line: bytes) -> bytes | None:
    """What to write for ``line`` (one line, with its newline); None: nothing."""
    if not _GLOO_WORDS.search(line) or _GLOO_PIECES.sub(b"", line):
      return line
    counts = _GLOO_FULL.findall(line)
    if any(connected != expected for connected, expected in counts):
      return line
    with self._lock:
      if self._said:
        return None
      self._said = True
    peers = f" to {int(counts[0][0])} peer rank(s)" if counts else ""
    return f"gloo: connected{peers} (further gloo connection lines hidden)\n".encode()


class LineBuffer:
  """Bytes in, whole lines out: a child's partial writes wait for their newline.

  A line longer than ``limit`` bytes is cut there (each piece ends with a
  newline), so one runaway line cannot hold all of memory.
  """

  def __init__(self, limit: int = _LINE_LIMIT):
    self._pending = bytearray()
    self._limit = limit

  def feed(self, chunk: bytes) -> list[bytes]:
    """The lines ``chunk`` completes, each ending with b"\\n"."""
    self._pending += chunk
    lines = []
    while True:
      cut = self._pending.find(b"\n")
      if cut < 0 and len(self._pending) < self._limit:
        return lines
      end = cut + 1 if cut >= 0 else self._limit
      line = bytes(self._pending[:end])
      del self._pending[:end]
      lines.append(line if line.endswith(b"\n") else line + b"\n")

  def flush(self) -> bytes | None:
    """The last partial line (at EOF), with a newline added; None if none."""
    if not self._pending:
      return None
    line = bytes(self._pending) + b"\n"
    self._pending.clear()
    return line


class _Output:
  """Copies a child's stream to ours, one whole prefixed line at a time.

  The pump reads whatever bytes are there (``read1``), so it never waits on
  a child that has printed half a line; :class:`LineBuffer` holds the half
  until its newline. Lines of every stream go through one lock, so no two
  are ever mixed mid-line. ``gloo`` (shared by a process's two streams)
  collapses that process's gloo chatter.
  """

  _lock = threading.Lock()
  closed: set[int] = set()  # the ids of sinks that a write found closed

  def __init__(self, stream, sink, prefix: bytes, gloo: GlooChatter | None = None):
    self._gloo = gloo
    self._thread = threading.Thread(target=self._pump, args=(stream, sink, prefix), daemon=True)
    self._thread.start()

  def _pump(self, stream, sink, prefix: bytes):
    buffer = LineBuffer()
    while chunk := stream.read1(65536):
      self._write(sink, prefix, buffer.feed(chunk))
    tail = buffer.flush()
    self._write(sink, prefix, [tail] if tail else [])
    stream.close()

  def _write(self, sink, prefix: bytes, lines: list[bytes]) -> None:
    if self._gloo is not None:
      lines = [out for out in map(self._gloo.filter, lines) if out is not None]
    if not lines:
      return
    with _Output._lock:
      if id(sink) in _Output.closed:
        return  # the child's output is still read, so the child never blocks
      try:
        sink.write(b"".join(prefix + line for line in lines))
        sink.flush()
      except (OSError, ValueError) as e:  # EPIPE (a reader that left), EIO (a closed tty)
        _Output.closed.add(id(sink))
        _sink_closed(sink, e)

  def join(self, timeout: float):
    self._thread.join(timeout)


def _status(returncode: int) -> int:
  return 128 - returncode if returncode < 0 else returncode


def _ended(index: int, returncode: int) -> str:
  """How process ``index`` ended: its exit status, or the signal that killed it."""
  if returncode < 0:
    try:
      name = signal.Signals(-returncode).name
    except ValueError:
      name = f"signal {-returncode}"
    why = " (also what the kernel's OOM killer sends)" if -returncode == signal.SIGKILL else ""
    return f"process {index} was killed by {name}{why}, status {_status(returncode)}"
  return f"process {index} exited with status {returncode}"


def _log(message: str) -> None:
  with _Output._lock:
    _log_locked(message)


def _log_locked(message: str) -> None:
  for stream in (sys.stderr, sys.stdout):  # stdout only when stderr is gone
    if id(stream.buffer) in _Output.closed:
      continue
    try:
      stream.write(f"[launch] {message}\n")
      stream.flush()
      return
    except (OSError, ValueError) as e:
      _Output.closed.add(id(stream.buffer))
      _detach(stream)
      del e


def _detach(stream) -> None:
  """Points a closed standard stream at /dev/null, so that nothing (Python's
  flush at exit included) fails on it again."""
  with contextlib.suppress(OSError, ValueError, AttributeError):
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, stream.fileno())
    os.close(devnull)


def _sink_closed(sink, error: Exception) -> None:
  """Called (under the lock) once, when a write to ``sink`` failed."""
  name = "stdout" if sink is sys.stdout.buffer else "stderr" if sink is sys.stderr.buffer else (
      "output")
  for stream in (sys.stdout, sys.stderr):
    if stream.buffer is sink:
      _detach(stream)
  _log_locked(f"{name} closed ({type(error).__name__}); the job goes on, its {name} lines "
              "are dropped.")


class Job:
  """One attempt: P processes of the same command."""

  def __init__(self, command: list[str], envs: list[dict[str, str]]):
    self.procs: list[subprocess.Popen] = []
    self.outputs: list[_Output] = []
    try:
      for i, env in enumerate(envs):
        proc = subprocess.Popen(
          command,
          env=env,
          stdin=subprocess.DEVNULL,
          stdout=subprocess.PIPE,
          stderr=subprocess.PIPE,
          # Own process group: signals reach the whole tree of the command,
          # and a terminal's Ctrl-C reaches only the launcher, which stops
          # the job in order.
          start_new_session=True,
          # Workers must not outlive a launcher that was SIGKILLed. The hook
          # only calls prctl and getppid (no locks), so threads are no risk.
          preexec_fn=_die_with_parent(os.getpid()),  # noqa: PLW1509
        )
        self.procs.append(proc)
        prefix, gloo = f"[p{i}] ".encode(), GlooChatter()
        self.outputs.append(_Output(proc.stdout, sys.stdout.buffer, prefix, gloo))
        self.outputs.append(_Output(proc.stderr, sys.stderr.buffer, prefix, gloo))
    except BaseException:
      self.stop(grace_s=0)
      raise

  def wait(self, deadline: float | None) -> tuple[int, str]:
    """Waits until all succeed, one fails, or the deadline; (status, why)."""
    while True:
      _check_stop()
      codes = [proc.poll() for proc in self.procs]
      failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
      if failed:
        # A process that ended because a peer died (EXIT_PEER_GONE) is not the cause:
        # the peer is, and it may have ended within the same poll.
        causes = [i for i in failed if _status(codes[i]) != EXIT_PEER_GONE]
        first = (causes or failed)[0]
        return self._settle(first, _status(codes[first]))
      running = None in codes
      if not running:
        return 0, "all processes succeeded"
      if deadline is not None and time.monotonic() > deadline:
        return EXIT_TIMEOUT, "--timeout_s ran out"
      time.sleep(_POLL_S)

  def _settle(self, first: int, status: int) -> tuple[int, str]:
    """Process ``first`` failed with ``status``: if another process ends with
    the bad-input status 2 within ``_SETTLE_S``, the attempt is bad input."""
    settle = time.monotonic() + (_SETTLE_S if status != EXIT_USAGE else 0)
    while True:
      _check_stop()
      codes = [proc.poll() for proc in self.procs]
      bad = [i for i, code in enumerate(codes) if code is not None and _status(code) == EXIT_USAGE]
      if bad:
        return EXIT_USAGE, f"process {bad[0]} exited with status {EXIT_USAGE}"
      if status == EXIT_PEER_GONE:  # the process whose death it saw may be named yet
        causes = [i for i, code in enumerate(codes)
                  if code not in (None, 0) and _status(code) != EXIT_PEER_GONE]
        if causes:
          first, status = causes[0], _status(codes[causes[0]])
      if None not in codes or time.monotonic() > settle:
        return status, _ended(first, self.procs[first].returncode)
      time.sleep(_POLL_S)

  def _signal_all(self, signum: int) -> None:
    for proc in self.procs:
      if proc.poll() is None:
        try:
          os.killpg(proc.pid, signum)
        except ProcessLookupError:
          pass

  def stop(self, grace_s: float) -> None:
    """SIGTERM to every process still running, SIGKILL after ``grace_s``."""
    self._signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
      time.sleep(_POLL_S)
    self._signal_all(signal.SIGKILL)
    for proc in self.procs:
      try:
        proc.wait(timeout=5)
      except subprocess.TimeoutExpired:  # pragma: no cover - unkillable
        pass
      # Grandchildren left behind in the group (a shell's children, say).
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
    # Every writer is gone, so each pipe ends; only a slow reader of our own
    # output can hold the copying back, and its lines must not be dropped.
    for out in self.outputs:
      out.join(timeout=60)


def run(args: argparse.Namespace, command: list[str]) -> int:
  """Runs the job with restarts; returns the final exit status."""
  status = 0
  for attempt in range(args.max_restarts + 1):
    port = args.port if args.port is not None else free_port()
    if attempt and args.port is not None and not port_is_free(port):
      _log(f"port {port} is still in use; cannot restart on --port={port}.")
      return status
    envs = [
      process_env(
        os.environ,
        port=port,
        num_processes=args.num_processes,
        process_id=i,
        devices_per_process=args.devices_per_process,
        restart=attempt,
        init_timeout_s=args.init_timeout_s,
      )
      for i in range(args.num_processes)
    ]
    if attempt:
      _log(f"restart {attempt}/{args.max_restarts} on {HOST}:{port}")
    deadline = None if args.timeout_s is None else time.monotonic() + args.timeout_s
    job = Job(command, envs)
    try:
      status, why = job.wait(deadline)
    finally:
      job.stop(args.grace_s)
    if status == 0:
      return 0
    if status == EXIT_USAGE:
      _log(f"attempt {attempt} failed: {why} (bad input); not restarting, it would fail again.")
      return status
    left = args.max_restarts - attempt
    _log(
      f"attempt {attempt} failed: {why}; "
      + (f"restarting ({left} restart(s) left)." if left else "stopping.")
    )
  return status


# The stop signal received, kept: an exception raised by a signal handler while the main
# thread runs a gc callback (JAX registers one at import) is printed as "Exception ignored
# in: <function _xla_gc_callback ...>" and dropped, and the launcher, ignoring the stop
# signals from then on, ran the job on: Job.wait raises it again.
_received: list[int] = []


def _raise_stop(signum, frame):
  del frame
  # A second Ctrl-C must not interrupt the stopping of the job.
  for other in _STOP_SIGNALS:
    signal.signal(other, signal.SIG_IGN)
  _received.append(signum)
  raise _Stop(signum)


def _check_stop() -> None:
  """Raises the stop a signal handler raised where it was dropped (see :data:`_received`)."""
  if _received:
    raise _Stop(_received[0])


# What stops the job in order: Ctrl-C, a stop request, a closed terminal, the stop request
# that mpirun and Slurm (--signal=USR1@N) pass on to every task.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


def main(argv: Sequence[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  try:
    args, command = parse_args(argv)
  except UsageError as e:
    sys.stderr.write(f"jaxcoll.launch: error: {e}\n")
    return EXIT_USAGE
  # A stop of an earlier main() in this process is not this job's; the caller's handlers
  # come back at the end (main() may be called from a program of the user's).
  _received.clear()
  previous = {signum: signal.getsignal(signum) for signum in _STOP_SIGNALS}
  for signum in _STOP_SIGNALS:
    signal.signal(signum, _raise_stop)
  try:
    return run(args, command)
  except _Stop as stop:
    # Job.stop already ran in run()'s `finally`.
    _log(f"received {signal.Signals(stop.signum).name}; stopped every process.")
    return 128 + stop.signum
  except (FileNotFoundError, PermissionError) as e:
    with contextlib.suppress(OSError, ValueError):
      sys.stderr.write(
        f"jaxcoll.launch: error: cannot run {command[0]!r}: {e.strerror}; "
        "check the command after `--`.\n"
      )
    return EXIT_USAGE
  finally:
    for signum, handler in previous.items():
      if handler is not None:
        signal.signal(signum, handler)


if __name__ == "__main__":
  sys.exit(main())
