"""jaxcoll: collective communication and data parallelism for JAX.

Importing jaxcoll with ``JAXCOLL_CPU_DEVICES=n`` in the environment turns on
the CPU simulation mode (n emulated XLA CPU devices) before JAX starts.
Without it, the import changes nothing global: the shipped tuning table that
``algorithm="auto"`` consults is read on first use.
"""

import os as _os
import signal as _signal
import sys as _sys

# The console scripts of pyproject.toml; `jaxcoll-launch` says `jaxcoll.launch` as that does.
_SCRIPTS = {"jaxcoll": "jaxcoll", "jaxcoll-train": "train", "jaxcoll-eval": "eval",
            "jaxcoll-report": "report", "jaxcoll-bench": "bench",
            "jaxcoll-launch": "jaxcoll.launch"}


def _starting_command() -> str | None:
  """The name of the jaxcoll command this import is the start of (``python -m
  jaxcoll.launch``, ``python -m experiments.eval``, a console script), or None when
  jaxcoll is imported as a library (a user's program, a test)."""
  argv = list(getattr(_sys, "orig_argv", ()))
  if _sys.argv[:1] == ["-m"] and "-m" in argv:  # runpy still importing the -m module's package
    module = argv[argv.index("-m") + 1] if argv.index("-m") + 1 < len(argv) else ""
    return module if module.startswith("jaxcoll.") else None
  spec = getattr(_sys.modules.get("__main__"), "__spec__", None)
  if spec is not None and spec.name.startswith("experiments."):
    return spec.name.rpartition(".")[2]
  return _SCRIPTS.get(_os.path.basename(_sys.argv[0])) if _sys.argv else None


def _interrupted_while_starting(signum, frame):
  """Ctrl-C while a command imports JAX: it ended in a KeyboardInterrupt traceback (an
  ImportError when it hit an extension), or was lost ("Exception ignored in
  _xla_gc_callback") and the command ran on to its end, exit 0."""
  del frame
  _os.write(2, f"{_COMMAND}: interrupted by SIGINT while starting; nothing was started or "
               "written.\n".encode())
  _os._exit(128 + signum)


_COMMAND = _starting_command()
if _COMMAND and _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
  try:  # not an ignored SIGINT (`cmd &`), nor a command's own handler (experiments.train)
    _signal.signal(_signal.SIGINT, _interrupted_while_starting)
  except ValueError:  # not the main thread
    pass

from jaxcoll import _moved  # noqa: E402
from jaxcoll.runtime import devices as devices  # noqa: E402

devices.simulate_from_environment()

from jaxcoll.observe import analysis as analysis  # noqa: E402
from jaxcoll import collectives as collectives  # noqa: E402
from jaxcoll.comm_model import cost as cost  # noqa: E402
from jaxcoll import data as data  # noqa: E402
from jaxcoll.runtime import distributed as distributed  # noqa: E402
from jaxcoll import errors as errors  # noqa: E402
from jaxcoll.scale import memory as memory  # noqa: E402
from jaxcoll import models as models  # noqa: E402
from jaxcoll.comm_model import tuning as tuning  # noqa: E402
from jaxcoll.collectives import Hierarchical as Hierarchical  # noqa: E402
from jaxcoll.collectives import algorithms as algorithms  # noqa: E402
from jaxcoll.collectives import all_gather as all_gather  # noqa: E402
from jaxcoll.collectives import all_reduce as all_reduce  # noqa: E402
from jaxcoll.collectives import all_to_all as all_to_all  # noqa: E402
from jaxcoll.collectives import broadcast as broadcast  # noqa: E402
from jaxcoll.collectives import reduce as reduce  # noqa: E402
from jaxcoll.collectives import reduce_scatter as reduce_scatter  # noqa: E402
from jaxcoll.comm_model.topology import Topology as Topology  # noqa: E402
from jaxcoll.train import DataParallel as DataParallel  # noqa: E402
from jaxcoll.train import Trainer as Trainer  # noqa: E402
from jaxcoll.train import ZeRO as ZeRO  # noqa: E402
from jaxcoll.train import fsdp_unit as fsdp_unit  # noqa: E402

__version__ = "0.1.0"

# Modules with heavier imports (orbax, matplotlib on demand) load on first use:
# `jaxcoll.checkpoint.Checkpointer`, `jaxcoll.bench.run_benchmark`, ...
# Curated short names: `jaxcoll.NAME` is the module at its home in the layout.
_LAZY = {
    "bench": "jaxcoll.observe.bench",
    "checkpoint": "jaxcoll.train.checkpoint",
    "launch": "jaxcoll.runtime.launch",
    "metrics": "jaxcoll.observe.metrics",
}

_moved.install()
if _signal.getsignal(_signal.SIGINT) is _interrupted_while_starting:  # the command's own from here
  _signal.signal(_signal.SIGINT, _signal.default_int_handler)


def __getattr__(name: str):
  import importlib  # noqa: PLC0415

  if name in _LAZY:
    return importlib.import_module(_LAZY[name])
  if f"jaxcoll.{name}" in _moved.MOVED:  # an old path of the layout move: warns
    return _moved.import_moved(f"jaxcoll.{name}")
  raise AttributeError(f"module 'jaxcoll' has no attribute {name!r}")
