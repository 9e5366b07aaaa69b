"""Record files as grain data sources: Parquet (pyarrow) and ArrayRecord.

Each row (record) is one example; its columns are the batch's keys. A numeric
scalar column becomes an ``(n,)`` array, a fixed-length list column an
``(n, L)`` array, reshaped to the field's ``shape`` metadata when the file has
one (``write_shards`` stores it, so images come back as ``(n, H, W, C)``).

- Parquet: random access through row groups (a global row index maps to a
  file, a row group and an offset; decoded row groups are kept in a small LRU
  cache), so a process reads only the row groups holding its rows.
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
import json
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

Batch = dict[str, np.ndarray]
FORMATS = ("parquet", "array_record")
_EXTENSIONS = {".parquet": "parquet", ".pq": "parquet", ".array_record": "array_record",
               ".arrayrecord": "array_record"}


def expand(pattern: str, field: str = "data.train") -> list[str]:
  """The files ``pattern`` (a glob, or several joined by commas) matches, sorted.

  Raises:
    ValueError: if nothing matches, naming the pattern and the fix.
  """
  paths = sorted({p for part in str(pattern).split(",") if part.strip()
                  for p in glob_lib.glob(os.path.expanduser(part.strip()))
                  if os.path.isfile(p)})
  if not paths:
    raise ValueError(
        f"`{field}`={pattern!r} matches no file; give a glob of Parquet or ArrayRecord "
        "files, e.g. /data/train-*.parquet (write them with python -m experiments.make_shards)."
    )
  return paths


def file_format(paths: Sequence[str], field: str = "data.train") -> str:
  """``"parquet"`` or ``"array_record"`` from the files' extensions (all alike)."""
  kinds = {_EXTENSIONS.get(os.path.splitext(p)[1].lower()) for p in paths}
  if None in kinds or len(kinds) != 1:
    raise ValueError(
        f"`{field}` must name files of one format with extension .parquet or .array_record, "
        f"got {sorted({os.path.basename(p) for p in paths})[:4]}; rename them or write "
        "them with python -m experiments.make_shards."
    )
  return kinds.pop()


def open_source(pattern: str | Sequence[str], field: str = "data.train") -> Any:
  """A :class:`ParquetSource` or :class:`ArrayRecordSource` over the files."""
  paths = expand(pattern, field) if isinstance(pattern, str) else list(pattern)
  if file_format(paths, field) == "parquet":
    return ParquetSource(paths, field=field)
  return ArrayRecordSource(paths, field=field)


def _mixed_schemas(field: str, first: str, schema0, path: str, schema) -> ValueError:
  def show(s):
    return ", ".join(f"{k}: {v}" for k, v in s.items())
  return ValueError(
      f"`{field}` mixes schemas: {os.path.basename(first)} has {{{show(schema0)}}} but "
      f"{os.path.basename(path)} has {{{show(schema)}}}; every file must have the same "
      "columns, types and shapes (rewrite them with python -m experiments.make_shards)."
  )


class _RowSource:
  """Shared part of the two sources: grain's protocol on top of read_rows."""

  paths: list[str]
  schema: dict[str, str]

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

  def _check_indices(self, indices) -> np.ndarray:
    indices = np.asarray(indices, np.int64).reshape(-1)
    if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
      raise IndexError(f"record index out of range 0..{len(self) - 1}: {indices}")
    return indices


class ParquetSource(_RowSource):
  """Random access to the rows of Parquet files, one row group read at a time."""

  def __init__(self, paths: Sequence[str], *, field: str = "data.train", cache_row_groups=64):
    import pyarrow.parquet as pq  # noqa: PLC0415

    self.paths = list(paths)
    self._files = []
    self._group_starts: list[int] = [0]  # global row index where each row group starts
    self._groups: list[tuple[int, int]] = []  # (file, row group)
    self.schema = {}
    self._shapes: dict[str, tuple[int, ...] | None] = {}
    for f, path in enumerate(self.paths):
      try:
        pfile = pq.ParquetFile(path)
      except Exception as e:  # noqa: BLE001  (pyarrow raises several types)
        raise ValueError(f"`{field}`: cannot read {path} as Parquet ({e}).") from None
      schema = {name: str(pfile.schema_arrow.field(name).type)
                for name in pfile.schema_arrow.names}
      if f == 0:
        self.schema = schema
        for name in pfile.schema_arrow.names:
          meta = pfile.schema_arrow.field(name).metadata or {}
          shape = meta.get(b"shape")
          self._shapes[name] = (tuple(int(s) for s in shape.decode().split(",") if s)
                                if shape is not None else None)
      elif schema != self.schema:
        raise _mixed_schemas(field, self.paths[0], self.schema, path, schema)
      self._files.append(pfile)
      for g in range(pfile.num_row_groups):
        self._groups.append((f, g))
        self._group_starts.append(self._group_starts[-1] + pfile.metadata.row_group(g).num_rows)
    self._starts = [0]
    for f in range(len(self.paths)):
      self._starts.append(self._starts[-1] + self._files[f].metadata.num_rows)
    self._cache: collections.OrderedDict[int, Batch] = collections.OrderedDict()
    self._cache_size = cache_row_groups
    self._lock = threading.Lock()
    self._touched: set[int] = set()

  def _row_group(self, g: int) -> Batch:
    with self._lock:
      if g in self._cache:
        self._cache.move_to_end(g)
        return self._cache[g]
    f, group = self._groups[g]
    table = self._files[f].read_row_group(group)
    columns = {name: _to_numpy(table.column(name), self._shapes.get(name), name)
               for name in table.column_names}
    with self._lock:
      self._touched.add(f)
      self._cache[g] = columns
      while len(self._cache) > self._cache_size:
        self._cache.popitem(last=False)
    return columns

  def read_rows(self, indices: Sequence[int]) -> Batch:
    """The rows ``indices`` (global row numbers) as one dict of stacked arrays."""
    indices = self._check_indices(indices)
    groups = np.searchsorted(self._group_starts, indices, side="right") - 1
    out: dict[str, np.ndarray] = {}
    for g in np.unique(groups):
      where = np.nonzero(groups == g)[0]
      columns = self._row_group(int(g))
      offsets = indices[where] - self._group_starts[g]
      for name, values in columns.items():
        if name not in out:
          out[name] = np.empty((len(indices), *values.shape[1:]), values.dtype)
        out[name][where] = values[offsets]
    if not len(indices):
      return {name: np.empty((0,)) for name in self.schema}
    return out


def _to_numpy(column, shape: tuple[int, ...] | None, name: str) -> np.ndarray:
  """An arrow column (scalars or (nested) lists) as an ``(n, ...)`` numpy array."""
  import pyarrow as pa  # noqa: PLC0415

  n = len(column)
  values = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
  nested = False
  while pa.types.is_list(values.type) or pa.types.is_fixed_size_list(values.type) or \
      pa.types.is_large_list(values.type):
    values, nested = values.flatten(), True
  flat = values.to_numpy(zero_copy_only=False)
  if flat.dtype == object:
    raise ValueError(
        f"column {name!r} has type {column.type}, not numbers; columns must be numeric "
        "scalars or fixed-length lists of numbers."
    )
  if not nested:
    return flat if shape is None else flat.reshape((n, *shape))
  if n == 0 or len(flat) % n:
    raise ValueError(
        f"column {name!r} holds lists of different lengths ({len(flat)} values in {n} rows); "
        "every row must have the same length (pad them, or write with make_shards)."
    )
  return flat.reshape((n, *shape)) if shape else flat.reshape((n, len(flat) // n))


class ArrayRecordSource(_RowSource):
  """ArrayRecord files of msgpack'd example dicts, through grain's data source."""

  def __init__(self, paths: Sequence[str], *, field: str = "data.train"):
    import grain  # noqa: PLC0415
    from array_record.python import array_record_module  # noqa: PLC0415

    self.paths = list(paths)
    self._starts = [0]
    self.schema = {}
    for f, path in enumerate(self.paths):
      try:
        reader = array_record_module.ArrayRecordReader(path)
        count = reader.num_records()
        first = _decode(reader.read([0])[0]) if count else {}
        reader.close()
      except Exception as e:  # noqa: BLE001
        raise ValueError(f"`{field}`: cannot read {path} as ArrayRecord ({e}).") from None
      schema = {k: f"{v.dtype}{list(v.shape)}" for k, v in first.items()}
      if f == 0:
        self.schema = schema
      elif schema != self.schema:
        raise _mixed_schemas(field, self.paths[0], self.schema, path, schema)
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
      with self._locks[f]:
        if f not in self._readers:
          self._readers[f] = array_record_module.ArrayRecordReader(
              self.paths[f], "readahead_buffer_size:0")
          self._touched.add(f)
        got = self._readers[f].read([int(i) - self._starts[f] for i in indices[where]])
      for i, record in zip(where, got, strict=True):
        records[i] = record
    return _decode_batch(records)


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
  ``{prefix}-{i:05d}-of-{n:05d}.{parquet|array_record}`` in ``out_dir``.

  Returns:
    The paths written, in order.

  Raises:
    ValueError: for arrays of different lengths, fewer rows than shards, or an
      unknown format.
  """
  if fmt not in FORMATS:
    raise ValueError(f"`format` must be one of {FORMATS}, got {fmt!r}.")
  arrays = {k: np.asarray(v) for k, v in columns.items()}
  lengths = {k: len(v) for k, v in arrays.items()}
  if not arrays or len(set(lengths.values())) != 1:
    raise ValueError(f"every column must have the same number of rows, got {lengths}.")
  n = next(iter(lengths.values()))
  if not 1 <= num_shards <= n:
    raise ValueError(f"`num_shards` must be in 1..{n} (the number of rows), got {num_shards}.")
  os.makedirs(out_dir, exist_ok=True)
  ext = "parquet" if fmt == "parquet" else "array_record"
  bounds = np.linspace(0, n, num_shards + 1).astype(int)
  paths = []
  for i in range(num_shards):
    path = os.path.join(out_dir, f"{prefix}-{i:05d}-of-{num_shards:05d}.{ext}")
    part = {k: v[bounds[i]:bounds[i + 1]] for k, v in arrays.items()}
    tmp = f"{path}.tmp{os.getpid()}"
    if fmt == "parquet":
      _write_parquet(tmp, part, row_group_size)
    else:
      _write_array_record(tmp, part)
    os.replace(tmp, path)
    paths.append(path)
  return paths


def _write_parquet(path: str, columns: Mapping[str, np.ndarray], row_group_size: int) -> None:
  import pyarrow as pa  # noqa: PLC0415
  import pyarrow.parquet as pq  # noqa: PLC0415

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
  table = pa.Table.from_arrays(arrays, schema=pa.schema(fields))
  pq.write_table(table, path, row_group_size=row_group_size)


def _write_array_record(path: str, columns: Mapping[str, np.ndarray]) -> None:
  from array_record.python import array_record_module  # noqa: PLC0415

  writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
  n = len(next(iter(columns.values())))
  for i in range(n):
    writer.write(_encode({k: v[i] for k, v in columns.items()}))
  writer.close()

