"""Guards a training step relies on: non-finite gradients and replica desync.

* :func:`all_finite`: one flag, equal on every device, saying whether every
  gradient element on every device is finite (a ``min`` all-reduce of a
  scalar). With ``nan_policy="skip"`` the step's new state is replaced by the
  old one (:func:`keep_if`) on every device alike, so replicas stay identical.
* :func:`fingerprint`: a cheap per-leaf checksum of the bits of a pytree,
  computed on each device (no communication); comparing the devices' rows on
  the host finds a replica that silently diverged, and names the leaf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcoll import collectives
from jaxcoll import fingerprint as fingerprint_lib
from jaxcoll.errors import NonFiniteGradientsError as NonFiniteGradientsError

NAN_POLICIES = ("none", "skip", "raise")


def all_finite(grads, axis) -> jax.Array:
  """int32 1 if every element of ``grads`` is finite on every device, else 0."""
  leaves = [g for g in jax.tree.leaves(grads) if jnp.issubdtype(g.dtype, jnp.inexact)]
  ok = jnp.ones((), jnp.int32)
  for g in leaves:
    ok = ok & jnp.all(jnp.isfinite(g)).astype(jnp.int32)
  return collectives.all_reduce(ok, axis, op="min", algorithm="native")


def keep_if(ok: jax.Array, new, old):
  """``new`` where ``ok`` (a scalar) is 1, else ``old``, leaf by leaf."""
  return jax.tree.map(lambda n, o: jnp.where(ok.astype(bool), n, o), new, old)


# The replicas' desync check and the checkpoints' checksums are one fingerprint.
fingerprint = fingerprint_lib.fingerprint


def gather_rows(rows) -> np.ndarray:
  """Every process's fingerprint rows, stacked (this process's alone on one)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # noqa: PLC0415

    rows = multihost_utils.process_allgather(rows, tiled=True)
  return np.asarray(rows)


def mismatches(rows: np.ndarray, names: list[str], group_size: int | None = None) -> list[str]:
  """Leaves whose fingerprint differs between devices (``rows``: devices x leaves).

  With ``group_size``, row ``d`` is compared with row ``d % group_size`` only (hybrid
  sharding: the devices at one position of each replica group hold the same rows)."""
  problems = []
  first = (np.zeros(len(rows), int) if group_size is None
           else np.arange(len(rows)) % group_size)  # each row's reference row
  for k, name in enumerate(names):
    column = rows[:, k]
    for ref in np.unique(first):
      bad = [int(d) for d in np.nonzero((column != column[ref]) & (first == ref))[0]]
      if bad:
        problems.append(f"{name}: devices {bad} differ from device {int(ref)}")
  return problems
