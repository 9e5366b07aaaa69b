"""Old module paths of the 2026-12 layout move, kept working with a warning.

``import jaxcoll.checkpoint`` (and ``from jaxcoll import data_files``) still
work: a finder that answers only for the names in :data:`MOVED` hands back
the module at its new path (the same module object, so monkeypatching either
name patches both). The short names of the curated modules (:data:`KEPT`,
e.g. ``jaxcoll.devices``, ``jaxcoll.checkpoint``) are public for good; the
others warn with ``DeprecationWarning``, as optax's ``deprecation_getattr``
does for moved names. The finder answers for no other name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

_RUNNER = ("loop", "inputs", "optim", "evaluate", "hooks", "watchdog", "lock", "attempts",
           "timing", "profiling", "config_error")

#: old module path -> new module path.
MOVED: dict[str, str] = {
    "jaxcoll.topology": "jaxcoll.comm_model.topology",
    "jaxcoll.cost": "jaxcoll.comm_model.cost",
    "jaxcoll.collective_sim": "jaxcoll.comm_model.collective_sim",
    "jaxcoll.tuning": "jaxcoll.comm_model.tuning",
    "jaxcoll.data_files": "jaxcoll.data.files",
    "jaxcoll.data_sources": "jaxcoll.data.sources",
    "jaxcoll.step_model": "jaxcoll.scale.step_model",
    "jaxcoll.memory": "jaxcoll.scale.memory",
    "jaxcoll.published": "jaxcoll.scale.published",
    "jaxcoll.devices": "jaxcoll.runtime.devices",
    "jaxcoll.distributed": "jaxcoll.runtime.distributed",
    "jaxcoll.analysis": "jaxcoll.observe.analysis",
    "jaxcoll.comm_share": "jaxcoll.observe.comm_share",
    "jaxcoll.bench": "jaxcoll.observe.bench",
    "jaxcoll.metrics": "jaxcoll.observe.metrics",
    "jaxcoll.run_report": "jaxcoll.observe.run_report",
    "jaxcoll.checkpoint": "jaxcoll.train.checkpoint",
    **{f"jaxcoll.train.{m}": f"jaxcoll.run.{m}" for m in _RUNNER},
}


#: Old paths that stay public for good (``jaxcoll.devices.simulate_cpu_devices``,
#: ``from jaxcoll.checkpoint import Checkpointer``): short names of the curated
#: modules, no warning.
KEPT = frozenset({
    "jaxcoll.devices", "jaxcoll.distributed", "jaxcoll.analysis", "jaxcoll.cost",
    "jaxcoll.tuning", "jaxcoll.memory", "jaxcoll.bench", "jaxcoll.metrics", "jaxcoll.checkpoint",
})


def warn_moved(old: str, new: str, stacklevel: int = 3) -> None:
  warnings.warn(f"`{old}` moved to `{new}`; the old path will be removed in a later release.",
                DeprecationWarning, stacklevel=stacklevel)


def renamed_getattr(module: str, renamed: dict[str, str], namespace: dict):
  """A module ``__getattr__`` that answers the old names in ``renamed`` (old -> new)
  with the object now at the new name, and a ``DeprecationWarning`` (optax's
  ``deprecation_getattr``)."""

  def __getattr__(name: str):
    if name in renamed:
      warn_moved(f"{module}.{name}", f"{module}.{renamed[name]}")
      return namespace[renamed[name]]
    raise AttributeError(f"module {module!r} has no attribute {name!r}")

  return __getattr__


def import_moved(old: str, *, warn: bool = True):
  """The module now at ``MOVED[old]`` (imported on first use)."""
  new = MOVED[old]
  if warn and old not in KEPT:
    warn_moved(old, new, stacklevel=4)
  return importlib.import_module(new)


class _Loader(importlib.abc.Loader):
  def __init__(self, old: str):
    self._old = old

  def create_module(self, spec):
    return import_moved(self._old)

  def exec_module(self, module):
    del module  # already executed at its new path


class _Finder(importlib.abc.MetaPathFinder):
  def find_spec(self, fullname, path=None, target=None):
    del path, target
    if fullname not in MOVED:
      return None
    return importlib.util.spec_from_loader(fullname, _Loader(fullname))


def install() -> None:
  """Installs the finder once (idempotent); called by ``import jaxcoll``."""
  if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.append(_Finder())
