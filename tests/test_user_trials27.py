"""Cases a user brought that no other test had tried (engineer trial27): an ML engineer's own
pytrees, meshes and jitted functions through the collectives and the measurement tools
(bench_pytree, tune, compile_time, comm_report). Each test of a fix fails without it."""

import sys

import jobs
import pytest

from experiments import _cli


@pytest.mark.parametrize("module,flag", [
    ("bench_pytree", "--leaves"),
    ("compile_time", "--devices"),
    ("tune", "--group_sizes"),
], ids=["bench_pytree", "compile_time", "tune"])
def test_a_count_written_with_a_superscript_digit_is_one_line_naming_the_flag(module, flag):
  # str.isdigit takes '²' and int() refuses it: bench_pytree --leaves=² and compile_time
  # --devices=² were a ValueError traceback (exit 1), tune --group_sizes=² the line
  # "invalid literal for int() with base 10: '²'", which named no flag.
  out = jobs.forked([sys.executable, "-m", f"experiments.{module}", f"{flag}=4,²",
                     "--out=/tmp/never-written.json"] if module == "tune" else
                    [sys.executable, "-m", f"experiments.{module}", f"{flag}=4,²"], devices=6)
  line = jobs.one_line(out, prefix=f"{module}: error: `{flag}`")
  assert "²'" in line and "invalid literal" not in line, line


def test_whole_number_reads_ascii_counts_only():
  assert [_cli.whole_number(t) for t in ("8", " 12 ", "0", "²", "", "-3", "1e3", "٣")] == [
      8, 12, 0, None, None, None, None, None]


@pytest.mark.parametrize("mbytes,says", [
    ("inf", "`--mbytes`=inf: give the tree's size in MB, > 0."),  # was an OverflowError
    # 10 TB a device: XLA's RESOURCE_EXHAUSTED traceback after tracing (a smaller excess gets
    # the process killed by the host instead).
    ("1e7", "`--mbytes`=1e+07: a tree of 9.54 TiB a device needs at least 229 TiB for the "
            "tree, its result and the packed buffers of each device, in this host's memory"),
], ids=["inf", "1e7"])
def test_bench_pytree_refuses_a_tree_it_cannot_build_in_one_line(mbytes, says):
  out = jobs.forked([sys.executable, "-m", "experiments.bench_pytree", f"--mbytes={mbytes}",
                     "--leaves=3", "--algorithms=native"])
  line = jobs.one_line(out, prefix="bench_pytree: error: ")
  assert says in line, line
  if mbytes != "inf":  # the largest that fits depends on this host's memory
    assert "; use --mbytes of at most " in line, line


def test_bench_pytree_memory_check_names_the_largest_tree_that_fits():
  from experiments import bench_pytree  # noqa: PLC0415

  # 8 CPU devices share 24 GiB: 3 trees a device, so 1 GiB a device fits, 1.1 does not.
  bench_pytree.check_memory(2**30, 8, host_bytes=24 * 2**30)
  with pytest.raises(ValueError, match=r"needs at least 26.4 GiB .* but there are 24 GiB; "
                     r"use --mbytes of at most 1024\.$"):
    bench_pytree.check_memory(int(1.1 * 2**30), 8, host_bytes=24 * 2**30)
