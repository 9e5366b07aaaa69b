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


def test_simulate_training_flags_that_change_nothing_are_one_line_not_ignored():
  """`--compute_scale=2` on a --params workload (it scales only the published ones), and
  `--achieved_tflops` / `--layers` without --params, printed the very table they would print
  without the flag (rc 0): a user who meant their GPU to be twice as fast got no sign that
  it was not. Now one line naming the flag and what to do, exit 2; where they apply they
  still work."""
  numbers = ["--workloads=", "--params=3e8", "--flops_per_example=1.8e12", "--max_gpus=8",
             "--strategies=dp"]
  for args, message in [
      ([*numbers, "--compute_scale=2"],
       "`--compute_scale`=2 scales the published workloads (resnet50, bert_large, "
       "decoder_1.3b, decoder_7b), and `--workloads` has none of them; for --params' workload "
       "set its speed with --achieved_tflops (the shipped ones are measured here)."),
      (["--workloads=resnet50", "--max_gpus=8", "--achieved_tflops=10"],
       "`--achieved_tflops`=10 describes the --params workload, and no --params is given; "
       "add --params=... --flops_per_example=..., or drop it."),
      (["--workloads=resnet50", "--max_gpus=8", "--layers=4"], "`--layers`=4 describes")]:
    out = _simulate(*args)
    assert out.returncode == 2, (args, out.stdout[-500:])
    assert out.stderr.strip().splitlines()[-1].startswith(
        f"simulate_training: error: {message}"), out.stderr[-1000:]
    assert "Traceback" not in out.stderr
  out = _simulate(*numbers, "--achieved_tflops=100", "--layers=4")
  assert out.returncode == 0, out.stderr[-2000:]
  assert "given: 1.8e+12 FLOPs/example at 100 TFLOP/s" in out.stdout
  # 1.8e12 FLOPs x 32 examples at 100 TFLOP/s: 576 ms of compute a step
  assert "576.00ms" in next(line for line in out.stdout.splitlines() if line.startswith("DP "))


def test_efficiency_against_a_baseline_of_more_devices_is_refused():
  """`efficiency(..., 16, baseline=32)` on a 4 x 4 cluster printed 100.9%: weak-scaling
  efficiency against a run of MORE devices is always above 100% (each of them is slower),
  silently. Now one line naming `baseline`; a baseline up to `num_devices` still works."""
  import pytest  # noqa: PLC0415
  from jaxcoll.comm_model.topology import Topology  # noqa: PLC0415
  from jaxcoll.scale.step_model import StepStrategy, WorkloadSpec, efficiency  # noqa: PLC0415

  cluster = Topology.from_hardware(nodes=4, gpus_per_node=4, intra_links=4, intra_link_GBps=25,
                                   inter_links=2, inter_link_Gbps=200)
  w = WorkloadSpec("mine", layer_params=(1e6, 5e7, 1e6), seconds_per_example=1 / 500,
                   layer_compute=(2, 1, 0.1))
  with pytest.raises(ValueError, match=r"^`baseline`=32 is more devices than `num_devices`=16;"):
    efficiency(w, StepStrategy(), cluster, 16, per_device_batch=32, baseline=32)
  for baseline in (1, 3, 8, 16, "node", "device"):
    assert 0.5 < efficiency(w, StepStrategy(), cluster, 16, per_device_batch=32,
                            baseline=baseline) <= 1.0
  assert efficiency(w, StepStrategy(), cluster, 16, per_device_batch=32, baseline=16) == 1.0
  assert efficiency(w, StepStrategy(), cluster, 2, per_device_batch=32, baseline="node") == 1.0


def test_simulate_training_out_that_cannot_be_written_is_one_line_before_simulating(tmp_path):
  """`--out=` a file (or a path under one), and `--record_cpu_calibration=` a path that
  cannot be written, were a FileExistsError / NotADirectoryError / FileNotFoundError
  traceback (rc 1) from os.makedirs or open AFTER the simulation (or the minutes of
  calibration measurements) had run. Now one line naming the flag, exit 2, before."""
  afile = tmp_path / "afile"
  afile.write_text("mine\n")
  cases = [
      (["--workloads=resnet50", "--max_gpus=8", f"--out={afile}"],
       f"`--out`='{afile}': '{afile}' is a file, not a directory; give a directory you can "
       "write."),
      (["--workloads=resnet50", "--max_gpus=8", f"--out={afile}/sub"],
       f"`--out`='{afile}/sub': cannot write in the directory '{afile}/sub' (Not a "
       "directory); give a directory you can write."),
      ([f"--record_cpu_calibration={afile}/c.json"],
       f"`--record_cpu_calibration`='{afile}/c.json': '{afile}' is a file, not a directory"),
      ([f"--record_cpu_calibration={tmp_path}"],
       f"`--record_cpu_calibration`='{tmp_path}' is a directory; give the JSON file to write"),
  ]
  for args, message in cases:
    out = _simulate(*args)
    assert out.returncode == 2, (args, out.stderr[-1500:])
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(
        f"simulate_training: error: {message}"), out.stderr[-1500:]
    assert out.stdout == ""  # nothing simulated or measured first
  assert afile.read_text() == "mine\n"
  out = _simulate("--workloads=resnet50", "--max_gpus=8", "--strategies=dp",
                  f"--out={tmp_path / 'new' / 'deep'}")
  assert out.returncode == 0, out.stderr[-1500:]
  assert sorted(p.name for p in (tmp_path / "new" / "deep").iterdir()) == [
      "efficiency.png", "simulate_training.json", "table.txt"]
