"""jaxcoll: collective communication and data parallelism for JAX.

Importing jaxcoll with ``JAXCOLL_CPU_DEVICES=n`` in the environment turns on
the CPU simulation mode (n emulated XLA CPU devices) before JAX starts.
Without it, the import changes nothing global: the shipped tuning table that
``algorithm="auto"`` consults is read on first use.
"""

from jaxcoll import _moved
from jaxcoll.runtime import devices as devices

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


def __getattr__(name: str):
  import importlib  # noqa: PLC0415

  if name in _LAZY:
    return importlib.import_module(_LAZY[name])
  if f"jaxcoll.{name}" in _moved.MOVED:  # an old path of the layout move: warns
    return _moved.import_moved(f"jaxcoll.{name}")
  raise AttributeError(f"module 'jaxcoll' has no attribute {name!r}")
