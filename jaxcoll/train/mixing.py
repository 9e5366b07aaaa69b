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
diagnostic such as ``zero_nans``' flag does not).
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


def first_mixing_op(optimizer, rows_like) -> str | None:
  """A description of the first reduction across elements of ``optimizer``'s update
  on parameters shaped ``rows_like`` (a pytree of ``jax.ShapeDtypeStruct``), or None
  when the update is elementwise."""

  def updates(grads, params):
    return optimizer.update(grads, optimizer.init(params), params)[0]

  try:
    closed = jax.make_jaxpr(updates)(rows_like, rows_like)
  except Exception:  # noqa: BLE001  (the step itself reports an optimizer that fails)
    return None
  jaxpr = closed.jaxpr
  tainted = {v for v in jaxpr.invars if _size(v) > 1}
  return _first(jaxpr, tainted)


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
  tainted = set(tainted)
  hits = {}  # eqn index -> description
  for i, eqn in enumerate(jaxpr.eqns):
    ins = [v for v in eqn.invars if isinstance(v, jex_core.Var) and v in tainted]
    if not ins:
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
  if not hits:
    return None
  needed = {v for v in jaxpr.outvars if isinstance(v, jex_core.Var)}
  for i in range(len(jaxpr.eqns) - 1, -1, -1):
    eqn = jaxpr.eqns[i]
    if not any(v in needed for v in eqn.outvars):
      continue
    if i in hits:
      return hits[i]
    needed.update(v for v in eqn.invars if isinstance(v, jex_core.Var))
  return None
