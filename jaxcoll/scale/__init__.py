"""Models of training at scale: step time, memory per device, published results.

Layer: above :mod:`jaxcoll.train` (it asks strategies and plans what they keep
and communicate) and :mod:`jaxcoll.comm_model`.

- :mod:`~jaxcoll.scale.step_model`: the data-parallel training-step model
  (compute, bucketed communication, overlap) and its scaling predictions.
- :mod:`~jaxcoll.scale.memory`: the ZeRO memory formulas and XLA's measured
  per-device peak of a compiled step.
- :mod:`~jaxcoll.scale.published`: published scaling results the step model
  is checked against.
"""
