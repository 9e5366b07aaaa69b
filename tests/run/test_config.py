"""jaxcoll.run.config: one frozen RunConfig, the only defaults, parsed and checked once."""

import ast
import dataclasses
import glob
import os
import runpy

import jobs
import ml_collections
import pytest

from configs import base
from jaxcoll.run import config, incidents, inputs, loop, watchdog
from jaxcoll.run.config_error import ConfigError


def _flat(d, prefix=""):
  out = {}
  for k, v in d.items():
    if isinstance(v, dict) and k != "model_overrides":
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[prefix + k] = v
  return out


def test_base_config_is_the_dataclass_defaults_field_by_field():
  got, want = _flat(base.base_config().to_dict()), _flat(config.RunConfig().to_dict())
  assert sorted(got) == sorted(want)  # the same fields
  for name, value in want.items():
    assert got[name] == value and type(got[name]) is type(value), name


def test_drifted_defaults_have_one_value():
  # watchdog_s was 600 in configs/base.py and 0 in loop.py; replica_axis had no base default.
  assert config.RunConfig().watchdog_s == 600.0 == base.base_config().watchdog_s
  assert config.parse({}).watchdog_s == 600.0  # a hand-built config without the field
  assert watchdog.limits({}) == (600.0, 2400.0)
  assert config.RunConfig().replica_axis == "" == base.base_config().replica_axis
  assert incidents.DEFAULTS == dataclasses.asdict(config.IncidentsConfig())
  assert incidents.settings_from_config({}) == incidents.DEFAULTS


@pytest.mark.parametrize("path", sorted(p for p in glob.glob(os.path.join(
    jobs.REPO, "configs", "*.py")) if os.path.basename(p) not in ("__init__.py", "base.py")))
def test_every_shipped_config_parses_to_the_same_values(path):
  get_config = runpy.run_path(path)["get_config"]
  for variant in (None, "smoke", "files", "smoke,files"):
    c = get_config(variant)
    parsed = config.parse(c)
    assert parsed.to_dict() == c.to_dict()
    assert config.parse(parsed) is parsed


def test_parse_fills_defaults_and_keeps_hand_built_values():
  c = config.parse(ml_collections.ConfigDict({"steps": 7, "data": {"prefetch": 0},
                                              "learning_rate": 1}))
  assert (c.steps, c.data.prefetch, c.data.num_threads, c.learning_rate) == (7, 0, 2, 1.0)
  assert type(c.learning_rate) is float  # an int given for a float field is stored as one
  with pytest.raises(dataclasses.FrozenInstanceError):
    c.steps = 8  # noqa: B903
  assert dataclasses.replace(c, steps=9).steps == 9


@pytest.mark.parametrize("given, message", [
    ({"stpes": 10}, "`config.stpes`=10: unknown config field 'stpes'; did you mean 'steps'?"),
    ({"data": {"prefetsh": 1}}, "`config.data.prefetsh`=1: unknown config field "
     "'data.prefetsh'; did you mean 'data.prefetch'?"),
    ({"incidents": {"loss_spikes": "warn"}}, "unknown signal or setting"),
    ({"steps": "10"}, "`config.steps`='10': must be an integer, not str"),
    ({"steps": True}, "`config.steps`=True: must be an integer, not bool"),
    ({"tensorboard": 1}, "`config.tensorboard`=1: must be True or False"),
    ({"data": {"prefetch": 2.5}}, "`config.data.prefetch`=2.5: must be an integer"),
    ({"learning_rate": "x"}, "`config.learning_rate`='x': must be a finite number > 0"),
    ({"data": {"prefetch": -1}}, "`config.data.prefetch`=-1: must be an integer >= 0"),
    ({"strategy": "zero4"}, "ZeRO has stages 0-3"),
    ({"schedule": "cosine", "warmup_steps": 100}, "cosine needs warmup_steps < steps"),
    ({"corrupt_batches": "1:2,5:6"}, "give one range A:B"),
    ({"checkpoint_every": 0, "incidents": {"loss_spike": "rollback"}}, "checkpoint_every is 0"),
])
def test_bad_fields_are_one_line_errors(given, message):
  with pytest.raises(ConfigError) as e:
    config.parse(given)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_each_check_is_made_once_in_the_config():
  # data.prefetch / data.eval_batch_size were checked in loop._check_config and in inputs too.
  for module in (loop, inputs):
    text = open(module.__file__).read()
    assert "must be an integer >= 0" not in text, module.__name__
  assert not hasattr(loop, "_check_config") and not hasattr(inputs, "_check_reader_fields")


_RUNNER = ("loop", "inputs", "optim", "hooks", "timing", "watchdog", "incidents", "evaluate")


def _config_gets(path):
  """``(line, source)`` of every ``X.get(...)`` call whose X is rooted at ``config`` or ``section``."""
  tree = ast.parse(open(path).read())
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
        node.func.attr == "get":
      root = node.func.value
      while isinstance(root, ast.Attribute):
        root = root.value
      if isinstance(root, ast.Name) and root.id in ("config", "section", "given"):
        found.append((node.lineno, ast.unparse(node)))
  return found


def test_the_runner_reads_attributes_not_config_get():
  assert _config_gets.__doc__  # the walker finds one (it can fail):
  probe = os.path.join(os.path.dirname(__file__), "_probe_config_get.py")
  try:
    with open(probe, "w") as f:
      f.write("def f(config):\n  return config.data.get('prefetch', 2)\n")
    assert _config_gets(probe) == [(2, "config.data.get('prefetch', 2)")]
  finally:
    os.remove(probe)
  run = os.path.dirname(loop.__file__)
  for name in _RUNNER:
    assert _config_gets(os.path.join(run, f"{name}.py")) == [], name


BAD_FILES = {
    "unknown.py": ("from configs import default\n\ndef get_config(variant=None):\n"
                   "  c = default.get_config('smoke')\n  c.learning_rat = 0.1\n  return c\n",
                   "`config.learning_rat`=0.1: unknown config field 'learning_rat'; did you mean "
                   "'learning_rate'?"),
    "wrong_type.py": ("import ml_collections\n\ndef get_config(variant=None):\n"
                      "  return ml_collections.ConfigDict({'model': 'mlp', 'steps': '6'})\n",
                      "`config.steps`='6': must be an integer, not str"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_unknown_field_or_wrong_type_at_the_cli_is_exit_2_and_writes_nothing(name, tmp_path):
  text, message = BAD_FILES[name]
  path = tmp_path / name
  path.write_text(text)
  workdir = tmp_path / "run"
  workdir.mkdir()
  out = jobs.train_forked(f"--config={path}", f"--workdir={workdir}")
  assert out.returncode == 2, out.stderr[-2000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("train: error: ") and message in lines[0]
  assert os.listdir(workdir) == []
