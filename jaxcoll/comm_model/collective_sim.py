"""The collective simulator: predicted time and bandwidth of every algorithm.

:func:`simulate` sweeps device counts and sizes on a preset's cluster
(``Topology.cluster``) with :mod:`jaxcoll.cost`'s model and marks the
fastest algorithm of each point; ``python -m experiments.simulate`` prints
and plots it. One level up, :mod:`jaxcoll.step_model` predicts whole
training steps from the same estimates. The sweep is defined in
:mod:`jaxcoll.comm_model.cost` (``jaxcoll.cost.simulate`` and
``jaxcoll.cost.SimRow`` are the same objects), so that this module imports
the cost model and not the other way round.

Example:
  >>> rows = simulate("dgx-h100", device_counts=[32], sizes=[1 << 30])
  >>> next(r.algorithm for r in rows if r.best)
  'native'
"""

from __future__ import annotations

from jaxcoll.comm_model.cost import SimRow as SimRow
from jaxcoll.comm_model.cost import simulate as simulate

__all__ = ["SimRow", "simulate"]
