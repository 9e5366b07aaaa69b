"""jaxcoll.bench and experiments.bench_collectives: sizes, timing rows, check, CLI."""

import csv
import io
import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jobs
import numpy as np
import pytest

import jaxcoll
from jaxcoll.observe import bench
from jaxcoll.comm_model import cost
from jaxcoll.collectives import _dispatch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = [sys.executable, "-m", "experiments.bench_collectives"]


def _env(**extra):
  env = dict(os.environ, PYTHONPATH=ROOT, JAXCOLL_CPU_DEVICES="8", **extra)
  env.pop("JAX_PLATFORMS", None)
  return env


def _run(args, *, code=None, timeout=180):
  """The CLI (or ``python -c code``) forked from a warm Python (jobs.forked: the same module,
  argv and environment in a process of its own, ~2 CPU-s of start-up less each)."""
  argv = CLI + list(args) if code is None else [sys.executable, "-c", code, *args]
  return jobs.forked(argv, cwd=ROOT, timeout=timeout)


# ------------------------------------------------------------------ sizes


@pytest.mark.parametrize(
    "text,value",
    [("64K", 64 << 10), ("1M", 1 << 20), ("4G", 4 << 30), ("16KiB", 16 << 10), ("100", 100),
     (256, 256)],
)
def test_parse_size(text, value):
  assert bench.parse_size(text) == value


@pytest.mark.parametrize("text", ["abc", "0", "-4K", "4X", "", "1.5M"])
def test_parse_size_rejects(text):
  with pytest.raises(ValueError, match="is not a size"):
    bench.parse_size(text, "min_bytes")


def test_size_sweep():
  assert bench.size_sweep("4K", "64K", 4) == [4096, 16384, 65536]
  assert bench.size_sweep(1000, 5000, 2) == [1000, 2000, 4000]
  assert bench.size_sweep("8", "8", 2) == [8]
  with pytest.raises(ValueError, match=r"`min_bytes` \(1M\) must not exceed `max_bytes` \(1K\)"):
    bench.size_sweep("1M", "1K")
  with pytest.raises(ValueError, match="`step_factor` must be an integer >= 2"):
    bench.size_sweep("1K", "1M", 1)


@pytest.mark.parametrize(
    "collective,size,dtype,count",
    [
        # nccl-tests' counts (src/common.cu setupArgs, src/<collective>.cu GetCollByteCount)
        ("all_reduce", 6, "float32", 1),  # rounded down to whole elements
        ("all_reduce", 1001, "float32", 250),
        ("all_reduce", 3, "bfloat16", 1),
        ("broadcast", 4, "float32", 1),
        ("all_gather", 128, "float32", 32),  # 16 B (4 floats) per rank at least
        ("all_gather", 64, "float32", 0),  # nccl-tests' size-0 row: left out
        ("all_gather", 1000, "float32", 224),  # 250 / 8 = 31 per rank, 28 in 16-B chunks
        ("reduce_scatter", 36 * 8, "float32", 64),
        ("all_to_all", 4096, "int32", 1024),
        ("all_to_all", 4096, "float64", 512),
        ("all_gather", 200, "int8", 128),  # 16 int8 per rank
    ],
)
def test_element_count_rounds_down_as_nccl_tests(collective, size, dtype, count):
  # Before: sizes rounded up (1001 B -> 251 floats, all_gather 1000 B -> 256): rows that
  # nccl-tests, run with the same -b -e -f, does not have.
  assert bench.element_count(collective, size, 8, dtype) == count
  if count:
    assert bench.element_count(collective, size, 8, dtype) * np.dtype(dtype).itemsize <= size


def test_sizes_below_the_smallest_are_left_out_and_a_sweep_of_only_those_is_an_error():
  assert bench.smallest_size("all_gather", 8, "float32") == 128
  assert bench.smallest_size("all_reduce", 8, "float64") == 8
  assert bench.left_out_sizes("all_gather", [8, 64, 128, "1K"], 8, "float32") == [8, 64]
  _, todo = bench.cases("all_gather", "native", [8, 64, 128, 256], n=8)
  assert [(c.size_bytes, c.count) for c in todo] == [(128, 32), (256, 64)]
  with pytest.raises(ValueError, match=r"every size of the sweep \(2 B\) is below 4 B, the "
                     r"smallest all_reduce of float32 .* use sizes >= 4 B \(-b/--min_bytes\)"):
    bench.cases("all_reduce", "native", [2], n=8)
  with pytest.raises(ValueError, match=r"below 128 B, the smallest all_to_all of float32 \(sizes "
                     r"round down to whole elements, in 16-byte chunks per rank of 8"):
    bench.cases("all_to_all", "native", [8, 64], n=8)


def test_a_size_beyond_memory_is_refused_before_anything_runs():
  # Before: numpy's MemoryError traceback from building the inputs (64G on 8 devices).
  with pytest.raises(ValueError, match=r"size 64 GiB of all_reduce \(float32, 8 devices\) needs "
                     r"at least .* but there are 23.5 GiB; use sizes of at most 256M"):
    bench.check_memory("all_reduce", 64 << 30, n=8, dtype="float32",
                       host_bytes=int(23.5 * 2**30))
  with pytest.raises(ValueError, match="-e/--max_bytes"):
    bench.cases("all_gather", "all", ["4K", "1T"], n=8)
  bench.check_memory("all_gather", 256 << 20, n=8, dtype="float32", host_bytes=8 << 30)
  host, device = bench.memory_needed("reduce_scatter", 8 << 20, 8)  # input 8M, output 1M
  assert device == (8 << 20) + (1 << 20) and host >= 8 * device


def test_count_wrong_exact_and_tolerant():
  want = np.array([1.0, 2.0, 0.0, -3.0], np.float32)
  got = want + np.array([0, 1e-6, 1e-6, 0], np.float32)
  assert bench.count_wrong(got, want, exact=True, dtype="float32") == 2
  assert bench.count_wrong(got, want, exact=False, dtype="float32") == 0
  assert bench.count_wrong(got + 1, want, exact=False, dtype="float32") == 4
  assert bench.count_wrong(got[:2], want, exact=False, dtype="float32") == 4  # wrong shape


# ------------------------------------------------------------------ in-process runs


@pytest.fixture(scope="module")
def all_reduce_rows(devices):
  return bench.run_benchmark(
      "all_reduce", ["native", "ring"], [64, "4K"], iters=2, warmup_iters=1
  )


def test_run_benchmark_all_reduce(all_reduce_rows):
  rows = all_reduce_rows
  assert [(r.algorithm, r.size_bytes, r.count) for r in rows] == [
      ("native", 64, 16), ("ring", 64, 16), ("native", 4096, 1024), ("ring", 4096, 1024)
  ]
  factor = cost.bus_bandwidth_factor("all_reduce", 8)
  assert factor == pytest.approx(1.75)
  for r in rows:
    assert r.wrong == 0
    assert (r.dtype, r.redop, r.root) == ("float32", "sum", -1)
    assert r.time_us > 0
    assert r.algbw_gbps == pytest.approx(r.size_bytes / r.time_us / 1e3)
    assert r.busbw_gbps == pytest.approx(r.algbw_gbps * factor)


def test_format_table_and_files(all_reduce_rows, tmp_path):
  text = bench.format_table(all_reduce_rows, title="t")
  lines = text.splitlines()
  assert lines[0] == "# t"
  header = next(line for line in lines if "algorithm" in line).split()
  assert header == ["#", "size", "count", "type", "redop", "root", "algorithm", "time", "algbw",
                    "busbw", "#wrong"]
  assert "# Wrong values: 0 OK" in lines
  assert any(line.split()[1:3] == ["all_reduce", "ring"] for line in lines)
  bench.write_json(all_reduce_rows, str(tmp_path / "a" / "rows.json"))
  loaded = json.loads((tmp_path / "a" / "rows.json").read_text())
  assert loaded == bench.to_dicts(all_reduce_rows)
  bench.write_csv(all_reduce_rows, str(tmp_path / "rows.csv"))
  with open(tmp_path / "rows.csv") as f:
    table = list(csv.DictReader(f))
  assert [int(r["size_bytes"]) for r in table] == [64, 64, 4096, 4096]
  pytest.importorskip("matplotlib")
  bench.plot(all_reduce_rows, str(tmp_path / "busbw.png"))
  assert (tmp_path / "busbw.png").read_bytes()[:4] == b"\x89PNG"


def test_a_broken_algorithm_is_detected(devices):
  name = "broken_for_test_bench"  # the registry is global: a name of our own

  def off_by_one_on_rank_3(x, group, reducer):
    total = _dispatch.run("all_reduce", "native", x, group, reducer=reducer)
    return total + (group.rank() == 3).astype(x.dtype)

  jaxcoll.collectives.register("all_reduce", name)(off_by_one_on_rank_3)
  try:
    rows = bench.run_benchmark("all_reduce", ["native", name], ["4K"], iters=1,
                               warmup_iters=0)
  finally:
    # No public unregister: leave the registry as other tests expect it.
    _dispatch._REGISTRY["all_reduce"].pop(name)
  assert [r.wrong for r in rows] == [0, 1024]  # every element of rank 3
  assert "# Wrong values: 1024 FAILED" in bench.format_table(rows)
  assert bench.total_wrong(rows) == 1024


def test_count_wrong_counts_every_element_of_another_dtype():
  # JAX with x64 off makes int64 int32: the small values agree, the buffer does not.
  want = np.arange(4, dtype=np.int64)
  assert bench.count_wrong(want.astype(np.int32), want, exact=True, dtype="int64") == 4
  assert bench.count_wrong(want.copy(), want, exact=True, dtype="int64") == 0


@pytest.mark.parametrize("dtype,op", [("float64", "mean"), ("int64", "sum"), ("uint64", "sum"),
                                      ("uint32", "sum"), ("uint8", "max")])
def test_nccl_tests_dtypes_are_checked_by_value(devices, dtype, op):
  # Before: `Unknown dtype` for double / int64 / uint64 / uint32 (nccl-tests' -d types).
  # The 64-bit ones run under jax.enable_x64 around their cases only; unsigned sums wrap
  # (the inputs' negative values are 2**bits - k) and are compared exactly.
  rows = bench.run_benchmark("all_reduce", ["native", "ring"], [64], dtype=dtype, op=op,
                             iters=1, warmup_iters=0, in_place=True)
  itemsize = np.dtype(dtype).itemsize
  assert [(r.dtype, r.redop, r.count, r.wrong, r.in_place_wrong) for r in rows] == [
      (dtype, op, 64 // itemsize, 0, 0)] * 2
  assert not jax.config.jax_enable_x64  # the process's setting is left as it was
  if dtype.startswith("uint"):  # negative inputs wrapped, so the sums wrap too
    assert bench.rank_input(0, 64, dtype).max() >= np.iinfo(dtype).max - 4


def test_check_off_reports_na(devices):
  rows = bench.run_benchmark("broadcast", "binomial_tree", [16], root=3, iters=1,
                             warmup_iters=0, check=False)
  assert rows[0].wrong is None and rows[0].root == 3
  assert "N/A (not checked)" in bench.format_table(rows)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(collective="gather"), "valid collectives: all_reduce, reduce_scatter"),
        (dict(algorithms="foo"), "valid choices: native, ring"),
        (dict(algorithms="hierarchical"), "needs a mesh of >= 2 axes"),
        (dict(dtype="float128"), "valid choices: float32, bfloat16, float16, float64, int8"),
        (dict(op="prod"), "valid choices: sum, mean, max, min"),
        (dict(op="mean", dtype="int32"), "valid ops for int32: sum, max, min"),
        (dict(root=8), r"`root` must be a rank in 0..7"),
        (dict(iters=0), "`iters` must be a positive integer"),
        (dict(sizes=[2]), "is below 4 B, the smallest all_reduce of float32"),
    ],
    ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()),
)
def test_run_benchmark_rejects_bad_arguments(devices, kwargs, message):
  args = dict(collective="all_reduce", algorithms="native", sizes=[64]) | kwargs
  with pytest.raises(ValueError, match=message):
    bench.run_benchmark(args.pop("collective"), args.pop("algorithms"), args.pop("sizes"),
                        **args)


# ------------------------------------------------------------------ the command line


def test_cli_writes_table_json_and_csv(tmp_path):
  out = _run([
      "--algorithms=native,ring", "--min_bytes=1K", "--max_bytes=4K", "--step_factor=4",
      "--iters=2", "--warmup_iters=1", f"--json={tmp_path}/r.json", f"--csv={tmp_path}/r.csv",
  ])
  assert out.returncode == 0, out.stderr
  assert "# Wrong values: 0 OK" in out.stdout
  assert "8 cpu devices (data=8" in out.stdout
  rows = json.loads((tmp_path / "r.json").read_text())
  assert len(rows) == 4
  assert set(rows[0]) == {"collective", "algorithm", "size_bytes", "count", "dtype", "redop",
                          "root", "time_us", "algbw_gbps", "busbw_gbps", "wrong",
                          # nccl-tests' in-place columns (on by default, as there)
                          "in_place_time_us", "in_place_algbw_gbps", "in_place_busbw_gbps",
                          "in_place_wrong",
                          # what the row was measured on (bench.run_metadata)
                          "devices", "device_kind", "platform", "process_count", "mesh",
                          "jax_version", "jaxlib_version", "jaxcoll_version", "timing_mode",
                          "date"}
  assert rows[0]["devices"] == 8 and rows[0]["platform"] == "cpu"
  assert [(r["algorithm"], r["size_bytes"]) for r in rows] == [
      ("native", 1024), ("ring", 1024), ("native", 4096), ("ring", 4096)
  ]
  for r in rows:
    assert r["wrong"] == 0 and r["in_place_wrong"] == 0
    assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 1.75)
    assert r["in_place_busbw_gbps"] == pytest.approx(r["in_place_algbw_gbps"] * 1.75)
  with open(tmp_path / "r.csv") as f:
    assert len(list(csv.DictReader(f))) == 4


def test_cli_every_collective_and_algorithm_passes_the_check(tmp_path):
  out = _run([
      "--collective=all", "--algorithms=all", "--min_bytes=128", "--max_bytes=128",
      "--mesh_shape=2,4", "--mesh_axes=node,local", "--root=5", "--dtype=bfloat16",
      "--iters=1", "--warmup_iters=0", f"--json={tmp_path}/r.json",
  ])
  assert out.returncode == 0, out.stderr + out.stdout
  rows = json.loads((tmp_path / "r.json").read_text())
  ran = {(r["collective"], r["algorithm"]) for r in rows}
  expected = {(c, a) for c in jaxcoll.collectives.COLLECTIVES
              for a in jaxcoll.algorithms(c) if a != "auto"}
  assert ran == expected
  assert all(r["wrong"] == 0 for r in rows)
  assert {r["root"] for r in rows if r["collective"] in ("broadcast", "reduce")} == {5}


BAD_INPUT = [
    (["--collective=gather"], "Unknown `collective` 'gather'; valid collectives: all_reduce"),
    (["--algorithms=ring,nope"], "Unknown all_reduce `algorithm` 'nope'; valid choices:"),
    (["--collective=all", "--algorithms=nope"], "Unknown `--algorithms` nope for this mesh"),
    (["--algorithms=hierarchical"], "needs a mesh of >= 2 axes"),
    (["--min_bytes=1M", "--max_bytes=1K"], "`min_bytes` (1M) must not exceed `max_bytes` (1K)"),
    (["--min_bytes=2", "--max_bytes=2"], "is below 4 B, the smallest all_reduce of float32"),
    (["--max_bytes=12Q"], "`max_bytes`='12Q' is not a size"),
    (["--mesh_shape=3,3"], "has 9 devices but 8 are available"),
    (["--mesh_shape=2,4", "--mesh_axes=node"], "must be 2 distinct names"),
    (["--dtype=float128"], "valid choices: float32, bfloat16, float16, float64, int8"),
    (["--op=prod"], "Unknown `op` 'prod'; valid choices: sum, mean, max, min"),
    (["--op=prod", "--collective=all_gather"], "Unknown `op` 'prod'; valid choices: sum, mean"),
    (["--dtype="], "`--dtype` is empty; name one (e.g. --dtype=float32), or all."),
    # Before: --csv= (and --json=, --plot=) measured everything and wrote nothing, exit 0.
    (["--csv="], "`--csv` is empty; give the CSV file to write, e.g. --csv=bench.csv, or leave "
                 "--csv out."),
    (["--json="], "`--json` is empty; give the JSON file to write"),
    (["--plot="], "`--plot` is empty; give the PNG file to write"),
    (["-g", "4"], "`-g/--ngpus` 4: this process runs the benchmark on 8 devices of the mesh"),
    (["-z", "0"], "nccl-tests' -z (--blocking) has no jaxcoll equivalent"),
    (["-i", "64", "-f", "2"], "`--step_bytes` (-i 64) and `--step_factor` (-f 2) both set"),
    (["--tuning_table=jaxcoll/comm_model/tuning_tables/cpu.json"],
     "`--tuning_table` is read by algorithm auto only, and --algorithms=all runs no auto"),
    (["--dtype=int32", "--op=mean"], "valid ops for int32: sum, max, min"),
    (["-b", "4K", "-e", "1T"], "needs at least"),  # refused before 4K..512G run
    (["--iters=many"], "flag --iters=many"),
    (["--bogus"], "Unknown command line flag 'bogus'"),
]


# These two start a real `python -m experiments.bench_collectives` (a flag absl
# refuses, a check of the CLI's own); the others fork it from a warm Python
# (jobs.forked: same module, argv and environment, in a process of its own,
# without ~2 CPU-s of start-up each).
REAL_START = (["--bogus"], ["--mesh_shape=3,3"])


def test_cli_bad_input_exits_2_with_one_line():
  real = [(args, subprocess.Popen(CLI + args, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True))
          for args, _ in BAD_INPUT if args in REAL_START]  # both at once
  assert len(real) == len(REAL_START)
  ended = {}
  for args, proc in real:
    out, err = proc.communicate(timeout=180)
    ended[tuple(args)] = (proc.returncode, out, err)
  for args, message in BAD_INPUT:
    if tuple(args) not in ended:
      run = jobs.forked(CLI + args, cwd=ROOT, timeout=180)
      ended[tuple(args)] = (run.returncode, run.stdout, run.stderr)
    code, out, err = ended[tuple(args)]
    assert code == 2, (args, err)
    assert out == "", args
    assert err.count("\n") == 1 and err.startswith("bench_collectives: error: "), (args, err)
    assert message in err, (args, err)


def _cli_script(prelude: str = "") -> str:
  """``python -c`` code: ``prelude``, then the CLI's main on the remaining arguments."""
  return prelude + textwrap.dedent("""
      import sys
      from absl import app
      from experiments import bench_collectives as cli
      sys.argv = ["bench_collectives", *sys.argv[1:]]
      app.run(cli.main, flags_parser=cli._cli.flags_parser(cli._PROG))
  """)


_BROKEN_ALL_GATHER = textwrap.dedent("""
    import jax.numpy as jnp
    import jaxcoll
    from jaxcoll.collectives import _dispatch

    @jaxcoll.collectives.register("all_gather", "broken_for_test_cli")
    def swap_first_two_chunks(chunk, group):
      out = _dispatch.run("all_gather", "native", chunk, group)
      return out[jnp.array([1, 0] + list(range(2, group.size)))]
""")


def test_cli_wrong_values_exit_1():
  out = _run(
      ["--collective=all_gather", "--algorithms=native,broken_for_test_cli",
       "--min_bytes=256", "--max_bytes=256", "--iters=1", "--warmup_iters=0"],
      code=_cli_script(_BROKEN_ALL_GATHER),
  )
  assert out.returncode == 1, out.stderr
  verdict = next(line for line in out.stdout.splitlines() if line.startswith("# Wrong values"))
  wrong = int(verdict.split()[3])
  # Chunks 0 and 1 (8 elements each) swapped on 8 ranks: 128 elements, less the
  # ~1/11 where both chunks hold the same small integer by chance; out of place
  # and in place (the same inputs) each.
  assert 200 < wrong <= 256 and wrong % 2 == 0 and verdict.endswith("FAILED"), verdict


def test_cli_plot_without_matplotlib_exits_2(tmp_path):
  no_matplotlib = "import sys\nsys.modules['matplotlib'] = None  # import fails\n"
  out = _run([f"--plot={tmp_path}/p.png", "--min_bytes=64", "--max_bytes=64"],
             code=_cli_script(no_matplotlib))
  assert out.returncode == 2
  assert out.stdout == ""
  assert out.stderr.splitlines() == [
      "bench_collectives: error: `--plot` needs matplotlib, which is not installed; "
      "pip install 'jaxcoll[plot]' (or matplotlib), or drop --plot."
  ]
  assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("platform,mode", [("cpu", "one_in_flight"), ("gpu", "back_to_back"),
                                           ("cuda", "back_to_back"), ("tpu", "back_to_back")])
def test_timing_mode_per_platform(platform, mode):
  assert bench.timing_mode(platform) == mode


def test_this_cpu_table_names_its_timing(all_reduce_rows):
  assert bench.timing_mode() == "one_in_flight"
  assert "# timing: one_in_flight (XLA:CPU, one call in flight" in bench.format_table(
      all_reduce_rows)
  assert "# timing: back_to_back" in bench.format_table(all_reduce_rows, timing="back_to_back")


class _FakeCall:
  """Records launches and syncs; each output's sync is logged."""

  def __init__(self):
    self.log = []

  def __call__(self):
    self.log.append("launch")
    log = self.log

    class Out:
      def block_until_ready(self):
        log.append("sync")
        return self

    return Out()


@pytest.mark.parametrize("mode,expected", [
    ("back_to_back", ["launch"] * 3 + ["sync"] * 3),
    ("one_in_flight", ["launch", "sync"] * 3),
])
def test_time_calls_order_of_launches_and_syncs(mode, expected):
  call = _FakeCall()
  assert bench.time_calls(call, iters=3, mode=mode) >= 0
  assert call.log == expected
  with pytest.raises(ValueError, match="valid modes: back_to_back, one_in_flight"):
    bench.time_calls(call, iters=3, mode="median")


def test_slowest_process_takes_the_max_over_processes():
  seen = []

  def gather(values):
    seen.append(values.tolist())
    return np.stack([values, np.asarray([0.5]), np.asarray([0.2])])

  assert bench.slowest_process(0.3, gather) == 0.5
  assert seen == [[0.3]]
  assert bench.slowest_process(0.3) == 0.3  # one process: its own time


class _Terminal(io.StringIO):
  def isatty(self):
    return True


def test_progress_line_logs_one_line_per_case_and_draws_a_bar_on_a_terminal():
  log = io.StringIO()
  progress = bench.ProgressLine(log)
  for done in range(3):
    progress(done, 2, f"all_reduce ring {done}K")
  assert log.getvalue().splitlines() == [
      "case 0/2 all_reduce ring 0K", "case 1/2 all_reduce ring 1K", "case 2/2 all_reduce ring 2K"]
  term = _Terminal()
  bar = bench.ProgressLine(term)
  bar(0, 2, "first")
  bar(2, 2, "done")
  text = term.getvalue()
  assert "\r" in text and "2/2" in text and "done" in text and text.endswith("\n")


# ------------------------------------------------------------------ nccl-tests' in-place and flags


@pytest.mark.parametrize("collective", list(bench.SPECS))
def test_in_place_rows_are_checked_and_the_buffer_is_donated(devices, collective):
  # ring where it exists: one composed algorithm besides native.
  algos = "native,ring" if "ring" in jaxcoll.algorithms(collective) else "native"
  size = 128 if bench.SPECS[collective].divisible else 96  # 4 floats per rank at least
  rows = bench.run_benchmark(collective, algos, [size], root=5, iters=2, warmup_iters=1,
                             in_place=True)
  for r in rows:
    assert r.wrong == 0 and r.in_place_wrong == 0, r
    assert r.in_place_time_us > 0
    assert r.in_place_algbw_gbps == pytest.approx(r.size_bytes / r.in_place_time_us / 1e3)
    assert r.in_place_busbw_gbps == pytest.approx(
        r.in_place_algbw_gbps * cost.bus_bandwidth_factor(collective, 8))
  # In place for real: XLA aliases the whole buffer of every rank to the output.
  mesh = jaxcoll.devices.flat_mesh()
  fn = bench._in_place_program(bench.SPECS[collective], collective, mesh=mesh,
                               group_axis="data", n=8, algo="native", op="sum", root=0)
  length = bench.SPECS[collective].input_count(24, 8)
  if collective == "all_gather":
    length *= 8  # the output-sized buffer
  x = np.zeros((8, length), np.float32)
  stats = fn.lower(x).compile().memory_analysis()
  assert stats.alias_size_in_bytes == length * 4, stats


def test_in_place_buffers_follow_nccl_tests_layout_and_are_checked(devices):
  # all_gather's rank r reads its chunk at offset r * chunk of the output-sized
  # buffer; reduce_scatter's result is read at that offset.
  xs = [np.arange(3, dtype=np.float32) + 10 * r for r in range(4)]
  layout = bench._in_place_buffer("all_gather", xs)
  assert [b.tolist()[3 * r:3 * r + 3] for r, b in enumerate(layout)] == [x.tolist() for x in xs]
  assert [len(b) for b in layout] == [12] * 4
  assert [b.tolist() for b in bench._in_place_result("reduce_scatter", layout)] == [
      x.tolist() for x in xs]
  name = "broken_in_place_for_test_bench"

  def off_by_one_on_rank_3(x, group, reducer):
    total = _dispatch.run("all_reduce", "native", x, group, reducer=reducer)
    return total + (group.rank() == 3).astype(x.dtype)

  jaxcoll.collectives.register("all_reduce", name)(off_by_one_on_rank_3)
  try:
    rows = bench.run_benchmark("all_reduce", [name], ["4K"], iters=1, warmup_iters=0,
                               in_place=True)
  finally:
    _dispatch._REGISTRY["all_reduce"].pop(name)
  assert (rows[0].wrong, rows[0].in_place_wrong) == (1024, 1024)  # every element of rank 3
  assert bench.total_wrong(rows) == 2048  # in-place errors fail the run too
  assert "# Wrong values: 2048 FAILED" in bench.format_table(rows)


def test_table_has_nccl_tests_out_of_place_and_in_place_groups(devices):
  rows = bench.run_benchmark("reduce_scatter", "native", [128], iters=1, warmup_iters=0,
                             in_place=True)
  lines = bench.format_table(rows).splitlines()
  at = next(i for i, line in enumerate(lines) if "algorithm" in line)
  assert lines[at].split() == [
      "#", "size", "count", "type", "redop", "root", "algorithm",
      "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong"]
  groups = lines[at - 1]
  assert groups.split() == ["#", "out-of-place", "in-place"]
  # Each label sits over its own four columns.
  first_time = lines[at].index("time")
  second_time = lines[at].index("time", first_time + 1)
  assert first_time < groups.index("out-of-place") < second_time < groups.index("in-place")
  cells = lines[at + 2].split()
  assert cells[9] == "0" and cells[13] == "0"  # both #wrong
  assert "# Avg bus bandwidth (GB/s):  out-of-place  in-place" in lines
  # Rows without in-place figures keep the old table.
  old = bench.format_table([bench.Row(**(bench.to_dicts(rows)[0] | {
      "in_place_time_us": None, "in_place_algbw_gbps": None, "in_place_busbw_gbps": None,
      "in_place_wrong": None}))])
  assert "in-place" not in old and "out-of-place" not in old


@pytest.mark.parametrize("argv,expected", [
    (["-c", "0"], ["--nocheck"]),
    (["-c", "1", "-n", "5"], ["--check", "-n", "5"]),
    (["-c=0"], ["--nocheck"]),
    (["-c"], ["-c"]),  # absl's boolean short flag: check on
    (["-c", "-n", "3"], ["-c", "-n", "3"]),
    (["--", "-c", "0"], ["--", "-c", "0"]),
    # getopt's attached values, as nccl-tests takes them ("Unknown command line flag 'b8'"):
    (["-b8", "-e128M", "-f2", "-n20", "-w5", "-c0", "-dfloat", "-oavg", "-r3"],
     ["-b", "8", "-e", "128M", "-f", "2", "-n", "20", "-w", "5", "--nocheck", "-d", "float",
      "-o", "avg", "-r", "3"]),
    (["-c1", "-dbfloat16", "-ebig"], ["--check", "-d", "bfloat16", "-ebig"]),
    # absl's own single-dash long flags are left to absl
    (["-dtype=half", "-op=max", "-root=2", "-check", "-noin_place", "-b", "8"],
     ["-dtype=half", "-op=max", "-root=2", "-check", "-noin_place", "-b", "8"]),
    (["--", "-b8"], ["--", "-b8"]),
    # nccl-tests' -i (step bytes), its long names, -h, and -t 1 -g N (one thread driving the
    # devices of the process, as ours; the CLI checks N against them)
    (["-i1M", "--minbytes=8", "--maxbytes", "1M", "--datatype=double", "--stepfactor=2"],
     ["-i", "1M", "--min_bytes=8", "--max_bytes", "1M", "--dtype=double", "--step_factor=2"]),
    (["-h"], ["--help"]),
    (["-t", "1", "-g", "8", "-b", "8"], ["--ngpus=8", "-b", "8"]),
    (["-t1", "-g8"], ["--ngpus=8"]),
    (["--nthreads=1", "--ngpus", "4"], ["--ngpus=4"]),
    (["-algorithms=ring", "-mesh_shape=8"], ["-algorithms=ring", "-mesh_shape=8"]),
    # nccl-tests' options given at the value that does what jaxcoll does: dropped (they were
    # refused, `-a 3` with a line saying our time is that of -a 3)
    (["-a", "3", "-m1", "--cudagraph=0", "-N", "1", "-R", "0", "-b", "8"], ["-b", "8"]),
])
def test_nccl_check_count_becomes_absl_boolean(argv, expected):
  # in jaxcoll.observe.bench: importing experiments.bench_collectives here would define its
  # absl flags in a worker where another experiment defined them (DuplicateFlagError)
  assert bench.nccl_argv(["prog", *argv]) == ["prog", *expected]


@pytest.mark.parametrize("argv,message", [
    (["-z", "0"], "nccl-tests' -z (--blocking) has no jaxcoll equivalent: the timing mode is "
                  "set by the platform and named in the table header"),
    (["-a1"], "-a (--average) has no jaxcoll equivalent: a row's time is the slowest process's"),
    (["-a", "0"], "drop it (-a 3, what jaxcoll does, is taken)."),
    (["--cudagraph=1"], "-G (--cudagraph) has no jaxcoll equivalent"),
    (["-J", "out.json"], "use --json=FILE instead"),
    (["-N", "0"], "run the command again for another cycle; drop it (-N 1, what jaxcoll does, "
                  "is taken)."),
    (["-t", "2"], "nccl-tests' -t 2 (--nthreads) has no jaxcoll equivalent: one thread drives"),
])
def test_nccl_tests_options_jaxcoll_has_not_are_one_line(argv, message):
  # Before: absl's "Unknown command line flag 'z'", which did not say what to do instead.
  with pytest.raises(ValueError, match=re.escape(message)):
    bench.nccl_argv(["prog", "-b", "8", *argv])


def test_size_sweep_with_step_bytes_as_nccl_tests_i():
  assert bench.size_sweep("1K", "4K", step_bytes="1K") == [1024, 2048, 3072, 4096]
  assert bench.size_sweep(100, 350, step_bytes=100) == [100, 200, 300]
  with pytest.raises(ValueError, match=r"`step_bytes` 8 from 8 to 128M is 16777216 sizes, each "
                     r"compiled and run; at most 1024: use a step of 256K or more"):
    bench.size_sweep(8, "128M", step_bytes=8)


def test_cli_takes_nccl_tests_short_flags(tmp_path):
  run = jobs.forked(CLI + ["-b", "64", "-e", "256", "-i", "192", "-t", "1", "-g", "8", "-n",
                           "2", "-w", "1", "-c", "0",
                           "-d", "float", "-o", "avg", "--algorithms=native",
                           f"--json={tmp_path}/r.json"], cwd=ROOT, timeout=180)
  assert run.returncode == 0, run.stderr
  assert "iters 2, warm-up 1" in run.stdout
  rows = json.loads((tmp_path / "r.json").read_text())
  assert [(r["size_bytes"], r["dtype"], r["redop"], r["wrong"], r["in_place_wrong"])
          for r in rows] == [(64, "float32", "mean", None, None), (256, "float32", "mean", None,
                                                                   None)]
  assert all(r["in_place_time_us"] > 0 for r in rows)
  run = jobs.forked(CLI + ["-b", "64", "-e", "64", "-d", "half", "-r", "3", "-c", "1",
                           "--collective=reduce", "--algorithms=native", "--noin_place",
                           f"--json={tmp_path}/h.json"], cwd=ROOT, timeout=180)
  assert run.returncode == 0, run.stderr
  (row,) = json.loads((tmp_path / "h.json").read_text())
  assert (row["dtype"], row["root"], row["wrong"], row["in_place_time_us"]) == (
      "float16", 3, 0, None)


def test_cli_runs_nccl_tests_dtype_all(tmp_path):
  # Before: -d all / -o all were `Unknown dtype 'all'` (nccl-tests runs every type / op).
  # 64 B is nccl-tests' size-0 row of all_gather on 8 ranks (16 B per rank at least): one
  # line says it is left out, and from which size the collective runs.
  run = jobs.forked(CLI + ["-b", "64", "-e", "128", "-f", "2", "-dall", "-n", "1", "-w", "0",
                           "-c", "1", "--collective=all_gather", "--algorithms=native",
                           "--noin_place", f"--json={tmp_path}/g.json"], cwd=ROOT, timeout=180)
  assert run.returncode == 0, run.stderr
  rows = json.loads((tmp_path / "g.json").read_text())
  assert [(r["dtype"], r["size_bytes"], r["redop"], r["wrong"]) for r in rows] == [
      (d, 128, "none", 0) for d in bench.DTYPES]
  assert ("# left out on 8 ranks, too small once rounded down as nccl-tests rounds (it prints "
          "them as size 0): all_gather (every type) 64 B, runs from 128 B\n" in run.stdout)
  assert "float64" in bench.DTYPES and "uint32" in bench.DTYPES


def test_cli_runs_several_dtypes_and_every_op_that_exists_for_each(tmp_path):
  run = jobs.forked(CLI + ["-b", "64", "-e", "64", "-d", "int8,double", "-o", "all", "-n", "1",
                           "-w", "0", "--algorithms=native", "--noin_place",
                           f"--json={tmp_path}/r.json"], cwd=ROOT, timeout=180)
  assert run.returncode == 0, run.stderr
  rows = json.loads((tmp_path / "r.json").read_text())
  assert [(r["dtype"], r["redop"], r["wrong"]) for r in rows] == [
      ("int8", "sum", 0), ("int8", "max", 0), ("int8", "min", 0),
      ("float64", "sum", 0), ("float64", "mean", 0), ("float64", "max", 0), ("float64", "min", 0)]
  assert "# op mean left out for int8 (mean needs a floating dtype)" in run.stdout
  assert "#   all_reduce      native                 float64   mean " in run.stdout


_BROKEN_ALL_REDUCE = textwrap.dedent("""
    import jaxcoll
    from jaxcoll.collectives import _dispatch

    @jaxcoll.collectives.register("all_reduce", "off_by_one_for_test_cli")
    def off_by_one(x, group, reducer):
      return _dispatch.run("all_reduce", "native", x, group, reducer=reducer) + 1
""")


def test_cli_auto_reads_the_users_tuning_table(tmp_path):
  # Before: no way to point the bench's auto at a table `jaxcoll tune` measured
  # ("Unknown command line flag 'tuning_table'"). A table naming a broken algorithm
  # shows that auto ran what the table says: its rows are wrong, native's are not.
  table = {"device_kind": "cpu", "topology": None, "entries": {"all_reduce": {"8": {
      "float32": [{"max_bytes": None, "algorithm": "off_by_one_for_test_cli"}]}}}}
  (tmp_path / "t.json").write_text(json.dumps(table))
  out = _run(["--algorithms=native,auto", f"--tuning_table={tmp_path}/t.json", "-b", "64",
              "-e", "64", "-n", "1", "-w", "0", "--noin_place", f"--json={tmp_path}/r.json"],
             code=_cli_script(_BROKEN_ALL_REDUCE))
  assert out.returncode == 1, out.stderr
  assert f"# auto reads the tuning table {tmp_path}/t.json" in out.stdout
  # what auto chose is named (the rows say only "auto")
  assert "# auto chose: all_reduce float32 64 B off_by_one_for_test_cli\n" in out.stdout
  rows = json.loads((tmp_path / "r.json").read_text())
  assert [(r["algorithm"], r["wrong"]) for r in rows] == [("native", 0), ("auto", 16 * 8)]
  # A table without an entry for this group size: the cost model picks, and the line says so
  # (it read as the table's choice).
  table["entries"]["all_reduce"] = {"4": {"float32": [{"max_bytes": None, "algorithm": "ring"}]}}
  (tmp_path / "t4.json").write_text(json.dumps(table))
  out = _run(["--algorithms=auto", f"--tuning_table={tmp_path}/t4.json", "-b", "64", "-e", "64",
              "-n", "1", "-w", "0", "--noin_place"])
  assert out.returncode == 0, out.stderr
  assert re.search(r"# auto chose: all_reduce float32 64 B \w+ \(cost model\)\n", out.stdout), (
      out.stdout)


@pytest.mark.parametrize("content,message", [
    (None, "cannot be read (No such file or directory); give the JSON file `jaxcoll tune "
           "--out=PATH` wrote, the same on every host."),
    ("[1, 2]", "Not a jaxcoll tuning table"),
    ("{not json", "is not valid JSON"),
    ('{"device_kind": "cpu", "topology": null, "entries": {"all_reduce": {"8": {"float32": '
     '[{"max_bytes": null, "algorithm": "nope"}]}}}}', "names all_reduce algorithm 'nope'"),
], ids=["missing", "a-list", "not-json", "unknown-algorithm"])
def test_cli_bad_tuning_table_is_one_line(tmp_path, content, message):
  path = tmp_path / "t.json"
  if content is not None:
    path.write_text(content)
  out = _run(["--algorithms=auto", f"--tuning_table={path}", "-b", "64", "-e", "64"])
  assert (out.returncode, out.stdout) == (2, ""), out.stderr
  assert out.stderr.startswith(f"bench_collectives: error: `--tuning_table`='{path}'")
  assert out.stderr.count("\n") == 1 and message in out.stderr, out.stderr


def test_cli_title_names_the_mean_where_calls_run_back_to_back():
  # Before: the title said "time = median" on GPU / TPU too, where the time is the mean.
  as_on_gpu = ("from jaxcoll.observe import bench\n"
               "bench.timing_mode = lambda platform=None: 'back_to_back'\n")
  out = _run(["--algorithms=native", "-b", "64", "-e", "64", "-n", "1", "-w", "0",
              "--noin_place"], code=_cli_script(as_on_gpu))
  assert out.returncode == 0, out.stderr
  assert "warm-up 0, time = mean\n# timing: back_to_back" in out.stdout
