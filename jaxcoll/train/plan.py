"""The interface every strategy implements, and what it is built from.

A strategy (:class:`jaxcoll.DataParallel`, :class:`jaxcoll.ZeRO`) is a small
frozen config; ``strategy.plan(model)`` returns a :class:`Plan` bound to one
model, which owns everything that differs between strategies (the optax
pattern: behaviour in small objects behind one interface). The
:class:`jaxcoll.Trainer` drives a plan without asking what kind it is:

* the state: :attr:`Plan.state_spec` (how each part of the
  :class:`TrainState` is laid out on the mesh) and :meth:`Plan.init`;
* one step, inside ``shard_map``: :meth:`Plan.grads` (local gradients and
  their reduction), :meth:`Plan.grad_norm`, :meth:`Plan.apply` (the
  optimizer update), :meth:`Plan.merge_aux`, :meth:`Plan.eval_loss`;
* what leaves the device: :meth:`Plan.full_params` and the canonical
  (layout-free) form, :meth:`Plan.export_leaves` / :meth:`Plan.import_leaves`
  with :meth:`Plan.canonical_spec` (see :mod:`jaxcoll.train.canonical`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxcoll import _moved, collectives
from jaxcoll.train import kinds
from jaxcoll.train.state import TrainState, place

# ``(params, batch) -> (loss, aux)``; ``(grad_fn, params, batch) -> (loss, aux, grads)``.
LossFn = Callable[[Any, Any], tuple[jax.Array, Any]]
Accumulate = Callable[[Callable, Any, Any], tuple[jax.Array, Any, Any]]


@dataclasses.dataclass(frozen=True)
class TrainSetup:
  """What a plan is built for: the parameters' structure, the optimizer, the mesh.

  Not a model (no ``apply``): the shapes, dtypes and paths of the parameter
  leaves the :class:`jaxcoll.Trainer` was given, with its optimizer, mesh and
  compute dtype. Plans keep it as ``plan.model``. (Called ``Model`` before
  2026-12; that name still works, with a ``DeprecationWarning``.)
  """

  treedef: Any
  like: tuple[jax.ShapeDtypeStruct, ...]
  paths: tuple[tuple[str, ...], ...]
  optimizer: optax.GradientTransformation
  mesh: Mesh
  compute_dtype: Any = None

  def unflatten(self, leaves):
    return self.treedef.unflatten(list(leaves))

  def cast(self, tree):
    """Floating leaves cast to ``compute_dtype`` (no-op without one)."""
    return tree if self.compute_dtype is None else cast_floating(tree, self.compute_dtype)


def cast_floating(tree, dtype):
  """``tree`` with its floating leaves cast to ``dtype``, the others as they are: the
  trainer's ``compute_dtype`` cast (:meth:`TrainSetup.cast`); ``jax.eval_shape`` of it
  gives the cast's shape structs."""
  return jax.tree.map(
    lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
  )


def _host(x):
  """A jax array as one numpy array on this host, also when other processes hold parts."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils  # noqa: PLC0415

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


class Plan:
  """One strategy bound to one model: the interface the Trainer drives.

  Attributes:
    model: the :class:`TrainSetup`.
    data_axes: the ``PartitionSpec`` entry the batch is split over.
    dp_size: into how many parts the global batch is split.
    state_spec: a :class:`TrainState` of ``PartitionSpec`` s.
    kind: the :class:`jaxcoll.train.kinds.StrategyKind` (what is sharded,
      which collectives a step runs), as data; each plan class has its own.
  """

  model: TrainSetup
  data_axes: Any
  dp_size: int
  state_spec: TrainState
  kind: kinds.StrategyKind
  #: Whether the optimizer update runs outside ``shard_map``, on global arrays
  #: (:meth:`global_apply`, ``params_of_rows``) instead of :meth:`apply`: ZeRO with an
  #: optimizer that reduces across parameter elements.
  updates_globally: bool = False

  @property
  def stage(self) -> int:
    """0 for data parallelism, else the ZeRO stage (informational: ``kind.stage``)."""
    return self.kind.stage

  # -- helpers shared by every plan (inside shard_map) -------------------------

  def smap(self, body, in_specs, out_specs):
    """``jax.shard_map`` on the model's mesh.

    ``check_vma=False``: replicated outputs come from jaxcoll collectives,
    which are typed varying whatever the algorithm; they are identical on
    every device by construction (``check_replicas`` verifies it).
    """
    mapped = jax.shard_map(
      body, mesh=self.model.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )
    if not _has_explicit_axes(self.model.mesh):
      return mapped

    def resharded(*args):
      # On an Explicit-axis mesh (``jax.make_mesh``'s default) shard_map requires
      # each argument's sharding type to equal its in_spec; values made inside a
      # traced function (``init_traced`` under ``init_from``/``abstract_state``)
      # are typed replicated. Move them first; a no-op where they already match.
      specs = (in_specs,) * len(args) if isinstance(in_specs, P) else in_specs
      args = tuple(
        jax.tree.map(lambda s, a: jax.tree.map(lambda x: _reshard(x, self.model.mesh, s), a), tuple(specs), args,
                     is_leaf=lambda s: isinstance(s, P)))
      return mapped(*args)

    return resharded

  def mean(self, x):
    """Mean over every device of the batch (the data axes)."""
    return collectives.all_reduce(x, self.data_axes, op="mean", algorithm="native")

  def reduce_aux(self, aux):
    """Floating aux leaves averaged over the data axes, integer ones summed."""

    def one(a):
      a = jnp.asarray(a)
      op = "mean" if jnp.issubdtype(a.dtype, jnp.inexact) else "sum"
      return collectives.all_reduce(a, self.data_axes, op=op, algorithm="native")

    return jax.tree.map(one, aux)

  def batch_spec(self) -> P:
    return P(self.data_axes)

  # -- the interface -----------------------------------------------------------

  def init(self, params) -> TrainState:
    """The placed train state of replicated ``params`` (host-level call)."""
    raise NotImplementedError

  def init_traced(self, params) -> TrainState:
    """The train state of full ``params``, as a traceable function (global view).

    Run under ``jax.jit`` with :meth:`state_shardings` as ``out_shardings``
    (``Trainer.init_from``) or under ``jax.eval_shape``
    (``Trainer.abstract_state``); the same values as :meth:`init`.
    """
    raise NotImplementedError

  def state_shardings(self, abstract: TrainState) -> TrainState:
    """``NamedSharding`` of every leaf of a state shaped like ``abstract``."""
    def field(spec, tree):
      sharding = jax.sharding.NamedSharding(self.model.mesh, spec)
      return jax.tree.map(lambda _: sharding, tree)

    return TrainState(*(field(s, t) for s, t in zip(self.state_spec, abstract)))

  def call_with_params(self, state: TrainState, fn, batch, *, cast: bool = True):
    """Inside shard_map: ``fn(params, batch)`` with the parameters as the step sees
    them (ZeRO-3: leaves outside units gathered, units gathered where they run);
    ``cast``: floating parameters in ``compute_dtype``."""
    raise NotImplementedError

  def host_param(self, leaf, i: int):
    """Parameter ``i`` of the state (``leaf``) as one full numpy array (on the host)."""
    return _host(leaf)

  def host_param_pieces(self, leaf, i: int):
    """Parameter ``i`` (``leaf``) as a :class:`jaxcoll.train.digest.Piecewise`: its
    flat values fetched to the host a piece (here: the whole leaf) at a time."""
    from jaxcoll.train import digest  # noqa: PLC0415

    size = self.model.like[i].size
    return digest.Piecewise(size, size, lambda k: self.host_param(leaf, i))

  def unit_bytes(self, by_kind: bool = False) -> tuple | None:
    """ZeRO-3 FSDP units: ``(bytes outside units, bytes of the unit rows, bytes of the
    largest unit (one layer of a scanned stack), whether it is scanned)``; None without.
    ``by_kind``: ``(outside, unit rows, bytes of all unrolled units, of the largest
    unrolled unit, of the largest scanned layer, of the scanned stacks' rows)``."""
    del by_kind
    return None

  def grads(self, state: TrainState, batch, loss: LossFn, accumulate: Accumulate):
    """``(loss, aux, grads, residual)``: gradients reduced as the optimizer needs them."""
    raise NotImplementedError

  def grad_norm(self, grads) -> jax.Array:
    """The global L2 norm of the (reduced) gradient."""
    raise NotImplementedError

  def apply(self, state: TrainState, grads):
    """``(params, opt_state)`` after one optimizer update."""
    raise NotImplementedError

  def global_apply(self, state: TrainState, grads):
    """Outside shard_map, when :attr:`updates_globally`: ``(kept parameter rows,
    opt_state)`` after one optimizer update (``params_of_rows`` then makes the kept
    parameters of the rows inside shard_map)."""
    raise NotImplementedError

  def merge_aux(self, params, aux, merge: Callable):
    """``merge(full params, aux)`` written back into the kept parameters."""
    raise NotImplementedError

  def eval_loss(self, state: TrainState, batch, loss: LossFn):
    """``(loss, aux)`` of the local batch with the current parameters."""
    raise NotImplementedError

  def replicated(self, state: TrainState):
    """The parts of the state every device holds a copy of (fingerprints)."""
    raise NotImplementedError

  def group_replicated(self, state: TrainState):
    """The parts of the state each replica group holds a copy of (hybrid sharding's
    rows: device ``r * group_size + i`` holds what device ``i`` holds), compared within
    the groups by the fingerprints; ``{}`` without replica groups."""
    del state
    return {}

  def full_params(self, params):
    """The full parameters (outside shard_map; jitted by the trainer)."""
    raise NotImplementedError

  def opt_mirrors(self) -> list[int | None]:
    """Per optimizer-state leaf, the parameter leaf it is laid out like (or None)."""
    raise NotImplementedError

  def export_leaves(self, state: TrainState, mirrors):
    """``(full param leaves, full optimizer-state leaves)`` (outside shard_map)."""
    raise NotImplementedError

  def import_leaves(self, params, opt, mirrors):
    """``(kept params leaves, kept optimizer-state leaves)`` of full leaves."""
    raise NotImplementedError

  def export_is_reshape(self, i: int) -> bool:
    """Whether each device's canonical block of parameter ``i`` (and of the optimizer
    state mirroring it) is its block of the state, reshaped: the same elements in the
    same order, so a checkpoint can read it without a copy. Identity exports (the
    state leaf is the canonical leaf) are found by the trainer itself."""
    del i
    return False

  def zero_residuals(self):
    """Error-feedback residuals at zero, as global arrays (``()`` if none)."""
    return ()

  def residual_layout(self) -> dict | None:
    """What the rows of the error-feedback residuals mean, as JSON (None: no
    residuals): a checkpoint's residuals fit a trainer whose layout is equal."""
    return None

  def check_opt_mirrors(self, mirrors, full_leaves, full_def) -> None:
    """Raises ``ValueError`` when the optimizer state as this plan keeps it has no
    canonical form (``full_leaves``: the state on the full parameters). Nothing
    to check for a plan that keeps it on the full parameters."""
    del mirrors, full_leaves, full_def

  def leaf_spec(self, i: int) -> P:
    """Canonical layout of parameter ``i`` and of optimizer state that mirrors it."""
    return self.canonical_spec(tuple(self.model.like[i].shape))

  def canonical_spec(self, shape: tuple[int, ...]) -> P:
    """How a full-shape canonical leaf is laid out (replicated unless overridden)."""
    del shape
    return P()


class ReplicatedParams(Plan):
  """A plan whose every device keeps the full parameters (data parallel, ZeRO-1/2).

  Subclasses set ``_init_replicated``: the jitted ``shard_map`` program of
  ``params -> TrainState`` (replicated in, the plan's ``state_spec`` out).
  """

  _init_replicated: Callable[[Any], TrainState]

  def init(self, params) -> TrainState:
    return self._init_replicated(place(params, self.model.mesh, P()))

  def init_traced(self, params) -> TrainState:
    return self._init_replicated(params)

  def merge_aux(self, params, aux, merge):
    return merge(params, aux)

  def eval_loss(self, state, batch, loss):
    return self.call_with_params(state, loss, batch)

  def call_with_params(self, state, fn, batch, *, cast=True):
    return fn(self.model.cast(state.params) if cast else state.params, batch)

  def full_params(self, params):
    return params


#: Old names of this module -> their new names (``plan.Model`` was no model).
_RENAMED = {"Model": "TrainSetup"}
__getattr__ = _moved.renamed_getattr(__name__, _RENAMED, globals())


def _has_explicit_axes(mesh) -> bool:
  """Whether ``mesh`` has an ``AxisType.Explicit`` axis (sharding in types)."""
  return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def _reshard(x, mesh, spec: P):
  """``x`` laid out as ``spec`` on the explicit ``mesh`` (a no-op where it already is)."""
  return jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, spec))
