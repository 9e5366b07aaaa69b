"""Cases a user of the scale planner brought that no other test had tried (engineer
trial15): their own clusters (a workstation of 2 GPUs over PCIe, 4 x 4 GPUs with 2 NICs,
16 x 8 with one), their own flax models and their own `simulate_training` flags. Each test
of a fix fails without it."""

import sys

import jobs


def _simulate(*args):
  return jobs.forked([sys.executable, "-m", "experiments.simulate_training", *map(str, args)],
                     devices=1)


def test_simulate_training_cluster_of_one_workstation_without_nics():
  """A workstation of 2 GPUs on one PCIe 3 x16 link and no NICs: `--cluster=2,1,15.75,0,0`
  (the library's Topology.from_hardware(nodes=1, ..., inter_links=0) builds it) was refused
  ("INTER_LINKS must be a whole number >= 1; got 0"), so one machine could not be simulated
  at all. Now it runs inside the machine, and a sweep that leaves it is one line, exit 2."""
  out = _simulate("--workloads=resnet50", "--cluster=2,1,15.75,0,0", "--min_gpus=1",
                  "--max_gpus=2", "--strategies=dp")
  assert out.returncode == 0, out.stderr[-2000:]
  rows = [line.split() for line in out.stdout.splitlines() if line.startswith("DP  ")]
  assert [r[1] for r in rows] == ["1", "2"]
  assert rows[0][7] == "100.0%"  # one GPU: its own baseline
  assert 80 < float(rows[1][7].rstrip("%")) < 100
  out = _simulate("--workloads=resnet50", "--cluster=2,1,15.75,0,0")
  assert out.returncode == 2
  assert out.stderr.strip().splitlines()[-1] == (
      "simulate_training: error: `--cluster`='2,1,15.75,0,0' has no links between nodes "
      "(INTER_LINKS=0): it is one machine of 2 GPUs, but the sweep reaches 16384; use "
      "--min_gpus=1 --max_gpus=2, or give its NICs (INTER_LINKS,INTER_Gbps, e.g. 2,200).")
  assert "Traceback" not in out.stderr
  # Only both zero means "no NICs": one of them alone is still a mistake.
  out = _simulate("--workloads=resnet50", "--cluster=2,1,15.75,0,5", "--max_gpus=2",
                  "--min_gpus=1")
  assert out.returncode == 2 and "INTER_LINKS must be a whole number >= 1; got 0" in out.stderr
