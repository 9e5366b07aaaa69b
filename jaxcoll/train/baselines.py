"""Idiomatic JAX baselines of the trainers, and a step timer.

What a JAX user writes without jaxcoll: ``jax.jit`` with ``NamedSharding``
and XLA's GSPMD partitioner inserting the collectives.

* ``GspmdTrainer(..., fsdp=False)``: data parallelism: parameters and
  optimizer state replicated, batch sharded over the data axis.
* ``GspmdTrainer(..., fsdp=True)``: GSPMD's FSDP, set up as the JAX
  "distributed arrays" guide and MaxText's FSDP (``ici_fsdp_parallelism``)
  set it up: every parameter sharded over the data axis along its largest
  dimension that divides; the optimizer state (Adam's ``mu`` / ``nu``)
  sharded exactly like the parameter it belongs to (each state leaf that
  mirrors a parameter, found as the ZeRO trainers find it; any other state
  leaf replicated); gradients constrained to the parameters'
  shardings; one ``jax.jit`` with ``in_shardings`` / ``out_shardings`` and
  the state donated. Leaves of a scanned stack (under a ``"layers"`` key,
  leading layer axis) are never cut along the layer axis, as MaxText's
  ``layers`` logical axis is unsharded: each scan iteration then gathers one
  layer, not the stack. A leaf none of whose dimensions divides by the device
  count (a width of 64 on 6 devices) is padded with zeros along its largest
  dimension to a multiple of it and sharded there, as PyTorch FSDP and
  DeepSpeed ZeRO pad their flat parameters; the step slices the padding off
  before ``loss_fn``, each slice kept sharded as its padded leaf (an uneven
  sharding, so a padded leaf moves the bytes an evenly divided one does; left
  to GSPMD the slice was replicated: the whole leaf gathered, its whole
  gradient all-reduced), so the padding's gradient is zero, and with an
  elementwise optimizer (SGD, momentum, Adam, AdamW) its moments and update
  stay zero: training is the unpadded model's. An optimizer that reads a
  whole leaf's shape or mean (Adafactor's parameter scale, Muon's shape
  factor) sees the padded leaf. Without padding (``pad=False``, MaxText's
  rule) such leaves stay replicated; :meth:`GspmdTrainer.layout` says which
  leaves are padded or replicated, and the benchmarks print its summary.
  The state holds the padded parameters; :meth:`GspmdTrainer.params` slices
  them back.

They share :class:`jaxcoll.train.Trainer`'s ``init`` / ``step`` /
``compile_step`` interface, so :func:`time_steps` and
:func:`jaxcoll.memory.compare`'s helpers take either.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll.train import extra_args
from jaxcoll.train import state as state_lib
from jaxcoll.train.axes_bound import bound_if_needed
from jaxcoll.train.canonical import state_mirrors
from jaxcoll.train.strategies import axis_spec, check_axis

LAYER_KEY = "layers"  # jaxcoll.models' scanned stacks: leading axis = layer


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a GSPMD baseline holds each parameter (:meth:`GspmdTrainer.layout`).

  Attributes:
    trainer: the baseline's name (``"GSPMD FSDP"``, ``"GSPMD DP"``).
    devices: the devices of its data axis.
    padded: ``path -> (shape, padded shape)`` of leaves padded to shard.
    replicated: paths of leaves held whole on every device (every leaf under
      GSPMD DP; under FSDP scalars, a stacked leaf with no dimension but the
      layer axis, and any leaf that does not divide when ``pad=False``).
    padded_elements: the zeros added, over all leaves.
    num_elements: the parameters' elements (unpadded).
    replicated_elements: the elements of the replicated leaves.
  """

  trainer: str
  devices: int
  padded: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
  replicated: tuple[str, ...]
  padded_elements: int
  num_elements: int
  replicated_elements: int

  def summary(self) -> str:
    """One line: how many leaves are padded, how many stay replicated (and which)."""
    total = max(self.num_elements, 1)
    leaves = lambda k: f"{k} {'leaf' if k == 1 else 'leaves'}"  # noqa: E731
    pad = (f"{leaves(len(self.padded))} padded to shard (+{self.padded_elements:,} zeros, "
           f"{100 * self.padded_elements / total:.1f}% of the parameters)")
    rep = (f"{leaves(len(self.replicated))} replicated ({self.replicated_elements:,} elements, "
           f"{100 * self.replicated_elements / total:.1f}%)")
    if self.replicated:
      rep += ": " + ", ".join(self.replicated[:4]) + (", ..." if len(self.replicated) > 4 else "")
    return f"{self.trainer} on {self.devices} devices: {pad}; {rep}."


def _path_name(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _is_stacked(path, layer_key: str | None) -> bool:
  if layer_key is None:
    return False
  return any(getattr(k, "key", getattr(k, "name", None)) == layer_key for k in path)


class GspmdTrainer:
  """``jax.jit`` + ``NamedSharding`` training step (the baseline).

  Args:
    loss_fn: as for :class:`jaxcoll.train.Trainer`.
    optimizer: an optax optimizer.
    mesh: the device mesh (Explicit axes are used as Auto: GSPMD places the step).
    axis: the data axis (or tuple of axes).
    fsdp: shard parameters, gradients and optimizer state over ``axis``
      (GSPMD FSDP).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    layer_key: leaves with this dict key in their path are scanned stacks
      whose leading axis is the layer: FSDP shards one of their other
      dimensions. None: every dimension may be sharded.
    pad: FSDP pads a leaf none of whose dimensions divides by the device
      count along its largest one, and shards it there (see the module doc);
      False keeps such a leaf replicated (MaxText's rule).

  Example:
    >>> trainer = GspmdTrainer(loss_fn, optax.adam(1e-3), mesh, fsdp=True)  # doctest: +SKIP
    >>> state = trainer.init(params)  # doctest: +SKIP
    >>> state, metrics = trainer.step(state, batch)  # doctest: +SKIP
  """

  def __init__(
    self,
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    axis="data",
    *,
    fsdp: bool = False,
    has_aux: bool = False,
    layer_key: str | None = LAYER_KEY,
    pad: bool = True,
  ):
    if any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
      # The baseline is GSPMD's propagation: on an Explicit-axis mesh (jax.make_mesh's
      # default) a user loss without sharding annotations fails to type
      # (f32[16@data,24] + f32[1,24@data]). The same devices with Auto axes.
      mesh = Mesh(mesh.devices, mesh.axis_names,
                  axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
    self.loss_fn, self.optimizer, self.mesh = loss_fn, optimizer, mesh
    self.dp_size = check_axis(axis, mesh)
    self.axis = axis_spec(axis)
    self.fsdp, self.has_aux, self.layer_key, self.pad = fsdp, has_aux, layer_key, pad
    self.name = "GSPMD FSDP" if fsdp else "GSPMD DP"
    self._built = None
    self._built_padded = None

  def _leaf_layout(self, shape: Sequence[int], stacked: bool) -> tuple[P, tuple[int, ...]]:
    """``(spec, padded shape)`` of a parameter of ``shape``."""
    shape = tuple(int(d) for d in shape)
    if not self.fsdp:
      return P(), shape
    dims = sorted(range(1 if stacked else 0, len(shape)), key=lambda d: -shape[d])
    cut = next((d for d in dims if shape[d] % self.dp_size == 0), None)
    padded = shape
    if cut is None and self.pad and dims and shape[dims[0]] > 1:
      cut = dims[0]
      padded = tuple(-(-s // self.dp_size) * self.dp_size if d == cut else s
                     for d, s in enumerate(shape))
    if cut is None:
      return P(), shape  # scalars, a stack's per-layer scalars; odd sizes when pad=False
    spec = [None] * len(shape)
    spec[cut] = self.axis
    return P(*spec), padded

  def param_spec(self, shape: Sequence[int], stacked: bool = False) -> P:
    """The ``PartitionSpec`` of a parameter of ``shape`` (a stacked leaf keeps axis 0
    whole), on its padded shape where it is padded (:meth:`padded_shape`)."""
    return self._leaf_layout(shape, stacked)[0]

  def padded_shape(self, shape: Sequence[int], stacked: bool = False) -> tuple[int, ...]:
    """The shape the state holds a parameter of ``shape`` at (``shape`` unless padded)."""
    return self._leaf_layout(shape, stacked)[1]

  def _padded_shapes(self, params):
    return jax.tree_util.tree_map_with_path(
      lambda path, x: self.padded_shape(np.shape(x), _is_stacked(path, self.layer_key)), params)

  def layout(self, params) -> Layout:
    """Which leaves of ``params`` (the model's arrays or shape structs) are
    padded or replicated; ``layout(params).summary()`` is one line of it."""
    padded, replicated, pad_elems, rep_elems, total = {}, [], 0, 0, 0
    for path, x in jax.tree_util.tree_leaves_with_path(params):
      shape = tuple(np.shape(x))
      spec, full = self._leaf_layout(shape, _is_stacked(path, self.layer_key))
      total += math.prod(shape)
      if full != shape:
        padded[_path_name(path)] = (shape, full)
        pad_elems += math.prod(full) - math.prod(shape)
      if spec == P():
        replicated.append(_path_name(path))
        rep_elems += math.prod(shape)
    name = self.name + (" (pad=False)" if self.fsdp and not self.pad else "")
    return Layout(name, self.dp_size, padded, tuple(replicated), pad_elems, total, rep_elems)

  def pad_params(self, params):
    """``params`` at the shapes the state holds them (zeros appended where padded); jittable."""
    import jax.numpy as jnp  # noqa: PLC0415

    def pad(x, full):
      if tuple(np.shape(x)) == full:
        return x
      widths = [(0, f - s) for s, f in zip(np.shape(x), full)]
      return np.pad(x, widths) if isinstance(x, np.ndarray) else jnp.pad(x, widths)

    return jax.tree.map(pad, params, self._padded_shapes(params))

  def _unpad(self, params, true_shapes=None, shardings=None):
    """The state's parameters sliced back to the model's shapes (inside the step:
    ``shardings``, the padded leaves' own, keep each slice sharded as its leaf)."""

    def cut(x, shape, sharding=None):
      if x.shape == shape:
        return x
      if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(shape, x.dtype)
      out = x[tuple(slice(0, s) for s in shape)]
      # The slice keeps its leaf's shards (the last one shorter: an uneven sharding,
      # each device slicing its own); left to GSPMD it is replicated, and the step
      # all-gathers the whole leaf and all-reduces its whole gradient.
      return out if sharding is None else jax.lax.with_sharding_constraint(out, sharding)

    shapes = self._true_shapes if true_shapes is None else true_shapes
    if shardings is None:
      return jax.tree.map(cut, params, shapes)
    return jax.tree.map(cut, params, shapes, shardings)

  def shardings(self, params) -> tuple[Any, Any]:
    """``(param_shardings, opt_state_shardings)`` for ``params`` (arrays or shape structs).

    Optimizer-state leaves that mirror a parameter (``mu``, ``nu``, ...) get
    that parameter's sharding; the rest (Adam's ``count``) are replicated.
    Both are of the state's (padded) shapes: place ``pad_params(params)``.
    """
    param_shardings = jax.tree_util.tree_map_with_path(
      lambda path, x: NamedSharding(
        self.mesh, self.param_spec(np.shape(x), _is_stacked(path, self.layer_key))
      ),
      params,
    )
    replicated = NamedSharding(self.mesh, P())
    padded, treedef = jax.tree.flatten(self._padded_structs(params))
    # Which state leaf mirrors which parameter, traced as the ZeRO trainers trace it
    # (optax.tree_map_params failed on optax.masked / multi_transform's MaskedNode
    # and gave adafactor's (1,) placeholders their parameter's sharding).
    mirrors, _, opt_def = state_mirrors(self.optimizer, treedef, padded)
    by_leaf = treedef.flatten_up_to(param_shardings)
    opt_shardings = opt_def.unflatten(
      [replicated if i is None else by_leaf[i] for i in mirrors])
    return param_shardings, opt_shardings

  def _padded_structs(self, params):
    return jax.tree.map(lambda x, full: jax.ShapeDtypeStruct(full, x.dtype), params,
                        self._padded_shapes(params))

  @staticmethod
  def _key(params):
    leaves, treedef = jax.tree.flatten(params)
    return (treedef, tuple((tuple(np.shape(x)), np.dtype(x.dtype)) for x in leaves))

  def _build(self, params) -> None:
    """Builds the step for ``params`` of the model's shapes (``init``,
    ``abstract_state``). The model's shapes decide the padding; the state's
    padded shapes alone cannot (a (16, 8) leaf padded to (18, 8) on 6 devices
    looks like an (18, 8) one), so a state is checked against the model built
    (:meth:`_build_for_state`)."""
    key = self._key(params)
    if key == self._built:
      return
    self._built = key
    self._built_padded = self._key(self._padded_structs(params))
    self._true_shapes = true_shapes = jax.tree.map(lambda x: tuple(np.shape(x)), params)
    self._shardings = shardings, opt_shardings = self.shardings(params)
    self._batch_sharding = NamedSharding(self.mesh, P(self.axis))

    needs_value = extra_args.needs_value(self.optimizer, self._padded_structs(params))

    def step(params, opt_state, batch):
      # Under GSPMD the global batch is the one shard, so a mean over "data" inside
      # the loss (nn.BatchNorm(axis_name="data")) is over the whole batch, as on one
      # device: the mesh's axes are bound at size 1 around a loss that needs them
      # (decided once per step compile by an abstract trace). A loss that runs its
      # own shard_map over the mesh is left as it is (a vmap named after the mesh's
      # axes would break it).
      loss_fn = bound_if_needed(self.loss_fn, self.mesh.axis_names,
                                jax.tree.map(lambda x, shape: jax.ShapeDtypeStruct(
                                  shape, x.dtype), params, true_shapes), batch)

      def loss(p):
        out = loss_fn(self._unpad(p, true_shapes, shardings), batch)
        return out if self.has_aux else (out, ())

      (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(params)
      grads = jax.lax.with_sharding_constraint(grads, shardings)
      # reduce_on_plateau, polyak_sgd: update(..., value=loss), the global batch's loss
      extra = {"value": value} if needs_value else {}
      updates, opt_state = self.optimizer.update(grads, opt_state, params, **extra)
      metrics = {"loss": value, "grad_norm": optax.tree.norm(grads)}
      if self.has_aux:
        metrics["aux"] = aux
      return optax.apply_updates(params, updates), opt_state, metrics

    self._step = jax.jit(
      step,
      in_shardings=(shardings, opt_shardings, self._batch_sharding),
      out_shardings=(shardings, opt_shardings, NamedSharding(self.mesh, P())),
      donate_argnums=(0, 1),
    )
    self._opt_init = jax.jit(self.optimizer.init, out_shardings=opt_shardings)

  def init(self, params):
    """``(params, opt_state)`` placed with their shardings."""
    self._build(params)
    # Via host copies: device_put could alias the caller's buffers, which
    # the donating step would then delete.
    params = jax.device_put(self.pad_params(jax.tree.map(np.asarray, params)),
                            self._shardings[0])
    return params, self._opt_init(params)

  def abstract_state(self, param_shapes):
    """The state ``init`` would return, as ``jax.ShapeDtypeStruct``s with
    shardings (nothing allocated): for :meth:`lower_step` of large models."""
    self._build(param_shapes)
    shardings, opt_shardings = self._shardings
    like = lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s)  # noqa: E731
    padded = self._padded_structs(param_shapes)
    opt = jax.eval_shape(self.optimizer.init, padded)
    return jax.tree.map(like, padded, shardings), jax.tree.map(like, opt, opt_shardings)

  def step(self, state, batch):
    params, opt_state = state
    state_lib.check_not_donated(next(iter(jax.tree.leaves(params)), None))  # not a segfault
    state_lib.check_batch(batch, self.dp_size, 1)  # one line, not jax's IndivisibleError
    batch = state_lib.place(batch, self.mesh, P(self.axis))
    params, opt_state, metrics = self._step(params, opt_state, batch)
    return (params, opt_state), metrics

  def _build_for_state(self, params) -> None:
    """Keeps the built step for a state of the built model (its padded
    parameters); a state of other shapes is taken as a model's, as before
    padding, when none of its leaves would be padded (a padded state never
    would: its cut dimension divides); else one line says what to do."""
    if self._built is not None and self._key(params) == self._built_padded:
      return
    self._check_unpadded_state(params)
    self._build(params)

  def _check_unpadded_state(self, params) -> None:
    """Raises unless ``params`` (a state's) is one that holds no padding."""
    key = self._key(params)
    if self._built is not None and key == self._built:
      raise ValueError(
        f"`state` holds {self.name}'s parameters at the model's shapes, not the padded ones "
        "it trains (" + self.layout(params).summary().rstrip(".") + "); pass the state "
        "`init(params)` or `abstract_state(param_shapes)` returns, or place "
        "`pad_params(params)` with `shardings(params)`.")
    if self._key(self._padded_structs(params)) != key:
      raise ValueError(
        f"`state`'s parameters are not those of the model this {self.name} was built for "
        "and would need padding (" + self.layout(params).summary().rstrip(".") + "); call "
        "`init(params)` or `abstract_state(param_shapes)` with the model's parameters first.")

  def lower_step(self, state, batch) -> jax.stages.Lowered:
    """The lowered step; ``state`` may be :meth:`abstract_state`, ``batch`` shape structs."""
    params, opt_state = state
    self._build_for_state(params)
    state_lib.check_batch(batch, self.dp_size, 1)
    if not all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(batch)):
      batch = state_lib.place(batch, self.mesh, P(self.axis))
    return self._step.lower(params, opt_state, batch)

  def compile_step(self, state, batch) -> jax.stages.Compiled:
    """The compiled step (for ``memory_analysis()``)."""
    return self.lower_step(state, batch).compile()

  def params(self, state):
    """The parameters at the model's shapes (global jax arrays, padding sliced off)."""
    params = state[0]
    if self._built is not None and self._key(params) == self._built_padded:
      return self._unpad(params)
    self._check_unpadded_state(params)
    return params


def time_steps(
  trainer, state, batches: Sequence, *, warmup: int, steps: int
) -> tuple[Any, list[float]]:
  """Seconds per step, waiting for each step to finish before the next.

  Waiting every step bounds the executions in flight (the XLA CPU backend
  aborts with many queued collective programs, see BUILD.md) and makes each
  sample one step's latency. Batches are reused round-robin.

  Returns:
    ``(state, times)``: the final state and ``steps`` durations (warm-up not
    included).
  """
  times = []
  for i in range(warmup + steps):
    start = time.perf_counter()
    state, metrics = trainer.step(state, batches[i % len(batches)])
    jax.block_until_ready(metrics)
    if i >= warmup:
      times.append(time.perf_counter() - start)
  return state, times


def median_ms(times: Sequence[float]) -> float:
  return 1e3 * statistics.median(times)


def data_sharded(batches, mesh: Mesh, axis) -> list:
  """Batches placed on ``mesh``, sharded over ``axis`` (outside the timing)."""
  spec = P(axis_spec(axis))
  return [state_lib.place(b, mesh, spec) for b in batches]

