"""The Trainer: one jitted ``shard_map`` program per training step.

Read top to bottom, one step is:

1. each device takes its slice of the global batch and splits it into
   ``grad_accum_steps`` microbatches (``lax.scan``; gradients averaged);
2. ZeRO-3 gathers the parameters bucket by bucket (and again in backward);
3. gradients are averaged over the data axis: a bucketed all-reduce (data
   parallel, ZeRO-1) or reduce-scatter (ZeRO-2; ZeRO-3 gets it from the
   gather's VJP), optionally compressed;
4. the global gradient norm is computed (across shards when sharded) and
   the gradient clipped;
5. the optimizer updates what this device owns (everything, or its rows);
   ZeRO-1/2 all-gather the updated rows back into full parameters.

The state is donated to the step, so its buffers are reused in place.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll import collectives
from jaxcoll.train import compression as compression_lib
from jaxcoll.train import guards
from jaxcoll.train import state as state_lib
from jaxcoll.train.buckets import (
  ShardLayout,
  flatten_bucket,
  make_gather,
  plan_buckets,
  unflatten_bucket,
  zero3_remat_policy,
)
from jaxcoll.train.state import TrainState, stack, unstack
from jaxcoll.train.strategies import DataParallel, ZeRO, axis_spec, check_axis

Strategy = DataParallel | ZeRO


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
      back into the parameters, e.g. ``workload.merge_aux``. Must keep the
      tree structure; leaves it replaces take the new (full-shape) values.
    nan_policy: what a step whose gradients are non-finite on any device
      does: ``"none"`` (apply it anyway), ``"skip"`` (leave the state
      unchanged on every device alike; ``metrics["skipped"]`` is 1) or
      ``"raise"`` (as skip, then ``step`` raises
      :class:`jaxcoll.train.NonFiniteGradientsError`, a ``FloatingPointError``
      carrying the step number and the unchanged state, since the state
      passed in was donated; this waits for every step's result).
    compute_dtype: e.g. ``jnp.bfloat16``: floating parameters are cast to it
      for forward and backward (and for ZeRO-3's all-gather); master
      parameters, gradients and optimizer state stay in their own dtype.
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
  ):
    if not isinstance(strategy, (DataParallel, ZeRO)):
      raise ValueError(
        f"`strategy` must be jaxcoll.DataParallel(...) or jaxcoll.ZeRO(...); got {strategy!r}."
      )
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
      raise ValueError(f"`optimizer` must be an optax.GradientTransformation; got {optimizer!r}.")
    if (
      isinstance(grad_accum_steps, bool)
      or not isinstance(grad_accum_steps, int)
      or grad_accum_steps < 1
    ):
      raise ValueError(
        f"`grad_accum_steps` must be a positive int; got {grad_accum_steps!r}. "
        "Use 1 for no accumulation."
      )
    if clip_global_norm is not None and not clip_global_norm > 0:
      raise ValueError(
        f"`clip_global_norm` must be a positive number or None; got {clip_global_norm!r}."
      )
    self.loss_fn = loss_fn
    self.optimizer = optimizer
    self.mesh = mesh
    self.strategy = strategy
    self.has_aux = has_aux
    self.grad_accum_steps = grad_accum_steps
    self.clip_global_norm = clip_global_norm
    self.compute_dtype = compute_dtype
    if merge_aux is not None and not has_aux:
      raise ValueError("`merge_aux` needs `has_aux=True`: it reads the aux of `loss_fn`.")
    self.merge_aux = merge_aux
    if nan_policy not in guards.NAN_POLICIES:
      raise ValueError(
          f"`nan_policy` must be one of {', '.join(guards.NAN_POLICIES)}; got {nan_policy!r}."
      )
    self.nan_policy = nan_policy
    if (
      isinstance(max_steps_in_flight, bool)
      or not isinstance(max_steps_in_flight, int)
      or max_steps_in_flight < 1
    ):
      raise ValueError(
        f"`max_steps_in_flight` must be a positive int; got {max_steps_in_flight!r}."
      )
    self.max_steps_in_flight = max_steps_in_flight
    self._in_flight: collections.deque = collections.deque()
    self.dp_size = check_axis(strategy.axis, mesh)
    self.axis = axis_spec(strategy.axis)
    self.stage = strategy.stage if isinstance(strategy, ZeRO) else 0
    self.trace_count = 0  # traces of the step body (tests bound retracing)
    self._built = None  # (treedef, leaf shapes) the programs were built for
    self._canonical_cache = None  # (self._built, export/import programs)

  # -- public API --------------------------------------------------------------

  def init(self, params) -> TrainState:
    """Places ``params`` (host or device pytree) and initializes the optimizer.

    Every replica starts from device 0's values (``jaxcoll.broadcast``), even
    if processes passed different ones (numpy or jax arrays).

    Raises:
      ValueError: a parameter leaf is not floating point (integer or bool
        leaves cannot be differentiated); the message names the leaf.
    """
    params = state_lib.place(params, self.mesh, P())
    self._build(params)
    return self._init(params)

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
    state, metrics = self._step(state, self._place_batch(batch, self.grad_accum_steps))
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
    metrics = self._eval(state, self._place_batch(batch, 1))
    self._bound_in_flight(metrics)
    return metrics

  def params(self, state: TrainState):
    """The full, unsharded parameters (replicated jax arrays).

    Always new buffers (a copy under data parallelism and ZeRO-1/2), so the
    result stays valid after ``state`` is donated to the next ``step``.
    """
    self._require_built()
    if self.stage < 3:
      return self._copy(state.params)
    return self._unshard(state.params)

  def lower_step(self, state: TrainState, batch) -> jax.stages.Lowered:
    """The lowered (not yet optimized) step program.

    Its HLO (``.as_text(dialect="hlo")``) shows every collective the trainer
    asked for; XLA may later combine, upcast or CSE them (the CPU backend
    upcasts bf16 all-reduces to f32, and drops remat's optimization barriers
    before CSE, so it may merge ZeRO-3's backward re-gather with the
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
    problems = state_lib.replica_mismatches(state)
    if problems and raise_on_mismatch:
      raise RuntimeError(
        "Replicas of the train state differ (they must be bit-identical):\n  "
        + "\n  ".join(problems)
      )
    return problems

  def check_fingerprints(
      self, state: TrainState, *, raise_on_mismatch: bool = True
  ) -> list[str]:
    """Cheap desync check: compares a per-leaf checksum of every replica.

    Each device hashes the bits of its copy of the replicated state (params
    and, for data parallelism, the optimizer state) on the device; only one
    uint32 per leaf and device reaches the host. ZeRO-3 holds no replicated
    parameters, so there is nothing to compare. Every process must call it.

    Returns:
      One line per leaf whose replicas differ, naming the devices.

    Raises:
      RuntimeError: on a mismatch when ``raise_on_mismatch``.
    """
    self._require_built()
    rows = self._fingerprint(state)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # noqa: PLC0415

      rows = multihost_utils.process_allgather(rows, tiled=True)
    problems = guards.mismatches(np.asarray(rows), self._fingerprint_names)
    if problems and raise_on_mismatch:
      raise RuntimeError(
          f"Replicas diverged at step {int(state.step)}: " + "; ".join(problems)
      )
    return problems

  def _replicated_part(self, state: TrainState):
    if self.stage == 3:
      return {}
    if self.stage == 0:
      return {"params": state.params, "opt_state": state.opt_state}
    return {"params": state.params}

  # -- canonical (layout-free) state -------------------------------------------

  def export_shapes(self) -> dict:
    """What :meth:`export_state` returns, as ``jax.ShapeDtypeStruct`` leaves.

    Each leaf carries its shape, dtype and the replicated sharding on this
    trainer's mesh: a restore target (e.g. orbax's ``StandardRestore``).

    Raises:
      ValueError: before ``init``, or if the optimizer state cannot be
        mapped to the parameters (see :meth:`export_state`).
    """
    return self._canonical()["like"]

  def export_state(self, state: TrainState) -> dict:
    """The canonical, layout-free train state (for checkpoints).

    The result does not depend on the strategy, the mesh or the number of
    processes: ``{"step": int32 scalar, "params": the full parameters,
    "opt_state": what optimizer.init(full params) on one device would hold,
    with full leaf shapes}``, as replicated jax arrays (new buffers: ``state``
    may be donated to the next step afterwards). Under ZeRO, the rows of every
    optimizer-state leaf that mirrors a parameter are gathered and
    un-padded; leaves of the optimizer's own (step counts, which every
    device holds identically) are taken from device 0. Error-feedback
    residuals are not part of it. Every process must call it.

    Raises:
      ValueError: before ``init``; or, under ZeRO, if ``optimizer.init`` on
        rows and on full parameters give differently structured states (e.g.
        a mask that depends on exact shapes; ``ndim`` is fine, rows keep it)
        or a leaf whose shape follows the parameters in another way than
        elementwise.

    Example:
      >>> canonical = trainer.export_state(state)  # doctest: +SKIP
      >>> canonical["opt_state"][0].mu["layer0"]["w"].shape  # doctest: +SKIP
      (4, 5)
    """
    return self._canonical()["export"](state)

  def import_state(self, canonical: dict) -> TrainState:
    """Places a canonical state (:meth:`export_state`) onto this trainer.

    The inverse of :meth:`export_state` on any layout: replicated under
    data parallelism, each device's rows under ZeRO, whatever strategy,
    device count or process count exported it. Error-feedback residuals
    restart at zero. ``import_state(export_state(s))`` steps bit-identically
    to ``s`` on the same layout (for ZeRO, as long as the padding of the rows
    stays zero, which holds for elementwise optax optimizers). Leaves may be
    numpy or jax arrays; dtypes are cast to the model's. Without a prior
    ``init``, the parameters of ``canonical`` define the model.

    Raises:
      ValueError: if ``canonical`` does not have the model's structure and
        shapes (the message names each differing leaf and both shapes).
    """
    if self._built is None:
      self._build(canonical["params"])
    plan = self._canonical()
    problems = state_lib.spec_mismatches(
      state_lib.leaf_specs(canonical), state_lib.leaf_specs(plan["like"]), ignore_dtype=True
    )
    if problems:
      raise ValueError(
        "`canonical` does not match this trainer's model (structure and shapes "
        "of trainer.export_shapes()):\n  " + "\n  ".join(problems) + "\nRestore a "
        "state of the same model and optimizer, or build the trainer for it."
      )
    # Same leaves and shapes: re-read in the model's structure, replicated.
    leaves = [state_lib.place(x, self.mesh, P()) for x in jax.tree.leaves(canonical)]
    canonical = jax.tree.structure(plan["like"]).unflatten(leaves)
    return plan["import"](canonical)

  def _canonical(self) -> dict:
    """The export/import programs of the current model (built once)."""
    self._require_built()
    if self._canonical_cache is not None and self._canonical_cache[0] is self._built:
      return self._canonical_cache[1]
    replicated = NamedSharding(self.mesh, P())
    full = self._treedef.unflatten(self._like)
    full_opt = jax.eval_shape(self.optimizer.init, full)
    opt_leaves, opt_def = jax.tree.flatten(full_opt)
    like = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
      {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": full, "opt_state": full_opt},
    )
    mirrors = self._opt_mirrors(opt_leaves, opt_def) if self.stage else [None] * len(opt_leaves)
    layout = self._layout

    def export(state):
      params = state.params
      opt = jax.tree.leaves(state.opt_state)
      if self.stage == 3:
        params = self._unshard_rows(params)
      if self.stage:
        opt = [x[0] if i is None else layout.unrows(x, i) for x, i in zip(opt, mirrors)]
      # A copy, never the input buffer itself: `state` may be donated next.
      return jax.tree.map(
        jnp.copy, {"step": state.step, "params": params, "opt_state": opt_def.unflatten(opt)}
      )

    n = self.dp_size

    def import_(canonical):
      canonical = jax.tree.map(lambda x, t: x.astype(t.dtype), canonical, like)
      params = jax.tree.leaves(canonical["params"])
      opt = jax.tree.leaves(canonical["opt_state"])
      if self.stage:
        opt = [
          jnp.broadcast_to(x[None], (n,) + x.shape) if i is None else layout.rows(x, i)
          for x, i in zip(opt, mirrors)
        ]
      kept = [layout.rows(x, i) for i, x in enumerate(params)] if self.stage == 3 else params
      return TrainState(
        canonical["step"],
        self._treedef.unflatten(kept),
        opt_def.unflatten(opt),
        self._stacked_zero_residuals(),
      )

    shardings = jax.tree.map(
      lambda spec: NamedSharding(self.mesh, spec),
      self._state_spec,
      is_leaf=lambda x: isinstance(x, P),
    )
    plan = {
      "like": like,
      "export": jax.jit(export, out_shardings=replicated),
      "import": jax.jit(import_, out_shardings=shardings),
    }
    self._canonical_cache = (self._built, plan)
    return plan

  def _opt_mirrors(self, full_leaves, full_def) -> list[int | None]:
    """ZeRO: which parameter each optimizer-state leaf mirrors, checked."""
    mirrors = state_lib.param_mirrors(self.optimizer, self._treedef, self._like)
    layout = self._layout
    rows = self._treedef.unflatten(
      [jax.ShapeDtypeStruct(layout.row_shape(i), x.dtype) for i, x in enumerate(self._like)]
    )
    row_leaves, row_def = jax.tree.flatten(jax.eval_shape(self.optimizer.init, rows))
    if row_def != full_def or len(mirrors) != len(row_leaves):
      raise ValueError(
        "`optimizer`: optimizer.init gives a differently structured state on ZeRO's "
        f"parameter rows ({row_def}) than on the full parameters ({full_def}), "
        "so the sharded state has no canonical form. Rows keep each leaf's rank "
        "but not its shape: make masks and other structure independent of exact "
        "shapes (ndim is fine), or use jaxcoll.DataParallel."
      )
    paths = list(state_lib.leaf_specs(full_def.unflatten(full_leaves)))
    for path, full, row, i in zip(paths, full_leaves, row_leaves, mirrors):
      want_full = full.shape if i is None else self._like[i].shape
      want_row = full.shape if i is None else layout.row_shape(i)
      if full.shape != want_full or row.shape != want_row:
        raise ValueError(
          f"`optimizer`: state leaf {path} has shape {full.shape} for the full "
          f"parameters and {row.shape} for ZeRO's rows; jaxcoll maps only leaves "
          "that mirror a parameter elementwise, or do not depend on its shape. "
          "Use jaxcoll.DataParallel for this optimizer."
        )
    return mirrors

  def _stacked_zero_residuals(self):
    """The error-feedback residuals at zero, as global stacked arrays."""
    s = self.strategy
    if self.stage or not (s.compression and s.error_feedback):
      return ()
    residual = []
    for bucket in self._buckets:
      size = sum(self._like[i].size for i in bucket)
      shapes = compression_lib.residual_shapes(size, self.dp_size, s.compression)
      residual.append({k: jnp.zeros((self.dp_size,) + v, jnp.float32) for k, v in shapes.items()})
    return tuple(residual)

  # -- building the programs ---------------------------------------------------

  def _bound_in_flight(self, metrics) -> None:
    self._in_flight.append(metrics)
    while len(self._in_flight) > self.max_steps_in_flight:
      jax.block_until_ready(self._in_flight.popleft())

  def _require_built(self):
    if self._built is None:
      raise ValueError("Call `trainer.init(params)` before step/eval/params.")

  def _place_batch(self, batch, accum: int):
    self._require_built()
    state_lib.check_batch(batch, self.dp_size, accum)
    state_lib.check_same_on_every_process(batch)  # local rows passed as global: refuse
    return state_lib.place(batch, self.mesh, P(self.axis))

  def _build(self, params) -> None:
    leaves, treedef = jax.tree.flatten(params)
    key = (treedef, tuple((x.shape, x.dtype) for x in leaves))
    if self._built == key:
      return
    _check_float_params(params)
    self._built = key
    self._treedef = treedef
    self._like = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    bucket_bytes = self.strategy.bucket_bytes
    self._layout = ShardLayout.build(leaves, self.dp_size, bucket_bytes)
    # One dtype per bucket: a bucket is one buffer (and one collective).
    dtypes = [x.dtype.name for x in leaves]
    self._buckets = plan_buckets([x.size * 4 for x in leaves], bucket_bytes, dtypes)

    rep, per_device = P(), P(self.axis)
    sharded_opt = self.stage > 0
    self._state_spec = TrainState(
      step=rep,
      params=per_device if self.stage == 3 else rep,
      opt_state=per_device if sharded_opt else rep,
      residual=per_device,
    )

    def smap(body, in_specs, out_specs):
      # check_vma=False: replicated outputs come from jaxcoll collectives,
      # which are typed varying whatever the algorithm; they are identical on
      # every device by construction (check_replicas verifies it).
      return jax.shard_map(
        body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
      )

    self._init = jax.jit(smap(self._init_body, rep, self._state_spec))
    self._step = jax.jit(
      smap(self._step_body, (self._state_spec, per_device), (self._state_spec, rep)),
      donate_argnums=0,
    )
    self._eval = jax.jit(smap(self._eval_body, (self._state_spec, per_device), rep))
    self._fingerprint = jax.jit(
        smap(lambda st: guards.fingerprint(self._replicated_part(st))[None],
             (self._state_spec,), per_device)
    )
    like_state = TrainState(0, params, jax.eval_shape(self.optimizer.init, params), ())
    self._fingerprint_names = [
        state_lib.leaf_name(path)
        for path, _ in jax.tree_util.tree_flatten_with_path(self._replicated_part(like_state))[0]
    ]
    replicated = NamedSharding(self.mesh, P())
    self._unshard = jax.jit(self._unshard_rows, out_shardings=replicated)
    # copy_p is never elided (unlike an identity, whose output jit forwards).
    self._copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), out_shardings=replicated)

  # -- init ----------------------------------------------------------------------

  def _init_body(self, params) -> TrainState:
    params = collectives.broadcast(params, self.axis, root=0)
    step = jnp.zeros((), jnp.int32)
    if self.stage == 0:
      residual = self._zero_residuals()
      return TrainState(step, params, self.optimizer.init(params), residual)
    shards = self._own_rows(params)
    opt_state = stack(self.optimizer.init(shards))
    kept = stack(shards) if self.stage == 3 else params
    return TrainState(step, kept, opt_state, ())

  def _zero_residuals(self):
    s = self.strategy
    if not (s.compression and s.error_feedback):
      return ()
    residual = []
    for bucket in self._buckets:
      size = sum(self._like[i].size for i in bucket)
      shapes = compression_lib.residual_shapes(size, self.dp_size, s.compression)
      residual.append({k: jnp.zeros((1,) + v, jnp.float32) for k, v in shapes.items()})
    return tuple(residual)

  def _own_rows(self, params):
    rank = jax.lax.axis_index(self.axis)
    rows = self._layout.own_shards(jax.tree.leaves(params), rank)
    return self._treedef.unflatten(rows)

  def _unshard_rows(self, stacked_rows):
    leaves = jax.tree.leaves(stacked_rows)
    return self._treedef.unflatten([self._layout.unrows(x, i) for i, x in enumerate(leaves)])

  # -- one step --------------------------------------------------------------------

  def _step_body(self, state: TrainState, batch):
    self.trace_count += 1
    if self.stage == 3:
      shards = unstack(state.params)
      loss, aux, grads = self._accumulate(self._zero3_grad_fn(), shards, batch)
      # Already averaged over the data axis by the gather's VJP.
      residual = state.residual
    else:
      loss, aux, local = self._accumulate(self._local_grad_fn(), state.params, batch)
      grads, residual = self._average_grads(local, state.residual)

    grad_norm = self._global_norm(grads)
    finite = None if self.nan_policy == "none" else guards.all_finite(grads, self.axis)
    if self.clip_global_norm is not None:
      grads = _clip(grads, grad_norm, self.clip_global_norm)

    if self.stage == 0:
      updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
    else:
      params, opt_state = self._update_rows(state, grads)

    metrics = {"loss": self._mean(loss), "grad_norm": grad_norm}
    if self.has_aux:
      metrics["aux"] = self._reduce_aux(aux)
      if self.merge_aux is not None:
        params = self._merge_aux(params, metrics["aux"])
    new_state = TrainState(state.step + 1, params, opt_state, residual)
    if finite is not None:  # identical on every device: replicas stay identical
      new_state = guards.keep_if(finite, new_state, state)
      metrics["skipped"] = 1 - finite
    return new_state, metrics

  def _merge_aux(self, params, aux):
    """Applies ``merge_aux``; under ZeRO-3 replaced leaves are cut to rows."""
    if self.stage < 3:
      return self.merge_aux(params, aux)
    rows = unstack(params)
    old = jax.tree.leaves(rows)
    new = jax.tree.leaves(self.merge_aux(rows, aux))
    rank = jax.lax.axis_index(self.axis)
    out = [
        o if n is o else self._layout.own_shard(n, i, rank)
        for i, (o, n) in enumerate(zip(old, new))
    ]
    return stack(self._treedef.unflatten(out))

  def _cast(self, tree):
    if self.compute_dtype is None:
      return tree
    dtype = self.compute_dtype
    return jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )

  def _loss_and_aux(self, params, batch):
    out = self.loss_fn(params, batch)
    loss, aux = out if self.has_aux else (out, ())
    # Bool aux leaves are counts: int32, summed over microbatches and devices.
    aux = jax.tree.map(
      lambda a: jnp.asarray(a, jnp.int32) if jnp.result_type(a) == jnp.bool_ else a, aux
    )
    return jnp.asarray(loss, jnp.float32), aux

  def _local_grad_fn(self):
    """``(params, microbatch) -> ((loss, aux), grads)`` on this device's data."""
    return jax.value_and_grad(lambda p, b: self._loss_and_aux(self._cast(p), b), has_aux=True)

  def _zero3_grad_fn(self):
    """Like :meth:`_local_grad_fn`, differentiated w.r.t. this device's rows.

    The gathered parameters are not saved for backward (checkpoint policy):
    they are gathered again, so full parameters are never held across the
    forward/backward boundary.
    """
    gather = make_gather(self._layout, self.axis, self.strategy.algorithm, self.compute_dtype)

    def loss_of_rows(rows, batch):
      full = self._treedef.unflatten(gather(jax.tree.leaves(rows)))
      return self._loss_and_aux(full, batch)

    return jax.value_and_grad(jax.checkpoint(loss_of_rows, policy=zero3_remat_policy), has_aux=True)

  def _accumulate(self, grad_fn, params, batch):
    """Mean loss, aux and gradient over ``grad_accum_steps`` microbatches."""
    k = self.grad_accum_steps
    if k == 1:
      (loss, aux), grads = grad_fn(params, batch)
      return loss, aux, grads
    micro = jax.tree.map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)

    def one(total, microbatch):
      (loss, aux), grads = grad_fn(params, microbatch)
      return jax.tree.map(jnp.add, total, grads), (loss, aux)

    zeros = jax.tree.map(jnp.zeros_like, params)
    total, (losses, auxes) = jax.lax.scan(one, zeros, micro)
    grads = jax.tree.map(lambda g: g / k, total)
    aux = jax.tree.map(lambda a: a.mean(0) if _is_float(a) else a.sum(0), auxes)
    return losses.mean(), aux, grads

  def _average_grads(self, local, residual):
    """Mean over the data axis: full grads (DP) or this device's rows (ZeRO)."""
    leaves = jax.tree.leaves(local)
    s = self.strategy
    if self.stage == 2:
      return self._treedef.unflatten(
        self._layout.reduce_scatter(leaves, self.axis, s.algorithm)
      ), residual
    if self.stage == 1:
      full = self._treedef.unflatten(self._all_reduce_buckets(leaves))
      return self._own_rows(full), residual
    if not s.compression:
      return self._treedef.unflatten(self._all_reduce_buckets(leaves)), residual

    return self._compressed_average(leaves, residual)

  def _compressed_average(self, leaves, residual):
    """Bucketed bf16 / int8 mean with error feedback (see compression.py)."""
    s = self.strategy
    out, new_residual = [None] * len(leaves), []
    residual = unstack(residual) if residual else [{}] * len(self._buckets)
    for bucket, old in zip(self._buckets, residual):
      flat = flatten_bucket(leaves, bucket, jnp.float32)
      mean, new = compression_lib.compressed_mean(
        flat,
        old,
        self.axis,
        compression=s.compression,
        algorithm=s.algorithm,
        error_feedback=s.error_feedback,
      )
      for i, g in unflatten_bucket(mean, bucket, leaves).items():
        out[i] = g
      new_residual.append(new)
    new_residual = stack(tuple(new_residual)) if s.error_feedback else ()
    return self._treedef.unflatten(_fill_empty(out, leaves)), new_residual

  def _all_reduce_buckets(self, leaves):
    out = [None] * len(leaves)
    for bucket in self._buckets:
      flat = flatten_bucket(leaves, bucket)
      mean = collectives.all_reduce(flat, self.axis, op="mean", algorithm=self.strategy.algorithm)
      for i, g in unflatten_bucket(mean, bucket, leaves).items():
        out[i] = g
    return _fill_empty(out, leaves)

  def _global_norm(self, grads):
    squares = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads))
    if self.stage > 0:  # rows are disjoint (padding is zero): sum over devices
      squares = collectives.all_reduce(squares, self.axis, op="sum", algorithm="native")
    return jnp.sqrt(squares)

  def _update_rows(self, state: TrainState, grad_rows):
    rows = unstack(state.params) if self.stage == 3 else self._own_rows(state.params)
    updates, opt_state = self.optimizer.update(grad_rows, unstack(state.opt_state), rows)
    rows = optax.apply_updates(rows, updates)
    if self.stage == 3:
      return stack(rows), stack(opt_state)
    leaves = self._layout.all_gather(jax.tree.leaves(rows), self.axis, self.strategy.algorithm)
    return self._treedef.unflatten(leaves), stack(opt_state)

  def _mean(self, x):
    return collectives.all_reduce(x, self.axis, op="mean", algorithm="native")

  def _reduce_aux(self, aux):
    def one(a):
      a = jnp.asarray(a)
      op = "mean" if _is_float(a) else "sum"
      return collectives.all_reduce(a, self.axis, op=op, algorithm="native")

    return jax.tree.map(one, aux)

  # -- eval ----------------------------------------------------------------------

  def _eval_body(self, state: TrainState, batch):
    params = state.params
    if self.stage == 3:
      rows = jax.tree.leaves(unstack(params))
      if self.compute_dtype is not None:
        rows = [r.astype(self.compute_dtype) for r in rows]
      params = self._treedef.unflatten(
        self._layout.all_gather(rows, self.axis, self.strategy.algorithm)
      )
    loss, aux = self._loss_and_aux(self._cast(params), batch)
    metrics = {"loss": self._mean(loss)}
    if self.has_aux:
      metrics["aux"] = self._reduce_aux(aux)
    return metrics


def _check_float_params(params) -> None:
  """Raises unless every parameter leaf is floating point (``jax.grad`` needs it)."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    dtype = jnp.result_type(leaf)
    if not jnp.issubdtype(dtype, jnp.inexact):
      raise ValueError(
        f"`params` leaf {state_lib.leaf_name(path)} has dtype {dtype}; every parameter "
        "must be floating point, since jax.grad cannot differentiate integer or bool "
        "leaves. Move it out of the trained parameters (e.g. into the batch or a "
        "closure of `loss_fn`), or cast it to a float dtype."
      )


def _is_float(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _fill_empty(out, leaves):
  """Zero-size leaves are in no bucket: give them their (empty) gradient."""
  return [o if o is not None else jnp.zeros_like(x) for o, x in zip(out, leaves)]


def _clip(grads, norm, max_norm):
  """Exactly ``optax.clip_by_global_norm(max_norm)`` given the global ``norm``."""
  trigger = norm < max_norm
  return jax.tree.map(
    lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm), grads
  )
