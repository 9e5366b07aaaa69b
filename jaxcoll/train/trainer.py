"""The Trainer: one jitted ``shard_map`` program per training step.

Read top to bottom, one step is:

1. each device takes its slice of the global batch and splits it into
   ``grad_accum_steps`` microbatches (``lax.scan``; gradients averaged);
2. the strategy's plan (:mod:`jaxcoll.train.plan`) differentiates the loss
   and reduces the gradients as it needs them (all-reduced in full for data
   parallelism, this device's rows for ZeRO; ZeRO-3 gathers parameters on
   the way, bucket by bucket or unit by unit);
3. the global gradient norm is computed (the plan knows whether it is
   sharded) and the gradient clipped;
4. the plan applies the optimizer update to what this device owns.

The Trainer never asks which strategy it runs. The state is donated to the
step, so its buffers are reused in place.
"""

from __future__ import annotations

import collections
import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll import checks, collectives
from jaxcoll.train import axes_bound, extra_args
from jaxcoll.train import grads as grads_lib
from jaxcoll.train import guards
from jaxcoll.train import state as state_lib
from jaxcoll.train import canonical as canonical_lib
from jaxcoll.train.canonical import Canonical
from jaxcoll.train.fsdp import leaf_paths
from jaxcoll.train.plan import TrainSetup
from jaxcoll.train.state import TrainState
from jaxcoll.train.strategies import DataParallel, ZeRO

Strategy = DataParallel | ZeRO


def _as_compute_dtype(dtype):
  """``compute_dtype`` as given, once checked to be a floating dtype (or None). An
  integer one cast every parameter to it: 0.3 became 0, the loss and gradients 0, and
  nothing trained, silently; a misspelt name was a TypeError traceback at the first step."""
  if dtype is None:
    return None
  try:
    resolved = jnp.dtype(dtype)
  except (TypeError, ValueError):
    resolved = None
  if resolved is None or not jnp.issubdtype(resolved, jnp.floating):
    raise ValueError(
      f"`compute_dtype` must be a floating dtype or None; got {checks.short_repr(dtype)}. "
      "E.g. compute_dtype=jnp.bfloat16 (None: compute in the parameters' own dtypes).")
  return dtype


def _as_key(rng):
  """A ``jax.random`` key from a key, an int seed or None (no randomness)."""
  if rng is None:
    return None
  if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
    return jax.random.key(int(rng))
  if isinstance(rng, jax.Array) and (
      jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
      or (rng.dtype == jnp.uint32 and rng.shape == (2,))):
    return rng
  raise ValueError(
      f"`rng` must be a jax.random key or an int seed (or None); got {rng!r}. "
      "E.g. rng=0 or rng=jax.random.key(0)."
  )


def _by_hand(x, like) -> bool:
  """Whether an optimizer-state scalar was set by hand: a Python or numpy scalar, or a
  rank-0 array where the plan keeps one copy per device (ZeRO)."""
  return not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) or x.shape != like.shape


def _leaf_getters(paths) -> list[Callable] | None:
  """For each jax key path, a function that reads that leaf of a tree by indexing
  (``tree["hyperparams"]["learning_rate"]``) without flattening the tree; None when a
  path has a step that cannot be read so (a custom pytree node's flattened index)."""
  getters = []
  for path in paths:
    steps = []
    for entry in path:
      if isinstance(entry, jax.tree_util.DictKey):
        steps.append(lambda x, k=entry.key: x[k])
      elif isinstance(entry, jax.tree_util.SequenceKey):
        steps.append(lambda x, k=entry.idx: x[k])
      elif isinstance(entry, jax.tree_util.GetAttrKey):
        steps.append(lambda x, k=entry.name: getattr(x, k))
      else:
        return None

    def get(tree, steps=tuple(steps)):
      for step in steps:
        tree = step(tree)
      return tree

    getters.append(get)
  return getters


def _warn_axes_left_out(axis, dp_size: int, mesh) -> None:
  """Warns when the strategy's axes leave mesh axes out: each of their groups repeats the step."""
  if dp_size >= mesh.devices.size:
    return
  used = set(checks.axis_names(axis))
  other = tuple(a for a in mesh.axis_names if a not in used)
  every = tuple(mesh.axis_names)
  warnings.warn(
    f"the strategy splits the batch over {axis!r} ({dp_size} of the mesh's "
    f"{mesh.devices.size} devices): the mesh's other axes {other} take no part, so each of "
    f"their {mesh.devices.size // dp_size} device groups runs the same step on the same "
    f"batch (no speed-up from them). Pass axis={every!r} to use every device, or "
    f"replica_axis={other[0] if len(other) == 1 else other!r} for hybrid ZeRO; if loss_fn "
    f"uses {other} itself (model parallelism), this is what you want.", stacklevel=3)


class Trainer:
  """Data-parallel or ZeRO training of any ``loss_fn`` with any optax optimizer.

  One step on ``N`` devices with global batch ``B`` computes the same update
  as one device with batch ``B`` (up to the order of float additions).

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss``, the mean loss over the
      (local) batch, or ``(loss, aux)`` with ``has_aux=True``. Model state
      such as BatchNorm statistics travels in ``aux``: floating aux leaves are
      averaged over microbatches and over the data axis, integer leaves
      (counts) are summed. Bool leaves are counts too: cast to int32 and
      summed, so ``metrics["aux"]`` holds on how many (device, microbatch)
      pairs the flag was true, whatever ``grad_accum_steps`` is.
    optimizer: an ``optax.GradientTransformation``. Under ZeRO it runs on the
      rows each device owns (see :class:`jaxcoll.ZeRO` for what that means for
      non-elementwise optimizers).
    mesh: the device mesh; ``strategy.axis`` must be axes of it.
    strategy: ``jaxcoll.DataParallel(...)`` or ``jaxcoll.ZeRO(stage=...)``.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    grad_accum_steps: microbatches per step; the global batch must divide by
      ``N * grad_accum_steps``.
    clip_global_norm: if set, gradients are scaled as
      ``optax.clip_by_global_norm(clip_global_norm)`` would, with the norm
      taken over the whole (sharded) gradient.
    merge_aux: ``merge_aux(params, aux) -> params``, applied after every
      optimizer update with the data-axis-reduced ``aux``: how model state
      that is not trained by gradients (BatchNorm running statistics) gets
      back into the parameters, e.g. ``workload.merge_aux``. ``params`` are
      the full parameters under every strategy (ZeRO-3 gathers the leaves it
      reads). Must keep the tree structure; leaves it replaces take the new
      (full-shape) values. Return the leaves you do not change as given (the
      same objects, not ``jax.tree.map`` copies): ZeRO-3 knows them by
      identity and drops their gathers; a merge that rebuilds every leaf
      gathers the whole model inside every step.
    nan_policy: what a step whose gradients are non-finite on any device
      does: ``"none"`` (apply it anyway), ``"skip"`` (leave the state
      unchanged on every device alike; ``metrics["skipped"]`` is 1) or
      ``"raise"`` (as skip, then ``step`` raises
      :class:`jaxcoll.train.NonFiniteGradientsError`, a ``FloatingPointError``
      carrying the step number and the unchanged state, since the state
      passed in was donated; this waits for every step's result).
    compute_dtype: a floating dtype, e.g. ``jnp.bfloat16``: floating parameters are cast to it
      for forward and backward (and for ZeRO-3's all-gather); master
      parameters, gradients and optimizer state stay in their own dtype.
    rng: a ``jax.random`` key or an int seed: randomness for the loss
      (dropout, stochastic depth, masking noise). With it, ``loss_fn`` is
      called as ``loss_fn(params, batch, rng)``: in a step, ``rng`` is
      ``fold_in(fold_in(key, step), row)`` where ``step`` is the number of
      steps done before this one (``state.step``) and ``row`` the global
      position in the batch of the first row of this device's (micro)batch
      shard, so the masks do not depend on how the devices are spread over
      processes, and a resumed run draws what an uninterrupted one would;
      in :meth:`eval` it is ``None`` (deterministic: no dropout). Without
      it (the default) ``loss_fn(params, batch)`` as before.
    max_steps_in_flight: how many dispatched steps may run ahead of the host
      before ``step`` waits for the oldest. Bounding it keeps the XLA CPU
      backend from aborting when many executions with collectives are queued
      (see BUILD.md), and costs nothing on accelerators at 2 or more.

  Raises:
    ValueError: a bad strategy, axis, ``grad_accum_steps`` or clip value;
      at ``init``, an integer or bool parameter leaf (``jax.grad`` cannot
      differentiate it).

  Example:
    >>> mesh = jaxcoll.devices.flat_mesh(8)
    >>> trainer = jaxcoll.Trainer(loss_fn, optax.adam(1e-3), mesh,
    ...                           jaxcoll.ZeRO(stage=3))  # doctest: +SKIP
    >>> state = trainer.init(params)  # doctest: +SKIP
    >>> state, metrics = trainer.step(state, {"x": x, "y": y})  # doctest: +SKIP
    >>> params = trainer.params(state)  # doctest: +SKIP
  """

  def __init__(
    self,
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    strategy: Strategy,
    *,
    has_aux: bool = False,
    grad_accum_steps: int = 1,
    clip_global_norm: float | None = None,
    compute_dtype=None,
    max_steps_in_flight: int = 2,
    merge_aux: Callable[[Any, Any], Any] | None = None,
    nan_policy: str = "none",
    rng: Any = None,
  ):
    if isinstance(strategy, type):  # jaxcoll.DataParallel: data_axes() missing 'mesh'
      raise ValueError(
        f"`strategy` must be an instance, e.g. jaxcoll.{strategy.__name__}(); got the class "
        f"{strategy.__name__} itself.")
    if not (hasattr(strategy, "plan") and hasattr(strategy, "data_axes")):
      raise ValueError(
        f"`strategy` must be jaxcoll.DataParallel(...) or jaxcoll.ZeRO(...); got {strategy!r}."
      )
    if not callable(loss_fn):  # it was "'NoneType' object is not callable" at the first step
      raise ValueError(
        "`loss_fn` must be callable, loss_fn(params, batch) -> loss; got "
        f"{checks.short_repr(loss_fn)}.")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
      if hasattr(optimizer, "tx") and hasattr(optimizer, "opt_state"):  # flax.nnx.Optimizer
        raise ValueError(
          "`optimizer` must be an optax.GradientTransformation; got flax.nnx."
          f"{type(optimizer).__name__}. Pass the optax transformation it wraps (e.g. "
          "optax.adam(1e-3)): the trainer keeps the optimizer state itself, sharded as the "
          "strategy says.")
      raise ValueError(
        f"`optimizer` must be an optax.GradientTransformation; got {checks.short_repr(optimizer)}.")
    grad_accum_steps = checks.positive_int(
        grad_accum_steps, "grad_accum_steps", fix="Use 1 for no accumulation.")
    if clip_global_norm is not None and not (checks.real_scalar(clip_global_norm) or 0) > 0:
      raise ValueError(
        f"`clip_global_norm` must be a positive number or None; got {clip_global_norm!r}."
      )
    compute_dtype = _as_compute_dtype(compute_dtype)
    self.loss_fn, self.optimizer, self.mesh, self.strategy = loss_fn, optimizer, mesh, strategy
    self.has_aux, self.grad_accum_steps = has_aux, grad_accum_steps
    self.clip_global_norm, self.compute_dtype = clip_global_norm, compute_dtype
    if merge_aux is not None and not has_aux:
      raise ValueError("`merge_aux` needs `has_aux=True`: it reads the aux of `loss_fn`.")
    self.merge_aux = merge_aux
    if nan_policy not in guards.NAN_POLICIES:
      raise ValueError(
          f"`nan_policy` must be one of {', '.join(guards.NAN_POLICIES)}; got {nan_policy!r}."
      )
    self.nan_policy = nan_policy
    self.rng = _as_key(rng)
    if self.rng is not None and _positional_count(loss_fn) == 2:  # a TypeError at step 1
      raise ValueError(
        f"`rng` was given, so `loss_fn` is called as loss_fn(params, batch, rng), but "
        f"{getattr(loss_fn, '__name__', 'it')} takes (params, batch) only: add a third "
        "parameter (def loss_fn(params, batch, rng=None): rng is None in eval), or drop "
        "`rng` if the loss draws no random numbers.")
    self.max_steps_in_flight = checks.positive_int(max_steps_in_flight, "max_steps_in_flight")
    self._in_flight: collections.deque = collections.deque()
    self.axis, self.dp_size = strategy.data_axes(mesh)
    _warn_axes_left_out(self.axis, self.dp_size, mesh)
    self.stage = strategy.stage
    self.trace_count = 0  # traces of the step body (tests bound retracing)
    self._built = None  # (treedef, leaf shapes) the programs were built for
    self._plan = None
    self._canonical_cache = None  # (self._built, Canonical)
    self._eval_sums: dict = {}  # fn -> the program of eval_sums
    self._export_programs: dict = {}  # export_state(copy=False)'s programs and leaf kinds

  # -- public API --------------------------------------------------------------

  def init(self, params) -> TrainState:
    """Places ``params`` (host or device pytree) and initializes the optimizer.

    Every replica starts from process 0's values, even if processes passed
    different ones (numpy or jax arrays). Under ZeRO-3 no device holds more
    than one leaf beyond its rows of the state, whether ``params`` are numpy,
    on one device (``jax.jit(model.init)``'s output) or already sharded: in
    one process each device's row is cut from numpy directly, and jax arrays
    are laid out in blocks first (no leaf is copied whole to every device);
    with several processes, leaf by leaf from device 0's copy. To never hold
    the full parameters at all, use :meth:`init_from`.

    Raises:
      ValueError: a parameter leaf is not floating point (integer or bool
        leaves cannot be differentiated), or shapes without values
        (``jax.eval_shape``'s output); the message names the leaf.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
      if isinstance(leaf, jax.ShapeDtypeStruct):  # it was a TypeError, another per strategy
        raise ValueError(
          f"`params` leaf {state_lib.leaf_name(path)} is a jax.ShapeDtypeStruct (a shape "
          "without values, as jax.eval_shape gives): `init` takes the values. Build them "
          "sharded with `trainer.init_from(init_fn, *args)` (e.g. init_from(model.init, key, "
          "x)), or, to restore a checkpoint, `trainer.abstract_state(param_shapes)` and then "
          "`Checkpointer.restore(trainer)`.")
    self._build(params)
    return self._plan.init(params)

  def init_from(self, init_fn: Callable[..., Any], *args) -> TrainState:
    """The train state of ``init_fn(*args)``'s parameters, never held in full.

    ``init_fn`` (e.g. ``workload.init_params`` or ``lambda key: model.init(key,
    x)``) runs under ``jax.jit`` with the state's shardings as its outputs:
    XLA computes on each device only the rows (ZeRO-3) or shards it keeps,
    so under ZeRO-3 the whole parameters exist nowhere, the meta-device
    initialization of MaxText and PyTorch FSDP. Every process computes the
    same values from the same ``args`` (e.g. the seed), so replicas agree.
    The state equals ``init(jax.jit(init_fn)(*args))`` bit for bit
    (``jax_threefry_partitionable``, JAX's default, makes random numbers
    independent of how they are sharded).

    Raises:
      ValueError: ``init_fn``'s output does not have the structure, shapes
        and dtypes of the model this trainer was built for (an earlier
        ``init``/``abstract_state``); or a parameter leaf is not floating point.
    """
    return self._init_program(init_fn, args)(*args)

  def lower_init_from(self, init_fn: Callable[..., Any], *args) -> jax.stages.Lowered:
    """The lowered program of :meth:`init_from` (``.compile().memory_analysis()``:
    what XLA allocates on each device to initialize; nothing is run)."""
    return self._init_program(init_fn, args).lower(*args)

  def _init_program(self, init_fn, args):
    if not callable(init_fn):
      raise ValueError(f"`init_fn` must be callable (e.g. workload.init_params); got {init_fn!r}.")
    shapes = jax.eval_shape(init_fn, *args)
    if not all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(shapes)) or not (
        jax.tree.leaves(shapes)):
      raise ValueError("`init_fn` must return a pytree of arrays (the parameters); got "
                       f"{jax.tree.map(lambda x: type(x).__name__, shapes)!r}.")
    self._check_tree(shapes, "init_fn's output")
    self._build(shapes)
    shardings = self._plan.state_shardings(self._abstract_state())
    plan = self._plan
    return jax.jit(lambda *a: plan.init_traced(init_fn(*a)), out_shardings=shardings)

  def abstract_state(self, param_shapes) -> TrainState:
    """The state :meth:`init` would return, as ``jax.ShapeDtypeStruct`` leaves with
    their shardings; nothing of the model's size is allocated.

    ``param_shapes`` may be shape structs (``jax.eval_shape(model.init, ...)``)
    or arrays. The result can be passed to :meth:`lower_step` /
    :meth:`compile_step` (e.g. for ``compiled.memory_analysis()``).

    Raises:
      ValueError: a parameter leaf is not floating point.
    """
    self._build(param_shapes)
    return self._abstract_state()

  def _abstract_state(self) -> TrainState:
    plan = self._plan
    like = plan.model.unflatten(plan.model.like)
    shapes = jax.eval_shape(plan.init_traced, like)
    shardings = plan.state_shardings(shapes)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, shardings)

  def _run_on_own_state(self, program, state, batch):
    """``program(state, batch)``; a state of another trainer is one line instead of the
    program's pytree or divisibility traceback."""
    try:
      return program(state, batch)
    except (ValueError, TypeError) as e:
      self._raise_if_not_own_state(state, e)
      raise
    except NameError as e:
      self._raise_if_unbound_axis(e)
      raise

  def _raise_if_unbound_axis(self, error: NameError) -> None:
    """One ``ValueError`` line for a ``loss_fn`` (or eval ``fn``) that reduces over an
    axis name the mesh lacks (``nn.BatchNorm(axis_name="data")`` on a ``node, local``
    mesh): every mesh axis is bound in the trainer's programs, so JAX's "unbound axis
    name ... please call psum under `jax.shard_map`" told a fix that was already so."""
    name = axes_bound.unbound_axis_name(error)
    if name is None:
      return
    axes = tuple(self.mesh.axis_names)
    data = self._plan.data_axes if self._plan is not None else axes
    raise ValueError(
        f"`loss_fn` reduces over axis {name!r} (e.g. nn.BatchNorm(axis_name="
        f"{name!r})), which the trainer's mesh does not have: its axes are {axes}. "
        f"Name the data axes, axis_name={data!r}, for statistics over the whole global "
        "batch.") from None

  def _raise_if_not_own_state(self, state, error: Exception) -> None:
    """One ``ValueError`` line when ``state`` is not laid out as this trainer keeps its
    state (made by a trainer of another optimizer, strategy or device count: the step
    failed with a pytree structure error or shard_map's divisibility traceback)."""
    try:
      got, got_def = jax.tree_util.tree_flatten_with_path(state)
      want, want_def = jax.tree_util.tree_flatten_with_path(self._abstract_state())
    except Exception:  # noqa: BLE001  (the step's own error is shown then)
      return
    fix = "pass a state this trainer made (`init`, `init_from`, `import_state`)"
    what = f"{self.strategy.kind.name} on {self.dp_size} devices and its optimizer"
    if got_def != want_def:
      have = [state_lib.leaf_name(p) for p, _ in got]
      names = [state_lib.leaf_name(p) for p, _ in want]
      extra = [n for n in have if n not in names][:2]
      missing = [n for n in names if n not in have][:2]
      nodes = None if extra or missing else _first_differing_node(got_def, want_def)
      if nodes is not None:  # the same leaves in other containers (adam's state, adamw's)
        raise ValueError(
            f"`state` is not a state of this trainer ({what}): its containers differ "
            f"({nodes[0]} where this trainer keeps {nodes[1]}; the same {len(have)} "
            f"leaves: another optimizer or model); {fix}.") from error
      raise ValueError(
          f"`state` is not a state of this trainer ({what}): its tree differs (extra "
          f"{extra or 'none'}, missing {missing or 'none'}, {len(have)} leaves, this "
          f"trainer's {len(names)}: another model or optimizer); {fix}.") from error
    for (path, x), (_, like) in zip(got, want):
      if tuple(np.shape(x)) != tuple(like.shape) or jnp.result_type(x) != like.dtype:
        raise ValueError(
            f"`state` is not a state of this trainer ({what}): leaf "
            f"{state_lib.leaf_name(path)} is {jnp.result_type(x)}{list(np.shape(x))}, this "
            f"trainer keeps {like.dtype}{list(like.shape)}; {fix}; to move one from a trainer "
            "of another strategy or device count: `trainer.import_state(other.export_state("
            "state))`.") from error

  def fsdp_unit_bytes(self, param_shapes, *, by_kind: bool = False) -> tuple | None:
    """ZeRO-3's FSDP units of the model: ``(bytes outside units, bytes of the unit
    rows, bytes of the largest unit (one layer of a scanned stack), whether that
    unit is scanned)``; None without units or under another strategy. Nothing
    is allocated (the units are known once the model's init or loss has run).
    ``by_kind=True``: ``(outside, unit rows, bytes of all unrolled units, of the
    largest unrolled unit, of the largest scanned layer, of the scanned stacks' rows)``
    (a model may have both: a tied embedding as a unit beside a scanned stack of layers)."""
    self._build(param_shapes)
    return self._plan.unit_bytes(by_kind=by_kind)

  def _check_tree(self, tree, what: str) -> None:
    """Raises unless ``tree`` matches the model this trainer was built for (if any)."""
    if self._built is None:
      return
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    want_treedef, want = self._built
    if treedef != want_treedef:
      have = [state_lib.leaf_name(p) for p, _ in flat]
      want_names = [state_lib.leaf_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(
          want_treedef.unflatten([0] * want_treedef.num_leaves))[0]]
      extra = [n for n in have if n not in want_names][:3]
      missing = [n for n in want_names if n not in have][:3]
      raise ValueError(
        f"{what} does not have the model's tree ({len(have)} leaves, the model "
        f"{len(want_names)}; extra {extra or 'none'}, missing {missing or 'none'}); return "
        "the parameters of the model this trainer was built for."
      )
    for (path, x), (shape, dtype) in zip(flat, want):
      if (tuple(np.shape(x)), jnp.result_type(x)) != (tuple(shape), dtype):
        raise ValueError(
          f"{what}: leaf {state_lib.leaf_name(path)} is {jnp.result_type(x)}{list(np.shape(x))}, "
          f"the model's is {dtype}{list(shape)}; return the parameters of the model this "
          "trainer was built for."
        )

  def step(self, state: TrainState, batch) -> tuple[TrainState, dict]:
    """One optimizer step on a global batch; returns ``(state, metrics)``.

    ``metrics`` has ``loss`` (mean over the global batch), ``grad_norm`` (of
    the averaged gradient, before clipping) and ``aux`` with ``has_aux``.
    ``state`` is donated: do not use it after the call.

    Raises:
      NonFiniteGradientsError: with ``nan_policy="raise"``, when a gradient
        is non-finite; its ``.state`` is the unchanged state to continue
        from (or save), its ``.step`` the failed step's number.
    """
    self._require_built()  # a trainer never init'ed: one line, not AttributeError '_step'
    self._require_live(state)
    state = self._with_scalars_placed(state)
    state, metrics = self._run_on_own_state(
        self._step, state, self._place_batch(batch, self.grad_accum_steps))
    self._bound_in_flight(metrics)
    if self.nan_policy == "raise" and int(metrics["skipped"]):
      step = int(state.step) + 1
      raise guards.NonFiniteGradientsError(
        f"Non-finite gradients at step {step} (nan_policy='raise'); the "
        "state was left unchanged (it is this error's `.state`). Lower the learning "
        "rate, clip gradients (clip_global_norm), or use nan_policy='skip'.",
        state=state,
        step=step,
      )
    return state, metrics

  def eval(self, state: TrainState, batch) -> dict:
    """``loss`` (and ``aux``) over a global batch, without updating."""
    self._require_built()
    self._require_live(state)
    metrics = self._run_on_own_state(self._eval, self._with_scalars_placed(state),
                                     self._place_batch(batch, 1))
    self._bound_in_flight(metrics)
    return metrics

  def _with_scalars_placed(self, state: TrainState) -> TrainState:
    """``state`` with each scalar of the optimizer state that the user set by hand
    (``state.opt_state.hyperparams["learning_rate"] = 3e-2`` of
    ``optax.inject_hyperparams``) laid out as the plan keeps that scalar: one copy per
    device under ZeRO (shard_map refused the rank-0 leaf with a traceback), a
    replicated array under data parallelism (a Python float could not be saved)."""
    if self._built is None or not hasattr(state, "opt_state"):
      return state  # e.g. the full params that check_replicas also takes
    if self._scalar_slots is None:
      abstract, _ = jax.tree_util.tree_flatten_with_path(self._abstract_state().opt_state)
      full = jax.tree.leaves(jax.eval_shape(
          self.optimizer.init, self._plan.model.unflatten(self._plan.model.like)))
      scalars = tuple((i, a) for i, ((_, a), f) in enumerate(zip(abstract, full))
                      if not f.shape) if len(abstract) == len(full) else ()
      self._scalar_slots = (len(abstract), scalars,
                            _leaf_getters([abstract[i][0] for i, _ in scalars]))
    count, scalars, getters = self._scalar_slots
    if getters is not None:  # the step's hot path: look only at the scalar leaves
      try:
        if not any(_by_hand(get(state.opt_state), like)
                   for get, (_, like) in zip(getters, scalars)):
          return state
      except (KeyError, IndexError, AttributeError, TypeError):
        pass  # another tree: the full look below
    leaves, treedef = jax.tree.flatten(state.opt_state)
    if len(leaves) != count:
      return state  # not this trainer's state: the program says what differs
    slots = [(i, like) for i, like in scalars if _by_hand(leaves[i], like)]
    for i, like in slots:
      value = np.broadcast_to(np.asarray(leaves[i], like.dtype), like.shape)
      leaves[i] = jax.make_array_from_callback(like.shape, like.sharding,
                                               lambda index, v=value: v[index])
    return state._replace(opt_state=treedef.unflatten(leaves)) if slots else state

  def params(self, state: TrainState):
    """The full, unsharded parameters (replicated jax arrays).

    Always new buffers (a copy under data parallelism and ZeRO-1/2), so the
    result stays valid after ``state`` is donated to the next ``step``.
    Under ZeRO-3 this holds the whole model on every device: for a model
    that fits only sharded use :meth:`host_params` or :meth:`eval_sums`.
    """
    self._require_built()
    self._require_live(state)
    return self._full_params(state.params)

  def host_params(self, state: TrainState):
    """Yields ``(path, numpy array)`` for every parameter leaf in tree order, one
    full leaf on the host at a time: no replicated copy of the model on any device
    (under ZeRO-3 each leaf is assembled on the host from the devices' rows).
    Every process must iterate it (with several processes, each leaf is gathered
    to every process). The values are those of :meth:`params`, bit for bit.
    """
    self._require_built()
    self._require_live(state)
    plan = self._plan
    leaves = jax.tree.leaves(state.params)
    for i, (path, leaf) in enumerate(zip(plan.model.paths, leaves)):
      yield "/".join(path), plan.host_param(leaf, i)

  def params_digest(self, state: TrainState) -> tuple[float, str, list[str]]:
    """``(global norm, sha256, non-finite leaves)`` of the parameters: summary.json's
    ``params_global_norm`` / ``params_sha256``, bit-identical to hashing
    :meth:`params` (float32 little-endian bytes of each leaf in tree order; norm
    summed in float64 as numpy does), computed shard by shard on the host: no
    replicated copy on any device, at most one layer of a scanned leaf on the
    host under ZeRO-3 (:mod:`jaxcoll.train.digest`). Every process must call it.
    """
    from jaxcoll.train import digest  # noqa: PLC0415

    self._require_built()
    self._require_live(state)
    plan = self._plan
    flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
    return digest.digest((jax.tree_util.keystr(path), plan.host_param_pieces(leaf, i))
                         for i, (path, leaf) in enumerate(flat))

  def eval_sums(self, fn: Callable[[Any, Any], Any], state: TrainState, batch):
    """``fn(params, local batch)`` on every device, summed over the data axes.

    ``fn`` sees the parameters as the train step does: under ZeRO-3 leaves
    outside FSDP units are gathered before it runs and each unit gathers its
    own where it runs (so at most one unit is held in full; on XLA:CPU only
    for scanned units, whose scheduler starts unrolled units' gathers at
    once), in the
    parameters' own dtype (not ``compute_dtype``). It returns a pytree of
    per-device sums (e.g. masked metric sums over the local rows); the
    result is their sum over the whole batch, replicated. ``batch`` is
    placed as for :meth:`step`. The program is compiled once per ``fn``.
    """
    self._require_live(state)
    try:
      out = self._eval_sums_program(fn)(self._with_scalars_placed(state),
                                        self._place_batch(batch, 1))
    except NameError as e:
      self._raise_if_unbound_axis(e)
      raise
    self._bound_in_flight(out)
    return out

  def lower_eval_sums(self, fn, state: TrainState, batch) -> jax.stages.Lowered:
    """The lowered program of :meth:`eval_sums` (``state`` may be :meth:`abstract_state`)."""
    return self._eval_sums_program(fn).lower(state, self._place_batch(batch, 1))

  def _eval_sums_program(self, fn):
    self._require_built()
    program = self._eval_sums.get(fn)
    if program is None:
      plan = self._plan

      def body(st, b):
        out = plan.call_with_params(st, lambda p, bb: fn(unboxed(p), bb), b, cast=False)
        return jax.tree.map(
            lambda v: collectives.all_reduce(v, plan.data_axes, op="sum", algorithm="native"), out)

      program = self._eval_sums[fn] = jax.jit(
          plan.smap(body, (plan.state_spec, plan.batch_spec()), P()))
    return program

  def lower_step(self, state: TrainState, batch) -> jax.stages.Lowered:
    """The lowered (not yet optimized) step program.

    Its HLO (``.as_text(dialect="hlo")``) shows every collective the trainer
    asked for; XLA may later combine, upcast or CSE them (XLA:CPU upcasts
    bf16 all-reduces and may merge ZeRO-3's backward re-gather into the
    forward one).
    """
    self._require_built()
    return self._step.lower(state, self._place_batch(batch, self.grad_accum_steps))

  def compile_step(self, state: TrainState, batch) -> jax.stages.Compiled:
    """The compiled step program (for ``memory_analysis()``, ``as_text()``)."""
    return self.lower_step(state, batch).compile()

  def state_bytes_per_device(self, state: TrainState) -> int:
    """Bytes of model state (params, optimizer state, residuals) one device holds."""
    return state_lib.bytes_per_device(state)

  def check_replicas(self, state: TrainState, *, raise_on_mismatch: bool = True) -> list[str]:
    """Verifies every replica of every replicated leaf is bit-identical.

    Returns:
      The mismatches found (empty when all replicas agree).

    Raises:
      RuntimeError: on a mismatch when ``raise_on_mismatch``; the message
        names each differing leaf and device (or process).
    """
    state = self._with_scalars_placed(state)
    problems = state_lib.replica_mismatches(state)
    if problems and raise_on_mismatch:
      raise RuntimeError(
        "Replicas of the train state differ (they must be bit-identical):\n  "
        + "\n  ".join(problems)
      )
    return problems

  def check_fingerprints(self, state: TrainState, *, raise_on_mismatch: bool = True) -> list[str]:
    """Cheap desync check: compares a per-leaf checksum of every replica.

    Each device hashes the bits of its copy of the replicated state (params
    and, for data parallelism, the optimizer state) on the device; only one
    uint32 per leaf and device reaches the host. ZeRO-3 holds no replicated
    parameters; under hybrid ZeRO (``replica_axis``) the devices of one position in
    the group compare their rows (params under ZeRO-3, optimizer state under every
    stage). Every process must call it.

    Returns:
      One line per leaf whose replicas differ, naming the devices.

    Raises:
      RuntimeError: on a mismatch when ``raise_on_mismatch``.
    """
    state = self._with_scalars_placed(state)
    self._require_built()
    rows = guards.gather_rows(self._fingerprint(state))
    k = len(self._fingerprint_names)
    problems = guards.mismatches(rows[:, :k], self._fingerprint_names)
    if self._group_fingerprint_names:  # hybrid ZeRO: each replica group's rows
      problems += guards.mismatches(rows[:, k:], self._group_fingerprint_names,
                                    group_size=self._plan.n)
    if problems and raise_on_mismatch:
      raise RuntimeError(f"Replicas diverged at step {int(state.step)}: " + "; ".join(problems))
    return problems

  # -- canonical (layout-free) state -------------------------------------------

  def export_shapes(self) -> dict:
    """What :meth:`export_state` returns, as ``jax.ShapeDtypeStruct`` leaves.

    Each leaf carries its shape, dtype and its sharding on this trainer's
    mesh (as :meth:`export_state` lays it out): a restore target (e.g.
    orbax's ``StandardRestore``, which then reads only each device's part).

    Raises:
      ValueError: before ``init``, or if the optimizer state cannot be
        mapped to the parameters (see :meth:`export_state`).
    """
    return self._canonical().like

  def export_state(self, state: TrainState, *, copy: bool = True) -> dict:
    """The canonical, layout-free train state (for checkpoints).

    ``{"step", "params": full parameters, "opt_state": what
    optimizer.init(full params) on one device would hold}``, independent of
    strategy, mesh and process count (see :mod:`jaxcoll.train.canonical`),
    as new jax arrays (``state`` may be donated next): replicated under data
    parallelism, sharded over the ZeRO group where a dimension allows (so no
    device holds a whole ZeRO state). Error-feedback residuals are not part
    of it (they depend on the layout: ``state.residual``,
    :meth:`residual_layout`). Every process must call it.

    Raises:
      ValueError: before ``init``; or, under ZeRO, if ``optimizer.init`` on
        rows and on full parameters differ in structure (a mask on exact
        shapes; ``ndim`` is fine) or a leaf is not elementwise in a parameter.

    With ``copy=False`` (what :class:`jaxcoll.checkpoint.Checkpointer` uses),
    leaves whose canonical form is the state leaf itself (the step, data
    parallel leaves) are returned as they are and, on the CPU backend, leaves
    whose canonical blocks are the state's blocks reshaped (ZeRO-3's aligned
    rows and their optimizer state) are zero-copy views of the state's buffers:
    no second copy of the state. Only the other leaves are computed (copies);
    on other backends all are, as with ``copy=True``. The values are the same
    bit for bit. Shared leaves stay valid only while ``state``'s buffers do:
    hold a numpy view of them (XLA:CPU then refuses to donate those buffers to
    a step, which computes into new ones) until you are done reading.

    Example:
      >>> canonical = trainer.export_state(state)  # doctest: +SKIP
      >>> canonical["opt_state"][0].mu["layer0"]["w"].shape  # doctest: +SKIP
      (4, 5)
    """
    self._require_live(state)
    state = self._with_scalars_placed(state)
    if copy:
      return self._canonical().export(state)
    return self._export_views(state)

  def _export_views(self, state: TrainState) -> dict:
    """:meth:`export_state` with ``copy=False``: views where they exist, the rest computed."""
    canonical = self._canonical()
    if any(d.platform != "cpu" for d in self.mesh.devices.flat):
      return canonical.export(state)  # a view would be no view there: copies, as before
    like, treedef = jax.tree.flatten(canonical.like)
    sources = treedef.flatten_up_to(
        {"step": state.step, "params": state.params, "opt_state": state.opt_state})
    kinds = self._export_kinds(state)
    out: list = [None] * len(like)
    for k, (kind, src, target) in enumerate(zip(kinds, sources, like)):
      if kind == "same" and src.sharding.is_equivalent_to(target.sharding, src.ndim):
        out[k] = src
      elif kind == "reshape":
        out[k] = _reshaped_view(src, target)
    rest = tuple(k for k, x in enumerate(out) if x is None)
    if rest:
      key = ("export_rest", rest)
      program = self._export_programs.get(key)
      if program is None:
        plan, mirrors, opt_def = self._plan, canonical.mirrors, canonical.opt_def

        def export_rest(st):
          params, opt = plan.export_leaves(st, mirrors)
          full = jax.tree.leaves({"step": st.step, "params": plan.model.unflatten(params),
                                  "opt_state": opt_def.unflatten(opt)})
          return [jnp.copy(full[k]) for k in rest]  # new buffers: `state` may be donated

        program = self._export_programs[key] = jax.jit(
            export_rest, out_shardings=[like[k].sharding for k in rest])
      for k, x in zip(rest, program(state)):
        out[k] = x
    return treedef.unflatten(out)

  def _export_kinds(self, state: TrainState) -> list[str]:
    """Per canonical leaf: ``"same"`` (the state leaf itself), ``"reshape"`` (each
    device's block reshaped, :meth:`Plan.export_is_reshape`) or ``"computed"``."""
    key = ("kinds", self._built)
    if key in self._export_programs:
      return self._export_programs[key]
    canonical, plan = self._canonical(), self._plan
    abstract = state  # traced only (its shapes and shardings)

    def tree(st):
      params, opt = plan.export_leaves(st, canonical.mirrors)
      return {"step": st.step, "params": plan.model.unflatten(params),
              "opt_state": canonical.opt_def.unflatten(opt)}

    # Outputs that are inputs of the traced export are the state leaves themselves.
    closed = jax.make_jaxpr(tree)(abstract)
    invars = {id(v): n for n, v in enumerate(closed.jaxpr.invars)}
    in_leaves = jax.tree.leaves(abstract)
    like, treedef = jax.tree.flatten(canonical.like)
    sources = treedef.flatten_up_to(
        {"step": abstract.step, "params": abstract.params, "opt_state": abstract.opt_state})
    n_params = len(plan.model.like)
    kinds = []
    for k, (out_var, src, target) in enumerate(zip(closed.jaxpr.outvars, sources, like)):
      mirror = self._canonical_mirror(k, treedef, n_params, canonical.mirrors)
      n = invars.get(id(out_var))
      if n is not None and in_leaves[n] is src and src.shape == target.shape:
        kinds.append("same")
      elif mirror is not None and plan.export_is_reshape(mirror):
        kinds.append("reshape")
      else:
        kinds.append("computed")
    self._export_programs[key] = kinds
    return kinds

  def _canonical_mirror(self, k: int, treedef, n_params: int, mirrors) -> int | None:
    """The parameter leaf canonical leaf ``k`` is laid out like (None: step, own leaves)."""
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(
        treedef.unflatten(list(range(treedef.num_leaves))))[0]]
    top = paths[k][0].key
    index = sum(1 for p in paths[:k] if p[0].key == top)
    if top == "params":
      return index
    if top == "opt_state":
      return mirrors[index]
    return None

  def residual_layout(self) -> dict | None:
    """What this trainer's error-feedback residuals are laid out by, as JSON:
    strategy, compression, data-parallel size and bucket plan (None without
    error feedback). Residuals saved under an equal layout (and equal
    :meth:`residual_shapes`) continue exactly here; under another they do not
    apply (see :meth:`jaxcoll.checkpoint.Checkpointer.restore`).

    Raises:
      ValueError: before ``init``.
    """
    self._require_built()
    return self._plan.residual_layout()

  def residual_shapes(self):
    """The state's ``residual`` field as ``jax.ShapeDtypeStruct`` leaves with
    their shardings (each device's rows, ``P(data axes)``); ``()`` without
    error feedback. Nothing is allocated.

    Raises:
      ValueError: before ``init``.
    """
    self._require_built()
    if self._plan.residual_layout() is None:
      return ()
    return self._abstract_state().residual

  def import_state(self, canonical: dict, *, donate: bool = False,
                   residual=None) -> TrainState:
    """Places a canonical state (:meth:`export_state`) onto this trainer.

    The inverse of :meth:`export_state` on any layout: replicated under
    data parallelism, each device's rows under ZeRO, whatever strategy,
    device count or process count exported it. Error-feedback residuals
    restart at zero unless ``residual`` is given: the residuals of a state
    of the same :meth:`residual_layout` (``state.residual``, or as a
    checkpoint restored them), shaped as :meth:`residual_shapes`.
    ``import_state(export_state(s), residual=s.residual)`` steps
    bit-identically to ``s`` (without ``residual``: only when there is no
    error feedback) on the same layout (for ZeRO, as long as the padding of the rows
    stays zero, which holds for elementwise optax optimizers). Leaves may be
    numpy or jax arrays; dtypes are cast to the model's. Without a prior
    ``init``, the parameters of ``canonical`` define the model. With
    ``donate=True`` the state may reuse the buffers of ``canonical``'s jax
    arrays and of ``residual`` (no second copy while restoring); do not use
    them afterwards.

    Raises:
      ValueError: if ``canonical`` does not have the model's structure and
        shapes (the message names each differing leaf and both shapes), or
        ``residual`` not those of :meth:`residual_shapes`.
    """
    if self._built is None:
      self._build(canonical["params"])
    if residual is not None:
      residual = self._check_residual(residual)
      if not donate:  # the state owns its buffers: a step may donate them
        residual = jax.tree.map(jnp.copy, residual)
    return self._canonical().import_(canonical, donate=donate, residual=residual)

  def _check_residual(self, residual):
    """``residual`` placed as :meth:`residual_shapes` lays it out (ValueError: another)."""
    like = self.residual_shapes()
    got = canonical_lib.leaf_specs(residual)
    want = canonical_lib.leaf_specs(like)
    problems = canonical_lib.spec_mismatches(got, want)
    if problems or jax.tree.structure(residual) != jax.tree.structure(like):
      raise ValueError(
        "`residual` does not match this trainer's error-feedback residuals "
        "(trainer.residual_shapes()): " + ("; ".join(problems) or "another tree structure")
        + ". Pass the residuals of a state of the same residual_layout(), or None (zeros).")
    return jax.tree.map(
      lambda x, t: state_lib.place(x, self.mesh, t.sharding.spec), residual, like)

  @property
  def has_model(self) -> bool:
    """Whether the model is known (``init`` or ``import_state`` was called)."""
    return self._built is not None

  def _canonical(self) -> Canonical:
    """The export/import programs of the current model (built once)."""
    self._require_built()
    if self._canonical_cache is None or self._canonical_cache[0] is not self._built:
      self._canonical_cache = (self._built, Canonical(self._plan))
    return self._canonical_cache[1]

  # -- building the programs ---------------------------------------------------

  def _bound_in_flight(self, metrics) -> None:
    self._in_flight.append(metrics)
    while len(self._in_flight) > self.max_steps_in_flight:
      jax.block_until_ready(self._in_flight.popleft())

  def _require_built(self):
    if self._built is None:
      raise ValueError(
          "Call `trainer.init(params)` before step/eval/params (for a state of another "
          "trainer: `state = trainer.import_state(other.export_state(state))`).")

  @staticmethod
  def _require_live(state) -> None:
    """One line for a state that ``step`` was given before (it donates the state: its
    buffers are reused for the new one). Reused in ``step``, the program ran on deleted
    buffers on a multi-device mesh and the process died of a segmentation fault; in
    ``eval`` / ``params`` it was "RuntimeError: Array has been deleted". The step counter
    is donated with the rest, so it alone is looked at (nothing more on the hot path)."""
    state_lib.check_not_donated(getattr(state, "step", None))

  def _place_batch(self, batch, accum: int):
    """The global batch split over the data axes (one place, so it can change alone)."""
    self._require_built()
    state_lib.check_batch(batch, self.dp_size, accum)
    state_lib.check_same_on_every_process(batch)  # local rows passed as global: refuse
    return state_lib.place(batch, self.mesh, P(self.axis))

  def _build(self, params) -> None:
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [x for _, x in flat]
    key = (treedef, tuple((np.shape(x), jnp.result_type(x)) for x in leaves))
    if self._built == key:
      return
    state_lib.check_float_params(params)
    like = tuple(jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x in leaves)
    # reduce_on_plateau, polyak_sgd: their update takes the step's loss (value=)
    self._needs_value = extra_args.needs_value(self.optimizer, treedef.unflatten(like))
    model = TrainSetup(
      treedef=treedef,
      like=like,
      paths=tuple(leaf_paths(params)),
      optimizer=(extra_args.with_value(self.optimizer) if self._needs_value
                 else self.optimizer),
      mesh=self.mesh,
      compute_dtype=self.compute_dtype,
    )
    plan = self._plan = self.strategy.plan(model, self.mesh)
    self._built = key
    self._scalar_slots = None  # (leaf count, (leaf index, struct), readers): scalars of optax
    self._eval_sums = {}
    self._export_programs = {}
    spec, rep = plan.state_spec, P()
    batch = plan.batch_spec()
    if plan.updates_globally:
      step = self._global_update_step(spec, batch)
    else:
      step = plan.smap(self._step_body, (spec, batch), (spec, rep))
    self._step = jax.jit(step, donate_argnums=0)
    self._eval = jax.jit(plan.smap(self._eval_body, (spec, batch), rep))
    self._fingerprint = jax.jit(plan.smap(  # per device: every copy's, then the group's
      lambda st: jnp.concatenate([guards.fingerprint(plan.replicated(st)),
                                  guards.fingerprint(plan.group_replicated(st))])[None],
      (spec,), P(plan.data_axes)
    ))
    like = model.unflatten(model.like)
    like_state = TrainState(0, like, jax.eval_shape(self.optimizer.init, like), ())
    self._fingerprint_names, self._group_fingerprint_names = (
      [state_lib.leaf_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(part)[0]]
      for part in (plan.replicated(like_state), plan.group_replicated(like_state)))
    replicated = NamedSharding(self.mesh, P())
    # copy_p is never elided (unlike an identity, whose output jit forwards).
    self._full_params = jax.jit(
      lambda p: jax.tree.map(jnp.copy, plan.full_params(p)), out_shardings=replicated
    )

  # -- one step --------------------------------------------------------------------

  def _step_body(self, state: TrainState, batch):
    loss, aux, grads, residual, grad_norm, finite = self._reduced_grads(state, batch)
    with extra_args.loss_value(self._plan.mean(loss) if self._needs_value else None):
      params, opt_state = self._plan.apply(state, grads)
    return self._updated(state, (loss, aux, residual, grad_norm, finite), params, opt_state)

  def _global_update_step(self, spec: TrainState, batch):
    """The step of a plan whose update runs outside shard_map (``plan.updates_globally``:
    ZeRO with an optimizer that reduces across elements): gradients in one shard_map,
    ``plan.global_apply`` on global arrays, the rest of the step in a second one."""
    plan, data, rows, rep = self._plan, P(self._plan.data_axes), P(self._plan.axis), P()
    skip = self.nan_policy != "none"

    def before(state, batch):
      loss, aux, grads, residual, grad_norm, finite = self._reduced_grads(state, batch)
      finite = finite if skip else jnp.ones((), jnp.int32)
      # Per-device loss and aux leave stacked over the data axes (reduced after).
      per_device = jax.tree.map(lambda x: jnp.asarray(x)[None], (loss, aux))
      return per_device, state_lib.to_block(grads), (residual, grad_norm, finite)

    def after(state, per_device, rest, rows, opt_state):
      loss, aux = jax.tree.map(lambda x: x[0], per_device)
      residual, grad_norm, finite = rest
      reduced = (loss, aux, residual, grad_norm, finite if skip else None)
      return self._updated(state, reduced, plan.params_of_rows(rows), opt_state)

    rest = (spec.residual, rep, rep)
    first = plan.smap(before, (spec, batch), (data, rows, rest))
    second = plan.smap(after, (spec, data, rest, rows, spec.opt_state), (spec, rep))

    def step(state, batch):
      per_device, grads, rest = first(state, batch)
      with extra_args.loss_value(jnp.mean(per_device[0]) if self._needs_value else None):
        rows_after, opt_state = plan.global_apply(state, grads)
      return second(state, per_device, rest, rows_after, opt_state)

    return step

  def _reduced_grads(self, state: TrainState, batch):
    """Inside shard_map: ``(loss, aux, grads, residual, grad_norm, finite)``, the
    gradients reduced as the plan keeps them and clipped (``clip_global_norm``)."""
    self.trace_count += 1
    plan = self._plan
    loss_fn = self._loss_and_aux
    if self.grad_accum_steps > 1:
      self._warn_if_microbatches_couple(batch)
    if self.rng is not None:  # the rows' global positions travel with the batch
      batch, loss_fn = self._with_rows(batch), self._loss_with_rng(state.step)
    loss, aux, grads, residual = plan.grads(state, batch, loss_fn, self._accumulate)
    grad_norm = plan.grad_norm(grads)
    finite = None if self.nan_policy == "none" else guards.all_finite(grads, plan.data_axes)
    if self.clip_global_norm is not None:
      grads = grads_lib.clip(grads, grad_norm, self.clip_global_norm)
    return loss, aux, grads, residual, grad_norm, finite

  def _warn_if_microbatches_couple(self, batch) -> None:
    """Inside shard_map: one warning when ``loss_fn`` reduces over the data axes
    (``nn.BatchNorm(axis_name="data")``) and the step accumulates microbatches.

    Microbatch ``i`` is the ``i``-th chunk of every device's rows, so such a loss
    sees ``B / grad_accum_steps`` rows spread over the batch: neither the global
    batch nor one device's ``i``-th ``B / grad_accum_steps`` consecutive rows."""
    if self.dp_size == 1:  # on one device: what one device accumulating does
      return
    treedef, leaves = self._built
    params = treedef.unflatten([jax.ShapeDtypeStruct(s, d) for s, d in leaves])
    k = self.grad_accum_steps
    micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // k,) + x.shape[1:],
                                                        x.dtype), batch)
    # What the loss value depends on only: a reduction in aux (a logged global mean)
    # does not couple the microbatches' gradients.
    found = grads_lib.reduces_over(lambda p, b: self._loss_and_aux(p, b, self.rng)[0],
                                   (params, micro), self._plan.data_axes)
    if found:
      local = jax.tree.leaves(batch)[0].shape[0]
      size, n = local * self.dp_size, self.dp_size
      warnings.warn(
          f"`loss_fn` reduces over the data axis {self._plan.data_axes!r} ({found}: e.g. "
          f"nn.BatchNorm(axis_name=...)) and `grad_accum_steps` is {k}: microbatch i is the "
          f"i-th {local // k} of each device's {local} rows, so its statistics are over "
          f"{size // k} rows spread over the global batch of {size}, not over the whole batch "
          f"(nor over rows i*{size // k}..(i+1)*{size // k}-1, as one device accumulating takes "
          f"them): training on {n} devices differs from one device's. Use grad_accum_steps=1 "
          "for statistics over the whole batch.", stacklevel=2)

  def _updated(self, state, reduced, params, opt_state):
    """Inside shard_map: ``(new state, metrics)`` of the updated ``params`` and state;
    ``reduced``: ``(loss, aux, residual, grad_norm, finite)`` of :meth:`_reduced_grads`."""
    plan = self._plan
    loss, aux, residual, grad_norm, finite = reduced
    metrics = {"loss": plan.mean(loss), "grad_norm": grad_norm}
    if self.has_aux:
      metrics["aux"] = plan.reduce_aux(aux)
      if self.merge_aux is not None:
        params = plan.merge_aux(params, metrics["aux"], self.merge_aux)
    new_state = TrainState(state.step + 1, params, opt_state, residual)
    if finite is not None:  # identical on every device: replicas stay identical
      new_state = guards.keep_if(finite, new_state, state)
      metrics["skipped"] = 1 - finite
    return new_state, metrics

  def _eval_body(self, state: TrainState, batch):
    loss, aux = self._plan.eval_loss(state, batch, self._eval_loss_and_aux)
    metrics = {"loss": self._plan.mean(loss)}
    if self.has_aux:
      metrics["aux"] = self._plan.reduce_aux(aux)
    return metrics

  def _accumulate(self, grad_fn, params, batch):
    return grads_lib.accumulate(grad_fn, params, batch, self.grad_accum_steps)

  def _with_rows(self, batch):
    """``(batch, rows)``: ``rows`` the global positions of this device's rows."""
    local = jax.tree.leaves(batch)[0].shape[0]
    first = jax.lax.axis_index(self._plan.data_axes) * local
    return batch, first + jnp.arange(local, dtype=jnp.int32)

  def _loss_with_rng(self, step):
    """``loss(params, (batch, rows))`` with the key of ``step`` and the first row."""

    def loss(params, batch_and_rows):
      batch, rows = batch_and_rows
      rng = jax.random.fold_in(jax.random.fold_in(self.rng, step), rows[0])
      return self._loss_and_aux(params, batch, rng)

    return loss

  def _eval_loss_and_aux(self, params, batch):
    return self._loss_and_aux(params, batch, None, evaluating=True)

  def _loss_and_aux(self, params, batch, rng=None, evaluating=False):
    params = unboxed(params)
    try:
      if self.rng is None and not (evaluating and takes_rng(self.loss_fn)):
        out = self.loss_fn(params, batch)
      else:  # rng None in eval: deterministic (a from_flax model in eval mode)
        out = self.loss_fn(params, batch, rng)
    except Exception as e:
      if type(e).__name__ != "TraceContextError":  # flax.errors.TraceContextError (nnx)
        raise
      raise ValueError(
        f"`loss_fn` mutates nnx state it closes over ({str(e).split(' (')[0]}): under the "
        "trainer's jit nnx may only change Variables made inside the trace. Pass that state "
        "through `params` (jaxcoll.models.from_nnx(model, loss) carries BatchStat-like state "
        "and reseeds rng streams), or run the merged model in eval mode "
        "(`model.eval()`) if it should not change."
      ) from None
    loss, aux = _loss_and_aux_of(out, self.has_aux, batch)
    # Bool aux leaves are counts: int32, summed over microbatches and devices.
    aux = jax.tree.map(
      lambda a: jnp.asarray(a, jnp.int32) if jnp.result_type(a) == jnp.bool_ else a, aux
    )
    return jnp.asarray(loss, jnp.float32), aux


def _tree_node(treedef) -> str:
  """``treedef``'s root as a line names it: ``tuple of 2``, ``ScaleByAdamState``."""
  data = treedef.node_data()
  if data is None:
    return "a leaf"
  kind = data[0]
  return f"{kind.__name__} of {len(treedef.children())}" if kind in (tuple, list) \
      else kind.__name__


def _first_differing_node(got, want) -> tuple[str, str] | None:
  """``(got's node, want's node)`` of the first node (depth first) where the two
  tree structures differ in type, arity or node data; None where they do not."""
  got_data, want_data = got.node_data(), want.node_data()
  if got_data is None and want_data is None:
    return None
  if (got_data is None or want_data is None or got_data[0] is not want_data[0]
      or len(got.children()) != len(want.children())):
    return _tree_node(got), _tree_node(want)
  for a, b in zip(got.children(), want.children()):
    found = _first_differing_node(a, b)
    if found is not None:
      return found
  return None if got_data == want_data else (_tree_node(got), _tree_node(want))


def _loss_and_aux_of(out, has_aux: bool, batch):
  """``(loss, aux)`` of what ``loss_fn`` returned; one ``ValueError`` line for a return
  that does not match ``has_aux`` or a loss that is not a scalar (each was a traceback
  from inside the step: ``float() argument must be ... not 'dict'``, ``iteration over a
  0-d array``, ``Gradient only defined for scalar-output functions``)."""
  pair = isinstance(out, (tuple, list))
  if has_aux and not (pair and len(out) == 2):
    raise ValueError(
        f"`has_aux=True` but `loss_fn` returned {_describe(out)}; return `(loss, aux)` "
        "(aux: a pytree of metrics or model state), or pass has_aux=False.")
  if not has_aux and (pair or isinstance(out, dict)):
    raise ValueError(
        f"`loss_fn` returned {_describe(out)}, not a scalar loss; pass `has_aux=True` "
        "and return `(loss, aux)` to carry metrics or model state along with the loss.")
  loss, aux = out if has_aux else (out, ())
  if isinstance(loss, (tuple, list, dict)) or np.shape(loss) != ():
    rows = [np.shape(x)[0] for x in jax.tree.leaves(batch) if np.ndim(x)]
    where = f" on this device's batch of {rows[0]} rows" if rows else ""
    raise ValueError(
        f"`loss_fn`'s loss is {_describe(loss)}{where}, not a scalar; return the mean over "
        "the batch it is given (e.g. jnp.mean(per_example_loss)).")
  return loss, aux


def _describe(out) -> str:
  if isinstance(out, dict):
    return f"a dict with keys {sorted(map(str, out))[:6]}"
  if isinstance(out, (tuple, list)):
    return f"a {type(out).__name__} of {len(out)}"
  return f"an array of shape {tuple(np.shape(out))}"


def unboxed(params):
  """``params`` with flax's partitioning boxes (``nn.with_partitioning``'s
  ``nn.Partitioned``, ``nn.LogicallyPartitioned``) replaced by their values, without
  the sharding constraint flax's own unboxing applies: inside the trainer's
  shard_map the logical names (``"embed"``, ``"mlp"``) are no mesh axes, and the
  strategy lays out the values. Gradients keep the boxes (they are pytree nodes)."""
  from flax.core import meta  # noqa: PLC0415

  box = lambda x: isinstance(x, meta.AxisMetadata)  # noqa: E731
  if not any(map(box, jax.tree.leaves(params, is_leaf=box))):
    return params
  return jax.tree.map(lambda x: x.unbox(apply_constraint=False) if isinstance(
      x, meta.Partitioned) else x.unbox() if box(x) else x, params, is_leaf=box)


def _positional_count(loss_fn) -> float | None:
  """How many positional arguments ``loss_fn`` takes: ``math.inf`` with ``*args``, None
  when its signature cannot be read."""
  try:
    parameters = list(inspect.signature(loss_fn).parameters.values())
  except (TypeError, ValueError):
    return None
  if any(p.kind == p.VAR_POSITIONAL for p in parameters):
    return math.inf
  return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)


def takes_rng(loss_fn) -> bool:
  """Whether ``loss_fn`` accepts ``(params, batch, rng)`` (``rng`` is ``None`` in
  evaluation)."""
  count = _positional_count(loss_fn)
  return count is not None and count >= 3


def _reshaped_view(src: jax.Array, like: jax.ShapeDtypeStruct) -> jax.Array | None:
  """``src`` as ``like``'s global array without a copy: each device's block of
  ``src`` reinterpreted as its block of ``like`` (same elements, same order).

  Only where the backend lets numpy alias a device buffer and a device array
  alias numpy memory (XLA:CPU); None elsewhere (the caller computes a copy).
  """
  if src.dtype != like.dtype:
    return None
  blocks = {s.device: s.data for s in src.addressable_shards}
  if any(d.platform != "cpu" for d in blocks):
    return None
  views = []
  for device, index in like.sharding.addressable_devices_indices_map(like.shape).items():
    shape = tuple(len(range(*sl.indices(n))) for sl, n in zip(index, like.shape))
    block = blocks.get(device)
    if block is None or block.size != int(np.prod(shape)):
      return None
    host = np.asarray(block)  # XLA:CPU: the device buffer itself
    if host.ctypes.data != block.unsafe_buffer_pointer():
      return None
    view = jax.device_put(host.reshape(shape), device, may_alias=True)
    if view.unsafe_buffer_pointer() != host.ctypes.data:
      return None
    views.append(view)
  return jax.make_array_from_single_device_arrays(like.shape, like.sharding, views)
