"""Does an optax update read across parameter elements? (ZeRO's exactness condition.)

Under ZeRO each device runs ``optimizer.update`` on its own rows of every leaf
(:class:`jaxcoll.ZeRO`). That equals one-device training exactly when the
update of each element reads only that element's gradient, parameter and
state (adam, sgd, lion, masks on ``ndim``, ``MultiSteps``, schedules). An
update that reduces over elements (``optax.clip_by_global_norm`` inside the
chain, LAMB / LARS trust ratios, adafactor's factored moments,
``apply_if_finite``) would see one shard per device and train something else.
:func:`first_mixing_op` finds such a reduction in the update's jaxpr (traced
on shapes: nothing is computed); ZeRO then runs the update on the full-shaped
leaves outside ``shard_map`` instead (``ZeROPlan.global_apply``), exactly.

It follows the data: a reduction counts only if what it reduces comes from
the gradients, parameters or optimizer state (a schedule's constant
boundaries do not) and if the updates depend on its result (a state-only
diagnostic such as ``zero_nans``' flag does not). The state is carried into the
next step: a reduction that only enters the state counts when a later step's
updates read it (SM3's per-dimension maxima, a transformation dividing by the
previous step's norm).

Two updates reduce nothing and still differ on rows: random draws of the rows'
shape (``optax.add_noise``: every device would draw the same noise for its own
rows, not its slice of the leaf's), and choices made from the exact shapes in
Python (``optax.masked`` with ``mask=lambda p: ... x.size > 1000``, a
``multi_transform`` labelled by shape): the update traced on the full leaves then
runs other operations than on the rows (:func:`_signature`). Both count as mixing.
"""

from __future__ import annotations

import math

import jax
from jax.extend import core as jex_core

from jaxcoll.errors import NotElementwiseWarning  # noqa: F401 - re-exported here


# Primitives whose output element reads several input elements.
_REDUCTIONS = frozenset({
  "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
  "reduce_xor", "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin",
  "cumlogsumexp",
})
_MIXING = _REDUCTIONS | {"dot_general", "sort", "conv_general_dilated", "psum", "pmax", "pmin"}
# Random draws: their values depend on the shape drawn (rows draw other numbers).
_RANDOM = frozenset({"random_bits", "threefry2x32"})
# Shape plumbing that jax.numpy elides when the shapes already agree: not a choice.
_SHAPE_ONLY = frozenset({"reshape", "broadcast_in_dim", "squeeze", "expand_dims"})


def first_mixing_op(optimizer, rows_like, full_like=None) -> str | None:
  """A description of the first reduction across elements of ``optimizer``'s update
  on parameters shaped ``rows_like`` (a pytree of ``jax.ShapeDtypeStruct``), or None
  when the update is elementwise. With ``full_like`` (the full leaves' shapes, same
  tree), an update that runs other operations on the full leaves than on the rows
  (a mask on exact sizes) counts too.

  The state is followed from step to step: a reduction whose result only enters the
  state (SM3's per-dimension maxima) counts when a later step's updates read it."""

  def step(grads, opt_state, params):
    updates, new_state = optimizer.update(grads, opt_state, params)
    return updates, new_state, optimizer.init(params)

  def trace(like):
    opt_like = jax.eval_shape(optimizer.init, like)
    return jax.tree.structure(opt_like), jax.make_jaxpr(step)(like, opt_like, like).jaxpr

  try:
    opt_tree, jaxpr = trace(rows_like)
  except Exception:  # noqa: BLE001  (the step itself reports an optimizer that fails)
    return None
  found = _first_over_steps(jaxpr, len(jax.tree.leaves(rows_like)), opt_tree.num_leaves)
  if found or full_like is None:
    return found
  # jax.numpy computes nothing on a leaf of no elements (a padded row has one): as rows.
  full_like = jax.tree.map(lambda f, r: r if f.size == 0 else f, full_like, rows_like)
  try:
    full_tree, full = trace(full_like)
  except Exception:  # noqa: BLE001
    return None
  on_rows, on_full = _signature(jaxpr), _signature(full)
  if on_rows == on_full and opt_tree == full_tree:
    return None
  at = next((i for i, (a, b) in enumerate(zip(on_rows, on_full)) if a != b),
            min(len(on_rows), len(on_full)))
  what = lambda ops: ops[at] if at < len(ops) else "nothing"  # noqa: E731
  return (f"an update that depends on the leaves' exact shapes ({what(on_full)} on the "
          f"full leaves where the rows run {what(on_rows)}: e.g. a mask on x.size or x.shape)")


def _first_over_steps(jaxpr, n: int, m: int) -> str | None:
  """:func:`_first` of ``step(grads, state, params) -> (updates, new state, init state)``
  (``n`` parameter leaves, ``m`` state leaves), with the state carried to the next step:
  a state input is tainted when its new or initial value is, and a state output is
  needed when a needed value reads that state input."""
  ins, outs = jaxpr.invars, jaxpr.outvars
  if len(ins) != 2 * n + m or len(outs) != n + 2 * m:  # not the trees traced: read it all
    return _first(jaxpr, {v for v in ins if _size(v) > 1})
  state_in = ins[n:n + m]
  fed = [(s, o) for part in (outs[n:n + m], outs[n + m:]) for s, o in zip(state_in, part)
         if isinstance(o, jex_core.Var)]  # (state input, what flows into it)
  carried = set()
  base = {v for v in ins[:n] + ins[n + m:] if _size(v) > 1}
  while True:
    hits, tainted = _scan(jaxpr, base | carried)
    more = {s for s, o in fed if o in tainted} - carried
    if not more:
      break
    carried |= more
  if not hits:
    return None
  roots = {v for v in outs[:n] if isinstance(v, jex_core.Var)}
  while True:
    found, needed = _needed_hit(jaxpr, hits, roots)
    more = {o for s, o in fed if s in needed} - roots
    if found or not more:
      return found
    roots |= more


def _signature(jaxpr) -> list[str]:
  """The operations ``jaxpr`` runs, in order, sub-jaxprs inlined, without shapes."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name not in _SHAPE_ONLY:
      out.append(eqn.primitive.name)
    for sub in _sub_jaxprs(eqn):
      out.extend(_signature(sub))
  return out


def _size(var) -> int:
  return math.prod(getattr(var.aval, "shape", ()))


def _sub_jaxprs(eqn):
  for value in eqn.params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(item, jex_core.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jex_core.Jaxpr):
        yield item


def _reduced_elements(eqn, var) -> int:
  """How many elements of ``var`` one output element of a mixing ``eqn`` reads."""
  shape = getattr(var.aval, "shape", ())
  if eqn.primitive.name in _REDUCTIONS and "axes" in eqn.params:
    return math.prod(shape[a] for a in eqn.params["axes"])
  if eqn.primitive.name in _REDUCTIONS and "axis" in eqn.params:  # cumulative ops
    return shape[eqn.params["axis"]] if shape else 1
  if eqn.primitive.name == "dot_general":
    (lhs, rhs), _ = eqn.params["dimension_numbers"]
    dims = lhs if var is eqn.invars[0] else rhs
    return math.prod(shape[d] for d in dims)
  return _size(var)


def _sub_taint(eqn, sub, tainted: set) -> set:
  """The inputs of ``sub`` (a jaxpr in ``eqn``'s params) that carry tainted values: the
  outer inputs line up with its last ones (cond's index, while's cond consts come
  first); a loop's carry may take a tainted value in any iteration, so all of a
  loop's inputs are."""
  if eqn.primitive.name in ("while", "scan") or len(sub.invars) > len(eqn.invars):
    return set(sub.invars)
  outer = eqn.invars[len(eqn.invars) - len(sub.invars):]
  return {v for v, o in zip(sub.invars, outer) if isinstance(o, jex_core.Var) and o in tainted}


def _first(jaxpr, tainted: set) -> str | None:
  """The first mixing eqn of ``jaxpr`` whose input is ``tainted`` (derived from the
  row-shaped inputs) and that the outputs depend on."""
  hits, _ = _scan(jaxpr, tainted)
  if not hits:
    return None
  return _needed_hit(jaxpr, hits, {v for v in jaxpr.outvars if isinstance(v, jex_core.Var)})[0]


def _scan(jaxpr, tainted: set) -> tuple[dict, set]:
  """``(hits, tainted)``: a description of each mixing eqn of ``jaxpr`` (by index) whose
  input is ``tainted`` or that draws random numbers, and every var derived from them."""
  tainted = set(tainted)
  hits = {}  # eqn index -> description
  for i, eqn in enumerate(jaxpr.eqns):
    if eqn.primitive.name in _RANDOM and any(_size(v) > 1 for v in eqn.outvars):
      hits[i] = f"{eqn.primitive.name} of {eqn.outvars[0].aval.str_short()} (a random draw)"
      tainted.update(eqn.outvars)
      continue
    ins = [v for v in eqn.invars if isinstance(v, jex_core.Var) and v in tainted]
    if not ins:
      for sub in _sub_jaxprs(eqn):  # a random draw from an untouched key (add_noise)
        found = _first(sub, set())
        if found:
          hits[i] = found
          tainted.update(eqn.outvars)
          break
      continue
    tainted.update(eqn.outvars)
    if eqn.primitive.name in _MIXING:
      wide = [v for v in ins if _reduced_elements(eqn, v) > 1]
      if wide:
        hits[i] = f"{eqn.primitive.name} over {wide[0].aval.str_short()}"
        continue
    for sub in _sub_jaxprs(eqn):  # pjit, cond, custom_jvp/vjp, scan, while
      found = _first(sub, _sub_taint(eqn, sub, tainted))
      if found:
        hits[i] = found
        break
  return hits, tainted


def _needed_hit(jaxpr, hits: dict, roots: set) -> tuple[str | None, set]:
  """``(description, needed)``: the last hit that ``roots`` (vars of ``jaxpr``) depend
  on, walking back, or None and every var they depend on."""
  needed = set(roots)
  for i in range(len(jaxpr.eqns) - 1, -1, -1):
    eqn = jaxpr.eqns[i]
    if not any(v in needed for v in eqn.outvars):
      continue
    if i in hits:
      return hits[i], needed
    needed.update(v for v in eqn.invars if isinstance(v, jex_core.Var))
  return None, needed
