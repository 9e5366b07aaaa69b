"""Record files as grain data sources: Parquet (pyarrow) and ArrayRecord.

Each row (record) is one example; its columns are the batch's keys. A numeric
scalar column becomes an ``(n,)`` array, a fixed-length list column an
``(n, L)`` array, reshaped to the field's ``shape`` metadata when the file has
one (``write_shards`` stores it, so images come back as ``(n, H, W, C)``).

- Parquet: random access through row groups (a global row index maps to a
  file, a row group and an offset; decoded row groups are kept in an LRU
  cache of 256 MiB, the newest one even when larger), so a process reads only
  the row groups holding its rows; each reader thread has its own pyarrow
  handles, and page checksums are verified (``write_shards`` writes them).
- ArrayRecord: ``grain.sources.ArrayRecordDataSource``; each record is one
  example: ``b"JXAR"``, a little-endian u32 header length, a JSON header
  ``[[column, dtype, shape], ...]`` and the columns' bytes. Records of one
  layout decode a batch at a time (one ``numpy.frombuffer`` with a structured
  dtype). Records written by others as
  ``flax.serialization.msgpack_serialize``'d dicts of arrays are read too.

Both implement grain's ``RandomAccessDataSource`` protocol (``__len__``,
``__getitem__``, ``__getitems__``) plus :meth:`read_rows`, which returns the
rows of a list of indices as one dict of stacked arrays.

Example:
  >>> import numpy as np, tempfile, os
  >>> d = tempfile.mkdtemp()
  >>> paths = write_shards({"x": np.arange(10.0), "y": np.ones((10, 3))}, d, num_shards=2)
  >>> source = open_source(os.path.join(d, "*.parquet"))
  >>> len(source), source.read_rows([9, 0])["x"].tolist()
  (10, [9.0, 0.0])
"""

from __future__ import annotations

import collections
import glob as glob_lib
import hashlib
import json
import os
import threading
import types
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxcoll.errors import DataError as DataError
from jaxcoll.errors import UnreadFilesWarning as UnreadFilesWarning

Batch = dict[str, np.ndarray]
FORMATS = ("parquet", "array_record")
# Decoded bytes a batch may be expected to decode again before the run is warned
# (ParquetSource.large_row_groups): about 0.2 s a batch on one core.
REDECODE_BYTES = 40 << 20
# Files of arrays that `python -m experiments.make_shards --input` converts to shards.
CONVERTIBLE = (".npz", ".csv", ".jsonl", ".json")
# What to do with .npy files (one array each, no column name), which neither the trainer nor
# make_shards reads.
NPY_FIX = ("a .npy file holds one array without a column name: save the arrays as one .npz, "
           "a name each, e.g. np.savez('data.npz', features=np.load('x.npy'), "
           "label=np.load('y.npy')), then python -m experiments.make_shards "
           "--input=data.npz --out=DIR --num_shards=N.")
# Compressed text files make_shards reads as they are (pyarrow's readers detect these).
COMPRESSED = (".gz", ".bz2", ".zst", ".lz4")
# Parquet's file names: `.parq` too, as Dask and fastparquet write them (`to_parquet("x.parq")`;
# a directory of them beside .parquet files had them skipped without a word).
PARQUET_EXTENSIONS = (".parquet", ".pq", ".parq")
_EXTENSIONS = {**dict.fromkeys(PARQUET_EXTENSIONS, "parquet"), ".array_record": "array_record",
               ".arrayrecord": "array_record"}


def patterns(value: Any, field: str = "data.train") -> list[str]:
  """The globs ``value`` names: a list / tuple of globs, a string holding a
  JSON or Python list of them (``'["/x/v1,v2/*.parquet", "/y/*.pq"]'``), or
  one glob string.

  Raises:
    ValueError: a list string that does not parse, or an element that is not
      a non-empty string.
  """
  if isinstance(value, str) and value.strip().startswith("["):
    text = value.strip()
    try:
      value = json.loads(text)
    except ValueError:
      import ast  # noqa: PLC0415

      try:
        value = ast.literal_eval(text)
      except (ValueError, SyntaxError):
        raise ValueError(
            f"`{field}`={text!r} starts with '[' but is not a JSON or Python list of globs; "
            f"write it as '[\"/data/a-*.parquet\", \"/data/b-*.parquet\"]'."
        ) from None
  if isinstance(value, str):
    return [value.strip()] if value.strip() else []
  if not isinstance(value, (list, tuple)) or not all(
      isinstance(v, str) and v.strip() for v in value):
    raise ValueError(
        f"`{field}`={value!r}: give a glob or a list of globs (non-empty strings), e.g. "
        "'[\"/data/a-*.parquet\", \"/data/b-*.parquet\"]'."
    )
  return [v.strip() for v in value]


def extension(path: str) -> str:
  """A file's kind from its name, lower case: ``.parquet``, ``.csv`` (``.csv.gz`` too:
  a compression suffix is looked through), ``""`` for none."""
  root, ext = os.path.splitext(os.path.basename(path).lower())
  if ext in COMPRESSED:
    ext = os.path.splitext(root)[1] or ext
  return ext


def data_kind(path: str) -> str | None:
  """``"parquet"`` / ``"array_record"`` from a file's extension; a file without one that
  starts with Parquet's magic ``PAR1`` (Hive and Impala name theirs ``000000_0``) is
  ``"parquet"``; None otherwise."""
  kind = _EXTENSIONS.get(extension(path))
  if kind is None and extension(path) == "" and _parquet_magic(path):
    kind = "parquet"
  return kind


def _parquet_magic(path: str) -> bool:
  """Whether the file ``path`` starts with Parquet's magic ``PAR1`` (False if unreadable)."""
  try:
    with open(path, "rb") as f:
      return f.read(4) == b"PAR1"
  except OSError:
    return False


# Files a data directory holds beside the data that no one takes for data: not warned about.
_NOT_DATA_EXTENSIONS = (".crc", ".md", ".txt", ".rst", ".json", ".yaml", ".yml", ".idx")
_NOT_DATA_NAMES = ("readme", "license", "notice", "notes", "changelog")
_WARNED_UNREAD: set[tuple[str, tuple[str, ...]]] = set()  # (directory, files) warned about


def _not_data(name: str) -> bool:
  lower = name.lower()
  return lower.endswith(_NOT_DATA_EXTENSIONS) or lower.startswith(_NOT_DATA_NAMES)


def _warn_unread(path: str, chosen: Sequence[str], unread: Sequence[str]) -> None:
  """One warning (once per process for that directory and those files) naming the files of
  directory ``path`` that are not read: ``part-0.parquet.bak`` or ``data.bin`` were skipped
  without a word, a share of the data set missing from the run."""
  unread = sorted(f for f in unread if not _not_data(os.path.basename(f)))
  key = (os.path.abspath(path), tuple(unread))
  if not unread or key in _WARNED_UNREAD:
    return
  _WARNED_UNREAD.add(key)
  names = [os.path.relpath(f, path) for f in unread]
  parquet = [name for f, name in zip(unread[:20], names)  # the first few: 4 bytes each
             if _parquet_magic(f)]
  shown = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
  read = {f"{extension(f)} files" if extension(f) else "Parquet files without an extension"
          for f in chosen}
  said = (f"; {', '.join(parquet[:6])}{', ...' if len(parquet) > 6 else ''} start with "
          "Parquet's magic PAR1: rename them to .parquet to train on them" if parquet else "")
  import warnings  # noqa: PLC0415

  warnings.warn(
      f"data directory {path}: {len(names)} file(s) not read ({shown}): only "
      f"{', '.join(sorted(read))} are read there ({len(chosen)} file(s)){said}; rename "
      "the files that are data, move the others out (names starting with '.' or '_', .crc "
      "and README / NOTES / LICENSE files are skipped without a word).", UnreadFilesWarning,
      stacklevel=3)


def directory_files(path: str, kinds: Sequence[str] | None = None, *,
                    warn: bool = False) -> list[str]:
  """The data files under directory ``path`` at any depth, sorted by path (the order
  is the data set's): as ``pyarrow.dataset`` and Hugging Face datasets read a
  directory, names starting with ``.`` or ``_`` (``_SUCCESS``, ``.crc``,
  ``_temporary/``) are skipped, at every level, and links to directories are not
  followed (a cycle, or a ``latest`` link, would repeat files). ``kinds``: the
  extensions taken (default: Parquet and ArrayRecord, else Parquet files without an
  extension, as Hive's ``000000_0``, else the files make_shards converts, so the error
  then says how to convert them). ``warn``: an :class:`UnreadFilesWarning` names the
  other files there that are not read (not those skipped by name, nor .crc or README
  files), once per process."""
  found = []
  for root, dirs, files in os.walk(path):  # a linked directory inside is not entered
    dirs[:] = [d for d in dirs if not d.startswith((".", "_"))]
    found += [os.path.join(root, f) for f in files if not f.startswith((".", "_"))]
  for wanted in ([kinds] if kinds else [tuple(_EXTENSIONS), "PAR1", CONVERTIBLE]):
    chosen = sorted(f for f in found if (data_kind(f) == "parquet" and not extension(f)
                                         if wanted == "PAR1" else extension(f) in wanted))
    if chosen:
      if warn:
        _warn_unread(path, chosen, sorted(set(found) - set(chosen)))
      return chosen
  return []


def _matches(pattern: str) -> tuple[list[str], list[str]]:
  """(files, directories) ``pattern`` matches; a path that exists is taken as
  it is (so ``[``, ``*`` or ``?`` in a file name need no escaping), and a
  directory that exists as its data files (:func:`directory_files`). A glob that
  matches no file but only directories named as data files is their data files, as
  Spark reads it (``df.write.parquet("/data/train_2024.parquet")`` writes a directory, so
  ``/data/train_*.parquet`` names directories); other directories are not read (a glob
  ``/data/*`` over ``train/`` and ``eval/`` would train on both)."""
  path = os.path.expanduser(pattern)
  if os.path.isdir(path):
    return directory_files(path, warn=True), [path]
  found = [path] if os.path.exists(path) else glob_lib.glob(path, recursive=True)  # `**`: any depth
  if not found:  # a directory that exists is taken as it is too ("/data [1]/*.parquet")
    head, tail = os.path.split(path)
    while head and not os.path.isdir(head) and os.path.dirname(head) != head:
      head, part = os.path.split(head)
      tail = os.path.join(part, tail)
    if head and os.path.isdir(head) and any(c in head for c in "*?["):
      found = glob_lib.glob(os.path.join(glob_lib.escape(head), tail), recursive=True)
  files = [p for p in found if os.path.isfile(p)]
  dirs = sorted(p for p in found if os.path.isdir(p))
  named = [d for d in dirs if not os.path.basename(os.path.normpath(d)).startswith((".", "_"))]
  if not files and named and all(_EXTENSIONS.get(extension(os.path.normpath(d))) for d in named):
    files = [f for d in named for f in directory_files(d, warn=True)]
  return files, dirs


def expand(pattern: str | Sequence[str], field: str = "data.train") -> list[str]:
  """The files ``pattern`` matches, sorted: one glob, a list of globs (or a
  string holding one, see :func:`patterns`).

  A comma is part of the path: ``/x/v1,v2/*.parquet`` is one glob. The old
  comma-separated form (``a/*.parquet,b/*.parquet``) still works when the
  whole string matches nothing and every part matches files; anything else
  with a comma that matches nothing is an error that shows the list form.

  Raises:
    ValueError: if a glob matches no file (naming it, and a directory it
      matches instead), or a comma-joined string is ambiguous.
  """
  globs = patterns(pattern, field)
  if not globs:
    raise ValueError(f"`{field}` is empty; give a glob of Parquet or ArrayRecord files, e.g. "
                     "/data/train-*.parquet (write them with python -m experiments.make_shards).")
  legacy = isinstance(pattern, str) and len(globs) == 1 and "," in globs[0] and \
      not pattern.strip().startswith("[")
  if legacy and not _matches(globs[0])[0]:
    parts = [p.strip() for p in globs[0].split(",") if p.strip()]
    missing = [p for p in parts if not _matches(p)[0]]
    if missing:
      raise ValueError(
          f"`{field}`={pattern!r} matches no file, neither as one path (a comma is part of "
          f"a path) nor split at its commas (part {missing[0]!r} matches no file); to give "
          f"several globs write a list: --config.{field}='{json.dumps(parts)}'."
      )
    globs = parts
  paths: set[str] = set()
  for glob in globs:
    found, dirs = _matches(glob)
    if not found:
      shown = repr(glob) if len(globs) == 1 else f"{glob!r} (of {pattern!r})"
      where = (f"; it matches the directory {dirs[0]}, not files: e.g. "
               f"{os.path.join(dirs[0], '*.parquet')}" if len(dirs) == 1 else
               f"; it matches {len(dirs)} directories ({', '.join(dirs[:3])}"
               f"{', ...' if len(dirs) > 3 else ''}), not files: e.g. "
               f"{os.path.join(glob, '*.parquet')} for the files of all of them" if dirs else "")
      if dirs and all(_EXTENSIONS.get(extension(os.path.normpath(d))) for d in dirs):
        where = (f"; it matches {len(dirs)} director{'y' if len(dirs) == 1 else 'ies'} named as "
                 f"data ({', '.join(dirs[:3])}{', ...' if len(dirs) > 3 else ''}), which hold "
                 "no .parquet or .array_record file at any depth (names starting with '.' or "
                 "'_' are skipped)")
      if os.path.isdir(os.path.expanduser(glob)):
        where = ("; it is a directory that holds no .parquet or .array_record file at any "
                 "depth (names starting with '.' or '_' are skipped)")
      elif not os.path.isabs(os.path.expanduser(glob)):  # a run resumed, or evaluated, elsewhere
        where += f" (a relative path: looked for in the current directory, {os.getcwd()})"
      raise ValueError(
          f"`{field}`={shown} matches no file{where}; give a "
          "glob of Parquet or ArrayRecord files, e.g. /data/train-*.parquet (write them with "
          "python -m experiments.make_shards)."
      )
    paths.update(found)
  return sorted(paths)


def file_format(paths: Sequence[str], field: str = "data.train", pattern: Any = None) -> str:
  """``"parquet"`` or ``"array_record"`` from the files' extensions (all alike);
  ``pattern``: what matched them, for messages."""
  kinds = {data_kind(p) for p in paths}
  convert = sorted({extension(p) for p in paths} & set(CONVERTIBLE))
  if convert and len(kinds) == 1:  # arrays the trainer does not read: make_shards converts them
    suffix = os.path.basename(paths[0]).lower().split(convert[0], 1)[-1]
    glob = paths[0] if len(paths) == 1 else os.path.join(os.path.dirname(paths[0]),
                                                          f"*{convert[0]}{suffix}")
    raise ValueError(
        f"`{field}` names {convert[0]} files ({os.path.basename(paths[0])}"
        f"{', ...' if len(paths) > 1 else ''}), which the trainer does not read (it reads "
        f"Parquet or ArrayRecord); convert them once: python -m experiments.make_shards "
        f"--input='{glob}' --out=DIR --num_shards=N, then pass "
        f"--config.{field}='DIR/train-*.parquet'."
    )
  data = [p for p in paths if data_kind(p)]
  if None in kinds and len(kinds) == 2 and data:  # a glob that takes in _SUCCESS, README.txt
    others = sorted(os.path.basename(p) for p in paths if p not in set(data))
    top = os.path.commonpath([os.path.abspath(p) for p in data])
    top = top if len({os.path.dirname(p) for p in data}) == 1 else os.path.join(top, "**")
    wanted = {extension(p) for p in data}.pop()
    given = "" if pattern is None else f"={pattern!r}"
    fix = (f"give only the data files, --config.{field}='{os.path.join(top, '*' + wanted)}', "
           "or their directory" if wanted else  # Hive's 000000_0: Parquet without extension
           f"give their directory, --config.{field}='{top.removesuffix(os.sep + '**')}'")
    raise ValueError(
        f"`{field}`{given} matches {len(others)} file(s) that are not Parquet or ArrayRecord "
        f"({others[:4]}{' ...' if len(others) > 4 else ''}) with its {len(data)} "
        f"{wanted or 'Parquet'} file(s); {fix} (names starting with '.' or '_', such as "
        "Spark's _SUCCESS and .crc files, are skipped)."
    )
  npy = [p for p in paths if extension(p) == ".npy"]
  if npy:  # make_shards reads no .npy either: the line said to write them with it
    raise ValueError(f"`{field}` names .npy files ({os.path.basename(npy[0])}"
                     f"{', ...' if len(npy) > 1 else ''}), which the trainer does not read; "
                     + NPY_FIX)
  if None in kinds or len(kinds) != 1:
    raise ValueError(
        f"`{field}` must name files of one format with extension .parquet or .array_record, "
        f"got {sorted({os.path.basename(p) for p in paths})[:4]}; rename them or write "
        "them with python -m experiments.make_shards."
    )
  return kinds.pop()


def open_source(pattern: str | Sequence[str], field: str = "data.train", *,
                strict: bool = True, cache_bytes: int = 256 << 20) -> Any:
  """A :class:`ParquetSource` or :class:`ArrayRecordSource` over the files
  ``pattern`` matches (one glob or a list: :func:`expand`).

  ``strict=False`` (the trainer's): Parquet columns the files disagree on (in some
  files only, or of clashing types) are not read, their reasons in the source's
  ``conflicts``, and int / float columns of other widths read as one dtype; ``True``:
  any difference is a ``ValueError`` naming the column. ``cache_bytes``: Parquet row
  groups kept decoded (:class:`ParquetSource`)."""
  paths = expand(pattern, field)
  if file_format(paths, field, pattern) == "parquet":
    return ParquetSource(paths, field=field, strict=strict, cache_bytes=cache_bytes)
  return ArrayRecordSource(paths, field=field)


class SchemaConflict(str):
  """The one-line message of a column the files disagree on (a ``str``: what
  ``ParquetSource.conflicts`` maps the column to), with ``reason``, the part that says
  what differs: ``"a.parquet and b.parquet differ: column 'score' is in a.parquet but
  not in b.parquet"``."""

  reason: str

  def __new__(cls, message: str, reason: str = ""):
    self = super().__new__(cls, message)
    self.reason = reason  # "" only while a copy is rebuilt (pickle restores it after)
    return self


def _schema_difference(first: str, schema0, path: str, schema, *,
                       unread: tuple[dict, dict] = ({}, {})) -> str:
  """The columns two files disagree on (a type, or a column only one has; ``unread``:
  each file's columns that are not numbers, with their types), as
  ``"a.parquet and b.parquet differ: ..."``."""
  a, b = os.path.basename(first), os.path.basename(path)

  def absent(k, there, other):
    kind = unread[other].get(k)
    return (f"column {k!r} is {kind}, not numbers, in {there}" if kind else
            f"column {k!r} is not in {there}")

  parts = [f"column {k!r} is {schema0[k]} in {a} but {schema[k]} in {b}"
           for k in schema0 if k in schema and schema0[k] != schema[k]]
  parts += [f"column {k!r} is in {a} but {absent(k, b, 1).split(' is ', 1)[1]}"
            for k in schema0 if k not in schema]
  parts += [f"column {k!r} is in {b} but {absent(k, a, 0).split(' is ', 1)[1]}"
            for k in schema if k not in schema0]
  return f"{a} and {b} differ: {'; '.join(parts)}"


def _mixed_schemas_message(field: str, difference: str) -> str:
  return (
      f"`{field}` mixes schemas: {difference}; every file must have the same numeric "
      "columns, types and shapes (column order may differ): write them with one schema "
      "(e.g. pyarrow's table.cast(schema) before writing, or python -m "
      "experiments.make_shards from your arrays), or leave the odd files out of the glob."
  )


def _mixed_schemas(field: str, first: str, schema0, path: str, schema, *,
                   unread: tuple[dict, dict] = ({}, {})) -> ValueError:
  """One line naming the columns two files disagree on (:func:`_schema_difference`)."""
  return ValueError(_mixed_schemas_message(
      field, _schema_difference(first, schema0, path, schema, unread=unread)))


def count_rows(path: str, field: str = "data.train") -> int:
  """The number of records in one file (a Parquet footer, an ArrayRecord index)."""
  fmt = file_format([path], field)
  try:
    if fmt == "parquet":
      import pyarrow.parquet as pq  # noqa: PLC0415

      return int(pq.read_metadata(path).num_rows)
    from array_record.python import array_record_module  # noqa: PLC0415

    reader = array_record_module.ArrayRecordReader(path)
    try:
      return int(reader.num_records())
    finally:
      reader.close()
  except Exception as e:  # noqa: BLE001  (pyarrow and array_record raise several types)
    raise DataError(f"`{field}`: cannot read {path} ({type(e).__name__}: {e}); rewrite it "
                    "(python -m experiments.make_shards) or leave it out of the glob.") from None


def display_names(paths: Sequence[str], among: Sequence[str] | None = None) -> list[str]:
  """How ``paths`` are named in messages, fingerprints and the run's ``data:`` line:
  each file's name without its directory, or, where two files of ``among`` (default
  ``paths``) share a name, as a partitioned directory's ``date=1/part-0.parquet`` and
  ``date=2/part-0.parquet``, its path below ``among``'s common directory."""
  among = list(paths if among is None else among)
  names = [os.path.basename(p) for p in among]
  if len(set(names)) == len(names):
    return [os.path.basename(p) for p in paths]
  top = os.path.commonpath([os.path.abspath(p) for p in among])
  return [os.path.relpath(os.path.abspath(p), top) for p in paths]


def fingerprint(paths: Sequence[str], rows: Sequence[int], *,
                basenames: bool = False) -> dict[str, Any]:
  """What identifies a data set's files, for a checkpoint's data position:
  each file's name (without its directory: moving the data is no change;
  where two files share a name, as a partitioned directory's
  ``date=1/part-0.parquet`` and ``date=2/part-0.parquet``, its path below the
  files' common directory; ``basenames``: the name alone, as fingerprints
  before that), size in bytes and record count, in order; their sha256; and
  the list itself when it is short enough to name what changed (up to 256
  files)."""
  names = [os.path.basename(p) for p in paths] if basenames else display_names(paths)
  entries = [[name, int(os.path.getsize(p)), int(n)]
             for name, p, n in zip(names, paths, rows, strict=True)]
  digest = hashlib.sha256(json.dumps(entries).encode()).hexdigest()
  out: dict[str, Any] = {"files": len(entries), "records": int(sum(rows)),
                         "bytes": int(sum(e[1] for e in entries)), "sha256": digest}
  if len(entries) <= 256:
    out["list"] = entries
  return out


def describe_change(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
  """What differs between two fingerprints (:func:`fingerprint`), in a few words."""
  def counts(fp):
    return f"{fp.get('files')} file(s), {fp.get('records')} records"

  head = f"were {counts(old)}, now {counts(new)}"
  if "list" not in old or "list" not in new:
    return f"the files differ ({head})"
  before = {e[0]: e[1:] for e in old["list"]}
  after = {e[0]: e[1:] for e in new["list"]}
  parts = []
  gone = [n for n in before if n not in after]
  added = [n for n in after if n not in before]
  changed = [n for n in before if n in after and before[n] != after[n]]
  if gone:
    parts.append(f"{', '.join(gone[:3])}{' ...' if len(gone) > 3 else ''} gone")
  if added:
    parts.append(f"{', '.join(added[:3])}{' ...' if len(added) > 3 else ''} added")
  for n in changed[:3]:
    (s0, r0), (s1, r1) = before[n], after[n]
    parts.append(f"{n} changed ({s0} -> {s1} bytes, {r0} -> {r1} records)")
  if not parts:
    parts.append("the same files in another order")
  return f"{'; '.join(parts)} ({head})"


class _RowSource:
  """Shared part of the two sources: grain's protocol on top of read_rows."""

  paths: list[str]
  schema: dict[str, str]
  ignored_columns: Sequence[str] = ()  # columns of the files that are no batch keys
  # Columns of numbers not read because the files disagree on them: {column: its
  # SchemaConflict}. Only a ParquetSource opened with strict=False has any.
  conflicts: Mapping[str, str] = types.MappingProxyType({})
  null_columns: Sequence[str] = ()  # those of `conflicts` not read because they hold nulls
  unused_columns: Sequence[str] = ()  # columns of numbers left out by select()

  def sample(self) -> tuple[Batch, dict[str, str]]:
    """Record 0's columns, and ``{}``: no column of it fails to read on its own (see
    :meth:`ParquetSource.sample`)."""
    return self.read_rows([0]), {}

  _selected: frozenset[str] | None = None

  def select(self, columns) -> None:
    """Batches hold only ``columns`` from now on (the columns the model reads); the
    others are named in :attr:`unused_columns`."""
    self._selected = frozenset(columns)
    self.unused_columns = sorted(set(self.schema) - self._selected)

  def __len__(self) -> int:
    return self._starts[-1]

  def __getitem__(self, index: int) -> Batch:
    return {k: v[0] for k, v in self.read_rows([int(index)]).items()}

  def __getitems__(self, indices: Sequence[int]) -> list[Batch]:
    rows = self.read_rows(indices)
    return [{k: v[i] for k, v in rows.items()} for i in range(len(indices))]

  @property
  def files_read(self) -> list[str]:
    """The files whose records this source has read so far, in order."""
    return [self.paths[i] for i in sorted(self._touched)]

  def file_rows(self) -> list[tuple[int, int]]:
    """``[start, stop)`` of each file's rows in the global index."""
    return [(self._starts[i], self._starts[i + 1]) for i in range(len(self.paths))]

  def _check_indices(self, indices) -> np.ndarray:
    indices = np.asarray(indices, np.int64).reshape(-1)
    if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
      raise IndexError(f"record index out of range 0..{len(self) - 1}: {indices}")
    return indices


class ParquetSource(_RowSource):
  """Random access to the rows of Parquet files, one row group read at a time.

  Safe under grain's reader threads: each thread reads through its own
  ``pyarrow.parquet.ParquetFile`` handles (a pyarrow reader is not safe to
  share between threads: a shared one segfaulted or raised ``ArrowInvalid``
  with many row groups), at most ``handles_per_thread`` open per thread.
  Page checksums (``make_shards`` writes them) are verified on every read.
  A row group that cannot be read, or holds nulls or lists of different
  lengths, raises :class:`DataError` naming the file and the row group;
  nulls that the files' statistics show are refused when the source opens
  (``strict=False``: their columns are not read, named in ``conflicts``).
  """

  def __init__(self, paths: Sequence[str], *, field: str = "data.train",
               cache_bytes: int = 256 << 20, handles_per_thread: int = 64,
               strict: bool = True, columns: Mapping[str, Any] | None = None):
    self.paths = list(paths)
    self.field = field
    self._metadata = []
    self._owners: list[list[str]] = []  # per file (column order may differ)
    self._group_starts: list[int] = [0]  # global row index where each row group starts
    self._groups: list[tuple[int, int]] = []  # (file, row group)
    self._first_group: list[int] = []  # per file: the index in _groups of its row group 0
    self._whole: dict[int, bool] = {}  # per file: read whole on a miss (_read_whole)
    self.schema = {}
    self._shapes: dict[str, tuple[int, ...] | None] = {}
    # Columns of numbers that cannot be batch keys because the files disagree on them (in
    # some files only, or of clashing types) or hold nulls (`null_columns`, from the row
    # groups' statistics): {column: the one-line message, a SchemaConflict whose .reason
    # says what differs}. Only when not `strict`: a model that needs one is told the
    # message; one that does not trains.
    self.conflicts: dict[str, SchemaConflict] = {}
    self.dtypes: dict[str, np.dtype] = {}  # each column read, as its batch key's dtype
    arrows, numeric = [], []
    for path in self.paths:
      pfile = _open_parquet(path, field)
      try:
        arrows.append(pfile.schema_arrow)
        self._metadata.append(pfile.metadata)
      finally:
        pfile.close()
      numeric.append({name: str(arrows[-1].field(name).type) for name in arrows[-1].names
                      if numeric_type(arrows[-1].field(name).type)})  # the columns read (see below)
    # The first file with rows gives the schema (the last one when none has any): an empty
    # file's columns are never read, so its schema is not compared.
    first = next((f for f, m in enumerate(self._metadata) if m.num_rows), len(self.paths) - 1)
    arrow, schema_from = arrows[first], self.paths[first]
    with_rows = [f for f, m in enumerate(self._metadata) if m.num_rows and f != first]

    def unread(f):
      return {n: str(arrows[f].field(n).type) for n in arrows[f].names if n not in numeric[f]}

    scanned: set[int] = set()  # files whose statistics were read for nulls

    if columns is None:
      self.schema = dict(numeric[first])
      # Columns that are not numbers (ids, text, timestamps) are no batch keys: never
      # read, listed in `ignored_columns` (a model that needs one is told so).
      self.ignored_columns = [n for n in arrow.names if n not in self.schema]
      for f in with_rows:
        if numeric[f] == self.schema:
          continue
        error = _mixed_schemas(field, schema_from, self.schema, self.paths[f], numeric[f],
                               unread=(unread(first), unread(f)))
        if strict:
          raise error
        for name in set(self.schema) | set(numeric[f]):  # each column they disagree on
          a, b = self.schema.get(name), numeric[f].get(name)
          if a == b or name in self.conflicts or (
              a is not None and b is not None and _widened(arrows[first].field(name).type,
                                                           arrows[f].field(name).type)):
            continue
          reason = _schema_difference(schema_from, {name: a} if a else {}, self.paths[f],
                                      {name: b} if b else {}, unread=(unread(first), unread(f)))
          self.conflicts[name] = SchemaConflict(_mixed_schemas_message(field, reason), reason)
      if not strict:  # numbers that some row group's statistics show nulls in: not read
        self.null_columns = []  # (a model that needs one is told where; one that does not
        scanned = {first, *with_rows}  # trains: Spark's nullable bookkeeping columns)
        for f in sorted(scanned):
          nulls = _null_columns(self._metadata[f], self.paths[f], field,
                                skip=set(arrows[f].names) - set(self.schema),
                                owners=_leaf_owners(arrows[f]))
          for name, why in nulls.items():
            if name not in self.conflicts:
              self.conflicts[name] = why
              self.null_columns.append(name)
      for name in self.conflicts:
        self.schema.pop(name, None)
      self.ignored_columns = [n for n in self.ignored_columns if n not in self.conflicts]
    else:  # the columns (and dtypes) another source chose: every file with rows has them
      self.schema = {n: numeric[first].get(n, "") for n in columns}
      self.ignored_columns = [n for n in arrow.names if n not in numeric[first]]
      for f in [first, *with_rows]:
        for name in columns:
          got = arrows[f].field(name).type if name in numeric[f] else None
          if got is None or np.result_type(_leaf_dtype(got), columns[name]) != columns[name]:
            raise _mixed_schemas(field, "the other processes' files", {name: str(columns[name])},
                                 self.paths[f], {name: str(got)} if got is not None else {})
    self._unread = unread(first)
    self._read = list(self.schema)
    for name in self._read:  # one dtype a column, over every file with rows
      kinds = [_leaf_dtype(arrows[f].field(name).type) for f in [first, *with_rows]]
      self.dtypes[name] = np.dtype(columns[name]) if columns is not None else np.result_type(*kinds)
    for name in arrow.names:
      shape = (arrow.field(name).metadata or {}).get(b"shape")
      self._shapes[name] = (tuple(int(s) for s in shape.decode().split(",") if s)
                            if shape is not None else None)
    for f, path in enumerate(self.paths):
      self._owners.append(_leaf_owners(arrows[f]))  # each leaf column's top-level column
      if f not in scanned:  # (the statistics of a wide file's chunks: ~2 us each)
        _check_no_nulls(self._metadata[f], path, field,
                        skip=set(arrows[f].names) - set(self._read), owners=self._owners[-1])
      self._first_group.append(len(self._groups))
      for g in range(self._metadata[f].num_row_groups):
        self._groups.append((f, g))
        self._group_starts.append(self._group_starts[-1] + self._metadata[f].row_group(g).num_rows)
    self._starts = [0]
    for meta in self._metadata:
      self._starts.append(self._starts[-1] + meta.num_rows)
    # Decoded row groups, least recently used first, up to `cache_bytes` (by bytes, not
    # count: a count of small row groups thrashed under shard_by=record's random rows), and
    # the newest one even when it alone is larger: pyarrow decodes a row group whole to read
    # any row of it, and one larger than the cache (pandas writes up to 1Mi rows a group) was
    # decoded again for every batch, an eval's sequential ones too (300 MB: 10-17 s each).
    self._cache: collections.OrderedDict[int, Batch] = collections.OrderedDict()
    self._cache_bytes, self._cached_bytes = int(cache_bytes), 0
    self._lock = threading.Lock()
    self._touched: set[int] = set()
    self._row_shapes: dict[str, tuple[tuple[int, ...], str]] = {}  # (shape, where first seen)
    self._local = threading.local()  # .handles: this thread's {file: ParquetFile}, LRU
    self._max_handles = max(1, int(handles_per_thread))

  def _handle(self, f: int):
    """This thread's open reader of file ``f``."""
    handles = getattr(self._local, "handles", None)
    if handles is None:
      handles = self._local.handles = collections.OrderedDict()
    if f in handles:
      handles.move_to_end(f)
      return handles[f]
    handles[f] = _open_parquet(self.paths[f], self.field)
    while len(handles) > self._max_handles:
      handles.popitem(last=False)[1].close()
    return handles[f]

  def _row_group(self, g: int) -> Batch:
    with self._lock:
      if g in self._cache:
        self._cache.move_to_end(g)
        return self._cache[g]
    f, group = self._groups[g]
    if self._read_whole_file(f):
      got = self._read_whole(f, g)
      if got is not None:
        return got
    where = (f"`{self.field}`: {self.paths[f]}, row group {group} (of "
             f"{self._metadata[f].num_row_groups})")
    try:
      table = self._handle(f).read_row_group(group, columns=self._read)
      if table.num_rows != self._metadata[f].row_group(group).num_rows:
        raise ValueError(f"{table.num_rows} rows where the footer read at the start said "
                         f"{self._metadata[f].row_group(group).num_rows}")
    except Exception as e:  # noqa: BLE001  (pyarrow raises OSError, ArrowInvalid, ...)
      self._drop_handle(f)
      if isinstance(e, DataError):
        raise
      raise DataError(
          f"{where}: {type(e).__name__}: {e}; the file is damaged, or changed since the run "
          "started: rewrite it (python -m experiments.make_shards) or leave it out of the "
          "glob. Nothing of this row group was trained on."
      ) from None
    try:
      columns = {name: _to_numpy(table.column(name), self._shapes.get(name), name)
                 for name in table.column_names}
      for name, values in columns.items():  # int32 in one file, int64 in another: one dtype
        if name in self.dtypes and values.dtype != self.dtypes[name]:
          columns[name] = values.astype(self.dtypes[name])
    except ValueError as e:  # values the model cannot take: nulls, ragged lists, strings
      raise DataError(f"{where}: {e}") from None
    with self._lock:
      self._check_row_shapes(columns, where)
      self._touched.add(f)
      if not self._cache_add(g, columns):  # another reader thread decoded it meanwhile:
        self._cache.move_to_end(g)  # the newest all the same
      self._cache_trim()
    return columns

  def _drop_handle(self, f: int) -> None:
    """Closes this thread's handle of file ``f`` after a failed read: opened afresh next time."""
    stale = getattr(self._local, "handles", {}).pop(f, None)
    if stale is not None:
      stale.close()

  def _cache_add(self, g: int, columns: Batch) -> bool:
    """Caches row group ``g``'s decoded ``columns`` unless it is cached; whether it was
    added (the caller holds ``_lock``)."""
    if g in self._cache:
      return False
    self._cache[g] = columns
    self._cached_bytes += sum(v.nbytes for v in columns.values())
    return True

  def _cache_trim(self) -> None:
    """Drops the least recently used row groups beyond ``cache_bytes``, keeping the newest
    even when it alone is larger (the caller holds ``_lock``)."""
    while len(self._cache) > 1 and self._cached_bytes > self._cache_bytes:
      _, old = self._cache.popitem(last=False)
      self._cached_bytes -= sum(v.nbytes for v in old.values())

  def _read_whole_file(self, f: int) -> bool:
    """Whether file ``f`` is read whole at its first miss: several row groups that
    together take at most 1/8 of the cache decoded. A batch of random rows draws from as
    many row groups as it has rows, and each read on its own costs ~0.2 ms: a 32 MB file
    of 31,250 row groups of 16 rows gave 58 ms a batch of 256 until every one was cached."""
    whole = self._whole.get(f)
    if whole is None:
      meta = self._metadata[f]
      read = [c for c, owner in enumerate(self._owners[f]) if owner in self._read]
      size = sum(meta.row_group(r).column(c).total_uncompressed_size
                 for r in range(meta.num_row_groups) for c in read)
      whole = self._whole[f] = meta.num_row_groups > 1 and 8 * size <= self._cache_bytes
    return whole

  def _read_whole(self, f: int, g: int) -> Batch | None:
    """Decodes file ``f`` whole into the cache, one entry a row group, and returns row
    group ``g``'s; None when it fails anywhere (the row group's own read then names what
    is wrong, and where)."""
    meta = self._metadata[f]
    try:
      table = self._handle(f).read(columns=self._read)
      if table.num_rows != meta.num_rows:
        return None
      whole = {name: _to_numpy(table.column(name), self._shapes.get(name), name)
               for name in table.column_names}
    except Exception:  # noqa: BLE001  (pyarrow's errors, nulls, lists of several lengths)
      self._drop_handle(f)
      return None
    first, start = self._first_group[f], self._starts[f]
    parts = {}
    for r in range(meta.num_row_groups):  # copies: a view would keep the whole file alive
      lo, hi = self._group_starts[first + r] - start, self._group_starts[first + r + 1] - start
      parts[first + r] = {name: values[lo:hi].astype(self.dtypes.get(name, values.dtype))
                          for name, values in whole.items()}
    with self._lock:
      for r, columns in parts.items():
        self._check_row_shapes(columns, f"`{self.field}`: {self.paths[f]}, row group "
                               f"{r - first} (of {meta.num_row_groups})")
      self._touched.add(f)
      for r, columns in parts.items():
        self._cache_add(r, columns)
      self._cache.move_to_end(g)
      self._cache_trim()
      return self._cache.get(g, parts[g])

  def _check_row_shapes(self, columns: Batch, where: str) -> None:
    """Every row group's per-row shape of a column is the first one read's (row 0's: the
    run reads it first). A (variable-length) list column's type does not say its length,
    so lists of 8 in one file and 9 in another passed the schema check and a batch of
    both failed in numpy inside grain's reader thread (a traceback)."""
    for name, values in columns.items():
      if not len(values):
        continue
      shape, first = self._row_shapes.setdefault(name, (values.shape[1:], where))
      if values.shape[1:] != shape:
        raise DataError(
            f"{where}: column {name!r} has per-row shape {list(values.shape[1:])}, but "
            f"{first.split(': ', 1)[1]} has {list(shape)}; every row of a column must have "
            "the same shape: pad or cut the lists to one length (or write fixed-size lists, "
            "as make_shards does), or leave the file out of the glob."
        )

  def large_row_groups(self, batch_rows: int = 0) -> str | None:
    """One line when batches will decode the same row groups again and again (None
    otherwise): pyarrow decodes a row group whole to read any of its rows, and batches
    drawing rows at random from all of them (both ``shard_by``s do) find in the cache of
    decoded row groups only the share it holds of them. Said when a row group's columns
    read are larger decoded than the cache and the files hold others, or (``batch_rows``:
    the rows a batch draws) when a batch is expected to decode more than
    :data:`REDECODE_BYTES` again (the row groups it draws from times the share the cache
    does not hold): a 1 GB file of four 1Mi-row groups (pyarrow's default) decoded 740
    MiB a batch of 256, 4 s."""
    sizes = []
    for (f, group) in self._groups:
      rg = self._metadata[f].row_group(group)
      size = sum(rg.column(c).total_uncompressed_size for c, owner in enumerate(self._owners[f])
                 if owner in self._read)
      sizes.append((size, rg.num_rows, f, group))
    if len([s for s in sizes if s[1]]) < 2:
      return None
    if max(sizes)[0] <= self._cache_bytes:
      redecoded, total = self.redecoded_bytes(batch_rows, [s[:2] for s in sizes])
      if redecoded <= REDECODE_BYTES:
        return None
      want = -(-int(total * 1.1) // 2**20)
      return (
          f"`{self.field}`: a batch draws its {batch_rows} rows at random from "
          f"{len(sizes)} row group(s) of {total / 2**20:.0f} MiB decoded in all, more than the "
          f"reader's {self._cache_bytes / 2**20:.0f} MiB cache of decoded row groups holds, so "
          f"each batch decodes about {redecoded / 2**20:.0f} MiB again (pyarrow decodes a row "
          "group whole to read any row of it; about 0.2 s per 40 MiB): raise "
          f"--config.data.cache_mib to {want} if this process has the memory, or split the "
          "data over more processes."
      )
    size, rows, f, group = max(sizes, key=lambda s: s[0])  # the first of the largest
    over = sum(1 for s in sizes if s[0] > self._cache_bytes)
    return (
        f"`{self.field}`: row group {group} of {self.paths[f]} holds {rows} rows, "
        f"{size / 2**20:.1f} MiB decoded ({over} row group(s) of the {len(sizes)} are larger "
        f"than the reader's {self._cache_bytes / 2**20:.1f} MiB cache of decoded row groups); "
        "pyarrow decodes a row group whole to read any row of it, so batches drawing rows "
        "from it and from the others decode it again and again (seconds a batch; pandas and "
        "pyarrow write up to 1Mi rows a group): write the files in smaller row groups, e.g. "
        "python -m experiments.make_shards --input=DIR --out=NEW_DIR --row_group_size=1024."
    )

  def redecoded_bytes(self, batch_rows: int,
                      sizes: Sequence[tuple[int, int]]) -> tuple[float, int]:
    """(bytes a batch of ``batch_rows`` rows drawn at random is expected to decode again,
    the decoded bytes of all row groups), from each row group's ``(decoded bytes, rows)``:
    the row groups it draws from (each with probability ``1 - (1 - rows/N)^batch_rows``)
    times the share of them the cache cannot hold."""
    total = sum(size for size, _ in sizes)
    count = sum(rows for _, rows in sizes)
    if not batch_rows or not count or total <= self._cache_bytes:
      return 0.0, total
    drawn = sum(size * (1.0 - (1.0 - rows / count) ** batch_rows) for size, rows in sizes)
    return drawn * (1.0 - self._cache_bytes / total), total

  def sample(self) -> tuple[Batch, dict[str, str]]:
    """(record 0's columns that read, ``{column: one line}`` for each that does not: nulls
    the statistics did not show, lists of several lengths in its row group). A column
    that fails stops a run only if the model reads it (:meth:`select` leaves the others
    out); a row group that fails whole raises :class:`DataError`."""
    try:
      return self.read_rows([0]), {}  # decoded once: the batches drawing from it reuse it
    except DataError:
      pass  # which columns fail, and whether the row group does
    f, group = self._groups[int(np.searchsorted(self._group_starts, 0, side="right")) - 1]
    where = (f"`{self.field}`: {self.paths[f]}, row group {group} (of "
             f"{self._metadata[f].num_row_groups})")
    try:
      table = self._handle(f).read_row_group(group, columns=self._read)
    except Exception as e:  # noqa: BLE001  (pyarrow raises OSError, ArrowInvalid, ...)
      raise DataError(f"{where}: {type(e).__name__}: {e}; the file is damaged: rewrite it "
                      "(python -m experiments.make_shards) or leave it out of the glob.") from None
    row, bad = {}, {}
    for name in table.column_names:
      try:  # the whole row group's: a batch reads it whole
        values = _to_numpy(table.column(name), self._shapes.get(name), name)[:1]
      except ValueError as e:
        bad[name] = f"{where}: {e}"
        continue
      row[name] = values.astype(self.dtypes.get(name, values.dtype), copy=False)
    return row, bad

  def select(self, columns) -> None:
    """Reads (and decodes, and caches) only ``columns`` from now on: the columns the
    model reads. The others (an id, a list of tags of any length, a column of nulls the
    statistics do not show) are named in :attr:`unused_columns` and never read."""
    wanted = set(columns)
    keep = [name for name in self._read if name in wanted]
    with self._lock:
      self.unused_columns = [name for name in self._read if name not in wanted]
      self._read = keep
      self._whole.clear()
      for g, decoded in list(self._cache.items()):  # what is decoded stays, less the others
        self._cache[g] = {name: v for name, v in decoded.items() if name in wanted}
      self._cached_bytes = sum(v.nbytes for c in self._cache.values() for v in c.values())

  def row_groups(self) -> list[tuple[int, int]]:
    """``[start, stop)`` of each row group in the global index, in file order (from the
    footers: nothing is read)."""
    return list(zip(self._group_starts[:-1], self._group_starts[1:], strict=True))

  def row_group_of(self, index: int) -> tuple[str, int]:
    """(file, row group) holding global row ``index``."""
    f, group = self._groups[int(np.searchsorted(self._group_starts, index, side="right")) - 1]
    return self.paths[f], group

  def column_range(self, name: str) -> tuple[Any, Any, str, int] | None:
    """``(min, max, file, row group of the extreme)`` of column ``name`` over
    every row group, from the files' statistics (no data is read; of a list
    column, the values in its lists); None when a row group has no statistics
    for it (files written without them)."""
    if name not in self.schema:
      return None
    lo = hi = None
    lo_at = hi_at = ("", 0)
    for (f, group) in self._groups:
      rg = self._metadata[f].row_group(group)
      # A list column's values are its one leaf column, e.g. "tokens.list.element".
      c = next((c for c, owner in enumerate(self._owners[f]) if owner == name), None)
      col = rg.column(c) if c is not None else None
      stats = col.statistics if col is not None else None
      if stats is None or not stats.has_min_max:
        if rg.num_rows:
          return None
        continue
      if lo is None or stats.min < lo:
        lo, lo_at = stats.min, (self.paths[f], group)
      if hi is None or stats.max > hi:
        hi, hi_at = stats.max, (self.paths[f], group)
    if lo is None:
      return None
    return lo, hi, lo_at, hi_at

  def read_rows(self, indices: Sequence[int]) -> Batch:
    """The rows ``indices`` (global row numbers) as one dict of stacked arrays."""
    indices = self._check_indices(indices)
    if not len(indices):
      return {name: np.empty((0,)) for name in self._read}
    groups = np.searchsorted(self._group_starts, indices, side="right") - 1
    order = np.argsort(groups, kind="stable")  # the rows of each row group, together
    cuts = np.flatnonzero(np.diff(groups[order])) + 1
    out: dict[str, np.ndarray] = {}
    for where in np.split(order, cuts):
      g = int(groups[where[0]])
      columns = self._row_group(g)
      offsets = indices[where] - self._group_starts[g]
      for name, values in columns.items():
        if name not in out:
          out[name] = np.empty((len(indices), *values.shape[1:]), values.dtype)
        out[name][where] = values[offsets]
    return out


def _open_parquet(path: str, field: str):
  """A ``ParquetFile`` that verifies page checksums, or a DataError naming the file."""
  import pyarrow.parquet as pq  # noqa: PLC0415

  try:
    return pq.ParquetFile(path, page_checksum_verification=True)
  except Exception as e:  # noqa: BLE001  (pyarrow raises several types)
    raise DataError(f"`{field}`: cannot read {path} as Parquet ({type(e).__name__}: {e}); "
                    "rewrite it (python -m experiments.make_shards) or leave it out of the "
                    "glob.") from None


def numeric_type(arrow_type) -> bool:
  """Whether a Parquet column of ``arrow_type`` can be a batch key: numbers or bools,
  or (nested) lists of them."""
  import pyarrow as pa  # noqa: PLC0415

  while (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)
         or pa.types.is_fixed_size_list(arrow_type)):
    arrow_type = arrow_type.value_type
  return (pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type)
          or pa.types.is_boolean(arrow_type))


def _structure(arrow_type) -> tuple[list[Any], Any]:
  """(the list levels of ``arrow_type``: ``"list"`` or a fixed size, its leaf type)."""
  import pyarrow as pa  # noqa: PLC0415

  levels: list[Any] = []
  while True:
    if pa.types.is_fixed_size_list(arrow_type):
      levels.append(arrow_type.list_size)
    elif pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
      levels.append("list")
    else:
      return levels, arrow_type
    arrow_type = arrow_type.value_type


def _leaf_dtype(arrow_type) -> np.dtype:
  """The numpy dtype of a column of numbers' values (in its lists)."""
  return np.dtype(_structure(arrow_type)[1].to_pandas_dtype())


def _widened(a, b) -> bool:
  """Whether columns of arrow types ``a`` and ``b`` (numbers) read as one: lists at the
  same levels (a fixed-size list of 8 and a ``list<float>``, as pandas writes it: every
  row group's lists are checked to have one length when read), values both bool or both
  numbers (int32 and int64, an int column and a float one: as numpy's ``result_type``,
  e.g. a CSV column of whole numbers in one file)."""
  la, lb = _structure(a)[0], _structure(b)[0]
  if len(la) != len(lb) or any(x != y and "list" not in (x, y) for x, y in zip(la, lb)):
    return False
  ka, kb = _leaf_dtype(a).kind, _leaf_dtype(b).kind
  return (ka == "b") == (kb == "b")


def _leaf_owners(arrow_schema) -> list[str]:
  """The top-level column of each Parquet leaf column, in order: a leaf's dotted
  ``path_in_schema`` does not say it (a column named ``meta.text`` has the path
  ``meta.text``, a list column ``x``'s leaf is ``x.list.element``)."""
  import pyarrow as pa  # noqa: PLC0415

  def leaves(t) -> int:
    if pa.types.is_struct(t):
      return sum(leaves(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_map(t):
      return leaves(t.key_type) + leaves(t.item_type)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
      return leaves(t.value_type)
    return 1

  return [f.name for f in arrow_schema for _ in range(leaves(f.type))]


def _null_columns(meta, path: str, field: str, skip=frozenset(),
                  owners=None) -> dict[str, SchemaConflict]:
  """The top-level columns (but those in ``skip``) whose column chunks' statistics count
  nulls (no data read; ``owners``: each leaf's top-level column, :func:`_leaf_owners`),
  each with the one line of its first null row group (its ``reason``: what and where)."""
  found: dict[str, SchemaConflict] = {}
  for g in range(meta.num_row_groups):
    rg = meta.row_group(g)
    for c in range(rg.num_columns):
      owner = owners[c] if owners else rg.column(c).path_in_schema.split(".")[0]
      if owner in skip or owner in found:
        continue
      stats = rg.column(c).statistics
      if stats is not None and stats.has_null_count and stats.null_count:
        leaf = rg.column(c).path_in_schema
        found[owner] = SchemaConflict(
            f"`{field}`: {path}, row group {g}: column {leaf!r} has {stats.null_count} "
            "null value(s); every row needs a value: fill or drop them before writing the "
            "shards.",
            f"column {leaf!r} has {stats.null_count} null value(s) in "
            f"{os.path.basename(path)}, row group {g}")
  return found


def _check_no_nulls(meta, path: str, field: str, skip=frozenset(), owners=None) -> None:
  """A column chunk whose statistics count nulls is refused (no data read);
  the columns in ``skip`` (never read) may hold nulls (:func:`_null_columns`)."""
  nulls = _null_columns(meta, path, field, skip, owners)
  if nulls:
    raise DataError(str(next(iter(nulls.values()))))


def column_to_numpy(column, name: str) -> np.ndarray:
  """An arrow column of numbers or equal-length (nested) lists of them as an
  ``(n, ...)`` numpy array (``ValueError`` naming the column otherwise)."""
  return _to_numpy(column, None, name)


def _to_numpy(column, shape: tuple[int, ...] | None, name: str) -> np.ndarray:
  """An arrow column (scalars or (nested) lists) as an ``(n, ...)`` numpy array.

  Raises:
    ValueError: nulls (in the rows or inside their lists), lists of different
      lengths at any level, or values that are not numbers.
  """
  import pyarrow as pa  # noqa: PLC0415
  import pyarrow.compute as pc  # noqa: PLC0415

  n = len(column)
  values = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
  widths = []  # the list length at each nesting level
  while True:
    if values.null_count:
      raise ValueError(
          f"column {name!r} has {values.null_count} null value(s)"
          f"{' inside its lists' if widths else ''}; every row needs a value: fill or drop "
          "them before writing the shards."
      )
    if pa.types.is_fixed_size_list(values.type):
      widths.append(values.type.list_size)
    elif pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
      lengths = pc.list_value_length(values)
      lo, hi = (pc.min(lengths).as_py(), pc.max(lengths).as_py()) if len(values) else (0, 0)
      if lo != hi:
        raise ValueError(
            f"column {name!r} holds lists of different lengths ({lo} to {hi} values a row); "
            "every row must have the same length (pad them, or write with make_shards)."
        )
      widths.append(int(lo or 0))
    else:
      break
    values = values.flatten()
  flat = values.to_numpy(zero_copy_only=False)
  if flat.dtype == object or flat.dtype.kind not in "biuf":
    raise ValueError(
        f"column {name!r} has type {column.type}, not numbers; columns must be numeric "
        "scalars or fixed-length lists of numbers."
    )
  if shape is not None and int(np.prod(shape)) == int(np.prod(widths or [1])):
    return flat.reshape((n, *shape))
  return flat.reshape((n, *widths))


class ArrayRecordSource(_RowSource):
  """ArrayRecord files of msgpack'd example dicts, through grain's data source."""

  def __init__(self, paths: Sequence[str], *, field: str = "data.train"):
    import grain  # noqa: PLC0415
    from array_record.python import array_record_module  # noqa: PLC0415

    self.paths = list(paths)
    self.field = field
    self._starts = [0]
    self.schema = {}
    schema_from = None  # the first file with records: its first record's layout is the schema
    for path in self.paths:
      try:
        reader = array_record_module.ArrayRecordReader(path)
        count = reader.num_records()
        record = reader.read([0])[0] if count else b""
        reader.close()
      except Exception as e:  # noqa: BLE001
        raise DataError(f"`{field}`: cannot read {path} as ArrayRecord ({type(e).__name__}: "
                        f"{e}); rewrite it (python -m experiments.make_shards) or leave it out of "
                        "the glob.") from None
      try:
        first = _decode(record) if count else {}
      except Exception as e:  # noqa: BLE001  (msgpack and numpy raise several types)
        raise DataError(_foreign_records(field, path, record, e)) from None
      schema = {k: f"{v.dtype}{list(v.shape)}" for k, v in first.items()}
      if count and schema_from is None:  # an empty file has no records to take a schema from
        self.schema, schema_from = schema, path
      elif count and schema != self.schema:
        raise _mixed_schemas(field, schema_from, self.schema, path, schema)
      self._starts.append(self._starts[-1] + count)
    self._source = grain.sources.ArrayRecordDataSource(self.paths)  # one record at a time
    # Batches read each file's records in one call from the calling (grain reader)
    # thread: grain's __getitems__ starts a thread pool per call, 10x slower here.
    self._readers: dict[int, Any] = {}
    self._locks = [threading.Lock() for _ in self.paths]
    self._touched: set[int] = set()

  def __getitem__(self, index: int) -> Batch:
    return _decode(self._source[int(index)])

  def read_rows(self, indices: Sequence[int]) -> Batch:
    """The rows ``indices`` (global record numbers) as one dict of stacked arrays."""
    from array_record.python import array_record_module  # noqa: PLC0415

    indices = self._check_indices(indices)
    if not len(indices):
      return {}
    files = np.searchsorted(self._starts, indices, side="right") - 1
    records: list[bytes] = [b""] * len(indices)
    for f in map(int, np.unique(files)):
      where = np.nonzero(files == f)[0]
      local = [int(i) - self._starts[f] for i in indices[where]]
      try:
        with self._locks[f]:
          if f not in self._readers:
            self._readers[f] = array_record_module.ArrayRecordReader(
                self.paths[f], "readahead_buffer_size:0")
            self._touched.add(f)
          got = self._readers[f].read(local)
      except Exception as e:  # noqa: BLE001  (the reader raises RuntimeError, OSError, ...)
        raise DataError(
            f"`{self.field}`: {self.paths[f]}, records {local[:4]}{'...' if len(local) > 4 else ''}"
            f": {type(e).__name__}: {e}; the file is damaged, or changed since the run "
            "started: rewrite it (python -m experiments.make_shards) or leave it out of the glob."
        ) from None
      for i, record in zip(where, got, strict=True):
        records[i] = record
    try:
      rows = _decode_batch(records)
      return rows if self._selected is None else {
          k: v for k, v in rows.items() if k in self._selected}
    except Exception as e:  # noqa: BLE001  (a record that is not one of ours decodes badly)
      names = sorted({os.path.basename(self.paths[int(f)]) for f in files})
      raise DataError(
          f"`{self.field}`: a record of {names[:4]} does not decode ({type(e).__name__}: {e}); "
          "write the files with python -m experiments.make_shards."
      ) from None


def _foreign_records(field: str, path: str, record: bytes, error: Exception) -> str:
  """One line for an ArrayRecord file whose records are not examples jaxcoll reads
  (pickles, JSON, tf.train.Example protobufs, ...): it is an ArrayRecord file all right."""
  kind = ("a pickle" if record[:1] == b"\x80" else
          "JSON" if record.lstrip()[:1] in (b"{", b"[") else
          "a protobuf such as tf.train.Example" if record[:1] == b"\n" else "")
  return (
      f"`{field}`: {path} is an ArrayRecord file, but its records are not examples jaxcoll "
      f"reads: record 0 ({len(record)} bytes, starting {record[:12]!r}"
      f"{f', {kind}' if kind else ''}) does not decode as one ({type(error).__name__}: "
      f"{error}). jaxcoll reads records that python -m experiments.make_shards "
      "--format=array_record or jaxcoll.data.sources.write_shards(columns, DIR, "
      "fmt='array_record') write, or flax.serialization.msgpack_serialize'd dicts of numpy "
      "arrays; decode yours into arrays and write them so."
  )


_MAGIC = b"JXAR"
_HEADER = "__jxar_header__"


def _encode(row: Mapping[str, np.ndarray]) -> bytes:
  """One example as magic + header length + JSON layout + the columns' bytes."""
  arrays = {k: np.asarray(v) for k, v in row.items()}  # tobytes() is C order
  header = json.dumps([[k, v.dtype.str, list(v.shape)] for k, v in arrays.items()]).encode()
  return b"".join([_MAGIC, len(header).to_bytes(4, "little"), header,
                   *(v.tobytes() for v in arrays.values())])


def _layout(record: bytes) -> np.dtype:
  """The structured dtype of a record: its header as padding, then the columns."""
  size = int.from_bytes(record[4:8], "little")
  columns = json.loads(record[8:8 + size])
  return np.dtype([(_HEADER, f"V{8 + size}")] +
                  [(k, dt, tuple(shape)) for k, dt, shape in columns])


def _decode_batch(records: Sequence[bytes]) -> Batch:
  """Records of one layout as stacked arrays, decoded in one frombuffer."""
  first = records[0]
  if not first.startswith(_MAGIC):  # msgpack'd dicts (flax.serialization)
    rows = [_decode(r) for r in records]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}
  layout = _layout(first)
  if any(len(r) != layout.itemsize for r in records):
    return {k: np.stack([r[k] for r in (_decode(x) for x in records)])
            for k in _decode(first)}
  table = np.frombuffer(b"".join(records), layout)
  return {k: np.array(table[k]) for k in layout.names if k != _HEADER}


def _decode(record: bytes) -> Batch:
  if record.startswith(_MAGIC):
    row = np.frombuffer(record, _layout(record))[0]
    return {k: np.array(row[k]) for k in row.dtype.names if k != _HEADER}
  from flax import serialization  # noqa: PLC0415

  return {k: np.asarray(v) for k, v in serialization.msgpack_restore(record).items()}


def write_shards(
    columns: Mapping[str, np.ndarray],
    out_dir: str,
    *,
    num_shards: int = 1,
    fmt: str = "parquet",
    prefix: str = "data",
    row_group_size: int = 1024,
) -> list[str]:
  """Writes ``columns`` (equal-length arrays, one row per example) as shards.

  Rows are split into ``num_shards`` contiguous shards
  ``{prefix}-{i:05d}-of-{n:05d}.{parquet|array_record}`` in ``out_dir``. Rows that do
  not fit in memory: :class:`ShardWriter` (the same files, written a chunk at a time).

  Returns:
    The paths written, in order.

  Raises:
    ValueError: for arrays of different lengths, fewer rows than shards, or an
      unknown format.
  """
  if fmt not in FORMATS:
    raise ValueError(f"`format` must be one of {FORMATS}, got {fmt!r}.")
  arrays = {k: np.asarray(v) for k, v in columns.items()}
  if not arrays:
    raise ValueError("`columns` is empty; give at least one array, one row per example.")
  for k, v in arrays.items():
    if v.ndim == 0:
      raise ValueError(f"`columns`[{k!r}] is a scalar ({v.item()!r}), not one value per row; "
                       "give an array of one row per example, or leave it out.")
  lengths = {k: len(v) for k, v in arrays.items()}
  if len(set(lengths.values())) != 1:
    raise ValueError(f"every column must have the same number of rows, got {lengths}.")
  n = next(iter(lengths.values()))
  with ShardWriter(out_dir, n, num_shards=num_shards, fmt=fmt, prefix=prefix,
                   row_group_size=row_group_size) as writer:
    writer.write(arrays)
  return writer.paths


class ShardWriter:
  """Writes ``rows`` rows, given in order a chunk at a time, as :func:`write_shards`'s
  shards: the same files (shard ``i`` holds rows ``linspace(0, rows, num_shards + 1)[i:i +
  2]``, Parquet row groups of ``row_group_size`` rows from each shard's start), holding at
  most a chunk and one row group's rows. Every shard is written to a temporary file and
  renamed into place only when all ``rows`` are written: a failed read leaves ``out_dir``'s
  old shards as they were.

  Example:
    >>> import tempfile
    >>> with ShardWriter(tempfile.mkdtemp(), 6, num_shards=2) as w:
    ...   w.write({"x": np.arange(4.0)})
    ...   w.write({"x": np.arange(2.0)})
    >>> [os.path.basename(p) for p in w.paths]
    ['data-00000-of-00002.parquet', 'data-00001-of-00002.parquet']
  """

  def __init__(self, out_dir: str, rows: int, *, num_shards: int = 1, fmt: str = "parquet",
               prefix: str = "data", row_group_size: int = 1024):
    if fmt not in FORMATS:
      raise ValueError(f"`format` must be one of {FORMATS}, got {fmt!r}.")
    if not 1 <= num_shards <= rows:
      raise ValueError(f"`num_shards` must be in 1..{rows} (the number of rows), got "
                       f"{num_shards}.")
    self._out, self._rows, self._fmt = out_dir, int(rows), fmt
    self._row_group = int(row_group_size)
    self._bounds = np.linspace(0, rows, num_shards + 1).astype(int)
    ext = "parquet" if fmt == "parquet" else "array_record"
    self.paths = [os.path.join(out_dir, f"{prefix}-{i:05d}-of-{num_shards:05d}.{ext}")
                  for i in range(num_shards)]
    self._tmps: list[str] = []
    self._shard, self._written = 0, 0  # the shard being written; rows written in all
    self._writer = None  # the open shard's writer
    self._pending: dict[str, np.ndarray] | None = None  # Parquet: < row_group_size rows
    # {column: (dtype, per-row shape)} of the first chunk written (None before it)
    self.layout: dict[str, tuple[np.dtype, tuple[int, ...]]] | None = None
    self._schema = None

  def __enter__(self) -> ShardWriter:
    return self

  def __exit__(self, kind, error, trace) -> None:
    if kind is None:
      self.close()
    else:
      self.abort()

  def write(self, columns: Mapping[str, np.ndarray]) -> None:
    """Appends the rows of ``columns`` (equal-length arrays; the first chunk's columns,
    dtypes and per-row shapes every time)."""
    arrays = {k: np.asarray(v) for k, v in columns.items()}
    layout = {k: (v.dtype, v.shape[1:]) for k, v in arrays.items()}
    if self.layout is None:
      self.layout = layout
    elif layout != self.layout:
      raise ValueError(f"a chunk of columns {_describe_layout(layout)}, but the first was "
                       f"{_describe_layout(self.layout)}; give every chunk the same columns.")
    n = len(next(iter(arrays.values()))) if arrays else 0
    if any(len(v) != n for v in arrays.values()):
      raise ValueError("every column must have the same number of rows, got "
                       f"{ {k: len(v) for k, v in arrays.items()} }.")
    if self._written + n > self._rows:
      raise ValueError(f"{self._written + n} rows written, more than the {self._rows} given.")
    done = 0
    while done < n:
      if self._writer is None:
        self._open_shard()
      take = min(n - done, int(self._bounds[self._shard + 1]) - self._written)
      self._append({k: v[done:done + take] for k, v in arrays.items()})
      done += take
      self._written += take
      if self._written == self._bounds[self._shard + 1]:
        self._close_shard()

  def close(self) -> list[str]:
    """Renames every shard into place (all rows must have been written); the paths."""
    if self._written != self._rows:
      self.abort()
      raise ValueError(f"{self._written} rows written, but {self._rows} were announced.")
    for tmp, path in zip(self._tmps, self.paths, strict=True):
      os.replace(tmp, path)
    self._tmps = []
    return self.paths

  def abort(self) -> None:
    """Removes the temporary files written so far; ``out_dir`` keeps what it had."""
    if self._writer is not None:
      try:
        self._writer.close()
      except Exception:  # noqa: BLE001  (already failing: the first error is the one told)
        pass
      self._writer = None
    for tmp in self._tmps:
      try:
        os.remove(tmp)
      except OSError:
        pass
    self._tmps = []

  def _open_shard(self) -> None:
    os.makedirs(self._out, exist_ok=True)
    tmp = f"{self.paths[self._shard]}.tmp{os.getpid()}"
    self._tmps.append(tmp)
    if self._fmt == "parquet":
      import pyarrow.parquet as pq  # noqa: PLC0415

      if self._schema is None:
        self._schema = _parquet_table({k: np.empty((0, *shape), dtype)
                                       for k, (dtype, shape) in self.layout.items()}).schema
      self._writer = pq.ParquetWriter(tmp, self._schema, write_page_checksum=True)
    else:
      from array_record.python import array_record_module  # noqa: PLC0415

      self._writer = array_record_module.ArrayRecordWriter(tmp, "group_size:1")

  def _append(self, part: dict[str, np.ndarray]) -> None:
    if self._fmt != "parquet":
      for i in range(len(next(iter(part.values())))):
        self._writer.write(_encode({k: v[i] for k, v in part.items()}))
      return
    if self._pending is not None:  # the rows short of a row group, first
      part = {k: np.concatenate([self._pending[k], v]) for k, v in part.items()}
    n = len(next(iter(part.values())))
    whole = n - n % self._row_group
    if whole:
      self._writer.write_table(_parquet_table({k: v[:whole] for k, v in part.items()}),
                               row_group_size=self._row_group)
    self._pending = {k: v[whole:].copy() for k, v in part.items()} if whole < n else None

  def _close_shard(self) -> None:
    if self._pending is not None:  # the shard's last, shorter row group
      self._writer.write_table(_parquet_table(self._pending), row_group_size=self._row_group)
      self._pending = None
    self._writer.close()
    self._writer = None
    self._shard += 1


def _describe_layout(layout: Mapping[str, tuple[np.dtype, tuple[int, ...]]]) -> str:
  return str({k: f"{dtype}{list(shape)}" for k, (dtype, shape) in layout.items()})


def _parquet_table(columns: Mapping[str, np.ndarray]):
  """``columns`` as an arrow table: lists of fixed length, their per-row shape in the
  field's metadata (the reader reshapes them)."""
  import pyarrow as pa  # noqa: PLC0415

  fields, arrays = [], []
  for name, v in columns.items():
    if v.ndim == 1:
      arrays.append(pa.array(v))
      fields.append(pa.field(name, arrays[-1].type))
    else:
      size = int(np.prod(v.shape[1:]))
      arr = pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1)), size)
      arrays.append(arr)
      fields.append(pa.field(name, arr.type,
                             metadata={"shape": ",".join(str(s) for s in v.shape[1:])}))
  return pa.Table.from_arrays(arrays, schema=pa.schema(fields))
