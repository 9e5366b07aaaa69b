r"""The run report: `python -m experiments.report --workdir=DIR`.

    python -m experiments.train --workdir=/tmp/default
    python -m experiments.report --workdir=/tmp/default

Writes DIR/report.png (loss and eval curves, step time per process,
examples/s, data / checkpoint / eval time, skipped steps; checkpoints and
restarts marked on the step axis) and DIR/report.txt, the short summary it
prints, from DIR/metrics.jsonl and DIR/summary.json. Needs matplotlib
(`pip install 'jaxcoll[plot]'`). ``--out_dir=OTHER`` writes the two files
there instead (e.g. for a read-only workdir; the eval-only rows that
`experiments.eval --out_dir=OTHER` recorded there are shown too, with
DIR/evals.jsonl's). A metrics.jsonl empty or missing in a run that has
summary.json or checkpoints/: reported, with a line saying no metrics were
logged. Bad input (no such directory, no metrics.jsonl rows and no run
there, no matplotlib): one line on stderr, exit status 2. A directory
it cannot write: the summary is still printed, then one line says why, exit
status 2. The library side: jaxcoll/observe/run_report.py.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging

from experiments import _cli

_PROG = "report"
_WORKDIR = flags.DEFINE_string("workdir", None, "The --workdir of a training run.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Where to write report.png and report.txt "
                               "(default: the --workdir).")


def main(argv: list[str]) -> int:
  _cli.no_positional(_PROG, argv, path_flag="workdir")
  if not _WORKDIR.value:
    _cli.fail(_PROG, "`--workdir` is required: the --workdir of a training run, e.g. "
              "--workdir=runs/default.")
  if not flags.FLAGS["verbosity"].present and not _cli.is_verbose():
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint it opens at INFO
  # The report reads checkpoints on the host: it never takes an accelerator (on a GPU node
  # JAX would reserve most of a GPU's memory, perhaps one a training job is using).
  os.environ["JAX_PLATFORMS"] = "cpu"
  from jaxcoll.observe import run_report  # noqa: PLC0415  (after flag parsing: the jax import)

  from jaxcoll.atomic_write import write_atomic  # noqa: PLC0415

  out = _OUT_DIR.value or _WORKDIR.value
  try:
    run = run_report.load_run(_WORKDIR.value, eval_dirs=[_OUT_DIR.value] if _OUT_DIR.value else ())
    text = run_report.summarize(run)
  except (ValueError, ImportError) as e:
    _cli.fail(_PROG, str(e))
  try:
    os.makedirs(out, exist_ok=True)
    run_report.draw(run, os.path.join(out, "report.png"))
    write_atomic(os.path.join(out, "report.txt"), text + "\n")
  except ImportError as e:
    _cli.fail(_PROG, str(e))
  except OSError as e:  # a read-only workdir, a full disk: the summary still shows
    print(text)
    sys.stdout.flush()
    where = e.filename or out
    _cli.fail(_PROG, f"cannot write the report in {out} ({e.strerror or e}: {where}); the "
              "summary is printed above; pass --out_dir=A_WRITABLE_DIR to write report.png "
              "and report.txt there.")
  print(text)
  print(f"wrote {out}/report.png and report.txt", file=sys.stderr)
  return 0


if __name__ == "__main__":
  app.run(main, flags_parser=_cli.flags_parser(_PROG))
