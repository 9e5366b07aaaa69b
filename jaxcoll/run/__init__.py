"""The experiment runner: the training loop and what keeps a run alive.

Layer: the top of the library. It wires configs to :mod:`jaxcoll.train`,
:mod:`jaxcoll.data` and :mod:`jaxcoll.observe`; no library module imports it.
``python -m experiments.train`` is a thin entry point into
:func:`jaxcoll.run.loop.train_and_evaluate`.

- ``config``: :class:`~jaxcoll.run.config.RunConfig`, the run's fields and
  their only defaults, parsed and checked once;
  ``loop``: train, evaluate, checkpoint, resume; ``inputs``: the input
  pipeline from the config; ``optim``: optimizer and schedule from the config;
  ``evaluate``: the evaluator; ``hooks``: fault injection and test hooks;
  ``watchdog``, ``lock``, ``attempts``: a hung step, a second job on the same
  workdir, the history of attempts; ``timing``, ``profiling``: step time per
  process, profiler traces; ``config_error``: one-line config errors.
"""
