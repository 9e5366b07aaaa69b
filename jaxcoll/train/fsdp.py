"""FSDP units: parameters gathered at the point of use under ZeRO-3.

ZeRO-3 keeps each device's rows of the parameters. Gathering every
parameter before ``loss_fn`` runs keeps them all alive at once (XLA:CPU
hoists the gathers and merges the backward re-gather into the forward one),
so, as PyTorch FSDP's wrapped modules and MaxText's scanned layers do, a
*unit* gathers its own parameters when it runs, drops them after, gathers
them again in the backward pass (``nn.remat``) and hands back its gradients
reduce-scattered (the gather's VJP).

* :func:`fsdp_unit` wraps a flax linen Module class. Outside a ZeRO-3
  trainer the unit is the class itself (same parameter tree, same outputs).
  It composes with ``nn.scan(fsdp_unit(Block), variable_axes={"params": 0},
  split_rngs={"params": True}, length=L)``: the trainer cuts the stacked
  leaves layer by layer, so each scan iteration gathers one layer.
* :func:`fsdp_params` is the same for loss functions written without flax:
  it marks one sub-tree of the parameters as a unit.

On XLA:CPU, *unrolled* units (a Python loop of units) do not save memory: XLA:CPU
takes out remat's optimization barriers before its CSE pass, which merges each
unit's backward re-gather into its forward gather, and its scheduler starts every
gather at the step's start, so the whole model stays gathered (README, "Unrolled
units on XLA:CPU"). Scanned units gather one layer at a time everywhere.

How the trainer finds the units: whenever a unit runs outside a ZeRO-3 step
(``model.init``, ``model.apply``), it records the paths and per-layer shapes
of its parameters in this process (every shape a path had, so several sizes
of one model can be built side by side). ``Trainer.init`` matches them against
the parameter tree (the unit's path is a suffix of the leaf's): a leaf of a
recorded shape is an unscanned unit leaf, a leaf with one more leading axis a
scanned one. Leaves of no unit are gathered up front, as without units. The
match is by path and shape: a model without units whose leaves have the paths
and shapes of a unit that ran earlier in the process is taken for it, and its
ZeRO-3 step is refused with a ValueError (give its modules other names).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxcoll import collectives
from jaxcoll.train.buckets import ZERO3_GATHERED, zero3_remat_policy

Path = tuple[str, ...]

# Path of every unit leaf seen outside a ZeRO-3 step -> every per-layer shape it had
# (several models built in one process may share paths with other sizes).
_SEEN: dict[Path, set[tuple[int, ...]]] = {}
_UNIT_OF: dict[Path, Path] = {}  # unit leaf path -> its unit's module path
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("jaxcoll_fsdp_active", default=None)
_IN_UNIT: contextvars.ContextVar = contextvars.ContextVar("jaxcoll_fsdp_in_unit", default=None)
# Set while a module of inside_remat runs: its units skip their own remat.
_UNDER_REMAT: contextvars.ContextVar = contextvars.ContextVar("jaxcoll_fsdp_remat", default=False)


def key_path(path) -> Path:
  """A jax key path (or flax module path) as a tuple of strings."""
  out = []
  for entry in path:
    value = next((getattr(entry, a) for a in ("key", "name", "idx") if hasattr(entry, a)), entry)
    out.append(str(value))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class LeafCut:
  """How one unit leaf's per-layer row becomes the full (per-layer) value."""

  n: int
  size: int
  chunk: int
  shape: tuple[int, ...]
  row: tuple[int, ...]  # one device's row (ShardLayout.inner_row_shape)


@dataclasses.dataclass(frozen=True)
class Gatherer:
  """What a unit needs during a ZeRO-3 step: the leaves it owns and the group."""

  cuts: dict[Path, LeafCut]
  axis: Any
  algorithm: Any
  compute_dtype: Any = None
  paths: tuple = ()  # every parameter leaf's path (to tell a unit that names none of them)
  used: set = dataclasses.field(default_factory=set, compare=False)
  # Units that ran with parameters of which none is a planned unit leaf: the trainer was
  # built before the unit was seen (params loaded from a file, the model never run).
  unplanned: set = dataclasses.field(default_factory=set, compare=False)

  def lookup(self, path: Path) -> LeafCut | None:
    """The cut of the leaf at ``path`` (seen from the unit: a suffix of the trainer's path)."""
    for key, cut in self.cuts.items():
      n = min(len(key), len(path))
      if n and key[-n:] == path[-n:] and (len(key) == n or len(path) == n):
        self.used.add(key)
        return cut
    return None

  def check_names_params(self, prefix: Path, leaves: Sequence[Path], what: str) -> None:
    """Raises if none of a unit's leaves (``prefix`` + each of ``leaves``) is a parameter
    leaf (by :meth:`lookup`'s suffix rule): the unit names nothing the trainer holds, a
    wrong ``path`` (its step warned that the params were loaded from a file)."""
    def match(a, b):
      n = min(len(a), len(b))
      return n and a[-n:] == b[-n:] and (len(a) == n or len(b) == n)

    if not self.paths or any(match(k, prefix + u) for k in self.paths for u in leaves):
      return
    hints = sorted({k[:-len(u)] for u in leaves if u for k in self.paths
                    if len(k) > len(u) and k[-len(u):] == u})
    names = ["/".join(prefix + u) for u in leaves]
    raise ValueError(
      f"{what} names no parameters: its leaves ({', '.join(names[:3])}"
      f"{', ...' if len(names) > 3 else ''}) are not leaves of the params the trainer holds "
      f"(e.g. {', '.join('/'.join(k) for k in self.paths[:3])}). Pass the key path of the "
      "sub-tree in those params" + (f" (e.g. path={hints[0]!r})" if hints else "") + "; a unit "
      "can only gather parameters the trainer holds."
    )

  def check_all_used(self, cause: BaseException | None = None) -> None:
    """Raises if a leaf planned as a unit leaf was not gathered by any unit (after a trace).

    With ``cause`` (the trace failed), only a flax parameter-shape error is
    explained this way: a row of a unit leaf reached a module that is no unit.
    """
    if cause is not None and not isinstance(cause, flax.errors.ScopeParamShapeError):
      return
    missed = sorted("/".join(k) for k in self.cuts if k not in self.used)
    if missed:
      raise ValueError(
        f"`params` leaves {missed[:3]} ({len(missed)} in all) have the path and shape of an "
        "FSDP unit's parameters seen earlier in this process, but no jaxcoll.fsdp_unit used "
        "them in this loss_fn under ZeRO-3. Give the modules of a model without units other "
        "names, or mark them with jaxcoll.fsdp_unit."
      ) from cause

  def warn_if_unplanned(self) -> None:
    """One warning naming the units that ran but were not planned as units (after a trace)."""
    if not self.unplanned:
      return
    names = sorted(self.unplanned)
    warnings.warn(
      f"FSDP unit(s) {names[:3]}{f' and {len(names) - 3} more' if len(names) > 3 else ''} "
      "ran under ZeRO-3, but the trainer was built before they were seen: units are found "
      "when the model runs outside a ZeRO-3 step (model.init), and these parameters were "
      "made without running it in this process (loaded from a file?). Their parameters were "
      "gathered up front with the rest of the model, so the step holds the whole model. Run "
      "the model once before trainer.init, e.g. jax.eval_shape(model.init, key, x) (nothing "
      "is allocated), or make the state with trainer.init_from(model.init, ...).",
      stacklevel=1)  # fsdp.py's line: said once per process, by the step or eval

  def gather(self, row: jax.Array, cut: LeafCut) -> jax.Array:
    """All-gather of one (layer's) row; its VJP is the mean reduce-scatter."""
    return checkpoint_name(_gather(row, cut, self.axis, self.algorithm, self.compute_dtype),
                           ZERO3_GATHERED)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _gather(row, cut: LeafCut, axis, algorithm, compute_dtype):
  flat = row.reshape(-1)
  if compute_dtype is not None:
    flat = flat.astype(compute_dtype)
  full = collectives.all_gather(flat, axis, algorithm=algorithm)
  return full[: cut.size].reshape(cut.shape)


def _gather_fwd(row, cut, axis, algorithm, compute_dtype):
  return _gather(row, cut, axis, algorithm, compute_dtype), jnp.zeros((0,), row.dtype)


def _gather_bwd(cut, axis, algorithm, compute_dtype, tag, cotangent):  # noqa: PLR0917
  del compute_dtype
  flat = cotangent.reshape(-1).astype(tag.dtype)
  flat = jnp.pad(flat, (0, cut.n * cut.chunk - cut.size))
  mine = collectives.reduce_scatter(flat, axis, op="mean", algorithm=algorithm)
  return (mine.reshape(cut.row),)


_gather.defvjp(_gather_fwd, _gather_bwd)


@contextlib.contextmanager
def active(gatherer: Gatherer | None):
  """Inside: units gather their rows with ``gatherer`` (the ZeRO-3 step sets it)."""
  token = _ACTIVE.set(gatherer)
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def _enter_unit(where: str):
  outer = _IN_UNIT.get()
  if outer is not None:
    raise ValueError(
      f"`module_cls`: FSDP unit {where} runs inside FSDP unit {outer}; a unit's "
      "parameters are gathered as one, so units cannot nest. Mark either the outer "
      "or the inner modules with jaxcoll.fsdp_unit, not both."
    )
  return _IN_UNIT.set(where)


def leaf_paths(tree) -> list[Path]:
  """The :func:`key_path` of every leaf of ``tree``, in tree order, a leaf inside a flax
  partitioning box (``nn.with_partitioning``'s ``nn.Partitioned``) at the box's path:
  the path ``loss_fn`` sees it at once the trainer has unboxed the parameters (a unit
  looked its leaves up without the box's ``value`` key and found none)."""
  from flax.core import meta  # noqa: PLC0415

  box = lambda x: isinstance(x, meta.AxisMetadata)  # noqa: E731
  boxes = {key_path(path) for path, x in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=box)[0] if box(x)}
  paths = [key_path(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  return [p[:-1] if p[:-1] in boxes else p for p in paths]


def _record(prefix: Path, tree) -> None:
  for path, leaf in zip(leaf_paths(tree), jax.tree.leaves(tree)):
    _SEEN.setdefault(prefix + path, set()).add(tuple(jnp.shape(leaf)))
    _UNIT_OF[prefix + path] = prefix


def unit_of(path: Path) -> Path:
  """The module path of the unit that owns the leaf at ``path`` (a suffix match), or ``()``."""
  return next((_UNIT_OF[path[k:]] for k in range(len(path)) if path[k:] in _UNIT_OF), ())


def _map_tree(prefix: Path, tree, gatherer: Gatherer, what: str):
  cuts = 0

  def one(path, leaf):
    nonlocal cuts
    cut = gatherer.lookup(prefix + key_path(path))
    cuts += cut is not None
    return leaf if cut is None else gatherer.gather(leaf, cut)

  out = jax.tree_util.tree_map_with_path(one, tree)
  if not cuts and jax.tree.leaves(tree):
    gatherer.check_names_params(prefix, leaf_paths(tree), what)
    gatherer.unplanned.add("/".join(prefix) or "(root)")
  return out


def fsdp_params(tree, path: Sequence[Hashable] = ()) -> Any:
  """Marks ``tree``, the parameters at ``path``, as one FSDP unit (no flax needed).

  Call it inside ``loss_fn`` where the sub-tree is used, e.g. in the body of a
  ``lax.scan`` over stacked layers: ``w = fsdp_params(layer, ("layers",))``.
  Wrap that body in ``jax.checkpoint`` (scan + remat, as MaxText): otherwise
  autodiff saves every layer's gathered parameters for the backward pass.
  Under a ZeRO-3 step it returns the gathered parameters (and, in backward,
  reduce-scatters their gradients); anywhere else it returns ``tree``
  unchanged and records the unit, so call ``loss_fn`` once (e.g.
  ``jax.eval_shape(loss_fn, params, batch)``) before ``trainer.init``.

  A ``flax.nnx`` Module is a pytree: the layer an ``nnx.scan`` body gets from
  an ``nnx.vmap``'d stack can be passed as it is, ``layer = fsdp_params(layer,
  ("params", "layers"))`` (the path in ``jaxcoll.models.from_nnx``'s tree;
  ``("layers",)`` in a plain ``nnx.split(model, nnx.Param, ...)`` State), the
  body wrapped in ``nnx.remat``.

  Args:
    tree: the unit's parameters (one layer of them, inside a scan).
    path: the key path of ``tree`` in the parameter tree given to ``loss_fn``.

  Raises:
    TypeError: ``path`` is not a sequence of keys.
    ValueError: called inside another unit.
  """
  if isinstance(path, (str, bytes)) or not isinstance(path, Sequence):
    raise TypeError(
      f"`path` must be a tuple of keys of the parameter tree, e.g. ('layers',); got {path!r}."
    )
  prefix = tuple(str(k) for k in path)
  token = _enter_unit(str(prefix))
  try:
    gatherer = _ACTIVE.get()
    if gatherer is None:
      _record(prefix, tree)
      return tree
    return _map_tree(prefix, tree, gatherer, f"jaxcoll.train.fsdp_params's `path` {path!r}")
  finally:
    _IN_UNIT.reset(token)


def fsdp_unit(module_cls: type[nn.Module]) -> type[nn.Module]:
  """A flax linen Module class whose parameters form one FSDP unit.

  Under a ZeRO-3 trainer, the unit's parameters are all-gathered when its
  ``__call__`` (or another public method, e.g. ``nn.Embed.attend`` for tied
  embeddings) runs, not kept after it (``nn.remat``: gathered again in the
  backward pass) and its gradients leave reduce-scattered. Anywhere else
  (one device, data parallelism, ZeRO-1/2) the class behaves exactly as
  ``module_cls``: same name, same parameter tree, bit-identical outputs.

  Args:
    module_cls: a ``flax.linen.Module`` subclass.

  Returns:
    A subclass of ``module_cls`` with the same ``__name__``.

  Raises:
    TypeError: ``module_cls`` is not a flax linen Module class.
    ValueError: (when the model runs) a unit inside another unit.

  Example:
    >>> Block = jaxcoll.fsdp_unit(Block)  # doctest: +SKIP
    >>> stack = nn.scan(Block, variable_axes={"params": 0},
    ...                 split_rngs={"params": True}, length=12)  # doctest: +SKIP
  """
  if not (isinstance(module_cls, type) and issubclass(module_cls, nn.Module)):
    raise TypeError(
      f"`module_cls` must be a flax.linen Module class (e.g. Block, not Block()); "
      f"got {module_cls!r}. For a loss function without flax use jaxcoll.train.fsdp_params."
    )
  return _with_methods(module_cls, {name: _unit_method(getattr(module_cls, name))
                                     for name in _unit_method_names(module_cls)})


def _unit_method_names(module_cls: type[nn.Module]) -> list[str]:
  """``__call__`` and the public methods ``module_cls`` and its bases below ``nn.Module``
  define (``nn.Embed.attend``, a tied embedding's read-out): each one reads the unit's
  parameters, so each gathers them (``attend`` got the device's rows)."""
  fields = {f.name for f in dataclasses.fields(module_cls)} if dataclasses.is_dataclass(
      module_cls) else set()
  names = []
  for klass in module_cls.__mro__:
    if klass is nn.Module or not issubclass(klass, nn.Module):
      continue
    for name, value in vars(klass).items():
      if (name == "__call__" or not name.startswith("_")) and name not in names and (
          name != "setup" and name not in fields and inspect.isfunction(value)
          and not hasattr(value, "nowrap") and name not in vars(nn.Module)):
        names.append(name)
  return names


def _unit_method(method: Callable) -> Callable:
  """``method`` of an FSDP unit: the unit's parameters gathered while it runs (ZeRO-3)."""

  def unit_method(self, *args, **kwargs):
    if self.scope is None:  # an unbound module's helper (no parameters to gather)
      return method(self, *args, **kwargs)
    prefix = key_path(self.path)
    where = "/".join(prefix) or type(self).__name__
    if _IN_UNIT.get() == where:  # a method of the unit called by another: gathered already
      return method(self, *args, **kwargs)
    token = _enter_unit(where)
    try:
      gatherer = _ACTIVE.get()
      if gatherer is None:
        out = method(self, *args, **kwargs)
        _record(prefix, self.variables.get("params", {}))
        return out
      return _gathered_call(self, method, prefix, gatherer, args=args, kwargs=kwargs)
    finally:
      _IN_UNIT.reset(token)

  unit_method.__name__, unit_method.__qualname__ = method.__name__, method.__qualname__
  unit_method.__doc__ = method.__doc__
  # Not wrapped by flax: its wrapper would run the module's setup() in the caller's scope,
  # on the device's rows (a setup()-defined parameter, nn.Embed's, failed its shape check
  # there); ``method`` (flax's wrapped one) sets the module up where it runs: under a
  # ZeRO-3 step inside map_variables, on the gathered parameters.
  return nn.nowrap(unit_method)


def _with_methods(module_cls: type[nn.Module], methods: dict[str, Callable]) -> type[nn.Module]:
  """A subclass of ``module_cls`` with ``methods`` replaced, named and documented as it."""
  sub = type(module_cls.__name__, (module_cls,), dict(methods))
  sub.__qualname__ = module_cls.__qualname__
  sub.__module__ = module_cls.__module__
  sub.__doc__ = module_cls.__doc__
  return sub


def _is_dynamic(x) -> bool:
  return any(isinstance(v, jax.Array) or hasattr(v, "__jax_array__") or hasattr(v, "dtype")
             for v in jax.tree.leaves(x))


def _gathered_call(module, call: Callable, prefix: Path, gatherer: Gatherer, *, args, kwargs):
  """``call(module, *args, **kwargs)`` with the unit's rows gathered, under remat."""
  dynamic = [i for i, a in enumerate(args) if _is_dynamic(a)]
  dyn_kwargs = sorted(k for k, v in kwargs.items() if _is_dynamic(v))

  def body(mdl, *values):
    full_args = list(args)
    for i, v in zip(dynamic, values[: len(dynamic)]):
      full_args[i] = v
    full_kwargs = dict(kwargs)
    full_kwargs.update(zip(dyn_kwargs, values[len(dynamic):]))
    return call(mdl, *full_args, **full_kwargs)

  def trans_in(variables):
    return {**variables, "params": _map_tree(prefix, variables.get("params", {}), gatherer,
                                             f"FSDP unit {'/'.join(prefix) or '(root)'}")}

  mapped = nn.map_variables(body, "params", trans_in_fn=trans_in, init=False)
  if _UNDER_REMAT.get():
    # Inside an nn.remat that saves nothing: it already drops the gathered parameters
    # after forward and recomputes the unit in backward, where one gather serves both
    # the recomputation and the gradient (a remat of the unit too would gather twice).
    return mapped(module, *[args[i] for i in dynamic], *[kwargs[k] for k in dyn_kwargs])
  remat = nn.remat(mapped, policy=zero3_remat_policy, prevent_cse=True)
  return remat(module, *[args[i] for i in dynamic], *[kwargs[k] for k in dyn_kwargs])


def inside_remat(module_cls: type[nn.Module]) -> type[nn.Module]:
  """``module_cls`` for ``nn.remat(inside_remat(module_cls))`` with remat's default policy
  (save nothing but the inputs): the FSDP units it contains skip their own remat, since
  the outer one already recomputes them in the backward pass. Each unit's parameters are
  then gathered once per backward pass instead of twice (once to recompute the forward,
  once more for the unit's own remat). Memory is the same: nothing of the unit outlives
  its forward pass either way. Do not use it under a remat policy that saves values
  (the gathered parameters would be saved). Same parameters and outputs everywhere."""
  if not (isinstance(module_cls, type) and issubclass(module_cls, nn.Module)):
    raise TypeError(f"`module_cls` must be a flax.linen Module class; got {module_cls!r}.")
  call = module_cls.__call__

  def __call__(self, *args, **kwargs):  # noqa: N807
    token = _UNDER_REMAT.set(True)
    try:
      return call(self, *args, **kwargs)
    finally:
      _UNDER_REMAT.reset(token)

  return _with_methods(module_cls, {"__call__": __call__})


def find_units(paths: Sequence[Path], shapes: Sequence[tuple[int, ...]]) -> dict[int, int | None]:
  """Which leaves belong to a unit this process has seen run, and their layer count.

  Args:
    paths: each parameter leaf's key path (:func:`key_path`), in tree order.
    shapes: each leaf's shape.

  Returns:
    ``{leaf index: L}`` for scanned unit leaves (stacked on a leading layer
    axis of ``L``), ``{leaf index: None}`` for unscanned ones.

  Raises:
    ValueError: a unit leaf is its unit's per-layer shape stacked on another
      axis than the first (``nn.scan(..., variable_axes={"params": 1})``).
  """
  found = {}
  for i, (path, shape) in enumerate(zip(paths, map(tuple, shapes))):
    inners = next((_SEEN[path[k:]] for k in range(len(path)) if path[k:] in _SEEN), None)
    if inners is None:
      continue
    if shape in inners:
      found[i] = None
    elif shape[1:] in inners and shape:
      found[i] = int(shape[0])
    elif any(shape[:k] + shape[k + 1:] in inners for k in range(1, len(shape))):
      inner = next(shape[:k] + shape[k + 1:] for k in range(1, len(shape))
                   if shape[:k] + shape[k + 1:] in inners)
      raise ValueError(
        f"`params` leaf {'/'.join(path)} has shape {shape}, but its FSDP unit "
        f"uses it with shape {inner}: a scanned unit's parameters must be stacked on "
        "a leading layer axis. Use nn.scan(..., variable_axes={'params': 0}) (the "
        "layer axis first), or do not mark the module with jaxcoll.fsdp_unit."
      )
    # Any other shape: a record of another model with the same path; not a unit.
  return found
