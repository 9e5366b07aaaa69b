"""make_shards --input reads the user's files a chunk at a time (jaxcoll.data.convert) and
writes the shards as it goes (sources.ShardWriter): the same files as the in-memory
writer, with no step holding more than a chunk's rows (a 1 GB Parquet file took 2.8 GB of
memory when it was read whole)."""

import gzip
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.json as pa_json
import pyarrow.parquet as pq
import pytest

from jaxcoll.data import convert, sources as data_sources


@pytest.fixture
def chunks_written(monkeypatch):
  """The row count of every chunk handed to a ShardWriter."""
  seen = []
  write = data_sources.ShardWriter.write

  def spy(self, columns):
    seen.append(len(next(iter(columns.values()))))
    return write(self, columns)

  monkeypatch.setattr(data_sources.ShardWriter, "write", spy)
  return seen


def _write(rows, out, **kw):
  """What make_shards does with the rows open_input gives."""
  with data_sources.ShardWriter(str(out), rows.rows, **kw) as writer:
    for chunk in rows.chunks():
      writer.write(chunk)
  return writer.paths


def _main_shards(columns, out, num_shards, row_group_size, prefix="data"):
  """The shards as main's write_shards wrote them (whole arrays: contiguous slices at
  linspace bounds, pq.write_table with row_group_size)."""
  n = len(next(iter(columns.values())))
  bounds = np.linspace(0, n, num_shards + 1).astype(int)
  os.makedirs(out, exist_ok=True)
  paths = []
  for i in range(num_shards):
    fields, arrays = [], []
    for k, v in columns.items():
      v = v[bounds[i]:bounds[i + 1]]
      if v.ndim == 1:
        arrays.append(pa.array(v))
        fields.append(pa.field(k, arrays[-1].type))
      else:
        arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1)),
                                                        int(np.prod(v.shape[1:]))))
        fields.append(pa.field(k, arrays[-1].type,
                               metadata={"shape": ",".join(map(str, v.shape[1:]))}))
    paths.append(os.path.join(out, f"{prefix}-{i:05d}-of-{num_shards:05d}.parquet"))
    pq.write_table(pa.Table.from_arrays(arrays, schema=pa.schema(fields)), paths[-1],
                   row_group_size=row_group_size, write_page_checksum=True)
  return paths


def _same_files(a, b):
  assert [os.path.basename(p) for p in a] == [os.path.basename(p) for p in b]
  for x, y in zip(a, b, strict=True):
    with open(x, "rb") as fx, open(y, "rb") as fy:
      assert fx.read() == fy.read(), (x, y)


def test_parquet_is_read_a_row_group_at_a_time_and_written_as_main_wrote_it(
    tmp_path, chunks_written):
  rng = np.random.default_rng(0)
  x = rng.normal(size=1000).astype(np.float32)
  v = rng.integers(0, 9, (1000, 3)).astype(np.int64)
  table = pa.table({"x": x, "v": pa.array(list(v), pa.list_(pa.int64())),
                    "name": [f"u{i}" for i in range(1000)]})
  pq.write_table(table.slice(0, 600), tmp_path / "a.parquet", row_group_size=100)
  pq.write_table(table.slice(600), tmp_path / "b.parquet", row_group_size=150)
  skipped = {}
  rows = convert.open_input(str(tmp_path / "*.parquet"), "", skipped)
  assert rows.rows == 1000 and skipped == {"name": "not numbers"}
  got = _write(rows, tmp_path / "new", num_shards=3, row_group_size=64)
  assert max(chunks_written) <= 150 and sum(chunks_written) == 1000  # a row group a write
  _same_files(got, _main_shards({"x": x, "v": v}, str(tmp_path / "old"), 3, 64))


@pytest.mark.parametrize("kind", ["csv", "jsonl.gz"])
def test_text_is_read_a_block_at_a_time_never_whole(tmp_path, monkeypatch, chunks_written,
                                                     kind):
  n = 3000
  rng = np.random.default_rng(1)
  x, y = rng.normal(size=n).round(6), np.arange(n) % 7
  if kind == "csv":
    text = "x,y,name\n" + "".join(f"{a},{b},n{i}\n" for i, (a, b) in enumerate(zip(x, y)))
    (tmp_path / "a.csv").write_text(text)
    expected = {"x": x, "y": y}
  else:
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
      for a, b in zip(x, y):
        f.write(json.dumps({"f": [a, a], "y": int(b), "s": "t"}) + "\n")
    expected = {"f": np.stack([x, x], 1), "y": y}
  monkeypatch.setattr(convert, "CHUNK_BYTES", 4096)
  whole = AssertionError("read whole")
  monkeypatch.setattr(pa_csv, "read_csv", lambda *a, **k: (_ for _ in ()).throw(whole))
  monkeypatch.setattr(pa_json, "read_json", lambda *a, **k: (_ for _ in ()).throw(whole))
  rows = convert.open_input(str(tmp_path / f"a.{kind}"))
  assert rows.rows == n
  got = _write(rows, tmp_path / "new", num_shards=4, row_group_size=100)
  assert len(chunks_written) > 10 and max(chunks_written) < 400, chunks_written
  _same_files(got, _main_shards(expected, str(tmp_path / "old"), 4, 100))


def test_a_type_a_later_block_widens_is_the_type_of_the_whole_file(tmp_path, monkeypatch):
  # pyarrow's streaming reader infers types from the first block; a 1.5 at the end makes
  # the column float64 when pyarrow reads the file whole, as main did: the same here
  lines = "".join(f"{i},{i % 5}\n" for i in range(2000)) + "2000,1.5\n"
  (tmp_path / "a.csv").write_text("id,y\n" + lines)
  monkeypatch.setattr(convert, "CHUNK_BYTES", 2048)
  rows = convert.open_input(str(tmp_path / "a.csv"))
  assert {k: str(dtype) for k, (dtype, _) in rows.columns.items()} == {"id": "int64",
                                                                       "y": "float64"}
  got = _write(rows, tmp_path / "new", num_shards=2, row_group_size=256)
  y = np.append(np.arange(2000) % 5, 1.5)
  _same_files(got, _main_shards({"id": np.arange(2001), "y": y}, str(tmp_path / "old"), 2,
                                256))


@pytest.mark.parametrize("save", ["savez", "savez_compressed"])
def test_npz_arrays_are_read_a_chunk_of_rows_at_a_time(tmp_path, monkeypatch, chunks_written,
                                                        save):
  rng = np.random.default_rng(2)
  x, y = rng.normal(size=(2000, 2, 3)).astype(np.float32), np.arange(2000, dtype=np.int32)
  getattr(np, save)(tmp_path / "a.npz", x=x[:1500], y=y[:1500])
  getattr(np, save)(tmp_path / "b.npz", x=x[1500:], y=y[1500:].astype(np.int64))
  monkeypatch.setattr(convert, "CHUNK_BYTES", 28 * 100)  # 100 rows of 24 + 4 bytes
  monkeypatch.setattr(np, "load", lambda *a, **k: pytest.fail("an array loaded whole"))
  rows = convert.open_input(str(tmp_path))
  got = _write(rows, tmp_path / "new", num_shards=3, row_group_size=128)
  assert max(chunks_written) <= 100 and sum(chunks_written) == 2000
  _same_files(got, _main_shards({"x": x, "y": y.astype(np.int64)}, str(tmp_path / "old"), 3,
                                128))


def test_a_row_group_that_fails_late_leaves_the_old_shards_as_they_were(tmp_path):
  # lists of 4 values in a.parquet, of 5 in b.parquet: found when b is read, after
  # shard 0 is written; the shards of the last good run stay, and no temporary file
  pq.write_table(pa.table({"v": pa.array([[1, 2, 3, 4]] * 10, pa.list_(pa.int64()))}),
                 tmp_path / "a.parquet")
  pq.write_table(pa.table({"v": pa.array([[1, 2, 3, 4, 5]] * 10, pa.list_(pa.int64()))}),
                 tmp_path / "b.parquet")
  out = tmp_path / "out"
  old = data_sources.write_shards({"v": np.zeros((20, 4), np.int64)}, str(out), num_shards=2)
  before = {p: open(p, "rb").read() for p in old}
  rows = convert.open_input(str(tmp_path / "*.parquet"))
  with pytest.raises(ValueError, match=r"b.parquet, row group 0 .* per-row shape \[5\]"):
    _write(rows, out, num_shards=2)
  assert sorted(os.listdir(out)) == sorted(os.path.basename(p) for p in old)
  assert {p: open(p, "rb").read() for p in old} == before


def test_shard_writer_refuses_more_or_fewer_rows_than_announced(tmp_path):
  with pytest.raises(ValueError, match="12 rows written, more than the 10 given"):
    with data_sources.ShardWriter(str(tmp_path), 10) as w:
      w.write({"x": np.zeros(12)})
  with pytest.raises(ValueError, match="4 rows written, but 10 were announced"):
    with data_sources.ShardWriter(str(tmp_path), 10, num_shards=2) as w:
      w.write({"x": np.zeros(4)})
  assert os.listdir(tmp_path) == []


def test_columns_of_a_parquet_file_decode_only_those(tmp_path):
  # a list column of several lengths (tags) stopped make_shards even with --columns
  # leaving it out: every column was decoded; now only the columns written are
  pq.write_table(pa.table({"x": np.arange(6.0), "tags": [[1], [1, 2], [2], [3], [4], [5]]}),
                 tmp_path / "a.parquet", row_group_size=4)
  rows = convert.open_input(str(tmp_path / "a.parquet"), "x")
  got = _write(rows, tmp_path / "new", num_shards=2, row_group_size=2)
  _same_files(got, _main_shards({"x": np.arange(6.0)}, str(tmp_path / "old"), 2, 2))


def test_a_file_named_npz_that_is_no_zip_is_one_line(tmp_path):
  (tmp_path / "a.npz").write_bytes(b"not a zip")
  with pytest.raises(ValueError, match=r"^`--input`: a.npz: not an .npz file \(.*\); give"):
    convert.open_input(str(tmp_path / "a.npz"))


def test_an_npz_member_that_is_not_a_whole_array_is_one_line_naming_it(tmp_path):
  # Another file in the zip was "EOF: reading magic string, expected 8 bytes got 5"; a
  # truncated member "buffer size must be a multiple of element size": neither named the file.
  import zipfile  # noqa: PLC0415

  extra = tmp_path / "extra.npz"
  np.savez(extra, x=np.arange(10.0))
  with zipfile.ZipFile(extra, "a") as z:
    z.writestr("notes.txt", "hello")
  np.savez(tmp_path / "whole.npz", x=np.arange(1000.0))
  with zipfile.ZipFile(tmp_path / "whole.npz") as z:
    data = z.read("x.npy")
  with zipfile.ZipFile(tmp_path / "cut.npz", "w") as z:
    z.writestr("x.npy", data[:-800])
  for name, member, why in (("extra.npz", "notes.txt", "EOF"),
                            ("cut.npz", "x.npy", "900 of 1000 rows")):
    with pytest.raises(ValueError) as e:
      rows = convert.open_input(str(tmp_path / name), "", {})
      for _ in rows.chunks():
        pass
    line = str(e.value)
    assert line.startswith(f"`--input`: {name}: member {member!r} is not a whole .npy array")
    assert why in line and "\n" not in line, line


_KILLED_WHILE_WRITING = """if True:
  import os, runpy, signal, sys
  # Ctrl-C as in a terminal: a suite started in the background (nohup, CI) passes SIGINT on
  # ignored, and Python then installs no KeyboardInterrupt handler.
  signal.signal(signal.SIGINT, signal.default_int_handler)
  from jaxcoll.data import convert, sources
  convert.CHUNK_BYTES = 4096  # several chunks
  write = sources.ShardWriter.write
  def write_then_sigterm(self, chunk):
    write(self, chunk)
    os.kill(os.getpid(), signal.SIGTERM)
  sources.ShardWriter.write = write_then_sigterm
  sys.argv = ["make_shards", *sys.argv[1:]]
  runpy.run_module("experiments.make_shards", run_name="__main__")
"""


@pytest.mark.parametrize("sig,by,status", [("SIGTERM", "SIGTERM", 143),
                                           ("SIGINT", "Ctrl-C", 130)])
def test_a_stop_while_shards_are_written_leaves_out_as_it_was(tmp_path, sig, by, status):
  # SIGTERM (a job's time limit) ended the process with every shard's temporary file left in
  # --out (they are all open until the last row now); Ctrl-C removed them, with a traceback.
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415

  import jobs  # noqa: PLC0415

  np.savez(tmp_path / "in.npz", x=np.arange(20000.0))
  args = [f"--input={tmp_path}/in.npz", f"--out={tmp_path}/out", "--num_shards=4"]
  first = subprocess.run([sys.executable, "-m", "experiments.make_shards", *args],
                         cwd=jobs.REPO, capture_output=True, text=True, timeout=300)
  assert first.returncode == 0, first.stderr
  before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
  killed = subprocess.run([sys.executable, "-c", _KILLED_WHILE_WRITING.replace("SIGTERM", sig),
                           *args], cwd=jobs.REPO, capture_output=True, text=True, timeout=300)
  assert killed.returncode == status, killed.stderr
  assert killed.stderr.strip().splitlines() == [
      f"make_shards: stopped by {by} before the last shard was written: nothing written to "
      f"--out='{tmp_path}/out' (what it held is as it was); run the command again to write the "
      "shards."], killed.stderr
  assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
