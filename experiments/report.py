r"""The run report: `python -m experiments.report --workdir=DIR`.

    python -m experiments.train --workdir=/tmp/default
    python -m experiments.report --workdir=/tmp/default

Writes DIR/report.png (loss and eval curves, step time per process,
examples/s, data / checkpoint / eval time, skipped steps; checkpoints and
restarts marked on the step axis) and DIR/report.txt, the short summary it
prints, from DIR/metrics.jsonl and DIR/summary.json. Needs matplotlib
(`pip install 'jaxcoll[plot]'`). Bad input (no such directory, no
metrics.jsonl, no matplotlib): one line on stderr, exit status 2. The
library side: jaxcoll/run_report.py.
"""

from __future__ import annotations

import sys

from absl import app, flags

from experiments import _cli

_PROG = "report"
_WORKDIR = flags.DEFINE_string("workdir", None, "The --workdir of a training run.")


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    _cli.fail(_PROG, f"unexpected arguments {argv[1:]}; every option is a --flag.")
  if not _WORKDIR.value:
    _cli.fail(_PROG, "`--workdir` is required: the --workdir of a training run, e.g. "
              "--workdir=runs/default.")
  from jaxcoll.observe import run_report  # noqa: PLC0415  (after flag parsing: the jax import)

  try:
    text = run_report.write_report(_WORKDIR.value)
  except (ValueError, ImportError) as e:
    _cli.fail(_PROG, str(e))
  print(text)
  print(f"wrote {_WORKDIR.value}/report.png and report.txt", file=sys.stderr)
  return 0


if __name__ == "__main__":
  app.run(main, flags_parser=_cli.flags_parser(_PROG))
