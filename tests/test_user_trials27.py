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
