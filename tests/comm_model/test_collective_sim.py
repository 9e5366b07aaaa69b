"""experiments.simulate: the CLI runs, writes its outputs, rejects bad input."""

import json
import os
import subprocess
import sys

import pytest
from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # experiments/ is not an installed package
  sys.path.insert(0, ROOT)

from experiments import simulate  # noqa: E402


@pytest.fixture
def run_main(capsys):
  """Parses ``args`` as the command line and calls main; returns (code, out, err)."""

  def run(*args):
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["simulate", *args])
    code = 0
    try:
      simulate.main(["simulate"])
    except SystemExit as e:
      code = e.code
    finally:
      flags.FLAGS.unparse_flags()
    out, err = capsys.readouterr()
    return code, out, err

  return run


def test_small_run_prints_tables_and_summary(run_main, tmp_path):
  code, out, err = run_main(
      "--preset=dgx-h100", "--max_gpus=32", "--max_bytes=1G", f"--out={tmp_path}"
  )
  assert code == 0, err
  assert "== all_reduce on dgx-h100: 4 node x 8 local (32 devices)" in out
  for section in ("ring: busbw", "log-step algorithms", "hierarchical across nodes",
                  "crossovers", "in-network reduction"):
    assert section in out
  record = json.loads((tmp_path / "simulate.json").read_text())
  assert record["device_counts"] == [8, 16, 32]
  assert record["sizes"][0] == 1024 and record["sizes"][-1] == 1 << 30
  ring = [r for r in record["rows"] if r["algorithm"] == "ring" and r["num_devices"] == 32
          and r["nbytes"] == 1 << 30]
  assert ring[0]["busbw_Bps"] == pytest.approx(47e9, rel=0.15)
  assert (tmp_path / "table.txt").read_text().startswith("jaxcoll cost model: dgx-h100")
  pytest.importorskip("matplotlib")
  assert (tmp_path / "busbw_all_reduce.png").stat().st_size > 0
  assert (tmp_path / "time_vs_n_all_reduce.png").stat().st_size > 0


def test_every_collective_and_in_network_reduction(run_main):
  code, out, err = run_main(
      "--preset=dgx-a100", "--collective=all", "--max_gpus=16", "--min_bytes=1M",
      "--max_bytes=16M", "--in_network_reduction",
  )
  assert code == 0, err
  for c in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all"):
    assert f"== {c} on dgx-a100" in out
  assert "in-network reduction on" in out
  assert "levels reducing in network: node" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--preset=dgx-h200"], "valid presets: dgx-h100, dgx-a100, tpu-v5e, cpu-sim"),
        (["--collective=allreduce"], "valid: all_reduce, reduce_scatter"),
        (["--min_gpus=64", "--max_gpus=8"], "`--min_gpus` (64) must not exceed"),
        (["--min_bytes=1G", "--max_bytes=1M"], "`--min_bytes`"),
        (["--max_bytes=4Q"], "`--max_bytes`='4Q' is not a size"),
        (["--min_bytes=lots"], "e.g. 1K, 64M, 4G"),
        (["--min_gpus=12"], "`--min_gpus`=12 is not a whole number of dgx-h100 nodes of 8 GPUs"),
        # the sweep doubles --min_gpus (was: an error naming `num_devices`, not a flag)
        (["--min_gpus=3", "--max_gpus=24"],
         "`--min_gpus`=3 doubles to 12 GPUs, not a whole number of dgx-h100 nodes of 8 GPUs; "
         "use e.g. --min_gpus=8, or --max_gpus=6."),
    ],
)
def test_bad_input_exits_2_with_one_line(run_main, args, message):
  code, out, err = run_main(*args)
  assert code == 2
  assert out == ""
  assert err.count("\n") == 1 and err.startswith("simulate: error:")
  assert message in err


@pytest.mark.parametrize("text,value", [("1K", 1024), ("4G", 4 << 30), ("64MiB", 64 << 20),
                                        ("100", 100)])
def test_parse_size(text, value):
  assert simulate.parse_size(text, "min_bytes") == value


def test_command_line():
  env = dict(os.environ, PYTHONPATH=ROOT)
  ok = subprocess.run(
      [sys.executable, "-m", "experiments.simulate", "--preset=cpu-sim", "--max_gpus=16",
       "--max_bytes=64K"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
  )
  assert ok.returncode == 0, ok.stderr
  assert "## Summary: all_reduce on cpu-sim" in ok.stdout
  bad = subprocess.run(
      [sys.executable, "-m", "experiments.simulate", "--preset=nope"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
  )
  assert bad.returncode == 2
  assert bad.stderr.strip().splitlines() == [
      "simulate: error: Unknown `--preset` 'nope'; valid presets: dgx-h100, dgx-a100, "
      "tpu-v5e, cpu-sim, pascal-pcie-25gbe-roce, pascal-pcie-25gbe-tcp, pascal-nvlink-50gbe, "
      "volta-nvlink-100gb-ib."
  ]
