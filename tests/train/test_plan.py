"""Plans answer for their strategy kind; strategy names map to stages in one place."""

from __future__ import annotations

import jax
import ml_collections
import optax
import pytest
from mlp_task import init_mlp, mse

import jaxcoll
from jaxcoll.run import loop
from jaxcoll.train import strategies


def test_strategy_names_map_to_stages_once():
  assert strategies.STAGES == {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
  assert loop.STRATEGIES == tuple(strategies.STAGES)
  for name, stage in strategies.STAGES.items():
    config = ml_collections.ConfigDict(dict(
        strategy=name, algorithm="native", bucket_bytes=1 << 20, compression=""))
    assert loop.build_strategy(config, "data").stage == stage


@pytest.mark.parametrize("strategy", [jaxcoll.DataParallel(), jaxcoll.ZeRO(stage=1), jaxcoll.ZeRO(stage=3)])
def test_the_plan_checks_its_own_optimizer_state(strategy):
  # A mask by size would see another structure on ZeRO's rows (they keep the rank, not
  # the size): ZeRO runs such an update on the full leaves, whose state exports as DP's.
  large = lambda p: jax.tree.map(lambda x: x.size > 4, p)  # noqa: E731
  momentum_on_large = optax.chain(optax.masked(optax.trace(0.9), large), optax.sgd(0.1))
  trainer = jaxcoll.Trainer(mse, momentum_on_large, jaxcoll.devices.flat_mesh(8), strategy)
  trainer.init(init_mlp())
  assert trainer._plan.updates_globally == (strategy.stage > 0)  # noqa: SLF001
  assert set(trainer.export_shapes()) == {"step", "params", "opt_state"}


# -- the stage is looked at once: plan classes and their kinds ------------------------

import ast  # noqa: E402
import pathlib  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402

from jaxcoll.observe import analysis  # noqa: E402
from jaxcoll.scale import memory, step_model  # noqa: E402
from jaxcoll.train import dp, kinds, plan as plan_lib, zero  # noqa: E402

ROOT = pathlib.Path(jaxcoll.__file__).parent


def _stage_branches(path: pathlib.Path, functions=None, allowed=("__new__",)):
  """``file:line`` of each test (if / while / ternary / comparison / boolean / a dict
  lookup's key) that reads an attribute named ``stage``, outside ``allowed``
  functions; only inside ``functions`` when given."""
  tree = ast.parse(path.read_text())
  found = []

  def reads_stage(node):
    return any(isinstance(n, ast.Attribute) and n.attr == "stage" for n in ast.walk(node))

  def visit(node, inside):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      inside = inside + (node.name,)
    tests = []
    if isinstance(node, (ast.If, ast.While, ast.IfExp)):
      tests.append(node.test)
    if isinstance(node, (ast.Compare, ast.BoolOp)):
      tests.append(node)
    if isinstance(node, ast.Subscript):
      tests.append(node.slice)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
        node.func.attr == "get"):
      tests.extend(node.args[:1])
    wanted = functions is None or any(f in functions for f in inside)
    if wanted and not any(a in inside for a in allowed) and any(map(reads_stage, tests)):
      found.append(f"{path.name}:{node.lineno}")
    for child in ast.iter_child_nodes(node):
      visit(child, inside)

  visit(tree, ())
  return sorted(set(found))


def test_no_plan_branches_on_its_stage():
  # ZeROPlan.__new__ (the factory) is the one place a plan reads the stage; memory's
  # peak, canonical and the step model's collectives ask the plan's kind instead.
  assert _stage_branches(ROOT / "train" / "zero.py") == []
  assert _stage_branches(ROOT / "train" / "dp.py") == []
  assert _stage_branches(ROOT / "train" / "plan.py") == []
  assert _stage_branches(ROOT / "train" / "canonical.py") == []
  assert _stage_branches(ROOT / "scale" / "memory.py", ("predict_peak",)) == []
  assert _stage_branches(ROOT / "scale" / "step_model.py",
                         ("_gradient_reduce", "_shard_group")) == []


def test_the_stage_branch_check_can_fail(tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text("class P:\n  def __new__(cls, s):\n    return {1: 2}[s.stage]\n"
                 "  def f(self):\n    if self.stage == 3:\n      pass\n"
                 "    x = 1 if self.stage < 3 else 2\n    return {0: 1}.get(self.stage)\n")
  assert _stage_branches(bad) == ["bad.py:5", "bad.py:7", "bad.py:8"]


MESH = jaxcoll.devices.flat_mesh(8)


@pytest.mark.parametrize("stage, cls", [(1, zero.ZeRO1Plan), (2, zero.ZeRO2Plan),
                                        (3, zero.ZeRO3Plan)])
def test_the_factory_builds_one_plan_class_per_stage(stage, cls):
  strategy = jaxcoll.ZeRO(stage=stage)
  trainer = jaxcoll.Trainer(mse, optax.sgd(0.1), MESH, strategy)
  trainer.init(init_mlp())
  built = trainer._plan
  assert type(built) is cls and isinstance(built, zero.ZeROPlan)
  assert built.kind is strategy.kind is kinds.BY_STAGE[stage]
  assert built.stage == trainer.stage == stage
  assert isinstance(built, zero.ReplicatedParamsPlan) == (stage < 3)
  assert isinstance(built, plan_lib.ReplicatedParams) == (stage < 3)
  # Built by the base class's name too (the old public constructor).
  again = zero.ZeROPlan(strategy, built.model, "data", 8, replica=None, replicas=1)
  assert type(again) is cls
  assert (built.state_spec.params == jax.sharding.PartitionSpec("data")) == (stage == 3)


def test_data_parallel_plan_kind():
  trainer = jaxcoll.Trainer(mse, optax.sgd(0.1), MESH, jaxcoll.DataParallel())
  trainer.init(init_mlp())
  assert type(trainer._plan) is dp.DataParallelPlan
  assert isinstance(trainer._plan, plan_lib.ReplicatedParams)
  assert trainer._plan.kind is jaxcoll.DataParallel().kind is kinds.DP
  assert trainer._plan.stage == 0


def test_kinds_table():
  assert [k.name for k in kinds.BY_STAGE.values()] == ["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
  assert [k.collectives for k in kinds.BY_STAGE.values()] == [
      ("all_reduce",), ("all_reduce", "all_gather"), ("reduce_scatter", "all_gather"),
      ("all_gather", "reduce_scatter")]
  assert [kinds.BY_STAGE[s].state_bytes(80, 160, 8) for s in range(4)] == [240, 100, 100, 30]
  for bad in (4, -1, True, "1"):
    with pytest.raises(ValueError, match="`stage` must be 0 \\(DP\\), 1, 2 or 3"):
      kinds.of_stage(bad)
  # The step model's strategies read the same table.
  for stage in range(4):
    assert step_model.StepStrategy(stage=stage).kind is kinds.BY_STAGE[stage]
    assert step_model.StepStrategy(stage=stage).name == kinds.BY_STAGE[stage].name
  assert step_model.StepStrategy.from_trainer(jaxcoll.ZeRO(stage=2)).kind is kinds.ZERO2


def _step_collectives(strategy):
  """HLO kinds (as collective names) of the step's collectives larger than a scalar."""
  trainer = jaxcoll.Trainer(mse, optax.sgd(0.1), MESH, strategy, nan_policy="none")
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(32, 4)).astype("float32"),
           "y": rng.normal(size=(32, 3)).astype("float32")}
  state = trainer.init(init_mlp())
  hlo = trainer.lower_step(state, batch).as_text(dialect="hlo")
  return {op.kind.replace("-", "_") for op in analysis.report_from_hlo(hlo).ops
          if op.size_bytes > 16}


@pytest.mark.parametrize("strategy", [jaxcoll.DataParallel(algorithm="native"),
                                      *(jaxcoll.ZeRO(stage=s, algorithm="native")
                                        for s in (1, 2, 3))], ids=lambda s: s.name)
def test_a_kind_names_the_collectives_its_step_runs(strategy):
  assert _step_collectives(strategy) == set(strategy.kind.collectives)


def test_memory_asks_the_kind():
  # predict_peak's state term is the kind's (ZeRO-1/2 rows of optimizer state only).
  w_params, batch = init_mlp(), {"x": np.zeros((32, 4), "float32"),
                                 "y": np.zeros((32, 3), "float32")}
  states = []
  for strategy in (jaxcoll.DataParallel(), *(jaxcoll.ZeRO(stage=s) for s in (1, 2, 3))):
    trainer = jaxcoll.Trainer(mse, optax.adam(1e-3), MESH, strategy)
    est = memory.predict_peak(trainer, w_params, batch)
    states.append(est.state_bytes)
    assert (est.row_bytes > 0) == strategy.kind.gathers_updated_params
    assert (est.gathered_bytes > 0) == strategy.kind.gathers_params_for_compute
  # 91 float32 parameters, rows of ceil(size / 8) per leaf; Adam: mu, nu and an int32 count.
  full, rows, opt = 91 * 4, (3 + 1 + 5 + 1 + 3 + 1) * 4, 2 * 91 * 4 + 4
  assert states == [full + opt, int(full + opt * rows / full), int(full + opt * rows / full),
                    int(rows + opt * rows / full)] == [1096, 476, 476, 168]


def test_renamed_names_keep_working():
  assert step_model.Strategy is step_model.StepStrategy
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert plan_lib.Model is plan_lib.TrainSetup
  assert [w.category for w in caught] == [DeprecationWarning]
  assert "jaxcoll.train.plan.TrainSetup" in str(caught[0].message)
  with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
    plan_lib.Nope  # noqa: B018


def test_plan_is_only_the_strategy_plan():
  # memory.plan() and bench.plan() were two other "plans": now compare() and cases();
  # the old names are the same functions.
  from jaxcoll.observe import bench  # noqa: PLC0415

  assert memory.plan is memory.compare and bench.plan is bench.cases
  algos, todo = bench.cases("all_reduce", "native", [1024, 1000], n=8)
  assert algos == ("native",)
  assert [(c.count, c.size_bytes) for c in todo] == [(250, 1000), (256, 1024)]
