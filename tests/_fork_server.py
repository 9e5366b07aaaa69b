"""A warm Python for ``jobs.forked``: imports the heavy third-party modules
once, then for each request (one JSON line on stdin: argv ``[python, -m,
MODULE, ARGS...]`` or ``[python, -c, CODE, ARGS...]``, cwd, env, stdout and stderr
file paths) forks a child that runs ``python -m MODULE ARGS`` (or ``python -c CODE
ARGS``) as a fresh interpreter would and answers two
lines: the child's pid, then its exit status (``subprocess``'s returncode).

Only modules that read nothing of the per-run environment are imported here
(no jaxcoll: it reads JAXCOLL_CPU_DEVICES at import; no experiments: they
define flags and read sys.argv at import), and JAX's backend is not started,
so a child starts as a new process would, less ~2 CPU-s of imports. Ends
when stdin closes (the pytest worker ended, however it ended) and removes
its directory, argv[1].

A request with ``"warm_workers": true`` for ``python -m jaxcoll.launch`` makes the
launcher start each process of its job that runs this Python (``-m MODULE``, ``-c
CODE``, ``SCRIPT``) as a fork of itself (``_WarmPopen``): it has imported jaxcoll,
so it is for jobs of jaxcoll programs (a command that never imports jaxcoll would see
JAXCOLL_CPU_DEVICES applied all the same).
"""

import atexit
import ctypes
import gc
import io
import json
import logging
import os
import runpy
import shutil
import signal
import subprocess
import sys
import threading
import types

import absl.app  # noqa: F401
import absl.flags  # noqa: F401
import absl.logging
import flax.linen  # noqa: F401
import jax  # noqa: F401
import jax.numpy  # noqa: F401
import ml_collections.config_flags  # noqa: F401
import numpy
import optax  # noqa: F401
import orbax.checkpoint  # noqa: F401
import scipy.optimize  # noqa: F401

# orbax's import logs (absl.logging.vlog) before any handler is set, and absl then gives the
# root logger logging.basicConfig's stderr handler, which a command started anew lacks until
# it imports orbax itself (experiments.train does it under absl.app, which removes it again).
for _handler in logging.root.handlers[:]:
  logging.root.removeHandler(_handler)

assert not any(m == "jaxcoll" or m.startswith(("jaxcoll.", "experiments")) for m in sys.modules)

_LIBC = ctypes.CDLL(None)


def _new_c_stdio(unbuffered: bool) -> None:
  """C's stdin, stdout and stderr as an exec leaves them: the parent's unflushed buffers
  dropped (not written twice), and unbuffered under PYTHONUNBUFFERED, as Python's start-up
  makes them for -u (a C library's printf then reaches the pipe at once, between Python's
  writes, as in a real start)."""
  for name in ("stdin", "stdout", "stderr"):
    stream = ctypes.c_void_p.in_dll(_LIBC, name)
    _LIBC.__fpurge(stream)
    if unbuffered:
      _LIBC.setvbuf(stream, None, 2, 0)  # _IONBF


def _exit(code: int) -> None:
  """os._exit(code) after what a Python's exit does below Python: C's stdio buffers flushed
  (a C or C++ library's unflushed printf to a pipe was lost)."""
  _LIBC.fflush(None)
  os._exit(code & 0xFF)


def _child(req) -> int:
  _new_c_stdio(False)  # the server's own environment: the same PYTHONUNBUFFERED (jobs.forked)
  os.chdir(req["cwd"])
  os.environ.clear()
  os.environ.update(req["env"])
  for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                          (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                          (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
    f = os.open(path, flags, 0o644)
    os.dup2(f, fd)
    os.close(f)
  # SIGINT as the requesting process would have passed it to a real start: inherited ignored
  # (a suite started as a background job), which Python's start-up keeps, or its handler.
  signal.signal(signal.SIGINT, signal.SIG_IGN if req.get("sigint_ignored")
                else signal.default_int_handler)
  sys.orig_argv = list(req["argv"])  # what jaxcoll's import reads (jaxcoll._COMMAND)
  if req.get("warm_workers") and req["argv"][1:3] == ["-m", "jaxcoll.launch"]:
    sys.argv = ["-m", *req["argv"][3:]]  # what runpy's import of the package sees
    _warm_workers()
  return _run_as_python(req["argv"])


def _run_as_python(argv) -> int:
  """Runs ``argv`` = ``[python, -m, MODULE | -c, CODE | SCRIPT, ARGS...]`` in this process
  as that command line would, to its end (threads, atexit); returns its exit status."""
  _, what, *args = argv
  option = what if what in ("-m", "-c") else None
  numpy.random.seed()  # from the OS's entropy, as in a new process (not the server's state)
  try:
    if option == "-m":
      what, *args = args
      sys.path[0] = os.getcwd()  # what `python -m` puts first
      sys.argv = [what, *args]  # runpy sets argv[0] to the module's file
      runpy.run_module(what, run_name="__main__", alter_sys=True)
    elif option == "-c":  # -c CODE: as `python -c` runs it
      what, *args = args
      sys.path[0] = ""
      sys.argv = ["-c", *args]
      main = type(sys)("__main__")
      sys.modules["__main__"] = main
      exec(compile(what, "<string>", "exec"), main.__dict__)  # noqa: S102
    else:  # SCRIPT
      sys.path[0] = os.path.dirname(os.path.realpath(what))
      sys.argv = [what, *args]
      runpy.run_path(what, run_name="__main__")
    code = 0
  except SystemExit as e:  # as the interpreter ends on it
    code = e.code
    if code is None:
      code = 0
    elif not isinstance(code, int):
      print(code, file=sys.stderr)
      code = 1
  except BaseException as e:  # noqa: BLE001  (an uncaught exception: traceback, status 1)
    # -c: from the code's own frame, as python -c prints it (this function's frame left out);
    # through sys.excepthook, as the interpreter does (jaxcoll's liveness installs one)
    if option == "-c":
      e = e.with_traceback(e.__traceback__.tb_next)
    sys.excepthook(type(e), e, e.__traceback__)
    code = 1
  threading._shutdown()  # as the interpreter ends: non-daemon threads, then atexit
  atexit._run_exitfuncs()
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # noqa: BLE001, S110
      pass
  return code


def _warm_workers() -> None:
  """Makes this process, the launcher to come (``python -m jaxcoll.launch``), start each
  process of its job (``python -m MODULE``, ``-c CODE`` or ``SCRIPT``) as a fork of itself
  instead of a new Python: the same argv, cwd, environment, standard streams, session,
  signals, parent and death signal as the real start (``_WarmPopen``), ~2.5 CPU-s less."""
  from jaxcoll.runtime import launch  # noqa: PLC0415  (as runpy's import of the launcher would)

  assert hasattr(launch._Output, "_lock"), "the launcher's output lock moved: see _WarmPopen"
  launch.subprocess = types.SimpleNamespace(**vars(subprocess))
  launch.subprocess.Popen = _WarmPopen


# What of the environment a real start reads before running its command (imports, Python's
# own start-up), other than what a warm start applies itself: JAXCOLL_* (jaxcoll reads
# JAXCOLL_CPU_DEVICES at import: applied again), PYTHONUNBUFFERED (the standard streams are
# made anew), PATH (read by nothing imported) and PYTEST_CURRENT_TEST.
def _read_at_start(env) -> dict[str, str]:
  return {k: v for k, v in env.items() if not k.startswith("JAXCOLL_")
          and k not in ("PATH", "PYTHONUNBUFFERED", "PYTEST_CURRENT_TEST")}


class _WarmPopen(subprocess.Popen):
  """``subprocess.Popen`` for the launcher's job: a command ``[python, -m MODULE | -c CODE |
  SCRIPT, ...]`` run by this interpreter starts as a fork of the launcher, which has imported
  JAX, flax, optax, orbax and jaxcoll and started no backend; any other command, or one that
  a fork cannot start as a real start would (another environment, a started backend), starts
  for real. The fork is made holding the launcher's output lock, so no thread of the
  launcher is inside a write to its standard streams (the child's copies are never used)."""

  def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                     startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite,
                     errread, errwrite, restore_signals, gid, gids, uid, umask,
                     start_new_session, process_group):
    if not _warm_startable(args, executable, close_fds, pass_fds, cwd, env, shell, gid, gids,
                           uid, umask, process_group):
      return super()._execute_child(
          args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
          creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
          restore_signals, gid, gids, uid, umask, start_new_session, process_group)
    from jaxcoll.runtime import launch  # noqa: PLC0415

    with launch._Output._lock:
      pid = os.fork()
      if pid == 0:
        code = 255
        try:
          launch._Output._lock.release()
          code = _warm_start(list(args), cwd, env, (p2cread, c2pwrite, errwrite),
                             start_new_session, preexec_fn, restore_signals)
        finally:
          _exit(code)
    self.pid = pid
    self._child_created = True
    self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
    return None


def _warm_startable(args, executable, close_fds, pass_fds, cwd, env, shell, gid, gids, uid,
                    umask, process_group) -> bool:
  from jax._src import xla_bridge  # noqa: PLC0415

  if (shell or executable is not None or not close_fds or pass_fds or gid is not None
      or gids is not None or uid is not None or umask >= 0 or process_group != -1
      or env is None or not isinstance(args, list | tuple) or len(args) < 2
      or args[0] != sys.executable or (cwd is not None and not os.path.isdir(cwd))):
    return False
  if args[1] in ("-m", "-c"):
    if len(args) < 3:
      return False
  elif args[1].startswith("-") or not args[1].endswith(".py") or not os.path.isfile(args[1]):
    return False
  try:
    devices = int(env.get("JAXCOLL_CPU_DEVICES", ""))
  except ValueError:
    return False
  return (devices >= 1 and not xla_bridge.backends_are_initialized()
          and _read_at_start(env) == _read_at_start(os.environ))


def _warm_start(argv, cwd, env, fds, start_new_session, preexec_fn, restore_signals) -> int:
  """In the forked child: what the exec of ``argv`` and a new Python's start-up would have
  done (as _posixsubprocess orders it), then the command; its exit status."""
  for target, fd in zip((0, 1, 2), fds, strict=True):
    if fd not in (-1, target):
      os.dup2(fd, target)
  if cwd is not None:
    os.chdir(cwd)
  # An exec resets every caught signal to its default (the launcher's stop handlers);
  # Python's start-up then ignores SIGPIPE and SIGXFSZ and gives SIGINT its handler.
  for signum in signal.valid_signals():
    handler = signal.getsignal(signum)
    if callable(handler):
      signal.signal(signum, signal.SIG_DFL)
  if restore_signals:
    for signum in (signal.SIGPIPE, signal.SIGXFSZ):
      signal.signal(signum, signal.SIG_DFL)
  for signum in (signal.SIGPIPE, signal.SIGXFSZ):
    signal.signal(signum, signal.SIG_IGN)
  if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
  if start_new_session:
    os.setsid()
  if preexec_fn is not None:
    preexec_fn()
  # No object of the launcher's is collected from here on (a cycle's late finalizer must not
  # close a descriptor number that the command has opened since); the live ones live until
  # os._exit.
  gc.freeze()
  os.closerange(3, os.sysconf("SC_OPEN_MAX"))
  os.environ.clear()
  os.environ.update(env)
  sys.orig_argv = list(argv)
  _new_c_stdio(bool(env.get("PYTHONUNBUFFERED")))
  _new_standard_streams(bool(env.get("PYTHONUNBUFFERED")))
  import jaxcoll  # noqa: PLC0415
  from jaxcoll.runtime import devices, launch  # noqa: PLC0415

  launch.subprocess = subprocess
  # What jaxcoll's import does in a real start, which the launcher's import already did: the
  # command it starts (jaxcoll._starting_command, as sys looks when the command imports it)
  # and its handler of a Ctrl-C while starting; then JAXCOLL_CPU_DEVICES.
  jaxcoll._COMMAND = _command(argv)
  if jaxcoll._COMMAND and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, jaxcoll._interrupted_while_starting)
  devices.simulate_from_environment()
  return _run_as_python(argv)


def _command(argv) -> str | None:
  """jaxcoll._COMMAND of a real start of ``argv``: ``-m jaxcoll.X`` imports jaxcoll with its
  package (X), ``-m experiments.X`` while its module runs (X, by ``__main__``'s spec); any
  other module, ``-c`` or a script: a console script's name or None."""
  import jaxcoll  # noqa: PLC0415

  _, what, *rest = argv
  if what == "-m" and rest and rest[0].startswith("jaxcoll."):
    return rest[0]
  if what == "-m" and rest and rest[0].startswith("experiments."):
    return rest[0].rpartition(".")[2]
  return jaxcoll._SCRIPTS.get(os.path.basename(rest[0] if what == "-m" and rest else what))


def _new_standard_streams(unbuffered: bool) -> None:
  """sys.stdin, stdout and stderr on descriptors 0, 1, 2 as a new Python makes them; the
  logging handlers that wrote to the old ones write to the new ones (absl.app removes the
  handler that an import's early log put on the root logger only when its stream is
  sys.stderr: left on the old stream, every log line of the job came twice)."""
  renamed = {}
  for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
    old = getattr(sys, name)
    buffering = 0 if unbuffered and fd else -1
    binary = io.open(fd, "rb" if fd == 0 else "wb", buffering=buffering, closefd=False)
    raw = binary if buffering == 0 else binary.raw
    raw.name = f"<{name}>"
    stream = io.TextIOWrapper(
        binary, encoding=old.encoding, errors=old.errors, newline="\n",
        line_buffering=not unbuffered and (fd == 2 or raw.isatty()),
        write_through=unbuffered)
    renamed[id(old)] = stream
    setattr(sys, name, stream)
    setattr(sys, f"__{name}__", stream)
  loggers = [logging.root, *logging.root.manager.loggerDict.values()]
  handlers = [h for lg in loggers for h in getattr(lg, "handlers", ())]
  handlers.append(absl.logging.get_absl_handler().python_handler)
  for handler in handlers:
    if isinstance(handler, logging.StreamHandler) and id(handler.stream) in renamed:
      handler.stream = renamed[id(handler.stream)]


def main():
  """Serves until stdin closes, then removes its directory (argv[1]): the
  pytest worker may have ended without closing it (SIGINT, SIGKILL)."""
  try:
    _serve()
  finally:
    shutil.rmtree(sys.argv[1], ignore_errors=True)


def _serve():
  for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
      code = 1
      try:
        code = _child(req)
      finally:
        _exit(code)
    print(pid, flush=True)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
  main()
