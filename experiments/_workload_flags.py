"""Flags shared by the experiments that build one workload on N devices
(bench_trainer, memory_plan), and the code that turns them into one."""

from __future__ import annotations

import os

from absl import flags

from experiments import _cli

MODEL = flags.DEFINE_string(
    "model", "mlp", "A jaxcoll.models workload name, or your own as module:function (the "
    "function returns a jaxcoll.models.Workload; the contract of --config.model).")
WIDTHS = flags.DEFINE_list("widths", ["512", "512"], "MLP hidden widths (model=mlp).")
DEVICES = flags.DEFINE_integer("devices", 8, "Data-parallel devices (emulated on CPU).")
BATCH = flags.DEFINE_integer("batch_size", 256, "Global batch size.")
DATA = flags.DEFINE_string(
    "data", "", "For a --model without a synthetic data set: a glob of its training files "
    "(Parquet / ArrayRecord); their first row gives the batch's columns and shapes.")


def workload_and_mesh(prog: str):
  """The workload the flags name and a flat mesh of ``--devices`` devices.

  Sets ``JAXCOLL_CPU_DEVICES`` before JAX starts (CPU simulation mode). Bad
  flags (unknown model, bad widths or device count) end the program: one
  line on stderr naming ``prog``, exit status 2.
  """
  try:
    return _workload_and_mesh()
  except ValueError as e:
    _cli.fail(prog, str(e))
    raise  # unreachable: fail exits


def _workload_and_mesh():
  os.environ.setdefault("JAXCOLL_CPU_DEVICES", str(DEVICES.value))
  import jaxcoll  # noqa: PLC0415 - after the device count is set

  overrides = {}
  if MODEL.value == "mlp":
    try:
      overrides["widths"] = tuple(int(w) for w in WIDTHS.value)
    except ValueError:
      raise ValueError(f"`--widths`={WIDTHS.value!r} must be integers, e.g. 512,512.") from None
  workload = make_workload(MODEL.value, overrides)
  return workload, jaxcoll.devices.flat_mesh(DEVICES.value)


def make_workload(name: str, overrides: dict):
  """``jaxcoll.models.make_workload(name, **overrides)``; ValueError (one line) naming
  ``--model`` for a name that is neither a jaxcoll model nor a ``module:function`` path."""
  import jaxcoll  # noqa: PLC0415

  if ":" not in name and name not in jaxcoll.models.names():
    raise ValueError(
        f"`--model`={name!r} is neither a jaxcoll model ({', '.join(jaxcoll.models.names())}) "
        "nor a 'module:function' path; write e.g. --model=my_pkg.my_model:make."
    )
  try:
    return jaxcoll.models.make_workload(name, **overrides)
  except ValueError as e:
    raise ValueError(f"`--model`={name!r}: {e}") from None


def batch_of(workload, batch_size: int):
  """A global batch of ``batch_size`` for ``workload``: its synthetic batch 0, or with
  ``--data`` (needed for a model trained only on files) shape structs of the files'
  columns (nothing of the data beyond one row is read). ValueError (one line) when
  the model has no synthetic data set and ``--data`` is not given."""
  if not DATA.value:
    if workload.dataset is None:
      raise ValueError(
          f"`--model`={MODEL.value!r} has no synthetic data set: pass --data=GLOB, its "
          "training files (their first row gives the batch's shapes), e.g. "
          "--data='/data/train-*.parquet'.")
    return workload.make_batch(0, batch_size)
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from jaxcoll.data import sources  # noqa: PLC0415

  source = sources.open_source(sources.patterns(DATA.value, "--data"), "--data")
  if not len(source):
    raise ValueError(f"`--data`={DATA.value!r}: the files hold no records.")
  row = source.read_rows([0])
  return {k: jax.ShapeDtypeStruct((batch_size, *np.shape(v)[1:]),
                                  jax.dtypes.canonicalize_dtype(np.asarray(v).dtype))
          for k, v in row.items()}


def batches_of(workload, batch_size: int, count: int, *, files: bool = True) -> list:
  """``count`` global batches of ``batch_size`` (numpy): the synthetic batches
  0..count-1, or with ``--data`` (and ``files``: False for a shipped model run beside
  ``--model``, which reads its own synthetic set) the files' records in order
  (wrapping around). ValueError (one line) as :func:`batch_of`."""
  if not DATA.value or not files:
    batch_of(workload, batch_size)  # the one-line error without a synthetic set
    return [workload.make_batch(i, batch_size) for i in range(count)]
  import numpy as np  # noqa: PLC0415

  from jaxcoll.data import sources  # noqa: PLC0415

  source = sources.open_source(sources.patterns(DATA.value, "--data"), "--data")
  if not len(source):
    raise ValueError(f"`--data`={DATA.value!r}: the files hold no records.")
  return [source.read_rows(np.arange(i * batch_size, (i + 1) * batch_size) % len(source))
          for i in range(count)]
