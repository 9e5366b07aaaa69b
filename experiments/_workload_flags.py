"""Flags shared by the experiments that build one workload on N devices
(bench_trainer, memory_plan), and the code that turns them into one."""

from __future__ import annotations

import os

from absl import flags

from experiments import _cli

MODEL = flags.DEFINE_string("model", "mlp", "A jaxcoll.models workload name.")
WIDTHS = flags.DEFINE_list("widths", ["512", "512"], "MLP hidden widths (model=mlp).")
DEVICES = flags.DEFINE_integer("devices", 8, "Data-parallel devices (emulated on CPU).")
BATCH = flags.DEFINE_integer("batch_size", 256, "Global batch size.")


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
  if MODEL.value not in jaxcoll.models.names():
    raise ValueError(
        f"`--model`={MODEL.value!r}; valid models: {', '.join(jaxcoll.models.names())}."
    )
  workload = jaxcoll.models.make_workload(MODEL.value, **overrides)
  return workload, jaxcoll.devices.flat_mesh(DEVICES.value)
