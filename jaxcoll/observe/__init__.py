"""Measurement: HLO communication report, benchmarks, metrics and run reports.

Layer: above :mod:`jaxcoll.collectives`, :mod:`jaxcoll.comm_model` and
:mod:`jaxcoll.train`; below the runner.

- :mod:`~jaxcoll.observe.analysis`: every collective of a compiled function
  and the bytes each device sends (the HLO communication report).
- :mod:`~jaxcoll.observe.comm_share`: the share of a step spent communicating.
- :mod:`~jaxcoll.observe.bench`: the nccl-tests-style harness.
- :mod:`~jaxcoll.observe.metrics`: JSONL / TensorBoard writers, progress.
- :mod:`~jaxcoll.observe.run_report`: the run report (text and PNG).
"""
