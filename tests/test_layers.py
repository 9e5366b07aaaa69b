"""jaxcoll's import graph: no cycle (deferred imports included), no upward import.

Every module under ``jaxcoll/`` is parsed with :mod:`ast`; every ``import`` and
``from ... import`` anywhere in it (inside functions, ``__getattr__`` and
``if TYPE_CHECKING:`` included) is an edge to the jaxcoll module it names.
Two rules:

- no cycle between modules: ``a`` imports ``b`` (at any depth) imports ``a``
  is refused even when one of the imports sits inside a function;
- a module imports only its own layer and the layers :data:`LAYERS` lets its
  layer use (with what those may use): arrows point down.

A module's parent packages are not edges (Python runs them first for every
submodule). ``jaxcoll._moved`` resolves the old paths of the layout move by
name (``importlib``); names in strings are not followed.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxcoll"

#: layer -> the layers it may import (and, through them, what those may).
LAYERS: dict[str, tuple[str, ...]] = {
    "leaves": (),                       # checks, sizes, fingerprint, atomic_write, errors, _moved
    "runtime": ("leaves",),             # devices, distributed, launch
    "collectives": ("leaves",),         # the algorithms, their registry and spec table
    "data": ("leaves",),                # synthetic sets, per-process sharding, file sources
    "comm_model": ("collectives",),     # topology, cost, collective_sim, tuning
    "train": ("collectives",),          # Trainer, plans, strategies, state, checkpoint
    "models": ("data", "train"),        # workloads
    "observe": ("comm_model", "runtime"),  # HLO report, comm share, bench, metrics, run report
    "scale": ("observe", "train"),      # step model, memory, published rows
    "run": ("scale", "models"),         # the experiment runner
    "facade": ("run",),                 # `import jaxcoll`, `python -m jaxcoll.launch`
}

# Top-level modules (``jaxcoll.disk``: disk-space checks; ``jaxcoll.cli``: console scripts).
_LEAVES = ("jaxcoll.checks", "jaxcoll.sizes", "jaxcoll.fingerprint", "jaxcoll.atomic_write",
           "jaxcoll.errors", "jaxcoll._moved", "jaxcoll.disk")
_FACADE = ("jaxcoll", "jaxcoll.launch", "jaxcoll.cli")
# Modules whose layer is not their package's. The run report tells where a resume starts with
# the resume's own rules (train.checkpoint's damage checks, run.incidents' rollback record),
# so it is at the top, with the runner: nothing in jaxcoll may import it.
_OWN_LAYER = {"jaxcoll.observe.run_report": "run"}


def layer_of(module: str) -> str | None:
  if module in _OWN_LAYER:
    return _OWN_LAYER[module]
  if module in _LEAVES:
    return "leaves"
  if module in _FACADE:
    return "facade"
  parts = module.split(".")
  if len(parts) >= 2 and parts[1] in LAYERS:
    return parts[1]
  return None


def modules() -> dict[str, pathlib.Path]:
  found = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    found[".".join(parts)] = path
  return found


def imports(source: str, module: str, is_package: bool, known) -> list[tuple[str, int]]:
  """``(imported jaxcoll module, line)`` of every import statement in ``source``."""
  package = module if is_package else module.rpartition(".")[0]

  def resolve(name: str) -> str | None:
    while name and name not in known:
      name = name.rpartition(".")[0]
    return name or None

  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(base + ([node.module] if node.module else []))
      else:
        base = node.module or ""
      # `from pkg import sub` imports the submodule; `from mod import name`, the module.
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                 for a in node.names]
    else:
      continue
    for target in targets:
      if target == "jaxcoll" or target.startswith("jaxcoll."):
        resolved = resolve(target)
        if resolved is not None and resolved != module:
          found.append((resolved, node.lineno))
  return found


def graph() -> dict[str, list[tuple[str, int]]]:
  known = modules()
  return {
      m: imports(p.read_text(), m, p.name == "__init__.py", known) for m, p in known.items()
  }


def allowed(layer: str) -> set[str]:
  """``layer`` and every layer it may import, directly or through others."""
  seen, todo = {layer}, [layer]
  while todo:
    for below in LAYERS[todo.pop()]:
      if below not in seen:
        seen.add(below)
        todo.append(below)
  return seen


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
  """One cycle ``[a, b, ..., a]`` of the directed graph, or None."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []

  def visit(node: str) -> list[str] | None:
    state[node] = 1
    path.append(node)
    for nxt in sorted(edges.get(node, ())):
      if state.get(nxt) == 1:
        return path[path.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    path.pop()
    state[node] = 2
    return None

  for node in sorted(edges):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


def test_the_walker_sees_deferred_relative_and_from_imports():
  known = {"jaxcoll", "jaxcoll.collectives", "jaxcoll.collectives._dispatch",
           "jaxcoll.comm_model", "jaxcoll.comm_model.tuning", "jaxcoll.comm_model.cost"}
  source = (
      "from . import _dispatch\n"
      "from jaxcoll.comm_model.cost import estimate\n"
      "import numpy\n"
      "def f():\n"
      "  from jaxcoll.comm_model import tuning\n"
      "  return tuning\n"
  )
  assert imports(source, "jaxcoll.collectives", True, known) == [
      ("jaxcoll.collectives._dispatch", 1), ("jaxcoll.comm_model.cost", 2),
      ("jaxcoll.comm_model.tuning", 5),
  ]
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


def test_the_declared_layers_are_layered():
  assert find_cycle({k: set(v) for k, v in LAYERS.items()}) is None
  assert allowed("facade") == set(LAYERS)


def test_every_module_has_a_layer():
  missing = [m for m in modules() if layer_of(m) is None]
  assert not missing, (
      f"modules outside every layer: {missing}; put them in a layer's package or declare "
      "them in tests/test_layers.py")


def test_no_import_cycle_deferred_or_not():
  edges = {m: {t for t, _ in targets} for m, targets in graph().items()}
  cycle = find_cycle(edges)
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_point_down_the_layers():
  upward = []
  for module, targets in graph().items():
    layer = layer_of(module)
    if layer is None:  # reported by test_every_module_has_a_layer
      continue
    ok = allowed(layer)
    for target, line in targets:
      if layer_of(target) not in ok:
        upward.append(f"{module}:{line} ({layer}) imports {target} ({layer_of(target)})")
  assert not upward, "imports up the layers:\n" + "\n".join(upward)


@pytest.mark.parametrize("module, layer", [
    ("jaxcoll.collectives._dispatch", "collectives"), ("jaxcoll.sizes", "leaves"),
    ("jaxcoll.run.loop", "run"), ("jaxcoll", "facade"),
])
def test_layer_of(module, layer):
  assert layer_of(module) == layer
