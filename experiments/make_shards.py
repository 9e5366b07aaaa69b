r"""Write Parquet or ArrayRecord shards for `--config.data.train` / `data.eval`.

From your own arrays (.npz: one array per column; CSV with a header; JSON Lines, one
object per line, lists of numbers of one length per key; CSV and JSON Lines also
compressed, .csv.gz / .jsonl.gz; Parquet; a glob or a directory of them). Columns that are
not numbers (text, nested objects) are left out and named; --columns=a,b writes only those:

    python -m experiments.make_shards --input=clicks.npz --out=/data/clicks --num_shards=4
    python -m experiments.make_shards --input='logs/*.csv' --out=/data/logs --format=array_record
    python -m experiments.make_shards --input='events-*.jsonl.gz' --out=/data/events \
        --columns=features,label

From a config's synthetic generator (what its `data.train` variant reads):

    python -m experiments.make_shards --config=configs/recommender_2x4.py --examples=8192 \
        --num_shards=4 --out=/tmp/jaxcoll-runs/shards/recommender
    python -m experiments.make_shards --config=configs/recommender_2x4.py --split=eval \
        --examples=1000 --out=/tmp/jaxcoll-runs/shards/recommender

Writes OUT/{split}-00000-of-0000N.{parquet|array_record} (rows split into
contiguous shards; each column one batch key, lists of fixed length with
their shape kept; Parquet with page checksums, which the trainer's reader
verifies) and prints the paths. Bad input: one line on stderr, exit 2.

The input is read a chunk at a time (a Parquet row group; 1 MiB blocks of CSV / JSON Lines
text, after a first pass that checks and counts every row; .npz arrays streamed from the
zip) and the shards written as it goes: files larger than memory convert. The shards are
renamed into place once every row is written (a failure leaves OUT's old ones).
"""

from __future__ import annotations

import os
import signal

os.environ.setdefault("JAXCOLL_CPU_DEVICES", "1")

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from experiments import _cli  # noqa: E402

_REPO = _cli.use_shipped_configs("make_shards")  # --config=NAME: a shipped one
try:
  _CONFIG = config_flags.DEFINE_config_file(
      "config", None, "Training config whose workload's synthetic generator writes the rows.",
      lock_config=True,
  )
except (KeyError, AttributeError, ValueError, TypeError, OSError) as e:
  _cli.fail("make_shards", _cli.explain_config_error(e))
_INPUT = flags.DEFINE_string("input", "", "Input file(s): .npz, .csv, .jsonl or .parquet (a "
                             "glob or a directory; .csv.gz, .jsonl.gz too).")
_OUT = flags.DEFINE_string("out", "", "Output directory.")
_FORMAT = flags.DEFINE_enum("format", "parquet", ["parquet", "array_record"], "Shard format.")
_NUM_SHARDS = flags.DEFINE_integer("num_shards", 4,
                                    "Number of shards (unset: 4, or one a row for fewer rows).")
_EXAMPLES = flags.DEFINE_integer("examples", 4096, "Rows to generate (with --config).")
_SPLIT = flags.DEFINE_enum("split", "train", ["train", "eval"],
                           "Synthetic split (with --config); also the file prefix.")
_COLUMNS = flags.DEFINE_string(
    "columns", "", "With --input: the columns to write, comma-separated (default: every "
    "column of numbers).")
_ROW_GROUP = flags.DEFINE_integer("row_group_size", 1024, "Parquet rows per row group.")


def synthetic_rows(config, examples: int, split: str):
  """``examples`` rows of the config's workload's synthetic ``split``."""
  import numpy as np  # noqa: PLC0415

  from jaxcoll import models  # noqa: PLC0415

  workload = models.make_workload(config.model, **dict(config.model_overrides))
  if workload.dataset is None:
    raise ValueError(f"`--config` model {config.model!r} has no synthetic generator; use "
                     "--input with your own arrays.")
  if examples < 1:
    raise ValueError(f"`--examples` must be a positive integer, got {examples}.")
  return workload.dataset.examples(np.arange(examples), split)


class _Terminated(Exception):
  """SIGTERM while shards are written: the writer's temporary files are removed on the way out."""


def _terminated(signum, frame):  # noqa: ARG001 - a signal handler's signature
  raise _Terminated


def main(argv):
  _cli.no_positional("make_shards", argv, path_flag="input")
  from jaxcoll.data import convert, sources as data_sources  # noqa: PLC0415

  try:
    if not _OUT.value:
      raise ValueError("`--out` must name the output directory.")
    if bool(_INPUT.value) == (_CONFIG.value is not None):
      raise ValueError("give exactly one of `--input` (your arrays) and `--config` (a "
                       "config's synthetic generator).")
    skipped: dict[str, str] = {}
    if _INPUT.value:
      data = convert.open_input(_INPUT.value, _COLUMNS.value, skipped)
    else:
      data = convert.in_memory_rows(
          synthetic_rows(_CONFIG.value, _EXAMPLES.value, _SPLIT.value))
    if not data.columns:
      raise ValueError(f"`--input`={_INPUT.value!r}: no column of numbers to write ("
                       + "; ".join(f"{k}: {why}" for k, why in skipped.items())
                       + "); give arrays of numbers, one row per example.")
    rows = data.rows
    num_shards = _NUM_SHARDS.value
    if not flags.FLAGS["num_shards"].present:  # the default, 4: no more shards than rows
      num_shards = min(num_shards, rows)
    elif not 1 <= num_shards <= rows:
      raise ValueError(f"`--num_shards`={num_shards}: must be in 1..{rows} (the number of "
                       f"rows), e.g. --num_shards={min(max(num_shards, 1), rows)}.")
    # shard i: rows linspace(0, rows, num_shards + 1)[i:i + 2], known before a row is
    # read (Parquet footers; the first pass over CSV / JSON Lines; .npz headers)
    # A SIGTERM (a job's time limit, `kill`) ends the writing as Ctrl-C does: the shards
    # written so far are temporary files, removed; --out keeps what it held.
    signal.signal(signal.SIGTERM, _terminated)
    with data_sources.ShardWriter(_OUT.value, rows, num_shards=num_shards, fmt=_FORMAT.value,
                                  prefix=_SPLIT.value,
                                  row_group_size=_ROW_GROUP.value) as writer:
      for chunk in data.chunks():
        writer.write(chunk)
    paths = writer.paths
  except ValueError as e:
    _cli.fail("make_shards", str(e))
  except (_Terminated, KeyboardInterrupt) as e:
    by, status = (("SIGTERM", 128 + signal.SIGTERM) if isinstance(e, _Terminated)
                  else ("Ctrl-C", 128 + signal.SIGINT))
    _cli.stopped("make_shards", f"stopped by {by} before the last shard was written: "
                 f"nothing written to --out={_OUT.value!r} (what it held is as it was); "
                 "run the command again to write the shards.", status)
  shapes = {k: list(shape) for k, (_, shape) in writer.layout.items()}
  print(f"wrote {rows} rows, columns {shapes}, in {len(paths)} {_FORMAT.value} shards:")
  if skipped:
    print("not written: " + "; ".join(
        f"{k} {why}" if k == convert.EMPTY else f"column {k!r} ({why})"
        for k, why in skipped.items()))
  for path in paths:
    print(f"  {path}")


if __name__ == "__main__":
  app.run(main, flags_parser=_cli.flags_parser("make_shards"))
