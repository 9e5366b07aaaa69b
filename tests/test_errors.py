"""jaxcoll.errors: every exception / warning class and exit status, in one place."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

from jaxcoll import errors

REPO = pathlib.Path(__file__).resolve().parent.parent

# (module, old name) -> the name in jaxcoll.errors it is.
OLD_NAMES = [
    ("jaxcoll.run.config_error", "ConfigError", "ConfigError"),
    ("jaxcoll.run.loop", "ConfigError", "ConfigError"),
    ("jaxcoll.run.loop", "ReplicaDesyncError", "ReplicaDesyncError"),
    ("jaxcoll.run.loop", "EXIT_DISK_FULL", "EXIT_DISK_FULL"),
    ("jaxcoll.run.loop", "EXIT_INJECTED_FAULT", "EXIT_INJECTED_FAULT"),
    ("jaxcoll.run.hooks", "EXIT_INJECTED_FAULT", "EXIT_INJECTED_FAULT"),
    ("jaxcoll.data.sources", "DataError", "DataError"),
    ("jaxcoll.run.lock", "WorkdirBusyError", "WorkdirBusyError"),
    ("jaxcoll.run.watchdog", "StopRequested", "StopRequested"),
    ("jaxcoll.run.incidents", "IncidentStop", "IncidentStop"),
    ("jaxcoll.run.incidents", "EXIT_INCIDENT_STOP", "EXIT_INCIDENT_STOP"),
    ("jaxcoll.run.watchdog", "EXIT_WATCHDOG", "EXIT_WATCHDOG"),
    ("jaxcoll.run.watchdog", "EXIT_TERMINATED", "EXIT_TERMINATED"),
    ("jaxcoll.runtime.launch", "UsageError", "UsageError"),
    ("jaxcoll.runtime.launch", "EXIT_USAGE", "EXIT_USAGE"),
    ("jaxcoll.runtime.launch", "EXIT_TIMEOUT", "EXIT_TIMEOUT"),
    ("jaxcoll.runtime.distributed", "INIT_TIMEOUT_EXIT_CODE", "EXIT_INIT_TIMEOUT"),
    ("jaxcoll.train.guards", "NonFiniteGradientsError", "NonFiniteGradientsError"),
    ("jaxcoll.train", "NonFiniteGradientsError", "NonFiniteGradientsError"),
    ("jaxcoll.train.checkpoint", "NonFiniteStateError", "NonFiniteStateError"),
    ("jaxcoll.train.checkpoint", "CorruptCheckpointWarning", "CorruptCheckpointWarning"),
    ("jaxcoll.checkpoint", "CorruptCheckpointWarning", "CorruptCheckpointWarning"),
    ("jaxcoll.observe.metrics", "TornLineWarning", "TornLineWarning"),
    ("jaxcoll.metrics", "TornLineWarning", "TornLineWarning"),
    ("jaxcoll.train.mixing", "NotElementwiseWarning", "NotElementwiseWarning"),
]


@pytest.mark.parametrize("module, old, new", OLD_NAMES)
def test_old_names_are_the_errors_module_objects(module, old, new):
  assert getattr(importlib.import_module(module), old) is getattr(errors, new)


def test_statuses_are_documented_distinct_and_fixed():
  constants = {k: v for k, v in vars(errors).items()
               if k.startswith("EXIT_") and k != "EXIT_STATUSES"}
  assert sorted(constants.values()) == sorted(errors.EXIT_STATUSES)  # each one documented once
  assert constants == {
      "EXIT_PARENT_GONE": 1, "EXIT_USAGE": 2, "EXIT_NON_FINITE": 3, "EXIT_REPLICA_DESYNC": 4,
      "EXIT_INCIDENT_STOP": 5, "EXIT_INJECTED_FAULT": 17, "EXIT_DISK_FULL": 74, "EXIT_INIT_TIMEOUT": 75,
      "EXIT_PEER_GONE": 76,
      "EXIT_WATCHDOG": 86, "EXIT_TIMEOUT": 124, "EXIT_TERMINATED": 143,
      "EXIT_INTERRUPTED": 130, "EXIT_HANGUP": 129, "EXIT_STOP_REQUEST": 138,
  }


def test_every_class_of_the_module_is_in_the_table():
  classes = {v for v in vars(errors).values()
             if isinstance(v, type) and v.__module__ == "jaxcoll.errors"}
  assert classes == set(errors.RAISED_BY)
  for cls, (_, status) in errors.RAISED_BY.items():
    assert status is None or status in errors.EXIT_STATUSES, cls


def _is_exception_base(base: ast.expr) -> bool:
  name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
  return name.endswith(("Error", "Exception", "Warning", "Exit", "Interrupt"))


def _python_files():
  for folder in ("jaxcoll", "experiments"):
    yield from sorted((REPO / folder).rglob("*.py"))


def test_no_public_exception_class_outside_the_errors_module():
  found = []
  for path in _python_files():
    if path == REPO / "jaxcoll" / "errors.py":
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if (isinstance(node, ast.ClassDef) and not node.name.startswith("_")
          and any(_is_exception_base(b) for b in node.bases)):
        found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}")
  assert not found, f"define these in jaxcoll/errors.py (and re-export them): {found}"


def test_no_exit_status_written_as_a_number():
  """``status=3``, ``sys.exit(4)``, ``os._exit(17)``: name the status in jaxcoll.errors."""
  found = []
  for path in _python_files():
    for node in ast.walk(ast.parse(path.read_text())):
      if not isinstance(node, ast.Call):
        continue
      func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(
          node.func, "id", "")
      args = [k.value for k in node.keywords if k.arg == "status"]
      if func in ("exit", "_exit"):
        args += node.args[:1]
      for a in args:
        if isinstance(a, ast.Constant) and isinstance(a.value, int) and a.value != 0:
          found.append(f"{path.relative_to(REPO)}:{node.lineno} {func}(... {a.value})")
  assert not found, found


def test_the_readme_table_is_the_module():
  readme = (REPO / "README.md").read_text()
  section = readme[readme.index("## Errors and exit statuses"):]
  section = section[: section.index("\n## ", 10)] if "\n## " in section[10:] else section
  names = {v: k for k, v in vars(errors).items() if k.startswith("EXIT_") and isinstance(v, int)}
  for status, meaning in errors.EXIT_STATUSES.items():
    assert f"| {status} | `{names[status]}` | {meaning} |" in section, status
  for cls, (where, status) in errors.RAISED_BY.items():
    shown = "-" if status is None else status
    row = f"| `{cls.__name__}` | `{cls.__mro__[1].__name__}` | {where} | {shown} |"
    assert row in section, row
  assert "(#errors-and-exit-statuses)" in readme[: readme.index("## Errors and exit statuses")]
