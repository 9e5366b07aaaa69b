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
"""

import atexit
import json
import logging
import os
import runpy
import shutil
import signal
import sys
import threading
import traceback

import absl.app  # noqa: F401
import absl.flags  # noqa: F401
import absl.logging  # noqa: F401
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


def _child(req) -> int:
  os.chdir(req["cwd"])
  os.environ.clear()
  os.environ.update(req["env"])
  for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                          (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                          (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
    f = os.open(path, flags, 0o644)
    os.dup2(f, fd)
    os.close(f)
  signal.signal(signal.SIGINT, signal.default_int_handler)
  _, option, what, *args = req["argv"]
  numpy.random.seed()  # from the OS's entropy, as in a new process (not the server's state)
  try:
    if option == "-m":
      sys.path[0] = os.getcwd()  # what `python -m` puts first
      sys.argv = [what, *args]  # runpy sets argv[0] to the module's file
      runpy.run_module(what, run_name="__main__", alter_sys=True)
    else:  # -c CODE: as `python -c` runs it
      sys.path[0] = ""
      sys.argv = ["-c", *args]
      main = type(sys)("__main__")
      sys.modules["__main__"] = main
      exec(compile(what, "<string>", "exec"), main.__dict__)  # noqa: S102
    code = 0
  except SystemExit as e:  # as the interpreter ends on it
    code = e.code
    if code is None:
      code = 0
    elif not isinstance(code, int):
      print(code, file=sys.stderr)
      code = 1
  except BaseException as e:  # noqa: BLE001  (an uncaught exception: traceback, status 1)
    # -c: from the code's own frame, as python -c prints it (this function's frame left out)
    traceback.print_exception(type(e), e, e.__traceback__.tb_next if option == "-c" else
                              e.__traceback__)
    code = 1
  threading._shutdown()  # as the interpreter ends: non-daemon threads, then atexit
  atexit._run_exitfuncs()
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # noqa: BLE001, S110
      pass
  return code


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
        os._exit(code & 0xFF)
    print(pid, flush=True)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
  main()
