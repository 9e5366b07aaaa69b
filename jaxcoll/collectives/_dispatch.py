"""Argument checks, the algorithm registry and the `auto` choice."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcoll import checks
from jaxcoll.collectives import native, pairwise, recursive, ring, specs, tree
from jaxcoll.collectives._group import REDUCERS, Group, Reducer
from jaxcoll.collectives.hierarchical import (
    Hierarchical,
    hierarchical_all_gather,
    hierarchical_all_reduce,
    hierarchical_reduce_scatter,
)

COLLECTIVES = tuple(specs.SPECS)  # all_reduce, reduce_scatter, all_gather, broadcast, ...
OPS = ("sum", "mean", "max", "min")

# collective -> algorithm name -> implementation in canonical form (native.py).
_REGISTRY: dict[str, dict[str, Callable[..., jax.Array]]] = {
    "all_reduce": {
        "native": native.native_all_reduce,
        "ring": ring.ring_all_reduce,
        "bidirectional_ring": ring.bidirectional_ring_all_reduce,
        "tree": tree.double_tree_all_reduce,
        "recursive_doubling": recursive.recursive_doubling_all_reduce,
        "halving_doubling": recursive.halving_doubling_all_reduce,
        "hierarchical": hierarchical_all_reduce,
    },
    "reduce_scatter": {
        "native": native.native_reduce_scatter,
        "ring": ring.ring_reduce_scatter,
        "recursive_halving": recursive.recursive_halving_reduce_scatter,
        "pairwise": pairwise.pairwise_reduce_scatter,
        "hierarchical": hierarchical_reduce_scatter,
    },
    "all_gather": {
        "native": native.native_all_gather,
        "ring": ring.ring_all_gather,
        "recursive_doubling": recursive.recursive_doubling_all_gather,
        "bruck": recursive.bruck_all_gather,
        "hierarchical": hierarchical_all_gather,
    },
    "broadcast": {
        "native": native.native_broadcast,
        "binomial_tree": tree.binomial_tree_broadcast,
        "scatter_allgather": tree.scatter_allgather_broadcast,
    },
    "reduce": {
        "native": native.native_reduce,
        "binomial_tree": tree.binomial_tree_reduce,
        "reduce_scatter_gather": tree.reduce_scatter_gather_reduce,
    },
    "all_to_all": {
        "native": native.native_all_to_all,
        "pairwise": pairwise.pairwise_all_to_all,
    },
}
# The flat collectives each level of a hierarchical algorithm runs.
_HIERARCHICAL_LEVELS = {
    "all_reduce": {"inner": ("reduce_scatter", "all_gather"), "outer": ("all_reduce",)},
    "reduce_scatter": {"inner": ("reduce_scatter",), "outer": ("reduce_scatter",)},
    "all_gather": {"inner": ("all_gather",), "outer": ("all_gather",)},
}

Algorithm = str | Hierarchical
_DEFAULT = object()  # `auto` asks the default chooser (below)
_auto_chooser: Any = _DEFAULT
# The default chooser, :func:`jaxcoll.tuning.choose`: the layer above
# (jaxcoll.comm_model.tuning, imported by ``import jaxcoll``) registers it, so
# that this layer never imports the cost model. None until it is imported.
_default_chooser: Callable[..., str] | None = None


def set_default_chooser(chooser: Callable[..., str]) -> None:
  """Registers the chooser `auto` uses by default (for :mod:`jaxcoll.tuning`).

  Reads nothing: the tuning table is loaded the first time `auto` decides.
  """
  global _default_chooser  # noqa: PLW0603 - one process-wide setting, like jax.config
  _default_chooser = chooser


def set_auto_chooser(chooser: Callable[..., str] | None) -> None:
  """Installs ``chooser(collective, nbytes, group, dtype) -> name`` for `auto`.

  The default, :func:`jaxcoll.tuning.choose` (tuning table, else cost model),
  reads its table the first time `auto` decides (``import jaxcoll`` installs
  nothing here and reads no table); ``None`` makes `auto` mean ``native``.
  """
  global _auto_chooser  # noqa: PLW0603 - one process-wide setting, like jax.config
  if chooser is not None and not callable(chooser):
    raise TypeError(f"`chooser` must be a callable or None, got {chooser!r}.")
  _auto_chooser = chooser


def reset_auto_chooser() -> None:
  """Goes back to the default chooser, :func:`jaxcoll.tuning.choose`."""
  global _auto_chooser  # noqa: PLW0603
  _auto_chooser = _DEFAULT


def algorithms(collective: str) -> tuple[str, ...]:
  """The algorithm names registered for ``collective`` (plus ``"auto"``).

  Example:
    >>> jaxcoll.algorithms("broadcast")
    ('native', 'binomial_tree', 'scatter_allgather', 'auto')
  """
  check_collective(collective)
  return tuple(_REGISTRY[collective]) + ("auto",)


def register(collective: str, name: str) -> Callable:
  """Decorator registering a new algorithm in canonical form (see native.py)."""
  check_collective(collective)
  if name in _REGISTRY[collective] or name == "auto":
    raise ValueError(f"`name` {name!r} is already registered for {collective}.")

  def decorate(fn):
    _REGISTRY[collective][name] = fn
    return fn

  return decorate


def check_collective(collective: str) -> str:
  """Returns ``collective`` if it is one of ``COLLECTIVES``.

  Raises:
    ValueError: an unknown name, with the valid ones.
  """
  if collective not in _REGISTRY:
    raise ValueError(
        f"Unknown `collective` {collective!r}; valid collectives: "
        f"{', '.join(COLLECTIVES)}."
    )
  return collective


def check_op(op: str, dtype) -> Reducer:
  if op not in OPS:
    raise ValueError(f"`op` must be one of {', '.join(OPS)}; got {op!r}.")
  name = np.dtype(dtype).name
  if op in ("sum", "mean") and np.dtype(dtype) == np.bool_:
    raise ValueError(
        f"`op`={op!r} on a bool array: lax.psum would count the True values as int32; cast "
        "to int32 first (x.astype(jnp.int32)). Bools take op='max' (any), 'min' (all) and "
        "every data movement."
    )
  if op in ("max", "min") and jnp.issubdtype(dtype, jnp.complexfloating):
    raise ValueError(
        f"`op`={op!r} has no order on {name}; use op='sum' or 'mean', or reduce jnp.abs(x)."
    )
  if op == "mean" and not jnp.issubdtype(dtype, jnp.inexact):
    raise ValueError(
        f"`op`='mean' needs a floating dtype, got {name}; use "
        "op='sum' and divide, or cast to a float dtype first."
    )
  return REDUCERS["sum" if op == "mean" else op]


def _bits(dtype) -> int | None:
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.finfo(dtype).bits
  if jnp.issubdtype(dtype, jnp.integer):
    return jnp.iinfo(dtype).bits
  return None  # bool, complex, ...


def check_dtype(x: jax.Array) -> None:
  dtype = np.dtype(jnp.result_type(x))
  if dtype == np.bool_ or jnp.issubdtype(dtype, jnp.complexfloating):
    return  # moved as uint8 / as (real, imaginary) pairs: see run()
  if _bits(dtype) not in (8, 16, 32, 64):
    raise ValueError(
        f"Collectives take floating, complex, integer or bool arrays (8 to 64 bits per "
        f"number); got dtype {dtype.name}. Widen 4-bit integers (x.astype(jnp.int8)) first."
    )


def bound_axes() -> dict[Hashable, int]:
  """Axis names bound here by shard_map / pmap and their sizes ({} outside them).

  Read at trace time from JAX's axis environment; where that is not
  available, the manual axes of the current abstract mesh (shard_map).
  """
  try:
    from jax._src import core  # noqa: PLC0415 - no public accessor of the axis env

    return dict(core.get_axis_env().axis_sizes)
  except Exception:  # noqa: BLE001 - fall back to the public abstract mesh
    mesh = jax.sharding.get_abstract_mesh()
    return {a: mesh.shape[a] for a in getattr(mesh, "manual_axes", ())}


def resolve_group(axis_name: Hashable | Sequence[Hashable]) -> Group:
  axes = checks.axis_names(axis_name)
  if not axes:
    raise ValueError("`axis_name` must name at least one mesh axis; got ().")
  if len(set(axes)) != len(axes):
    raise ValueError(f"`axis_name` {axes} repeats an axis; name each axis once.")
  sizes = []
  for a in axes:
    if checks.is_int(a) or isinstance(a, bool):
      # lax reads an integer axis name as a positional axis of the array, and said "axis 0 is
      # out of bounds for array of dimension 0" about the scalar it asks the size of.
      bound = bound_axes()
      raise ValueError(
          f"`axis_name` {a!r} is an integer; a collective runs over named mesh axes (bound "
          f"here: {list(bound)}): pass a name such as {next(iter(bound), 'data')!r}. The "
          "array dimension is the `axis` / `scatter_dimension` / `split_axis` keyword.")
    try:
      sizes.append(int(lax.axis_size(a)))
    except NameError:
      bound = bound_axes()
      mesh_axes = getattr(jax.sharding.get_abstract_mesh(), "axis_names", ())
      if a in mesh_axes and not bound:  # jax.set_mesh(mesh), then jit without shard_map
        raise ValueError(
            f"`axis_name` {a!r} is an axis of the mesh set here (jax.set_mesh / use_mesh), "
            "but no jax.shard_map (or pmap) runs this code, and a collective runs on each "
            "device's shard: call it inside jax.shard_map(f, mesh=..., in_specs=..., "
            f"out_specs=...) over {a!r}.") from None
      if a in mesh_axes:  # a mesh axis that this shard_map did not make manual
        raise ValueError(
            f"`axis_name` {a!r} is an axis of the mesh that this shard_map leaves to the "
            f"compiler (its manual axes: {list(bound)}); a collective runs over manual axes: "
            f"add {a!r} to jax.shard_map's axis_names, or name a manual axis.") from None
      where = f"bound axes here: {list(bound)}" if bound else "no axis is bound here"
      raise ValueError(
          f"`axis_name` {a!r} is not an axis of the current mesh ({where}). "
          "Call jaxcoll collectives inside jax.shard_map or jax.pmap over a "
          "mesh that has this axis."
      ) from None
  vmapped = _vmap_axes(axes)
  if vmapped and len(axes) > 1:
    raise ValueError(
        f"`axis_name` {axes} mixes the jax.vmap axis {vmapped[0]!r} with other axes; over a "
        "vmap axis jaxcoll collectives run on that one axis alone (jax.vmap's ppermute moves "
        "one axis). Reduce over each axis in turn, or make them axes of one shard_map mesh.")
  return Group(axes, tuple(sizes), _mesh_order(axes), vmapped=bool(vmapped))


def _vmap_axes(axes: tuple) -> tuple:
  """The axes of ``axes`` that ``jax.vmap(axis_name=...)`` binds: bound here (they have a
  size) but not manual axes of the current mesh, as shard_map's and pmap's are."""
  mesh = jax.sharding.get_abstract_mesh()
  manual = getattr(mesh, "manual_axes", ())
  return tuple(a for a in axes if a not in manual)


def _mesh_order(axes: tuple) -> tuple | None:
  """``axes`` in the order of the current mesh (how ppermute numbers them),
  or None when that is their given order or no mesh is known (pmap)."""
  if len(axes) < 2:
    return None
  try:
    names = tuple(jax.sharding.get_abstract_mesh().axis_names)
  except Exception:  # noqa: BLE001 - no abstract mesh in this context
    return None
  if not all(a in names for a in axes):
    return None
  ordered = tuple(sorted(axes, key=names.index))
  return None if ordered == axes else ordered


def _check_algorithm(collective: str, algorithm: Algorithm, group: Group) -> Algorithm:
  if isinstance(algorithm, Hierarchical):
    name = "hierarchical"
  elif isinstance(algorithm, str):
    name = algorithm
  else:
    raise ValueError(
        f"`algorithm` must be a name or jaxcoll.Hierarchical(...), got {algorithm!r}."
    )
  if name != "auto" and name not in _REGISTRY[collective]:
    raise ValueError(
        f"Unknown {collective} `algorithm` {name!r}; valid choices: "
        f"{', '.join(algorithms(collective))}."
    )
  if name == "hierarchical":
    if len(group.axes) < 2:
      raise ValueError(
          f"`algorithm`='hierarchical' needs a tuple of >= 2 axes (outer..., "
          f"inner), e.g. ('node', 'local'); got axis_name={group.axis_name!r}."
      )
    spec = algorithm if isinstance(algorithm, Hierarchical) else Hierarchical()
    if spec.outer == "hierarchical" and len(group.axes) < 3:
      # Else the outer level's own check named its one axis, which the caller never passed.
      raise ValueError(
          f"Hierarchical `outer`='hierarchical' splits the outer axes again, so it needs a "
          f"tuple of >= 3 axes; axis_name={group.axis_name!r} has one outer axis "
          f"{group.axes[0]!r}: choose a flat `outer` algorithm (e.g. 'ring').")
    for level, kinds in _HIERARCHICAL_LEVELS[collective].items():
      value = getattr(spec, level)
      # Valid for this level: registered for every collective the level runs.
      # The inner level is one axis, so it cannot itself be hierarchical.
      valid = [
          a for a in algorithms(kinds[0])
          if all(a in algorithms(k) for k in kinds)
          and not (level == "inner" and a == "hierarchical")
      ]
      if value not in valid:
        raise ValueError(
            f"Hierarchical `{level}`={value!r} is not valid for {collective} (the {level} "
            f"level runs {' and '.join(kinds)}); valid: {', '.join(valid)}."
        )
    return spec
  return name


def choose_algorithm(collective: str, nbytes: int, group: Group, dtype) -> str:
  """The flat algorithm `auto` picks at trace time (static, shown in HLO)."""
  if group.size == 1:
    return "native"
  chooser = _auto_chooser
  if chooser is _DEFAULT:
    chooser = _default_chooser
  if chooser is None:
    return "native"
  return chooser(collective, nbytes, group, dtype)


def run(
    collective: str,
    algorithm: Algorithm,
    x: jax.Array,
    group: Group,
    **kwargs: Any,
) -> jax.Array:
  """Runs ``algorithm`` on canonical-form ``x`` (see native.py).

  Complex ``x`` runs as its (real, imaginary) parts on a trailing axis of 2 (a sum of
  complex numbers is the sum of their parts, as ``lax.psum`` computes it); bool ``x``
  runs as uint8 (0 / 1: max is any, min is all). Every algorithm then sees a real dtype.
  """
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    parts = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    out = run(collective, algorithm, parts, group, **kwargs)
    return lax.complex(out[..., 0], out[..., 1])
  if x.dtype == jnp.bool_:
    return run(collective, algorithm, x.astype(jnp.uint8), group, **kwargs).astype(jnp.bool_)
  algorithm = _check_algorithm(collective, algorithm, group)
  if algorithm == "auto":
    algorithm = _check_algorithm(collective, chosen(collective, algorithm, x, group), group)
  if isinstance(algorithm, Hierarchical):
    impl = _REGISTRY[collective]["hierarchical"]
    return impl(x, group, spec=algorithm, run=run, **kwargs)
  return _REGISTRY[collective][algorithm](x, group, **kwargs)


def chosen(collective: str, algorithm: Algorithm, x, group: Group) -> Algorithm:
  """``algorithm``; for ``"auto"``, the flat algorithm it picks for ``x`` (an array or a
  ``jax.ShapeDtypeStruct``: a pytree's packed buffer before it is made), as :func:`run` picks
  it: on the size and real dtype that cross the wire (complex as its two parts, bool as uint8).
  """
  if not (isinstance(algorithm, str) and algorithm == "auto"):
    return algorithm
  shape, dtype = tuple(x.shape), np.dtype(x.dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    shape, dtype = shape + (2,), np.dtype(jnp.finfo(dtype).dtype)
  elif dtype == np.bool_:
    dtype = np.dtype(np.uint8)
  wire = jax.ShapeDtypeStruct(shape, dtype)
  return choose_algorithm(collective, nccl_size_bytes(collective, wire, group), group, dtype)


def nccl_size_bytes(collective: str, x: jax.Array, group: Group) -> int:
  """nccl-tests' ``size`` of a canonical-form input: the largest buffer."""
  count = int(np.prod(x.shape, dtype=np.int64)) if len(x.shape) else 1
  return specs.SPECS[collective].size_count(count, group.size) * jnp.dtype(x.dtype).itemsize
