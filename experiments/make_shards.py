r"""Write Parquet or ArrayRecord shards for `--config.data.train` / `data.eval`.

From your own arrays (.npz: one array per column; CSV with a header; JSON Lines, one
object per line, lists of numbers of one length per key; Parquet):

    python -m experiments.make_shards --input=clicks.npz --out=/data/clicks --num_shards=4
    python -m experiments.make_shards --input='logs/*.csv' --out=/data/logs --format=array_record
    python -m experiments.make_shards --input='events-*.jsonl' --out=/data/events

From a config's synthetic generator (what its `data.train` variant reads):

    python -m experiments.make_shards --config=configs/recommender_2x4.py --examples=8192 \
        --num_shards=4 --out=/tmp/jaxcoll/shards/recommender
    python -m experiments.make_shards --config=configs/recommender_2x4.py --split=eval \
        --examples=1000 --out=/tmp/jaxcoll/shards/recommender

Writes OUT/{split}-00000-of-0000N.{parquet|array_record} (rows split into
contiguous shards; each column one batch key, lists of fixed length with
their shape kept; Parquet with page checksums, which the trainer's reader
verifies) and prints the paths. Bad input: one line on stderr, exit 2.
"""

from __future__ import annotations

import os

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
_INPUT = flags.DEFINE_string("input", "", "Input file(s): .npz, .csv, .jsonl or .parquet (a glob).")
_OUT = flags.DEFINE_string("out", "", "Output directory.")
_FORMAT = flags.DEFINE_enum("format", "parquet", ["parquet", "array_record"], "Shard format.")
_NUM_SHARDS = flags.DEFINE_integer("num_shards", 4, "Number of shards.")
_EXAMPLES = flags.DEFINE_integer("examples", 4096, "Rows to generate (with --config).")
_SPLIT = flags.DEFINE_enum("split", "train", ["train", "eval"],
                           "Synthetic split (with --config); also the file prefix.")
_ROW_GROUP = flags.DEFINE_integer("row_group_size", 1024, "Parquet rows per row group.")


def read_input(pattern: str):
  """The columns of ``pattern``'s files (.npz, .csv, .jsonl or .parquet), concatenated."""
  import glob  # noqa: PLC0415

  import numpy as np  # noqa: PLC0415

  from jaxcoll.data import sources as data_sources  # noqa: PLC0415

  paths = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
  if not paths:
    raise ValueError(f"`--input`={pattern!r} matches no file; give .npz, .csv, .jsonl or "
                     ".parquet files.")
  kinds = {os.path.splitext(p)[1].lower() for p in paths}
  kinds = {".jsonl" if k == ".json" else k for k in kinds}
  if len(kinds) != 1 or not kinds <= {".npz", ".csv", ".jsonl", ".parquet"}:
    raise ValueError(f"`--input` must be files of one kind (.npz, .csv, .jsonl or .parquet), "
                     f"got {sorted(kinds)}.")
  kind = kinds.pop()
  if kind == ".parquet":
    source = data_sources.open_source(paths, "--input")
    return source.read_rows(np.arange(len(source)))
  parts = []
  for path in paths:
    if kind == ".npz":
      with np.load(path) as f:
        parts.append({k: f[k] for k in f.files})
    elif kind == ".jsonl":  # one JSON object per line (pyarrow's reader)
      import pyarrow as pa  # noqa: PLC0415
      from pyarrow import json as pa_json  # noqa: PLC0415

      try:
        table = pa_json.read_json(path)
        parts.append({k: data_sources.column_to_numpy(table.column(k), k)
                      for k in table.column_names})
      except Exception as e:  # noqa: BLE001  (pyarrow's ArrowInvalid; ours ValueError)
        if isinstance(e, ValueError) and not isinstance(e, pa.ArrowException):
          raise ValueError(f"`--input`: {os.path.basename(path)}: "  # ragged lists, nulls
                           f"{str(e).split(' (pad them')[0].rstrip('.')}.") from None
        raise ValueError(f"`--input`: {os.path.basename(path)}: {type(e).__name__}: "
                         f"{' '.join(str(e).split())}; give one JSON object per line whose "
                         "values are numbers or lists of numbers of one length.") from None
    else:
      from pyarrow import csv  # noqa: PLC0415

      table = csv.read_csv(path)
      for k in table.column_names:  # an empty cell is a null: it became NaN (or a float label)
        if table.column(k).null_count:
          raise ValueError(
              f"`--input`: {os.path.basename(path)}: column {k!r} has "
              f"{table.column(k).null_count} empty value(s); every row needs a value: fill "
              "or drop them before converting.")
      parts.append({k: table.column(k).to_numpy() for k in table.column_names})
  keys = list(parts[0])
  for path, part in zip(paths, parts, strict=True):
    if list(part) != keys:
      raise ValueError(f"`--input`: {os.path.basename(path)} has columns {list(part)}, but "
                       f"{os.path.basename(paths[0])} has {keys}; give files with one schema.")
  return {k: np.concatenate([p[k] for p in parts]) for k in keys}


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


def main(argv):
  if len(argv) > 1:
    _cli.fail("make_shards", f"unexpected arguments {argv[1:]}; every option is a --flag.")
  from jaxcoll.data import sources as data_sources  # noqa: PLC0415

  try:
    if not _OUT.value:
      raise ValueError("`--out` must name the output directory.")
    if bool(_INPUT.value) == (_CONFIG.value is not None):
      raise ValueError("give exactly one of `--input` (your arrays) and `--config` (a "
                       "config's synthetic generator).")
    if _INPUT.value:
      columns = read_input(_INPUT.value)
    else:
      columns = synthetic_rows(_CONFIG.value, _EXAMPLES.value, _SPLIT.value)
    paths = data_sources.write_shards(
        columns, _OUT.value, num_shards=_NUM_SHARDS.value, fmt=_FORMAT.value,
        prefix=_SPLIT.value, row_group_size=_ROW_GROUP.value,
    )
  except ValueError as e:
    _cli.fail("make_shards", str(e))
  rows = len(next(iter(columns.values())))
  shapes = {k: list(v.shape[1:]) for k, v in columns.items()}
  print(f"wrote {rows} rows, columns {shapes}, in {len(paths)} {_FORMAT.value} shards:")
  for path in paths:
    print(f"  {path}")


if __name__ == "__main__":
  app.run(main, flags_parser=_cli.flags_parser("make_shards"))
