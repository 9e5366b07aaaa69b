"""Flax models with learnable synthetic data, packaged as workloads; or your own.

Each model comes as a :class:`Workload`: ``init_params(rng)``,
``loss_fn(params, batch) -> (loss, aux)`` for
``jaxcoll.Trainer(w.loss_fn, optimizer, mesh, strategy, has_aux=w.has_aux)``,
``make_batch(step, batch_size)`` (deterministic in the step), ``eval_fn`` and
``num_params``. Your own model is a function returning a :class:`Workload`
(e.g. built by :func:`from_flax` for linen, :func:`from_nnx` for flax.nnx),
named ``"my_pkg.my_module:make"`` wherever
a workload name goes. Models with state (ResNet's BatchNorm statistics) carry it in
``params["batch_stats"]``, return the update in ``aux["batch_stats"]``, and
:func:`merge_aux` writes it back.

Example:
  >>> from jaxcoll import models
  >>> models.names()
  ('mlp', 'resnet', 'transformer', 'recommender')
  >>> w = models.make_workload("mlp", widths=(16,))
  >>> w.num_params
  698
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable
from typing import Any

from jaxcoll.models import layers as layers
from jaxcoll.models import mlp as mlp
from jaxcoll.models import recommender as recommender
from jaxcoll.models import resnet as resnet
from jaxcoll.models import transformer as transformer
from jaxcoll.models.nnx_model import from_nnx as from_nnx
from jaxcoll.models.workload import Workload as Workload
from jaxcoll.models.workload import count_params as count_params
from jaxcoll.models.workload import fixed_key as fixed_key
from jaxcoll.models.workload import from_flax as from_flax
from jaxcoll.models.workload import merge_aux as merge_aux

_FACTORIES: dict[str, Callable[..., Workload]] = {
    "mlp": mlp.make_workload,
    "resnet": resnet.make_workload,
    "transformer": transformer.make_workload,
    "recommender": recommender.make_workload,
}


def names() -> tuple[str, ...]:
  """Names of the available workloads."""
  return tuple(_FACTORIES)


def get(name: str) -> Callable[..., Workload]:
  """The factory ``make_workload(**overrides)`` of workload ``name``.

  ``name`` is one of :func:`names` or a ``"module:function"`` path (the module
  imported as ``import module`` would, the function called with the
  overrides and returning a :class:`Workload`).

  Raises:
    ValueError: for an unknown name, a module that does not import or a
      missing function; the message says which and the fix.
  """
  if not isinstance(name, str):
    raise TypeError(f"`name` must be a str, got {type(name).__name__}.")
  if ":" in name:
    return _import_factory(name)
  if name not in _FACTORIES:
    raise ValueError(
        f"`name` must be one of {names()} or a 'module:function' path, got {name!r}."
    )
  return _FACTORIES[name]


def _import_factory(path: str) -> Callable[..., Workload]:
  module_name, _, function = path.partition(":")
  if not module_name or not function.isidentifier():
    raise ValueError(
        f"{path!r} is not a 'module:function' path; write e.g. 'my_pkg.my_model:make'."
    )
  if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
    folder, file = os.path.split(module_name)
    stem = file[:-3] if file.endswith(".py") else file
    folder = folder or "."
    raise ValueError(
        f"{path!r} is a file path; a model is named by its module: put {folder} on "
        f"PYTHONPATH and name '{stem}:{function}' (e.g. PYTHONPATH={folder} python -m "
        f"experiments.train ... --config.model={stem}:{function})."
    )
  try:
    module = importlib.import_module(module_name)
  except Exception as e:  # noqa: BLE001  (any import failure is the user's to see)
    raise ValueError(
        f"{path!r}: module {module_name!r} does not import ({type(e).__name__}: {e}); put it "
        "on PYTHONPATH (or run from its directory) and fix the error."
    ) from None
  factory = getattr(module, function, None)
  if not callable(factory):
    raise ValueError(
        f"{path!r}: module {module_name!r} has no function {function!r}; define "
        f"`def {function}(**overrides) -> jaxcoll.models.Workload` there."
    )
  return factory


def check_overrides(name: str, overrides: dict[str, Any]) -> None:
  """Raises ``ValueError`` unless ``name``'s function takes every key of ``overrides``;
  the message names the unknown key, the closest valid one and all of them."""
  import difflib  # noqa: PLC0415

  parameters = inspect.signature(get(name)).parameters
  valid = tuple(parameters)
  takes_any = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
  unknown = sorted(set(overrides) - set(valid))
  if unknown and not takes_any:
    close = difflib.get_close_matches(unknown[0], valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(
        f"Unknown override(s) {unknown} for workload {name!r}{hint}; valid: {valid}."
    )
  hints = _type_hints(get(name))
  for key, value in overrides.items():  # '{"width": "64"}': text where a number goes
    default = parameters[key].default if key in parameters else inspect.Parameter.empty
    if not (isinstance(value, str) and isinstance(default, (bool, int, float, tuple, list))):
      continue
    if key in hints:  # `remat: bool | str = False`: the annotation decides
      if _admits_str(hints[key]):
        continue
    elif not _parses_as_json_value(value):  # `def make(remat=False)` given "dots": may be meant
      continue
    import json  # noqa: PLC0415

    kind = ("true or false" if isinstance(default, bool) else
            "a list" if isinstance(default, (tuple, list)) else "a number")
    raise ValueError(
        f"override {key!r}={value!r} is text, but the default of {name!r} for it is "
        f"{default!r}: pass {kind}, unquoted, as in {json.dumps({key: default})}."
    )


def _type_hints(factory) -> dict[str, Any]:
  """``factory``'s parameter annotations, resolved; {} where they do not resolve."""
  import typing  # noqa: PLC0415

  try:
    return typing.get_type_hints(factory)
  except Exception:  # noqa: BLE001  (an unresolvable annotation: decide without it)
    return {}


def _admits_str(annotation: Any) -> bool:
  """Whether a value of type ``annotation`` may be a ``str`` (``str``, ``bool | str``,
  ``Optional[str]``, ``Literal["dots", ...]``, ``Any``)."""
  import typing  # noqa: PLC0415

  if annotation is Any or annotation is str:
    return True
  if isinstance(annotation, type):
    return issubclass(str, annotation)  # `object`
  origin = typing.get_origin(annotation)
  args = typing.get_args(annotation)
  if origin is typing.Literal:
    return any(isinstance(a, str) for a in args)
  if origin is typing.Union or type(annotation).__name__ == "UnionType":
    return any(_admits_str(a) for a in args)
  if origin is typing.Annotated:
    return _admits_str(args[0])
  return False


def _parses_as_json_value(text: str) -> bool:
  """Whether ``text`` is a quoted number, true/false, null or list ("128", "[8]")."""
  import json  # noqa: PLC0415

  try:
    return not isinstance(json.loads(text), str)
  except ValueError:
    return False


def make_workload(name: str, **overrides: Any) -> Workload:
  """Workload ``name`` with its defaults, except the keyword ``overrides``.

  Args:
    name: one of :func:`names`.
    **overrides: keyword arguments of the model's ``make_workload`` (e.g.
      ``width=64`` for ``"resnet"``).

  Returns:
    The :class:`Workload`.

  Raises:
    ValueError: for an unknown name or override; the message lists the valid
      ones.
  """
  check_overrides(name, overrides)
  return build_checked(name, overrides)


def build_checked(name: str, overrides: dict[str, Any]) -> Workload:
  """:func:`make_workload` for ``overrides`` already passed by :func:`check_overrides`
  (``jaxcoll.run.inputs`` checks them first to blame the config field)."""
  workload = get(name)(**overrides)
  if not isinstance(workload, Workload):
    raise ValueError(
        f"{name!r} returned {type(workload).__name__}, not a jaxcoll.models.Workload; return "
        "one, e.g. jaxcoll.models.from_flax(module, loss, sample_batch=...)."
    )
  return workload
