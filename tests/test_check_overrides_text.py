"""`models.check_overrides` refuses a quoted number where a number goes, but not text a
factory takes: `def make(remat=False)` given "dots", or a parameter annotated `bool | str`."""
import sys
import textwrap

import pytest

from jaxcoll import models


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
  (tmp_path / "textual_overrides_model.py").write_text(textwrap.dedent("""
      from typing import Literal

      def make(remat=False, width=64, mode: bool | str = False, size: int | str = 8,
               depth: int = 2, kind: Literal["a", "dots"] | None = None, widths=(64, 64)):
        raise AssertionError("check_overrides does not call the factory")
      """))
  monkeypatch.syspath_prepend(str(tmp_path))
  yield "textual_overrides_model:make"
  sys.modules.pop("textual_overrides_model", None)


@pytest.mark.parametrize("overrides", [
    {"remat": "dots"}, {"mode": "dots"}, {"size": "auto"}, {"size": "128"},
    {"kind": "dots"}, {"width": "wide"}])
def test_text_the_factory_may_take_is_accepted(factory_module, overrides):
  models.check_overrides(factory_module, overrides)


@pytest.mark.parametrize("overrides,kind", [
    ({"width": "128"}, "a number"), ({"remat": "true"}, "true or false"),
    ({"widths": "32"}, "a list"), ({"depth": "deep"}, "a number"),
    ({"depth": "3"}, "a number")])
def test_a_quoted_number_or_text_an_annotation_refuses_is_one_line(factory_module, overrides,
                                                                     kind):
  (key, value), = overrides.items()
  with pytest.raises(ValueError, match=rf"^override {key!r}={value!r} is text, .*: pass {kind}, "
                                       "unquoted"):
    models.check_overrides(factory_module, overrides)


def test_a_typo_still_says_did_you_mean(factory_module):
  with pytest.raises(ValueError, match=r"did you mean 'remat'\?"):
    models.check_overrides(factory_module, {"remta": "dots"})


def test_run_inputs_checks_the_overrides_once(monkeypatch):
  """`run.inputs.make_workload` checked them, then `models.make_workload` checked again
  (a second signature walk and type-hint resolution per run)."""
  from jaxcoll.run import config as run_config
  from jaxcoll.run import inputs

  calls = []
  check = models.check_overrides
  monkeypatch.setattr(models, "check_overrides", lambda *a: calls.append(a) or check(*a))
  workload = inputs.make_workload(run_config.RunConfig(
      model="mlp", model_overrides={"widths": [8], "input_dim": 4}))
  assert workload.name and len(calls) == 1, calls
