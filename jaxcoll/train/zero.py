"""ZeRO stages 1-3, flat or hybrid, as a :class:`~jaxcoll.train.plan.Plan`.

Every device of the sharding group (``axis``, ``N`` devices) owns one row of
every parameter leaf (:class:`~jaxcoll.train.buckets.ShardLayout`) and the
optimizer state of its rows. With ``replica_axis`` (hybrid sharding, FSDP's
HYBRID_SHARD), that group is repeated over ``replica_axis``: gradients are
reduce-scattered inside the group, then all-reduced across replicas on the
shard; parameters are gathered only inside the group.

* stage 1: gradients all-reduced in full, each device updates its rows, the
  parameters are all-gathered back;
* stage 2: gradients reduce-scattered instead;
* stage 3: the parameters themselves are rows. Leaves outside any FSDP unit
  are gathered before ``loss_fn`` (and again in backward); leaves of a unit
  (:mod:`jaxcoll.train.fsdp`) are gathered by the unit where it runs. The
  gradients leave the gathers' VJPs reduce-scattered.

Init, export and import never hold more than one leaf in full at a time
beyond each device's rows: init cuts the parameters into rows chunk by
chunk, and the canonical form is laid out sharded over ``axis``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll import collectives
from jaxcoll.collectives import Hierarchical
from jaxcoll.train import fsdp
from jaxcoll.train import grads as grads_lib
from jaxcoll.train.buckets import ShardLayout, make_gather, plan_buckets, zero3_remat_policy
from jaxcoll.train.canonical import check_mirrors, param_mirrors, state_mirrors
from jaxcoll.train import kinds, mixing
from jaxcoll.train.dp import all_reduce_buckets
from jaxcoll.train.plan import Plan, ReplicatedParams, TrainSetup, _has_explicit_axes
from jaxcoll.train.state import (TrainState, concat_shape, from_block, place,
                                 same_on_every_process, to_block)


class ZeROPlan(Plan):
  """:class:`jaxcoll.ZeRO` bound to a model: what every stage shares.

  ``ZeROPlan(strategy, ...)`` builds the plan of ``strategy.stage`` (the one
  place a stage is looked at): :class:`ZeRO1Plan`, :class:`ZeRO2Plan` or
  :class:`ZeRO3Plan`. Stages 1 and 2 keep the parameters in full
  (:class:`ReplicatedParamsPlan`); stage 3 owns them as rows. Each device
  owns the optimizer state of its rows in every stage.
  """

  def __new__(cls, strategy, *args, **kwargs):
    del args, kwargs
    if cls is ZeROPlan:  # the factory: one class per stage
      cls = _BY_STAGE[strategy.stage]
    return super().__new__(cls)

  def __init__(self, strategy, model: TrainSetup, axis, n: int, *, replica, replicas: int):
    self.strategy, self.model = strategy, model
    self.axis, self.n, self.replica = axis, n, replica
    self.data_axes = axis if replica is None else _join(replica, axis)
    self.dp_size = n * replicas
    self.group_algorithm = self.replica_algorithm = strategy.algorithm
    spec = Hierarchical() if strategy.algorithm == "hierarchical" else strategy.algorithm
    if replica is not None and isinstance(spec, Hierarchical) and not isinstance(axis, tuple):
      # Hybrid over one group axis is itself the hierarchy: the inner
      # algorithm inside the group, the outer one across the replicas.
      self.group_algorithm, self.replica_algorithm = spec.inner, spec.outer
    like = model.like
    self.layout = ShardLayout.build(like, n, strategy.bucket_bytes, units=self._units())
    dtypes = [x.dtype.name for x in like]
    self.full_buckets = plan_buckets([x.size * 4 for x in like], strategy.bucket_bytes, dtypes)
    self.row_buckets = plan_buckets(
      [self.layout.width(i) * 4 for i in range(len(like))], strategy.bucket_bytes, dtypes
    )
    rep, rows = P(), P(axis)
    self.state_spec = TrainState(step=rep, params=self._params_spec(), opt_state=rows,
                                 residual=rows)
    # Per-device shapes of the rows and their optimizer state (the state keeps
    # them concatenated over the group: state.concat_shape).
    self._rows_like = self.row_like()
    # An update that reduces across elements (clip_by_global_norm in the chain, LAMB,
    # adafactor, apply_if_finite), draws random numbers (add_noise) or decides on exact
    # shapes (a mask on x.size) is run on the full-shaped leaves instead, outside
    # shard_map, where GSPMD adds the all-reduces its reductions need (exact_apply).
    self._explicit = _has_explicit_axes(model.mesh)
    self.mixing_op = mixing.first_mixing_op(model.optimizer, self._rows_like,
                                            model.unflatten(model.like))
    self.updates_globally = self.mixing_op is not None
    if self.updates_globally:
      self._mirrors, self._opt_like = self._global_state_layout()
      self._opt_init = jax.jit(self._global_opt_init)
    else:
      self._opt_like = jax.eval_shape(model.optimizer.init, self._rows_like)
      self._opt_init = jax.jit(self.smap(
        lambda r: to_block(model.optimizer.init(self._rows(r))), rows, rows))

  # -- what a stage decides --------------------------------------------------------

  def _units(self) -> dict:
    """The FSDP units of the model (:func:`jaxcoll.train.fsdp.find_units`); none here."""
    return {}

  def _params_spec(self) -> P:
    """How ``TrainState.params`` is laid out on the mesh."""
    raise NotImplementedError

  def _export_params(self, params: list) -> list:
    """The kept parameter leaves -> full leaves (outside shard_map)."""
    raise NotImplementedError

  def _import_params(self, params: list) -> list:
    """Full parameter leaves -> the kept ones (the inverse of :meth:`_export_params`)."""
    raise NotImplementedError

  # -- state ---------------------------------------------------------------------

  def _own_rows(self, params):
    rank = jax.lax.axis_index(self.axis)
    return self.model.unflatten(self.layout.own_shards(jax.tree.leaves(params), rank))

  # -- one step ----------------------------------------------------------------------

  def _local_grads(self, state, batch, loss, accumulate):
    """``(loss, aux, gradient leaves)`` of the full parameters on this device's batch."""
    grad_fn = jax.value_and_grad(lambda p, b: loss(self.model.cast(p), b), has_aux=True)
    value, aux, local = accumulate(grad_fn, state.params, batch)
    return value, aux, jax.tree.leaves(local)

  def _across_replicas(self, rows):
    """Hybrid: the group's mean gradient rows averaged over the replicas."""
    if self.replica is None:
      return rows
    leaves = all_reduce_buckets(
      jax.tree.leaves(rows), self.row_buckets, self.replica, self.replica_algorithm
    )
    return self.model.unflatten(leaves)

  def grad_norm(self, grads):
    squares = sum(_sum_of_squares(g) for g in jax.tree.leaves(grads))
    # Rows are disjoint inside the group (padding is zero): sum over it.
    return jnp.sqrt(collectives.all_reduce(squares, self.axis, op="sum", algorithm="native"))

  def _update(self, state, grads, rows):
    """``(rows, opt_state)`` after the optimizer's update of this device's ``rows``."""
    opt_state = from_block(state.opt_state, self._opt_like)
    updates, opt_state = self.model.optimizer.update(grads, opt_state, rows)
    return optax.apply_updates(rows, updates), opt_state

  def _rows(self, blocks):
    """Inside shard_map: this device's parameter rows from its blocks of the state."""
    return from_block(blocks, self._rows_like)

  # -- the exact update of an optimizer that mixes elements (outside shard_map) ------

  def _global_state_layout(self):
    """``(mirrors, per-device shapes)`` of the state of ``optimizer.init(full params)``
    as kept when the update runs globally: a leaf that mirrors parameter ``i`` (same
    shape) is kept as its rows, any other (``count``, adafactor's factored moments) as
    one copy per device, concatenated."""
    model = self.model
    mirrors, leaves, tree = state_mirrors(model.optimizer, model.treedef, list(model.like))
    like = [jax.ShapeDtypeStruct(x.shape if i is None else self.layout.row_shape(i), x.dtype)
            for x, i in zip(leaves, mirrors)]
    return mirrors, tree.unflatten(like)

  def _full_of_rows(self, rows, i: int):
    """Global view: concatenated rows of leaf ``i`` -> the leaf, sharded over ``axis``.

    Aligned rows are the canonical blocks (a local reshape). Others are cut globally
    and laid out on their largest dimension, unevenly where it does not divide (XLA
    pads): laid out as the canonical form (replicated: no dimension divides) every
    device would update the whole leaf (measured: 2.2x adam's peak on 6 devices).
    """
    if self._aligned(i) or self._explicit:  # explicit axes refuse the global reshape
      return self._unrows(rows, i)
    full = self.layout.unrows(rows.reshape(self.n, -1), i)
    return jax.lax.with_sharding_constraint(full, self._sharding(_largest_dim_spec(
      full.shape, self.n, self.axis)))

  def _rows_of_full(self, full, i: int):
    """Inverse of :meth:`_full_of_rows`."""
    if self._aligned(i) or self._explicit:
      return self._rows_of(full, i)
    rows = self.layout.rows(full, i).reshape(concat_shape(self.layout.row_shape(i), self.n))
    return jax.lax.with_sharding_constraint(rows, self._sharding(P(self.axis)))

  def _sharding(self, spec: P) -> NamedSharding:
    return NamedSharding(self.model.mesh, spec)

  def _global_opt_init(self, row_blocks):
    """Global view: the kept optimizer state of the parameter rows ``row_blocks``."""
    full = [self._full_of_rows(r, i) for i, r in enumerate(jax.tree.leaves(row_blocks))]
    return self._store_opt(self.model.optimizer.init(self.model.unflatten(full)))

  def _store_opt(self, opt):
    """Global view: full-shaped optimizer state -> as kept (rows, or a copy per device)."""
    leaves, tree = jax.tree.flatten(opt)
    tile = self.smap(to_block, P(), P(self.axis))
    return tree.unflatten([tile(x) if i is None else self._rows_of_full(x, i)
                           for x, i in zip(leaves, self._mirrors)])

  def _load_opt(self, blocks):
    """Inverse of :meth:`_store_opt` (each device reads its own copy: no communication)."""
    leaves, tree = jax.tree.flatten(blocks)
    out = []
    for x, t, i in zip(leaves, jax.tree.leaves(self._opt_like), self._mirrors):
      if i is None:
        out.append(self.smap(lambda b, s=t.shape: b.reshape(s), P(self.axis), P())(x))
      else:
        out.append(self._full_of_rows(x, i))
    return tree.unflatten(out)

  def _full_of_params(self, params):
    """Global view: the kept parameters -> full leaves laid out as :meth:`leaf_spec`."""
    raise NotImplementedError

  def global_apply(self, state, grad_blocks):
    """Outside shard_map (global arrays): ``(parameter row blocks, opt_state)`` after
    ``optimizer.update`` on the full-shaped leaves, each laid out as :meth:`leaf_spec`
    (sharded over ``axis`` where a dimension divides): the optimizer sees every leaf's
    true shape and GSPMD inserts the all-reduces of its reductions, so the update is the
    one-device update while the state stays sharded."""
    grads = self.model.unflatten(
      [self._full_of_rows(g, i) for i, g in enumerate(jax.tree.leaves(grad_blocks))])
    params = self.model.unflatten(self._full_of_params(jax.tree.leaves(state.params)))
    updates, opt = self.model.optimizer.update(grads, self._load_opt(state.opt_state), params)
    new = jax.tree.leaves(optax.apply_updates(params, updates))
    rows = self.model.unflatten([self._rows_of_full(x, i) for i, x in enumerate(new)])
    return rows, self._store_opt(opt)

  def params_of_rows(self, row_blocks):
    """Inside shard_map: the kept parameters of the updated rows' blocks."""
    raise NotImplementedError

  def eval_loss(self, state, batch, loss):
    return self.call_with_params(state, loss, batch)

  # -- leaving the device ------------------------------------------------------------

  def row_like(self):
    return self.model.unflatten([
      jax.ShapeDtypeStruct(self.layout.row_shape(i), x.dtype)
      for i, x in enumerate(self.model.like)
    ])

  def opt_mirrors(self):
    if self.updates_globally:
      return list(self._mirrors)
    return param_mirrors(self.model.optimizer, self.model.treedef, self.model.like)

  def check_opt_mirrors(self, mirrors, full_leaves, full_def):
    if self.updates_globally:  # the state of the full parameters by construction
      return
    # The state is kept on rows: each leaf must mirror a parameter or be its own.
    check_mirrors(self, mirrors, full_leaves, full_def)

  def export_leaves(self, state, mirrors):
    params = self._export_params(jax.tree.leaves(state.params))
    opt = [self._first(x, t.shape) if i is None else self._unrows(x, i)
           for x, t, i in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(self._opt_like),
                              mirrors)]
    return params, opt

  def _first(self, x, shape):
    """A concatenated optimizer-state leaf that is the same on every device -> its value."""
    spec = self.canonical_spec(shape)
    return self.smap(lambda b: _own_block(b.reshape(shape), spec, self.n), P(self.axis), spec)(x)

  def _everywhere(self, x):
    """The inverse of :meth:`_first`: the value of every device, concatenated."""
    spec = self.canonical_spec(x.shape)
    return self.smap(lambda b: to_block(_gather_block(b, spec)), spec, P(self.axis))(x)

  def import_leaves(self, params, opt, mirrors):
    opt = [self._everywhere(x) if i is None else self._rows_of(x, i) for x, i in zip(opt, mirrors)]
    return self._import_params(params), opt

  def _aligned(self, i: int) -> bool:
    """Whether device r's row of leaf i is the r-th block of its first (inner) dimension."""
    return self.layout.aligned(i)

  def leaf_spec(self, i: int) -> P:
    """Canonical layout of parameter ``i`` (and its optimizer state): rows where they align."""
    if self._aligned(i):
      return P(*([None] * (1 if self.layout.layers[i] else 0)), self.axis)
    return self.canonical_spec(self.model.like[i].shape)

  def _unrows(self, rows, i: int):
    """Concatenated rows -> the full leaf; a local reshape where rows align with the layout."""
    if not self._aligned(i):  # gathered, cut, and each device keeps its canonical block
      spec = self.leaf_spec(i)

      def cut(blocks):
        table = jax.lax.all_gather(blocks.reshape(-1), self.axis, tiled=True)
        return _own_block(self.layout.unrows(table.reshape(self.n, -1), i), spec, self.n)

      return self.smap(cut, P(self.axis), spec)(rows)
    shape = list(self.model.like[i].shape)
    shape[1 if self.layout.layers[i] else 0] //= self.n
    return self.smap(lambda r: r.reshape(shape), P(self.axis), self.leaf_spec(i))(rows)

  def _rows_of(self, full, i: int):
    """The full leaf -> concatenated rows (inverse of :meth:`_unrows`)."""
    block = self.layout.row_shape(i)
    if not self._aligned(i):  # each device gathers the leaf and cuts its own row
      spec, axis = self.leaf_spec(i), self.axis

      def cut(b):
        own = self.layout.own_shard(_gather_block(b, spec), i, jax.lax.axis_index(axis))
        return to_block(own)

      return self.smap(cut, spec, P(self.axis))(full)
    return self.smap(lambda f: f.reshape(block), self.leaf_spec(i), P(self.axis))(full)

  def canonical_spec(self, shape):
    """Sharded over ``axis`` on the first dimension that divides by ``N``."""
    for d, size in enumerate(shape):
      if size % self.n == 0 and size >= self.n:
        return P(*([None] * d), self.axis)
    return P()


class ReplicatedParamsPlan(ZeROPlan, ReplicatedParams):
  """ZeRO-1 and ZeRO-2: every device keeps the full parameters and the optimizer
  state of its rows; after the update the rows are all-gathered back."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    init = self.smap(self._init_body, P(), self.state_spec)
    if self.updates_globally:  # the state of the full parameters' rows, built globally
      own = self.smap(lambda p: to_block(self._own_rows(p)), P(), P(self.axis))

      def init_global(params):
        state = init(params)
        return state._replace(opt_state=self._global_opt_init(own(state.params)))

      self._init_replicated = jax.jit(init_global)
    else:
      self._init_replicated = jax.jit(init)

  def _full_of_params(self, params):
    out = []
    for i, p in enumerate(params):
      if self._aligned(i) or self._explicit:
        spec = self.leaf_spec(i)
        out.append(self.smap(lambda x, s=spec: _own_block(x, s, self.n), P(), spec)(p))
      else:  # replicated: each device keeps its (uneven) block, no communication
        spec = _largest_dim_spec(p.shape, self.n, self.axis)
        out.append(jax.lax.with_sharding_constraint(p, self._sharding(spec)))
    return out

  def params_of_rows(self, row_blocks):
    rows = jax.tree.leaves(self._rows(row_blocks))
    return self.model.unflatten(self.layout.all_gather(rows, self.axis, self.group_algorithm))

  def _params_spec(self):
    return P()

  def _export_params(self, params):
    return params

  def _import_params(self, params):
    return params

  def _init_body(self, params) -> TrainState:
    # Leaf by leaf, as before tensor fusion: packing would add a copy of the
    # model at init, where memory is tightest.
    params = collectives.broadcast(params, self.data_axes, root=0, bucket_bytes=0)
    if self.updates_globally:  # built by init_global instead
      opt_state = to_block(jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), self._opt_like))
    else:
      opt_state = to_block(self.model.optimizer.init(self._own_rows(params)))
    return TrainState(jnp.zeros((), jnp.int32), params, opt_state, ())

  def apply(self, state, grads):
    rows, opt_state = self._update(state, grads, self._own_rows(state.params))
    leaves = self.layout.all_gather(jax.tree.leaves(rows), self.axis, self.group_algorithm)
    return self.model.unflatten(leaves), to_block(opt_state)

  def replicated(self, state):
    return {"params": state.params}

  def group_replicated(self, state):
    return {} if self.replica is None else {"opt_state": state.opt_state}


class ZeRO1Plan(ReplicatedParamsPlan):
  """ZeRO-1: gradients all-reduced in full; each device updates its rows."""

  kind = kinds.ZERO1

  def grads(self, state, batch, loss, accumulate):
    value, aux, leaves = self._local_grads(state, batch, loss, accumulate)
    full = all_reduce_buckets(leaves, self.full_buckets, self.data_axes, self.strategy.algorithm)
    return value, aux, self._own_rows(self.model.unflatten(full)), state.residual


class ZeRO2Plan(ReplicatedParamsPlan):
  """ZeRO-2: gradients reduce-scattered to rows (then across replicas when hybrid)."""

  kind = kinds.ZERO2

  def grads(self, state, batch, loss, accumulate):
    value, aux, leaves = self._local_grads(state, batch, loss, accumulate)
    rows = self.model.unflatten(
      self.layout.reduce_scatter(leaves, self.axis, self.group_algorithm))
    return value, aux, self._across_replicas(rows), state.residual


class ZeRO3Plan(ZeROPlan):
  """ZeRO-3: the parameters themselves are rows (sharded params).

  Leaves outside any FSDP unit are gathered before ``loss_fn`` (and again in
  backward); leaves of a unit (:mod:`jaxcoll.train.fsdp`) are gathered by the
  unit where it runs. The gradients leave the gathers' VJPs reduce-scattered.
  """

  kind = kinds.ZERO3

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self._row_programs = {}
    self._cut_programs = {}  # leaf -> jitted canonical block -> rows (init of jax arrays)

  def _units(self):
    return fsdp.find_units(self.model.paths, [x.shape for x in self.model.like])

  def _params_spec(self):
    return P(self.axis)

  def _export_params(self, params):
    return [self._unrows(x, i) for i, x in enumerate(params)]

  def _full_of_params(self, params):
    return [self._full_of_rows(x, i) for i, x in enumerate(params)]

  def params_of_rows(self, row_blocks):
    return row_blocks

  def _import_params(self, params):
    return [self._rows_of(x, i) for i, x in enumerate(params)]

  def export_is_reshape(self, i: int) -> bool:
    # Rows that align with the canonical blocks: _unrows is a local reshape.
    return self._aligned(i)

  # -- state ---------------------------------------------------------------------

  def init(self, params) -> TrainState:
    leaves = jax.tree.leaves(params)
    rows = [None] * len(leaves)
    if same_on_every_process(leaves):
      # Host leaves: each device's row is cut straight from the host array. Jax
      # arrays (on one device, replicated or sharded in any way) are first laid out
      # as the canonical form (each device receives its block, no device the whole
      # leaf), then cut into rows there, one leaf at a time. With several processes
      # that agree, each reads its devices' rows from its own copy (process-local
      # jax arrays through the host, one leaf at a time): no broadcast.
      sharding = NamedSharding(self.model.mesh, P(self.axis))
      local = jax.process_count() > 1
      for i, x in enumerate(leaves):
        if not isinstance(x, jax.Array) or (local and x.is_fully_addressable):
          rows[i] = self._host_rows(np.asarray(x, self.model.like[i].dtype), i, sharding)
        else:
          x = x.astype(self.model.like[i].dtype)
          block = jax.device_put(x, NamedSharding(self.model.mesh, self.leaf_spec(i)))
          del x
          if i not in self._cut_programs:
            self._cut_programs[i] = jax.jit(lambda b, i=i: self._rows_of(b, i))
          rows[i] = self._cut_programs[i](block)
          del block
    # Processes that passed different values, where device 0's win: chunk by
    # chunk, so at most about one leaf is held in full on a device at once.
    todo = [i for i in range(len(leaves)) if rows[i] is None]
    nbytes = [self.model.like[i].size * self.model.like[i].dtype.itemsize for i in todo]
    for positions in _chunks(nbytes):
      chunk = tuple(todo[k] for k in positions)
      placed = [place(leaves[i], self.model.mesh, P()) for i in chunk]
      for i, r in zip(chunk, self._rows_program(chunk)(placed)):
        rows[i] = r
      del placed
    rows = self.model.unflatten(rows)
    step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(self.model.mesh, P()))
    return TrainState(step, rows, self._opt_init(rows), ())

  def init_traced(self, params) -> TrainState:
    n = self.n
    rows = [self.layout.rows(x, i).reshape(concat_shape(self.layout.row_shape(i), n))
            for i, x in enumerate(jax.tree.leaves(params))]
    rows = self.model.unflatten(rows)
    return TrainState(jnp.zeros((), jnp.int32), rows, self._opt_init(rows), ())

  def host_param(self, leaf, i: int):
    # The concatenated rows, assembled on the host from each device's row, then
    # cut as unrows does on the device (the same elements: bit-identical).
    table = super().host_param(leaf, i).reshape(self.n, -1)
    return self.layout.unrows(table, i)

  def host_param_pieces(self, leaf, i: int):
    from jaxcoll.train import digest  # noqa: PLC0415

    layout = self.layout
    if not leaf.is_fully_addressable:
      return super().host_param_pieces(leaf, i)
    layers, size, c = layout.layer_count(i), layout.sizes[i], layout.chunks[i]
    # One copy of each row: under hybrid sharding (`replica_axis`) every row is on one
    # device of each replica group (all of them were concatenated: the digest of other values).
    shards = sorted((s for s in leaf.addressable_shards if s.replica_id == 0),
                    key=lambda s: s.index[0].start or 0)

    def layer(k):  # one layer: each device's row of it, in device order, padding cut
      rows = [np.asarray(s.data).reshape(layers, c)[k] for s in shards]
      return np.concatenate(rows)[:size]

    return digest.Piecewise(layers * size, size, layer)

  def unit_bytes(self, by_kind: bool = False):
    layout = self.layout
    if not layout.units:
      return None
    outside = unit_rows = stack_rows = 0
    per_unit: dict[tuple, list] = {}
    for i, (path, like) in enumerate(zip(self.model.paths, self.model.like)):
      nbytes = like.size * like.dtype.itemsize
      if i not in layout.units:
        outside += nbytes
        continue
      unit_rows += -(-nbytes // self.n)
      layers = layout.layer_count(i)
      stack_rows += -(-nbytes // self.n) if layers > 1 else 0
      unit = per_unit.setdefault(fsdp.unit_of(path), [0, False])
      unit[0] += nbytes // layers
      unit[1] = unit[1] or layers > 1
    if by_kind:  # unrolled units apart from scanned layers (a model may have both)
      unrolled = [b for b, scanned in per_unit.values() if not scanned]
      layers = [b for b, scanned in per_unit.values() if scanned]
      return (outside, unit_rows, sum(unrolled), max(unrolled, default=0),
              max(layers, default=0), stack_rows)
    largest, scanned = max(per_unit.values())
    return outside, unit_rows, largest, scanned

  def _host_rows(self, x: np.ndarray, i: int, sharding) -> jax.Array:
    layout = self.layout
    layers, size, c = layout.layers[i] or 1, layout.sizes[i], layout.chunks[i]
    flat = x.reshape(layers, size)
    block = concat_shape(layout.row_shape(i), 1)

    def row(index):
      r = (index[0].start or 0) // block[0]
      piece = flat[:, r * c: min((r + 1) * c, size)]
      if piece.shape[1] < c:  # the padded end (otherwise a view: no host copy)
        piece = np.pad(piece, ((0, 0), (0, c - piece.shape[1])))
      return piece.reshape(block)

    return jax.make_array_from_callback(concat_shape(layout.row_shape(i), self.n), sharding, row)

  def _rows_program(self, chunk):
    # Keyed by what the program depends on, so same-shaped leaves share one.
    key = tuple((self.layout.shapes[i], self.layout.layers[i], self.model.like[i].dtype)
                for i in chunk)
    if key not in self._row_programs:
      def body(leaves):
        # Leaf by leaf, as before tensor fusion: packing would add a copy of the
        # model at init, where memory is tightest.
        leaves = collectives.broadcast(leaves, self.data_axes, root=0, bucket_bytes=0)
        rank = jax.lax.axis_index(self.axis)
        return [to_block(self.layout.own_shard(x, i, rank)) for i, x in zip(chunk, leaves)]

      self._row_programs[key] = jax.jit(self.smap(body, P(), P(self.axis)))
    return self._row_programs[key]

  # -- one step ----------------------------------------------------------------------

  def _gatherer(self, dtype=None):
    paths = self.model.paths
    cuts = {
      paths[i]: fsdp.LeafCut(self.n, self.layout.sizes[i], self.layout.chunks[i],
                             self.layout.inner_shape(i), self.layout.inner_row_shape(i))
      for i in self.layout.units
    }
    return fsdp.Gatherer(cuts, self.axis, self.group_algorithm, dtype, tuple(paths))

  def _loss_of_rows(self, loss, cast: bool = True):
    """``(rows, batch) -> (loss, aux)``: outside leaves gathered, units gather theirs."""
    dtype = self.model.compute_dtype if cast else None
    gather = make_gather(self.layout, self.axis, self.group_algorithm, dtype)
    gatherer = self._gatherer(dtype)

    def loss_of_rows(rows, batch):
      full = self.model.unflatten(gather(jax.tree.leaves(rows)))
      try:
        with fsdp.active(gatherer):
          out = loss(full, batch)
      except Exception as error:  # a unit leaf no unit gathered fails inside flax first
        gatherer.check_all_used(error)
        raise
      gatherer.check_all_used()
      gatherer.warn_if_unplanned()
      return out

    return loss_of_rows

  def grads(self, state, batch, loss, accumulate):
    loss_of_rows = self._loss_of_rows(loss)
    if not self.layout.units:
      # Gathered again in backward, not kept from the forward pass. With units this
      # outer policy ("save all but the gathered params") would override the units'
      # and the scanned layers' own remat and keep every layer's activations, so there
      # the leaves outside units stay gathered from forward to backward instead.
      loss_of_rows = jax.checkpoint(loss_of_rows, policy=zero3_remat_policy)
    grad_fn = jax.value_and_grad(loss_of_rows, has_aux=True)
    value, aux, rows = accumulate(grad_fn, self._rows(state.params), batch)
    return value, aux, self._across_replicas(rows), state.residual

  def apply(self, state, grads):
    rows, opt_state = self._update(state, grads, self._rows(state.params))
    return to_block(rows), to_block(opt_state)

  def merge_aux(self, params, aux, merge):
    # `merge` gets the full parameters, as under every other plan: it was given the rows,
    # so a merge that reads them (an EMA of statistics, 0.9 * p + 0.1 * aux) failed to
    # broadcast a (2,) row with an (8,) aux. A leaf it returns as it got it keeps its row,
    # and its gather, used by nothing, is dropped by XLA.
    # A leaf is known unchanged by identity (`n is f`): a merge that rebuilds a leaf it does
    # not change (jax.tree.map over all of them) gathers the whole model in every step.
    old = jax.tree.leaves(self._rows(params))
    full = self._full_leaves(old)
    new = jax.tree.leaves(merge(self.model.unflatten(full), aux))
    rank = jax.lax.axis_index(self.axis)
    out = [o if n is f else self.layout.own_shard(n, i, rank)
           for i, (o, f, n) in enumerate(zip(old, full, new))]
    return to_block(self.model.unflatten(out))

  def call_with_params(self, state, fn, batch, *, cast=True):
    return self._loss_of_rows(fn, cast)(self._rows(state.params), batch)

  def replicated(self, state):
    return {}

  def group_replicated(self, state):
    return {} if self.replica is None else {"params": state.params, "opt_state": state.opt_state}

  def full_params(self, params):
    def body(blocks):
      return self.model.unflatten(self._full_leaves(jax.tree.leaves(self._rows(blocks))))

    return self.smap(body, P(self.axis), P())(params)

  def _full_leaves(self, rows) -> list:
    """Inside shard_map: the full parameter leaves of this device's ``rows`` (leaves in
    tree order). Each device gathers the rows and cuts them locally: a reshape of the
    sharded global array is refused on meshes with explicit axis types."""
    return [self.layout.unrows(jax.lax.all_gather(r.reshape(-1), self.axis, tiled=True)
                               .reshape(self.n, -1), i) for i, r in enumerate(rows)]


#: ZeRO stage -> its plan class (read only by :meth:`ZeROPlan.__new__`).
_BY_STAGE = {cls.kind.stage: cls for cls in (ZeRO1Plan, ZeRO2Plan, ZeRO3Plan)}


def _gather_block(block, spec: P):
  """Inside shard_map: the whole leaf from this device's block of it (laid out as ``spec``)."""
  for d, names in enumerate(spec):
    if names is not None:
      block = jax.lax.all_gather(block, names, axis=d, tiled=True)
  return block


def _own_block(full, spec: P, n: int):
  """Inside shard_map: this device's block of ``full`` as ``spec`` lays it out (one axis)."""
  for d, names in enumerate(spec):
    if names is not None:
      size = full.shape[d] // n
      full = jax.lax.dynamic_slice_in_dim(full, jax.lax.axis_index(names) * size, size, d)
  return full


# Elements a chunked reduction reads at a time (see _sum_of_squares).
_CHUNK = 2**18


def _sum_of_squares(x) -> jax.Array:
  """``sum(x**2)`` in float32, a chunk at a time.

  XLA:CPU materializes the input of a large reduction (and CSE shares that
  ``x**2`` with Adam's second moment), a row-sized temporary; chunks keep it
  small and leave the optimizer's fusion alone.
  """
  flat = x.reshape(-1)
  full = flat.shape[0] // _CHUNK

  def part(v):
    return jnp.sum(grads_lib.abs_squared(v))

  total = jnp.float32(0)
  if full > 1:
    total = jax.lax.fori_loop(0, full, lambda k, acc: acc + part(
      jax.lax.dynamic_slice_in_dim(flat, k * _CHUNK, _CHUNK)), total)
  else:
    full = 0
  return total + part(flat[full * _CHUNK:])


def _largest_dim_spec(shape, n: int, axis) -> P:
  """Sharded over ``axis`` on the largest dimension of ``shape`` (unevenly where it does
  not divide by ``n``); replicated when no dimension has ``n`` elements."""
  if not shape or max(shape) < n:
    return P()
  d = max(range(len(shape)), key=lambda k: shape[k])
  return P(*([None] * d), axis)


def _join(a, b):
  """The ``PartitionSpec`` entry of the axes of ``a`` followed by those of ``b``."""
  as_tuple = lambda x: tuple(x) if isinstance(x, tuple) else (x,)  # noqa: E731
  return as_tuple(a) + as_tuple(b)


def _chunks(nbytes: list[int]) -> list[tuple[int, ...]]:
  """Consecutive leaf indices grouped so no group exceeds the largest leaf's bytes."""
  cap = max(nbytes, default=0)
  out, current, total = [], [], 0
  for i, b in enumerate(nbytes):
    if current and total + b > cap:
      out.append(tuple(current))
      current, total = [], 0
    current.append(i)
    total += b
  if current:
    out.append(tuple(current))
  return out

