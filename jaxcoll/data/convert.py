"""The user's files (.npz, CSV, JSON Lines, Parquet) read a chunk at a time, for
``experiments.make_shards``: :func:`open_input` checks every row and counts them
(Parquet: from the footers), then :meth:`Rows.chunks` gives them in order, so
:class:`jaxcoll.data.sources.ShardWriter` writes shards of files larger than memory.

Memory is bounded by a chunk: a Parquet row group, :data:`CHUNK_BYTES` of CSV / JSON
Lines text or of .npz arrays (stored or compressed alike; a Fortran-order array is
loaded whole), plus the writer's row group.
"""

from __future__ import annotations

import os

from jaxcoll.data.sources import CONVERTIBLE, PARQUET_EXTENSIONS

# what make_shards reads: Parquet under any of the trainer's names (.pq and .parq were
# refused or skipped) and the files it converts
_KINDS = CONVERTIBLE + PARQUET_EXTENSIONS
# the key in `skipped` naming the files of no rows
EMPTY = "files of no rows (read past, as the trainer reads past empty shards)"


# Bytes of CSV / JSON Lines text parsed at a time (pyarrow's block_size), and of .npz
# arrays read at a time: what bounds make_shards' memory (with a Parquet input's row group
# and the writer's row group). pyarrow's streaming readers read about 40 blocks ahead
# (measured, pyarrow 26: 16 MiB blocks held 413 MiB of a 460 MB CSV, 1 MiB blocks 38 MiB),
# so the block is pyarrow's default, 1 MiB: no slower (5.2 s either way for 115 MB).
CHUNK_BYTES = 1 << 20


class Rows:
  """The rows to write, read a chunk at a time: ``rows`` (their count), ``columns``
  (``{name: (dtype, per-row shape)}``, in the order written; of Parquet the shape is None,
  known once read) and :meth:`chunks`."""

  def __init__(self, rows: int, columns: dict, chunks):
    self.rows, self.columns, self._chunks = rows, columns, chunks

  def chunks(self):
    """The rows in order, as dicts of arrays of at most a chunk's rows each."""
    return self._chunks()


def in_memory_rows(columns: dict) -> Rows:
  """``columns`` (equal-length arrays) as one chunk."""
  import numpy as np  # noqa: PLC0415

  columns = {k: np.asarray(v) for k, v in columns.items()}
  rows = len(next(iter(columns.values()))) if columns else 0
  layout = {k: (v.dtype, v.shape[1:]) for k, v in columns.items()}
  return Rows(rows, layout, lambda: iter([columns]))


class _NpzMember:
  """One array of a .npz file, its header read (dtype, shape), its rows read on demand:
  the zip member is read from its start as a stream (stored or deflated alike), so a
  chunk of rows is all that is held; a Fortran-order array is loaded whole."""

  def __init__(self, path: str, info):
    import numpy as np  # noqa: PLC0415

    self.path, self.info = path, info
    try:
      with _zip(path) as z, z.open(info) as f:
        version = np.lib.format.read_magic(f)
        read = {(1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if read is None:  # (3, 0): a header in utf8; np.load reads it
          with np.load(path, allow_pickle=False) as npz:
            header = npz[self.key]
          self.shape, self.fortran, self.dtype = header.shape, False, header.dtype
        else:
          self.shape, self.fortran, self.dtype = read(f)
    except (ValueError, OSError, EOFError) as e:
      if str(e).startswith("`--input`"):  # _zip's line
        raise
      raise self._bad(e) from None

  def _bad(self, e: Exception) -> ValueError:
    """The line for a member that is not a whole .npy array (another file in the zip, a
    truncated one)."""
    return ValueError(
        f"`--input`: {os.path.basename(self.path)}: member {self.info.filename!r} is not a "
        f"whole .npy array ({' '.join(str(e).split())}); give arrays saved with np.savez or "
        "np.savez_compressed.")

  @property
  def key(self) -> str:
    name = self.info.filename
    return name[:-4] if name.endswith(".npy") else name

  def load(self):
    """The whole array (a scalar's value)."""
    import numpy as np  # noqa: PLC0415

    with np.load(self.path, allow_pickle=False) as npz:
      return npz[self.key]

  def row_chunks(self, rows: int):
    """The array's rows, ``rows`` at a time."""
    import numpy as np  # noqa: PLC0415

    if self.fortran or self.dtype.hasobject:
      whole = self.load()
      for lo in range(0, len(whole), rows):
        yield whole[lo:lo + rows]
      return
    row_shape = self.shape[1:]
    row_bytes = self.dtype.itemsize * int(np.prod(row_shape))
    with _zip(self.path) as z, z.open(self.info) as f:
      _skip_header(f)
      left = self.shape[0]
      while left:
        take = min(rows, left)
        data = f.read(take * row_bytes)
        if len(data) != take * row_bytes:  # the member ends before its header's shape does
          raise self._bad(EOFError(f"{self.shape[0] - left + len(data) // max(row_bytes, 1)} "
                                   f"of {self.shape[0]} rows"))
        yield np.frombuffer(data, self.dtype).reshape(take, *row_shape)
        left -= take


def _zip(path: str):
  """The .npz ``path`` open as the zip it is (one line naming it when it is not)."""
  import zipfile  # noqa: PLC0415

  try:
    return zipfile.ZipFile(path)
  except (zipfile.BadZipFile, OSError) as e:
    raise ValueError(f"`--input`: {os.path.basename(path)}: not an .npz file ({e}); give "
                     "arrays saved with np.savez or np.savez_compressed.") from None


def _skip_header(f) -> None:
  """Reads past an .npy header: the magic and version, the length field, the header."""
  import struct  # noqa: PLC0415

  magic = f.read(8)
  size = struct.unpack("<H", f.read(2))[0] if magic[6] == 1 else struct.unpack(
      "<I", f.read(4))[0]
  f.read(size)


def _npz_columns(path: str, name: str, wanted: list[str], skipped: dict) -> dict:
  """The arrays of the .npz ``path`` that can be columns, as :class:`_NpzMember`s (only
  their headers read): arrays of numbers or bools with one row per example. A scalar
  (``num_classes=10``), text (``names``) or an object array (pickled: never loaded) is
  left out into ``skipped``; an array of numbers whose length is not the others'
  (``class_weights`` of 10 rows) is one line naming it and ``--columns``."""
  part = {}
  with _zip(path) as z:
    infos = z.infolist()
  for info in infos:
    member = _NpzMember(path, info)
    k = member.key
    if wanted and k not in wanted:
      continue
    if member.dtype.hasobject:  # loading it would unpickle
      skipped[k] = "an object array, not numbers; pickled objects are not loaded"
    elif member.dtype.kind not in "biuf":
      skipped[k] = f"{member.dtype}, not numbers"
    elif not member.shape:
      skipped[k] = f"a scalar ({member.load().item()!r}), not one value per row"
    else:
      part[k] = member
  lengths = {k: v.shape[0] for k, v in part.items()}
  if len(set(lengths.values())) > 1:
    counts = sorted(set(lengths.values()), key=lambda n: (-list(lengths.values()).count(n), -n))
    rows = counts[0]
    odd = [k for k, n in lengths.items() if n != rows]
    keep = [k for k, n in lengths.items() if n == rows]
    raise ValueError(f"`--input`: {name}: array {odd[0]!r} has {lengths[odd[0]]} rows, but "
                     f"{keep[0]!r} has {rows}; every column needs one row per example: "
                     f"leave it out, --columns={','.join(keep)}.")
  return part


def _text_reader(path: str, kind: str, schema=None, include=None):
  """A streaming reader of the CSV / JSON Lines file ``path``, ``CHUNK_BYTES`` of text a
  record batch; ``schema``: the column types (else inferred from the first block);
  ``include``: the CSV columns read (with ``schema``)."""
  from pyarrow import csv, json as pa_json  # noqa: PLC0415

  if kind == ".jsonl":
    parse = (pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
             if schema is not None else None)
    return pa_json.open_json(path, read_options=pa_json.ReadOptions(block_size=CHUNK_BYTES),
                             parse_options=parse)
  convert = csv.ConvertOptions(
      column_types=schema, include_columns=include) if schema is not None else None
  return csv.open_csv(path, read_options=csv.ReadOptions(block_size=CHUNK_BYTES),
                      convert_options=convert)


def _read_whole(path: str, kind: str, name: str):
  """The file read whole, as pyarrow infers it over every row (one line on failure)."""
  import pyarrow as pa  # noqa: PLC0415
  from pyarrow import csv, json as pa_json  # noqa: PLC0415

  try:  # one JSON object per line (pyarrow's reader); CSV with a header
    return pa_json.read_json(path) if kind == ".jsonl" else csv.read_csv(path)
  except Exception as e:  # noqa: BLE001  (pyarrow's ArrowInvalid, a bad gzip's OSError)
    if isinstance(e, pa.ArrowInvalid) and "Empty JSON file" in str(e):
      return None  # no rows, as a CSV of only its header: read past
    raise ValueError(f"`--input`: {name}: {type(e).__name__}: {' '.join(str(e).split())}; "
                     + ("give one JSON object per line whose values are numbers or lists of "
                        "numbers of one length." if kind == ".jsonl" else
                        "give a CSV file with a header line.")) from None


def _scan_text(path: str, kind: str, name: str):
  """One pass over the CSV / JSON Lines file ``path``, a block at a time: ``(rows,
  arrow schema, {column: null count}, {column: (dtype, per-row shape)}, {column: why
  it cannot be a column})``, None for a file of no rows. The schema is the one pyarrow
  infers from the first block; when a later block does not fit it (a 1.5 after a
  block of integers) the file is read whole, as pyarrow infers it over every row."""
  from jaxcoll.data import sources as data_sources  # noqa: PLC0415

  try:
    reader = _text_reader(path, kind)
    schema = reader.schema
  except Exception:  # noqa: BLE001  (no rows; bad text: told as reading it whole tells it)
    reader = None
  rows, nulls, layout, bad = 0, {}, {}, {}

  def take(batch) -> None:
    nonlocal rows
    rows += batch.num_rows
    for k in batch.column_names:
      column = batch.column(k)
      if not data_sources.numeric_type(column.type):
        continue
      nulls[k] = nulls.get(k, 0) + column.null_count
      if column.null_count or k in bad or not batch.num_rows:
        continue
      try:
        values = data_sources.column_to_numpy(column, k)
      except ValueError as e:  # ragged lists, nulls inside lists
        bad[k] = str(e)
        continue
      seen = layout.setdefault(k, (values.dtype, values.shape[1:]))
      if seen[1] != values.shape[1:]:  # lists of one length in a block, another in the next
        lengths = sorted({seen[1][0] if seen[1] else 0, values.shape[1] if values.ndim > 1
                          else 0})
        bad[k] = (f"column {k!r} holds lists of different lengths ({lengths[0]} to "
                  f"{lengths[-1]} values a row); every row must have the same length (pad "
                  "them, or write with make_shards).")

  while reader is not None:
    try:
      batch = reader.read_next_batch()
    except StopIteration:
      break
    except Exception:  # noqa: BLE001  (a later block that the first one's types do not fit)
      reader = None
      break
    take(batch)
  if reader is None:
    rows, nulls, layout, bad = 0, {}, {}, {}
    table = _read_whole(path, kind, name)
    if table is None:
      return None
    schema = table.schema
    for batch in table.to_batches(max_chunksize=None) or []:
      take(batch)
    rows = table.num_rows
    del table
  if rows == 0:  # its columns have no types (null): not compared
    return None
  return rows, schema, nulls, layout, bad


def open_input(pattern: str, columns: str = "", skipped: dict | None = None) -> Rows:
  """The rows of ``pattern``'s files (.npz, .csv, .jsonl or .parquet; CSV and JSON
  Lines also compressed, ``.csv.gz``; a directory: its files at any depth), in file
  order, read a chunk at a time: a Parquet row group, ``CHUNK_BYTES`` of CSV / JSON Lines
  text (after a first pass that checks every row and counts them) or of .npz arrays.

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
    # else Parquet files without an extension (Hive's 000000_0), as the trainer reads them
    paths = data_sources.directory_files(path, _KINDS) or [
        p for p in data_sources.directory_files(path) if data_sources.data_kind(p) == "parquet"]
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
  kinds = {".parquet" if data_sources.data_kind(p) == "parquet"  # by its PAR1 magic too
           else data_sources.extension(p) for p in paths}
  kinds = {".jsonl" if k == ".json" else
           ".parquet" if k in PARQUET_EXTENSIONS else k for k in kinds}
  if ".npy" in kinds:
    raise ValueError("`--input` names .npy files, which make_shards does not read; "
                     + data_sources.NPY_FIX)
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
    # cache_bytes=0: one row group decoded at a time (the newest is kept, no other)
    source = data_sources.open_source(paths, "--input", strict=False, cache_bytes=0)
    for c, why in source.conflicts.items():
      skipped[c] = why.reason
    for c in source.ignored_columns:
      skipped[c] = "not numbers"
    names = list(pick(dict.fromkeys(source.schema), "the files"))
    source.select(names)  # the others are never decoded
    layout = {k: (np.dtype(source.dtypes[k]), None) for k in names}

    def parquet_chunks():
      for lo, hi in source.row_groups():
        if hi > lo:
          chunk = source.read_rows(np.arange(lo, hi))
          yield {k: chunk[k] for k in names}

    return Rows(len(source), layout, parquet_chunks)
  files, empty = [], []  # files: (path, name, {column: (dtype, shape)}, what reads it)
  for path in paths:
    name = os.path.basename(path)
    if kind == ".npz":
      members = pick(_npz_columns(path, name, wanted, skipped), name)
      files.append((path, name, {k: (m.dtype, m.shape[1:]) for k, m in members.items()},
                    members, next(iter(members.values())).shape[0] if members else 0))
      continue
    scan = _scan_text(path, kind, name)
    if scan is None:
      empty.append(name)
      continue
    rows, schema, nulls, layout, bad = scan
    padded = _zero_padded(path, schema) if kind == ".csv" else {}
    part, numbers = {}, []
    for field in schema:
      k = field.name
      if k in padded:  # "007": an id pyarrow would read as 7
        skipped[k] = f"text with leading zeros, e.g. {padded[k]!r}, not numbers"
        continue
      if not data_sources.numeric_type(field.type):  # text, nested objects, dates
        skipped[k] = f"{field.type}, not numbers"
        continue
      numbers.append(k)
      if wanted and k not in wanted:
        continue
      if nulls.get(k):  # an empty CSV cell, a key some JSON lines lack: a null
        raise ValueError(
            f"`--input`: {name}: column {k!r} has {nulls[k]} "
            f"{'empty value' if kind == '.csv' else 'null or missing value'}(s); every row "
            "needs a value: fill or drop them before converting"
            + ("" if wanted else ", or leave the column out: --columns=NAME,NAME,...")
            + ".")
      if k in bad:  # ragged lists
        raise ValueError(f"`--input`: {name}: {bad[k].split(' (pad them')[0].rstrip('.')}.")
      part[k] = layout[k]
    files.append((path, name, pick(part, name, numbers), schema, rows))
  if not files:
    raise ValueError(f"`--input`={pattern!r}: its {len(paths)} file(s) hold no rows.")
  if empty:
    skipped[EMPTY] = f"{len(empty)}: " + ", ".join(empty[:4]) + (" ..." if len(empty) > 4
                                                                 else "")
  first = files[0]
  keys = list(first[2])
  for _, name, part, _, _ in files:
    if set(part) != set(keys):
      raise ValueError(f"`--input`: {name} has columns {sorted(part)}, but {first[1]} has "
                       f"{sorted(keys)}; give files with one schema, or name the columns to "
                       "write: --columns=NAME,NAME,....")
    for k in keys:
      if part[k][1] != first[2][k][1]:
        raise ValueError(f"`--input`: {name}: column {k!r} has per-row shape "
                         f"{list(part[k][1])}, but in {first[1]} {list(first[2][k][1])}; "
                         "every row of a column must have the same shape: pad or cut the "
                         "lists to one length, or leave the column out: --columns=NAME,....")
  layout = {k: (np.result_type(*[part[k][0] for _, _, part, _, _ in files]), first[2][k][1])
            for k in keys}
  rows = sum(f[4] for f in files)

  def text_chunks():
    import pyarrow as pa  # noqa: PLC0415

    for path, _, _, schema, _ in files:
      types = {k: schema.field(k).type for k in keys}
      reader = _text_reader(path, kind, pa.schema(list(types.items())) if kind == ".jsonl"
                            else types, include=keys)
      for batch in reader:
        if batch.num_rows:
          yield {k: data_sources.column_to_numpy(batch.column(k), k).astype(
              layout[k][0], copy=False) for k in keys}

  def npz_chunks():
    for _, _, _, members, count in files:
      if not count:
        continue
      row_bytes = sum(m.dtype.itemsize * int(np.prod(m.shape[1:])) for m in members.values())
      step = max(1, CHUNK_BYTES // max(row_bytes, 1))
      streams = {k: members[k].row_chunks(step) for k in keys}
      for parts in zip(*streams.values(), strict=True):
        yield {k: v.astype(layout[k][0], copy=False)
               for k, v in zip(keys, parts, strict=True)}

  return Rows(rows, layout, npz_chunks if kind == ".npz" else text_chunks)


def _zero_padded(path: str, schema) -> dict[str, str]:
  """The integer columns of the CSV ``path`` (of arrow ``schema``) whose text has a
  leading zero ("007", "02134": ids, zip codes), each with one such value: pyarrow
  infers int64 and the zeros are gone (and "07" and "007" become one). Read a block at
  a time."""
  import pyarrow as pa  # noqa: PLC0415
  import pyarrow.compute as pc  # noqa: PLC0415

  ints = [f.name for f in schema if pa.types.is_integer(f.type)]
  if not ints:
    return {}
  found = {}
  for batch in _text_reader(path, ".csv", {k: pa.string() for k in ints}, include=ints):
    for k in ints:
      if k in found:
        continue
      hits = batch.column(k).filter(pc.match_substring_regex(batch.column(k),
                                                              r"^\s*[+-]?0[0-9]"))
      if len(hits):
        found[k] = hits[0].as_py()
    if len(found) == len(ints):
      break
  return found
