"""The console scripts: ``jaxcoll <command>`` and ``jaxcoll-train`` & co.

``pip install .`` (or ``pip install jaxcoll``) installs them; they work from
any directory. ``jaxcoll train --workdir=DIR`` is exactly ``python -m
experiments.train --workdir=DIR`` in a checkout, and so for every command of
:data:`COMMANDS`; ``jaxcoll launch ...`` is ``python -m jaxcoll.launch ...``.

The runner's modules and the training configs ship inside the package (the
checkout's ``experiments/`` and ``configs/``, installed under
``jaxcoll/_shipped/``); in a checkout they are read where they are. A
command runs in a fresh interpreter (see :func:`run_command`) with the
directory that holds them first on ``sys.path``, then the current directory
(as ``python -m`` puts it there), so ``--config.model=my_module:make``
finds a model in the directory you run from. ``--config=NAME`` names a
shipped config (``jaxcoll train --config=resnet_dp8:smoke``); ``jaxcoll
configs`` lists them.
"""

from __future__ import annotations

import os
import sys

from jaxcoll.errors import EXIT_USAGE

# command -> (module under experiments/, what it does)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train", "train a workload (a config) into a workdir"),
    "eval": ("eval", "evaluate a run's checkpoint without training (evals.jsonl)"),
    "report": ("report", "report.png and report.txt of a run's workdir"),
    "bench": ("bench_collectives", "nccl-tests-style benchmark of the collectives"),
    "tune": ("tune", "measure a tuning table for `auto`"),
    "simulate": ("simulate", "cost-model simulation of collectives on a cluster"),
    "simulate_training": ("simulate_training", "predicted step time of training at scale"),
    "memory_plan": ("memory_plan", "ZeRO memory plan checked against XLA"),
    "make_shards": ("make_shards", "write Parquet / ArrayRecord shards"),
    "bench_trainer": ("bench_trainer", "time the trainer's step"),
    "bench_input": ("bench_input", "time the input pipeline against the step"),
    "compile_time": ("compile_time", "trace and compile time of every all_reduce algorithm"),
    "demo": ("demo_collectives", "check, time and analyse every all_reduce algorithm"),
}


def root() -> str:
  """The directory holding ``experiments/`` and ``configs/`` (installed or checkout)."""
  here = os.path.dirname(os.path.abspath(__file__))
  for candidate in (os.path.join(here, "_shipped"), os.path.dirname(here)):
    if os.path.isfile(os.path.join(candidate, "experiments", "train.py")):
      return candidate
  raise RuntimeError(
      f"jaxcoll's runner is not installed next to {here} (no _shipped/experiments): "
      "reinstall jaxcoll (pip install --force-reinstall jaxcoll)."
  )


def configs_dir() -> str:
  """Where the shipped configs are."""
  return os.path.join(root(), "configs")


def config_names() -> tuple[str, ...]:
  """The shipped configs, by the name ``--config=NAME`` takes."""
  return tuple(sorted(
      f[:-3] for f in os.listdir(configs_dir())
      if f.endswith(".py") and not f.startswith("_") and f != "base.py"
  ))


def run_command(module: str, argv: list[str]) -> None:
  """Replaces this process with ``python -m experiments.<module> ARGV``.

  A fresh interpreter (``exec``, same pid: signals from a launcher, mpirun
  or srun reach it), so the command sets up JAX exactly as ``python -m``
  does in a checkout; :func:`root` goes first on ``sys.path``, then the
  current directory, so a folder of yours named ``experiments`` or
  ``configs`` does not shadow jaxcoll's.
  """
  code = ("import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
          f"runpy.run_module('experiments.{module}', run_name='__main__', alter_sys=True)")
  sys.stdout.flush()
  sys.stderr.flush()
  os.execv(sys.executable, [sys.executable, "-c", code, root(), *argv])


def _usage() -> str:
  width = max(map(len, COMMANDS))
  lines = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
  lines.append(f"  {'launch':<{width}}  run a command as a multi-process job (jaxcoll.launch)")
  lines.append(f"  {'configs':<{width}}  list the shipped configs (--config=NAME)")
  return ("usage: jaxcoll <command> [--flags]   (jaxcoll <command> --help for its flags)\n"
          "commands:\n" + "\n".join(lines))


def _say(text: str) -> None:
  """Prints ``text``; a reader that left (``jaxcoll configs | head -1``) ends the listing
  quietly, as a Unix tool does (the commands themselves: ``experiments._cli``)."""
  try:
    print(text, flush=True)
  except BrokenPipeError:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # the exit's flush finds no pipe either
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
  """``jaxcoll <command> [flags]``."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help", "help"):
    _say(_usage())
    return 0 if argv else EXIT_USAGE
  command, rest = argv[0], argv[1:]
  if command == "launch":
    return launch(rest)
  if command == "configs":
    _say("\n".join(config_names()))
    return 0
  if command not in COMMANDS:
    print(f"jaxcoll: error: unknown command {command!r}; valid commands: "
          f"{', '.join([*COMMANDS, 'launch', 'configs'])}.", file=sys.stderr)
    return EXIT_USAGE
  run_command(COMMANDS[command][0], rest)
  return 0  # not reached: run_command replaces the process


def launch(argv: list[str] | None = None) -> int:
  """``jaxcoll-launch``: :func:`jaxcoll.runtime.launch.main`."""
  from jaxcoll.runtime import launch as launch_lib  # noqa: PLC0415

  return launch_lib.main(list(sys.argv[1:] if argv is None else argv))


def _script(command: str):
  def run() -> int:
    run_command(COMMANDS[command][0], sys.argv[1:])
    return 0  # not reached

  run.__name__ = run.__qualname__ = command
  run.__doc__ = f"``jaxcoll-{command}``: ``python -m experiments.{COMMANDS[command][0]}``."
  return run


train = _script("train")
evaluate = _script("eval")  # `jaxcoll-eval` (not `eval`: a builtin's name)
report = _script("report")
bench = _script("bench")


if __name__ == "__main__":
  sys.exit(main())
