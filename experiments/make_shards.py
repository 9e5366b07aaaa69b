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


_KINDS = (".npz", ".csv", ".jsonl", ".json", ".parquet")
_EMPTY = "files of no rows (read past, as the trainer reads past empty shards)"


def _npz_columns(path: str, name: str, wanted: list[str], skipped: dict) -> dict:
  """The arrays of the .npz ``path`` that can be columns: arrays of numbers or bools
  with one row per example. A scalar (``num_classes=10``), text (``names``) or an object
  array (pickled: never loaded) is left out into ``skipped``; an array of numbers whose
  length is not the others' (``class_weights`` of 10 rows) is one line naming it and
  ``--columns``."""
  import numpy as np  # noqa: PLC0415

  part = {}
  with np.load(path, allow_pickle=False) as f:
    for k in f.files:
      if wanted and k not in wanted:
        continue
      try:
        v = f[k]
      except ValueError:  # an object array: loading it would unpickle
        skipped[k] = "an object array, not numbers; pickled objects are not loaded"
        continue
      if v.dtype.kind not in "biuf":
        skipped[k] = f"{v.dtype}, not numbers"
      elif v.ndim == 0:
        skipped[k] = f"a scalar ({v.item()!r}), not one value per row"
      else:
        part[k] = v
  lengths = {k: len(v) for k, v in part.items()}
  if len(set(lengths.values())) > 1:
    counts = sorted(set(lengths.values()), key=lambda n: (-list(lengths.values()).count(n), -n))
    rows = counts[0]
    odd = [k for k, n in lengths.items() if n != rows]
    keep = [k for k, n in lengths.items() if n == rows]
    raise ValueError(f"`--input`: {name}: array {odd[0]!r} has {lengths[odd[0]]} rows, but "
                     f"{keep[0]!r} has {rows}; every column needs one row per example: "
                     f"leave it out, --columns={','.join(keep)}.")
  return part


def read_input(pattern: str, columns: str = "", skipped: dict | None = None):
  """The columns of ``pattern``'s files (.npz, .csv, .jsonl or .parquet; CSV and JSON
  Lines also compressed, ``.csv.gz``; a directory: its files at any depth), concatenated.

  ``columns``: a comma-separated list of the columns to write (default: every column of
  numbers). Columns that are not numbers (text, nested objects) and, of Parquet, columns
  the files disagree on are left out, each into ``skipped`` with its reason."""
  import glob  # noqa: PLC0415

  import numpy as np  # noqa: PLC0415

  from jaxcoll.data import sources as data_sources  # noqa: PLC0415

  skipped = {} if skipped is None else skipped
  wanted = [c.strip() for c in columns.split(",") if c.strip()]
  path = os.path.expanduser(pattern)
  if os.path.isdir(path):  # as pyarrow.dataset reads one: '.' and '_' names skipped
    paths = data_sources.directory_files(path, _KINDS)
  else:
    found = [path] if os.path.isfile(path) else sorted(glob.glob(path, recursive=True))
    paths = [p for p in found if os.path.isfile(p)]
    dirs = [p for p in found if os.path.isdir(p)]
    if not paths and dirs and all(data_sources.extension(d) in _KINDS for d in dirs):
      # Spark's df.write.parquet("/data/train_2024.parquet") writes a directory: read
      # each one the glob names, as the trainer does
      paths = [f for d in dirs for f in data_sources.directory_files(d, _KINDS)]
  if not paths:
    raise ValueError(f"`--input`={pattern!r} matches no file; give .npz, .csv, .jsonl or "
                     ".parquet files (.csv.gz, .jsonl.gz too), a glob or a directory of them.")
  kinds = {data_sources.extension(p) for p in paths}
  kinds = {".jsonl" if k == ".json" else k for k in kinds}
  if len(kinds) != 1 or not kinds <= set(_KINDS):
    raise ValueError(f"`--input` must be files of one kind (.npz, .csv, .jsonl or .parquet), "
                     f"got {sorted(kinds)}.")
  kind = kinds.pop()

  def pick(part: dict, name: str, numbers=None) -> dict:
    """``part``'s columns to write: ``--columns``'s (each must be there), else all
    (``numbers``: every column of numbers the file has)."""
    if not wanted:
      return part
    lacking = [c for c in wanted if c not in part]
    if lacking:
      why = f" ({skipped[lacking[0]]})" if lacking[0] in skipped else ""
      raise ValueError(f"`--columns`: {name} has no column {lacking[0]!r} of numbers{why}; "
                       f"its columns of numbers: {sorted(part if numbers is None else numbers)}.")
    return {c: part[c] for c in wanted}

  if kind == ".parquet":
    source = data_sources.open_source(paths, "--input", strict=False)
    for c, why in source.conflicts.items():
      skipped[c] = why.reason
    for c in source.ignored_columns:
      skipped[c] = "not numbers"
    return pick(source.read_rows(np.arange(len(source))), "the files")
  parts, empty, read = [], [], []
  for path in paths:
    name = os.path.basename(path)
    if kind == ".npz":
      parts.append(pick(_npz_columns(path, name, wanted, skipped), name))
      read.append(name)
      continue
    import pyarrow as pa  # noqa: PLC0415
    from pyarrow import csv, json as pa_json  # noqa: PLC0415

    try:  # one JSON object per line (pyarrow's reader); CSV with a header
      table = pa_json.read_json(path) if kind == ".jsonl" else csv.read_csv(path)
    except Exception as e:  # noqa: BLE001  (pyarrow's ArrowInvalid, a bad gzip's OSError)
      if isinstance(e, pa.ArrowInvalid) and "Empty JSON file" in str(e):
        empty.append(name)  # no rows, as a CSV of only its header: read past
        continue
      raise ValueError(f"`--input`: {name}: {type(e).__name__}: {' '.join(str(e).split())}; "
                       + ("give one JSON object per line whose values are numbers or lists of "
                          "numbers of one length." if kind == ".jsonl" else
                          "give a CSV file with a header line.")) from None
    if table.num_rows == 0:  # its columns have no types (null): not compared
      empty.append(name)
      continue
    padded = _zero_padded(path, table) if kind == ".csv" else {}
    part, numbers = {}, []
    for k in table.column_names:
      column = table.column(k)
      if k in padded:  # "007": an id pyarrow would read as 7
        skipped[k] = f"text with leading zeros, e.g. {padded[k]!r}, not numbers"
        continue
      if not data_sources.numeric_type(column.type):  # text, nested objects, dates
        skipped[k] = f"{column.type}, not numbers"
        continue
      numbers.append(k)
      if wanted and k not in wanted:
        continue
      if column.null_count:  # an empty CSV cell, a key some JSON lines lack: a null
        raise ValueError(
            f"`--input`: {name}: column {k!r} has {column.null_count} "
            f"{'empty value' if kind == '.csv' else 'null or missing value'}(s); every row "
            "needs a value: fill or drop them before converting"
            + ("" if wanted else ", or leave the column out: --columns=NAME,NAME,...")
            + ".")
      try:
        part[k] = data_sources.column_to_numpy(column, k)
      except ValueError as e:  # ragged lists
        raise ValueError(f"`--input`: {name}: "
                         f"{str(e).split(' (pad them')[0].rstrip('.')}.") from None
    parts.append(pick(part, name, numbers))
    read.append(name)
  if not parts:
    raise ValueError(f"`--input`={pattern!r}: its {len(paths)} file(s) hold no rows.")
  if empty:
    skipped[_EMPTY] = f"{len(empty)}: " + ", ".join(empty[:4]) + (" ..." if len(empty) > 4
                                                                 else "")
  keys = list(parts[0])
  for name, part in zip(read, parts, strict=True):
    if set(part) != set(keys):
      raise ValueError(f"`--input`: {name} has columns {sorted(part)}, but {read[0]} has "
                       f"{sorted(keys)}; give files with one schema, or name the columns to "
                       "write: --columns=NAME,NAME,....")
  return {k: np.concatenate([p[k] for p in parts]) for k in keys}


def _zero_padded(path: str, table) -> dict[str, str]:
  """The integer columns of the CSV ``path`` (read as ``table``) whose text has a
  leading zero ("007", "02134": ids, zip codes), each with one such value: pyarrow
  infers int64 and the zeros are gone (and "07" and "007" become one)."""
  import pyarrow as pa  # noqa: PLC0415
  import pyarrow.compute as pc  # noqa: PLC0415
  from pyarrow import csv  # noqa: PLC0415

  ints = [f.name for f in table.schema if pa.types.is_integer(f.type)]
  if not ints:
    return {}
  text = csv.read_csv(path, convert_options=csv.ConvertOptions(
    include_columns=ints, column_types={k: pa.string() for k in ints}))
  found = {}
  for k in ints:
    hits = text.column(k).filter(pc.match_substring_regex(text.column(k), r"^\s*[+-]?0[0-9]"))
    if len(hits):
      found[k] = hits[0].as_py()
  return found


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
    skipped: dict[str, str] = {}
    if _INPUT.value:
      columns = read_input(_INPUT.value, _COLUMNS.value, skipped)
    else:
      columns = synthetic_rows(_CONFIG.value, _EXAMPLES.value, _SPLIT.value)
    if not columns:
      raise ValueError(f"`--input`={_INPUT.value!r}: no column of numbers to write ("
                       + "; ".join(f"{k}: {why}" for k, why in skipped.items())
                       + "); give arrays of numbers, one row per example.")
    rows = len(next(iter(columns.values())))
    num_shards = _NUM_SHARDS.value
    if not flags.FLAGS["num_shards"].present:  # the default, 4: no more shards than rows
      num_shards = min(num_shards, rows)
    elif not 1 <= num_shards <= rows:
      raise ValueError(f"`--num_shards`={num_shards}: must be in 1..{rows} (the number of "
                       f"rows), e.g. --num_shards={min(max(num_shards, 1), rows)}.")
    paths = data_sources.write_shards(
        columns, _OUT.value, num_shards=num_shards, fmt=_FORMAT.value,
        prefix=_SPLIT.value, row_group_size=_ROW_GROUP.value,
    )
  except ValueError as e:
    _cli.fail("make_shards", str(e))
  shapes = {k: list(v.shape[1:]) for k, v in columns.items()}
  print(f"wrote {rows} rows, columns {shapes}, in {len(paths)} {_FORMAT.value} shards:")
  if skipped:
    print("not written: " + "; ".join(f"{k} {why}" if k == _EMPTY else f"column {k!r} ({why})"
                                      for k, why in skipped.items()))
  for path in paths:
    print(f"  {path}")


if __name__ == "__main__":
  app.run(main, flags_parser=_cli.flags_parser("make_shards"))
