"""The canonical, layout-free train state that checkpoints hold.

``{"step": int32 scalar, "params": the full parameters, "opt_state": what
optimizer.init(full params) on one device would hold}``, whatever strategy,
mesh or process count produced it. :class:`Canonical` converts a strategy's
state to that form and back (through the plan's ``export_leaves`` /
``import_leaves``); :mod:`jaxcoll.checkpoint` uses this module's public
functions (:func:`leaf_specs`, :func:`spec_mismatches`, :func:`empty_containers`,
:func:`container_mismatches`) and the trainer's
public ``export_state`` / ``import_state`` / ``export_shapes``.

Full-shape leaves are laid out as the plan says (:meth:`Plan.canonical_spec`:
sharded over the ZeRO group where a dimension divides, so no device holds a
whole ZeRO state while saving or restoring; replicated for data parallelism);
the saved form does not depend on it.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxcoll.train.state import TrainState, leaf_name, place

# Length of the last axis of the probe leaves :func:`param_mirrors` feeds the
# optimizer: large and odd enough that no other state leaf has it (eval_shape
# only, so nothing of this size is ever allocated).
_PROBE_BASE = 1_000_003


def param_mirrors(optimizer, treedef, like) -> list[int | None]:
  """For each optimizer-state leaf, the parameter leaf it mirrors (or None).

  optax states mirror the parameter tree in sub-trees (``mu``, ``nu``,
  ``trace``, ...) next to leaves of their own (``count``). To tell them
  apart, ``optimizer.init`` is traced (``jax.eval_shape``) on a probe tree
  with the parameters' structure whose leaf ``i`` has the shape of a ZeRO
  row of that leaf (its rank: ``(1, ..., 1, L_i)``) with ``L_i =
  _PROBE_BASE + i``: a state leaf of that shape mirrors parameter ``i``. This
  needs no knowledge of the optimizer's state classes and handles chains,
  ``masked`` (also masks by ``ndim``), ``inject_hyperparams`` and empty
  states alike.

  A scalar parameter's probe is a scalar, which cannot carry ``i``; a second
  probe gives scalars the shape ``(L_i,)`` and is used when it yields the
  same state structure. Otherwise state leaves of scalar parameters are
  reported as None (not mirroring), which only affects ZeRO's padding rows.

  Args:
    optimizer: the ``optax.GradientTransformation``.
    treedef: the parameters' tree structure.
    like: the parameter leaves (anything with ``shape`` and ``dtype``), in
      tree order.

  Returns:
    One entry per leaf of ``optimizer.init(rows)``, in tree order: the index
    of the parameter leaf it mirrors, or None.
  """

  def probe_shape(i, x, scalars_1d):
    ndim = len(x.shape)
    if ndim == 0:
      return (_PROBE_BASE + i,) if scalars_1d else ()
    return (1,) * (ndim - 1) + (_PROBE_BASE + i,)

  def trace(scalars_1d):
    shapes = [probe_shape(i, x, scalars_1d) for i, x in enumerate(like)]
    probe = treedef.unflatten([jax.ShapeDtypeStruct(s, x.dtype) for s, x in zip(shapes, like)])
    leaves, tree = jax.tree.flatten(jax.eval_shape(optimizer.init, probe))
    mirrors = []
    for leaf in leaves:
      shape = tuple(leaf.shape)
      index = shape[-1] - _PROBE_BASE if shape else -1
      ok = 0 <= index < len(like) and shapes[index] == shape
      mirrors.append(index if ok else None)
    return tree, mirrors

  tree, mirrors = trace(scalars_1d=False)
  if any(len(x.shape) == 0 for x in like):
    try:
      tree_1d, mirrors_1d = trace(scalars_1d=True)
    except Exception:  # noqa: BLE001  (the optimizer rejects 1-D scalars)
      tree_1d = None
    if tree_1d == tree:
      mirrors = mirrors_1d
  return mirrors


def state_mirrors(optimizer, treedef, like) -> tuple[list[int | None], list, Any]:
  """``(mirrors, leaves, treedef)`` of ``optimizer.init`` of the parameters ``like``
  (shape structs): the state's leaves (shape structs) and tree, and for each leaf the
  parameter it mirrors with that parameter's own shape (``mu``, ``nu``: laid out as the
  parameter), else None (``count``, adafactor's factored moments and ``(1,)``
  placeholders, every leaf when :func:`param_mirrors` cannot tell).

  Args:
    optimizer: the ``optax.GradientTransformation``.
    treedef: the parameters' tree structure.
    like: the parameter leaves (shape structs), in tree order.
  """
  leaves, tree = jax.tree.flatten(jax.eval_shape(optimizer.init, treedef.unflatten(like)))
  probed = param_mirrors(optimizer, treedef, like)
  if len(probed) != len(leaves):
    probed = [None] * len(leaves)
  mirrors = [i if i is not None and tuple(x.shape) == tuple(like[i].shape) else None
             for x, i in zip(leaves, probed)]
  return mirrors, leaves, tree


def leaf_specs(tree) -> dict[str, tuple[tuple[int, ...], str]]:
  """``{path: (shape, dtype name)}`` of every leaf, in tree order."""
  return {
    leaf_name(path): (tuple(int(d) for d in np.shape(x)), np.dtype(x.dtype).name)
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def saved_specs(leaves) -> dict[str, tuple[tuple[int, ...], str]]:
  """:func:`leaf_specs` of a checkpoint, from its metadata's ``leaves`` (``[{"path",
  "shape", "dtype", ...}]``, as :meth:`Checkpointer.metadata` gives them)."""
  return {d["path"]: (tuple(d["shape"]), d["dtype"]) for d in leaves}


def spec_mismatches(actual: dict, expected: dict, *, ignore_dtype: bool = False) -> list[str]:
  """Differences between two :func:`leaf_specs`, one line per leaf."""
  problems = []
  for name, (shape, dtype) in expected.items():
    if name not in actual:
      problems.append(f"{name}: missing (expected shape {shape}, {dtype})")
      continue
    got_shape, got_dtype = actual[name]
    if got_shape != shape:
      problems.append(f"{name}: shape {got_shape}, but the model has shape {shape}")
    elif got_dtype != dtype and not ignore_dtype:
      problems.append(f"{name}: dtype {got_dtype}, but the model has dtype {dtype}")
  problems += [f"{name}: not in the model" for name in actual if name not in expected]
  return problems


def mismatches_line(problems: list[str], shown: int = 4) -> str:
  """:func:`spec_mismatches`' ``problems`` for a one-line message: the parameters' first
  (the optimizer state's mirror them), at most ``shown``, and how many in all (a layer
  added to a model is dozens: each of its leaves, and their adam moments)."""
  ordered = sorted(problems, key=lambda p: p.startswith("['opt_state']"))
  more = len(ordered) - shown
  return "; ".join(ordered[:shown]) + (
      f"; and {more} more ({len(ordered)} leaves differ)" if more > 0 else "")


def empty_containers(tree) -> dict[str, str]:
  """``{path: type name}`` of every container in ``tree`` that holds nothing (optax's
  ``EmptyState()``, ``None``, ``{}``), in tree order.

  With :func:`leaf_specs`, whose paths name every container that holds a leaf, these
  paths fix the tree's containers as orbax compares them on restore: two states with the
  same leaves at the same paths differ in their containers only here (``optax.adam``'s
  ``(ScaleByAdamState, EmptyState)`` and ``optax.adamw``'s one ``EmptyState`` more).
  """

  def bare(x):  # a leaf, or a container without children
    return jax.tree_util.treedef_is_leaf(jax.tree.structure(x))

  return {
    leaf_name(path): type(x).__name__
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=bare)[0]
    if jax.tree.structure(x).num_leaves == 0
  }


def container_mismatches(saved: dict, expected: dict) -> list[str]:
  """Differences between two :func:`empty_containers`, one per path: where one tree has
  an empty container the other lacks. Their types are named, not compared (orbax restores
  one empty container into another, and optax renames state classes between versions)."""
  return [f"{name}: an empty {kind} in this trainer, not in the checkpoint"
          for name, kind in expected.items() if name not in saved] + [
          f"{name}: an empty {kind} in the checkpoint, not in this trainer"
          for name, kind in saved.items() if name not in expected]



class Canonical:
  """Export and import programs between a plan's state and the canonical form.

  Args:
    plan: a :class:`jaxcoll.train.plan.Plan` bound to the model.

  Raises:
    ValueError: the optimizer's state on ZeRO rows cannot be mapped to the
      state on full parameters (see :meth:`jaxcoll.Trainer.export_state`).
  """

  def __init__(self, plan):
    model = plan.model
    mesh = model.mesh
    full = model.unflatten(model.like)
    full_opt = jax.eval_shape(model.optimizer.init, full)
    opt_leaves, self.opt_def = jax.tree.flatten(full_opt)
    self.mirrors = plan.opt_mirrors()
    plan.check_opt_mirrors(self.mirrors, opt_leaves, self.opt_def)
    def struct(x, spec):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    params = [struct(x, plan.leaf_spec(i)) for i, x in enumerate(model.like)]
    opt = [struct(x, plan.canonical_spec(tuple(x.shape)) if i is None else plan.leaf_spec(i))
           for x, i in zip(opt_leaves, self.mirrors)]
    self.like = {
      "step": struct(jax.ShapeDtypeStruct((), jnp.int32), jax.sharding.PartitionSpec()),
      "params": model.unflatten(params),
      "opt_state": self.opt_def.unflatten(opt),
    }
    out = jax.tree.map(lambda x: x.sharding, self.like)
    state_shardings = jax.tree.map(
      lambda spec: NamedSharding(mesh, spec), plan.state_spec,
      is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
    )
    mirrors, opt_def = self.mirrors, self.opt_def

    def export(state):
      params, opt = plan.export_leaves(state, mirrors)
      canonical = {"step": state.step, "params": model.unflatten(params),
                   "opt_state": opt_def.unflatten(opt)}
      # A copy, never the input buffer itself: `state` may be donated next.
      return jax.tree.map(jnp.copy, canonical)

    def import_(step, params, opt_state):
      # Arguments in the order of TrainState's fields: jit pairs donated inputs
      # with same-shaped outputs in order, so each buffer becomes its own leaf of
      # the state (in the canonical dict's key order XLA would swap buffers by copies).
      canonical = {"step": step, "params": params, "opt_state": opt_state}
      canonical = jax.tree.map(lambda x, t: x.astype(t.dtype), canonical, self.like)
      params, opt = plan.import_leaves(
        jax.tree.leaves(canonical["params"]), jax.tree.leaves(canonical["opt_state"]), mirrors
      )
      return TrainState(canonical["step"], model.unflatten(params), opt_def.unflatten(opt), ())

    self._export = jax.jit(export, out_shardings=out)
    shardings = state_shardings._replace(residual=None)
    self._import = jax.jit(import_, out_shardings=shardings)
    self._import_donated = jax.jit(import_, out_shardings=shardings, donate_argnums=(0, 1, 2))
    self._plan = plan

  def export(self, state: TrainState) -> dict:
    return self._export(state)

  def import_(self, canonical: dict, *, donate: bool = False, residual=None) -> TrainState:
    """Places ``canonical`` (numpy or jax leaves) as the plan's state.

    With ``donate``, jax leaves already laid out as :attr:`like` says give
    their buffers to the state (do not use them afterwards). ``residual``:
    the state's error-feedback residuals as they are (already placed and
    checked by the caller); None: at zero.
    """
    problems = spec_mismatches(leaf_specs(canonical), leaf_specs(self.like), ignore_dtype=True)
    if problems:
      raise ValueError(
        "`canonical` does not match this trainer's model (structure and shapes "
        "of trainer.export_shapes()): " + mismatches_line(problems) + ". Restore a "
        "state of the same model and optimizer, or build the trainer for it."
      )
    mesh = self._plan.model.mesh
    # Same leaves and shapes: re-read in the model's structure, each leaf in
    # its canonical layout (only this process's slices of numpy leaves).
    leaves = [
      place(x, mesh, t.sharding.spec)
      for x, t in zip(jax.tree.leaves(canonical), jax.tree.leaves(self.like))
    ]
    canonical = jax.tree.structure(self.like).unflatten(leaves)
    with warnings.catch_warnings():  # leaves that cannot alias (padded rows) are copied
      warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
      program = self._import_donated if donate else self._import
      state = program(canonical["step"], canonical["params"], canonical["opt_state"])
    return state._replace(
      residual=self._plan.zero_residuals() if residual is None else residual)


def check_mirrors(plan, mirrors, full_leaves, full_def) -> None:
  """ZeRO: every optimizer-state leaf mirrors a parameter elementwise or is its own.

  For :meth:`jaxcoll.train.plan.Plan.check_opt_mirrors` of a plan that keeps the
  optimizer state on parameter rows (``plan.row_like()``, ``plan.layout``).
  """
  model = plan.model
  row_leaves, row_def = jax.tree.flatten(jax.eval_shape(model.optimizer.init, plan.row_like()))
  if row_def != full_def or len(mirrors) != len(row_leaves):
    raise ValueError(
      "`optimizer`: optimizer.init gives a differently structured state on ZeRO's "
      f"parameter rows ({row_def}) than on the full parameters ({full_def}), "
      "so the sharded state has no canonical form. Rows keep each leaf's rank "
      "but not its shape: make masks and other structure independent of exact "
      "shapes (ndim is fine), or use jaxcoll.DataParallel."
    )
  paths = list(leaf_specs(full_def.unflatten(full_leaves)))
  for path, full, row, i in zip(paths, full_leaves, row_leaves, mirrors):
    want_full = full.shape if i is None else model.like[i].shape
    want_row = full.shape if i is None else plan.layout.row_shape(i)
    if full.shape != want_full or row.shape != want_row:
      raise ValueError(
        f"`optimizer`: state leaf {path} has shape {full.shape} for the full "
        f"parameters and {row.shape} for ZeRO's rows; jaxcoll maps only leaves "
        "that mirror a parameter elementwise, or do not depend on its shape. "
        "Use jaxcoll.DataParallel for this optimizer."
      )
