"""jaxcoll.step_model: the training-step model, its validation, its calibration, its CLI."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest

import jaxcoll
from jaxcoll.comm_model import cost
from jaxcoll.scale import published
from jaxcoll.collectives import Hierarchical
from jaxcoll.scale.step_model import (
    DEFAULT_INTERFERENCE,
    Strategy,
    WorkloadSpec,
    efficiency,
    fit_native_level,
    knee,
    scaling,
    step_time,
)
from jaxcoll.comm_model.topology import Level, Topology

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(ROOT, "tests", "data", "cpu_sim_calibration.json")
COUNTS = [8 << k for k in range(12)]  # 8 .. 16,384
SEVEN_B = WorkloadSpec.from_numbers(
    "7B", num_params=7e9, flops_per_example=6 * 7e9 * 2048, achieved_flops=4e14
)
STRATEGIES = [Strategy(), Strategy(stage=1), Strategy(stage=2), Strategy(stage=3),
              Strategy(stage=3, hybrid=True), Strategy(compression="bf16"),
              Strategy(algorithm=Hierarchical())]


# --------------------------------------------------------------- validation


def test_every_published_row_within_5_points_with_one_fitted_row():
  # The interference is fitted on Goyal et al. (ResNet-50, 256 P100) ONLY;
  # the five Horovod rows (other cluster, framework, models) are predictions.
  assert published.VALIDATION[published.FIT_ROW].source == "Goyal et al. 2017"
  assert published.fit_interference() == DEFAULT_INTERFERENCE
  results = published.validate()
  assert [r.fitted_here for r in results].count(True) == 1
  for r in results:
    assert abs(r.error_pp) <= 5.0, (r.row, r.predicted_efficiency)
  fitted = results[published.FIT_ROW]
  assert abs(fitted.error_pp) < 0.5


def test_validation_table_lists_source_published_prediction_error():
  table = published.validation_table(published.validate())
  lines = table.splitlines()
  assert len(lines) == 2 + len(published.VALIDATION)
  assert "| Horovod README | VGG-16 | pascal-pcie-25gbe-roce | 512 | 68% |" in table
  assert "(fitted)" in lines[2 + published.FIT_ROW]


@pytest.mark.parametrize(
    "name,params",
    [("vgg16", 138_357_544), ("resnet50", 25_557_032), ("resnet101", 44_549_160),
     ("inception_v3", 23_851_784)],
)
def test_layer_tables_have_the_published_parameter_counts(name, params):
  assert published.WORKLOADS[name].num_params == pytest.approx(params, abs=1)


def test_interference_fit_is_monotone_and_reproduces_its_row():
  row = published.VALIDATION[published.FIT_ROW]
  effs = [published.predict(row, k) for k in (0.0, 0.25, 0.5, 0.75, 1.0)]
  assert effs == sorted(effs, reverse=True) and effs[0] > effs[-1]
  assert published.predict(row, DEFAULT_INTERFERENCE) == pytest.approx(
      row.published_efficiency, abs=0.005)


def test_bucket_size_effect_giant_bucket_loses_the_overlap():
  sweep = published.bucket_sweep("resnet50")
  assert sweep[1 << 30] > 1.05 * sweep[25 << 20]  # one bucket: nothing overlaps backward
  assert sweep[100 << 20] >= sweep[25 << 20]


# --------------------------------------------------------------- the event timeline


def two_level(*, node_bw=1e9, local_bw=1e10, latency=0.0, launch=0.0, nodes=4, local=4):
  return Topology(
      (Level("node", nodes, latency, node_bw, math.inf), Level("local", local, latency, local_bw,
                                                               math.inf)),
      name="test", launch_s=launch,
  )


def test_timeline_by_hand_two_layers():
  # Two equal layers, 3 s of compute per example: forward 1 s, backward 1 s per layer.
  w = WorkloadSpec("two", (1e6, 1e6), 3.0, optimizer_traffic_bytes_per_param=0)
  topo = two_level()
  c = cost.estimate("all_reduce", 4e6, topo, "ring")
  for kappa in (0.0, 1.0):
    t = step_time(w, Strategy(bucket_bytes=4_000_000, algorithm="ring"), topo,
                  per_device_batch=1, interference=kappa)
    if kappa == 0.0:
      # bucket of layer 1 starts at 2 s; layer 0's at max(3, 2 + c); step ends c later
      expected = max(3.0, 2.0 + c) + c
    else:
      # time-sharing: compute + communication, as if serialized
      expected = 3.0 + 2 * c
    assert t.step_s == pytest.approx(expected, rel=1e-9)
    assert t.comm_s == pytest.approx(2 * c, rel=1e-9)
    assert t.compute_s == 3.0 and t.optimizer_s == 0.0
    assert t.exposed_comm_s == pytest.approx(expected - 3.0, rel=1e-9)


def test_one_giant_bucket_exposes_all_communication_even_with_perfect_overlap():
  w = WorkloadSpec("ten", (1e7,) * 10, 1e-1, optimizer_traffic_bytes_per_param=0)
  topo = two_level()
  one = step_time(w, Strategy(bucket_bytes=1 << 40), topo, per_device_batch=8, interference=0)
  many = step_time(w, Strategy(bucket_bytes=40_000_000), topo, per_device_batch=8,
                   interference=0)
  assert one.exposed_comm_s == pytest.approx(one.comm_s, rel=1e-9)
  assert many.exposed_comm_s < 0.5 * many.comm_s
  assert many.hidden_fraction > 0.5 and one.hidden_fraction == pytest.approx(0, abs=1e-9)


def test_zero3_moves_one_and_a_half_times_dp_and_holds_one_nth():
  topo = Topology.cluster("dgx-h100", 64)
  dp = step_time(SEVEN_B, Strategy(), topo, per_device_batch=4)
  z3 = step_time(SEVEN_B, Strategy(stage=3), topo, per_device_batch=4)
  ar = cost.estimate("all_reduce", 7e9 * 4 / 32, topo, "native")
  ag = cost.estimate("all_gather", 7e9 * 4 / 32, topo, "native")
  rs = cost.estimate("reduce_scatter", 7e9 * 4 / 32, topo, "native")
  assert dp.comm_s == pytest.approx(32 * ar, rel=1e-6)
  assert z3.comm_s == pytest.approx(32 * (2 * ag + rs), rel=1e-3)
  assert z3.memory_bytes == pytest.approx(dp.memory_bytes / 64)
  assert dp.optimizer_s == pytest.approx(64 * z3.optimizer_s)


# --------------------------------------------------------------- monotonic and limits


def test_efficiency_never_exceeds_one_and_falls_with_a_slower_network():
  fast = Topology.preset("dgx-h100", nodes=2)
  slow = fast.with_level("node", bandwidth_Bps=fast.level("node").bandwidth_Bps / 4)
  for strategy in STRATEGIES:
    rows = scaling(SEVEN_B, [strategy], "dgx-h100", COUNTS, per_device_batch=4)
    assert all(0 < r.efficiency <= 1 for r in rows)
    effs = [efficiency(SEVEN_B, strategy, topo, 256, per_device_batch=4) for topo in (fast, slow)]
    assert effs[1] < effs[0], strategy.name


def test_fixed_per_device_batch_approaches_the_bandwidth_bound():
  # No latency, no launch cost, no overlap: step = compute + sum of ring
  # all-reduces = C + 2(N-1)/N S / B, falling towards C / (C + 2 S / B).
  w = WorkloadSpec("w", (1e7,) * 8, 1e-3, optimizer_traffic_bytes_per_param=0)
  base = two_level(node_bw=1e9, nodes=2, local=8)
  c, s = 8 * 1e-3, 8e7 * 4
  bound = c / (c + 2 * s / 1e9)
  effs = [efficiency(w, Strategy(algorithm="ring"), base, n, per_device_batch=8,
                     interference=1.0) for n in COUNTS[1:]]
  assert effs == sorted(effs, reverse=True)
  assert all(e >= bound for e in effs)
  assert effs[-1] == pytest.approx(bound, rel=1e-3)
  # with overlap the curve flattens too, at (compute + optimizer) / (that + exposed comm)
  rows = scaling(SEVEN_B, [Strategy()], "dgx-h100", COUNTS, per_device_batch=4)
  last = rows[-1].step
  assert rows[-1].efficiency == pytest.approx(
      (last.compute_s + last.optimizer_s) / last.step_s, rel=1e-9)
  assert 0 < last.exposed_comm_s < last.comm_s
  assert abs(rows[-1].efficiency - rows[-2].efficiency) < 0.01


def test_knee_and_what_moves_it():
  topo = "pascal-pcie-25gbe-roce"
  vgg = published.WORKLOADS["vgg16"]
  counts = [4 << k for k in range(8)]
  dp = scaling(vgg, [Strategy()], topo, counts, per_device_batch=64)
  bf16 = scaling(vgg, [Strategy(compression="bf16")], topo, counts, per_device_batch=64)
  at = knee(dp, "DP", 0.8)
  assert at is not None and at > 4
  assert knee(bf16, "DP bf16", 0.8) is None or knee(bf16, "DP bf16", 0.8) > at
  with pytest.raises(ValueError, match="`threshold`"):
    knee(dp, "DP", 1.5)


# --------------------------------------------------------------- calibration on recorded data


def test_cpu_sim_calibrated_predictions_within_25pct_of_bench_trainer():
  # A fixed recorded measurement (tests/data, with its command and date): the
  # model gets the no-communication step of 8 devices at once and two
  # all-reduces, and must predict bench_trainer's 8-device DP and ZeRO-3 steps.
  with open(FIXTURE) as f:
    record = json.load(f)
  per_device = record["global_batch"] // record["devices"]
  for model, m in record["models"].items():
    shapes = jaxcoll.models.make_workload(
        model, **{k: tuple(v) for k, v in m["overrides"].items()}).param_shapes
    topo = fit_native_level(Topology.preset("cpu-sim", local=record["devices"]),
                            tiny_s=m["all_reduce_tiny_s"], big_s=m["all_reduce_grad_s"],
                            big_bytes=m["grad_bytes"])
    for name, strategy in (("DP (native)", Strategy()), ("ZeRO-3", Strategy(stage=3))):
      step = m["no_comm_step_s"][name]  # compute + optimizer + the strategy's own work
      if strategy.stage:
        # A one-device ZeRO step updates and lays out ALL parameters; on N
        # devices each does 1/N of what is beyond the gradient.
        grad = m["no_comm_step_s"]["gradient only"]
        step = grad + (step - grad) / record["devices"]
      seconds = step / per_device
      w = WorkloadSpec.from_params(model, shapes, seconds, optimizer_traffic_bytes_per_param=0)
      predicted = step_time(w, strategy, topo, global_batch=record["global_batch"],
                            interference=1.0).step_s  # XLA:CPU: no overlap
      measured = m["bench_trainer_median_s"][name]
      assert predicted == pytest.approx(measured, rel=0.25), (model, name, predicted, measured)


def test_fit_native_level_reproduces_both_measurements():
  topo = fit_native_level(Topology.preset("cpu-sim"), tiny_s=2e-4, big_s=3e-3, big_bytes=1e6)
  assert cost.estimate("all_reduce", 1e6, topo, "native") == pytest.approx(3e-3)
  assert cost.estimate("all_reduce", 0, topo, "native") == pytest.approx(2e-4)


# --------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda: WorkloadSpec("w", (-1.0,), 1.0), ValueError, "`layer_params entry`"),
        (lambda: WorkloadSpec("w", (0.0,), 1.0), ValueError, "sum to 0"),
        (lambda: WorkloadSpec("w", (1.0,), 0.0), ValueError, "`seconds_per_example`"),
        (lambda: WorkloadSpec.from_numbers("w", num_params=0, flops_per_example=1,
                                           achieved_flops=1), ValueError, "`num_params`"),
        (lambda: Strategy(stage=4), ValueError, "`stage`"),
        (lambda: Strategy(stage=3, compression="bf16"), ValueError, "needs stage=0"),
        (lambda: Strategy(stage=1, hybrid=True), ValueError, "`hybrid`"),
        (lambda: Strategy(bucket_bytes=0), ValueError, "`bucket_bytes`"),
        (lambda: Strategy(bucket_bytes=1.5), TypeError, "`bucket_bytes`"),
        (lambda: step_time(SEVEN_B, Strategy(), Topology.cluster("dgx-h100", 16),
                           global_batch=20), ValueError, "not divisible"),
        (lambda: step_time(SEVEN_B, Strategy(stage=3, algorithm="halving_doubling"),
                           Topology.cluster("dgx-h100", 16), per_device_batch=1),
         ValueError, "valid choices"),
        (lambda: step_time(SEVEN_B, Strategy(), Topology.cluster("dgx-h100", 16),
                           per_device_batch=1, interference=2), ValueError, "`interference`"),
        (lambda: step_time(SEVEN_B, "dp", Topology.cluster("dgx-h100", 16),
                           per_device_batch=1), TypeError, "`strategy`"),
        (lambda: efficiency(SEVEN_B, Strategy(), "dgx-h200", 16, per_device_batch=1),
         ValueError, "valid presets"),
        (lambda: efficiency(SEVEN_B, Strategy(), "dgx-h100", 12, per_device_batch=1),
         ValueError, "multiple of 8"),
    ],
)
def test_bad_input_raises(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_workload_from_a_shipped_model_is_measured_here():
  model = jaxcoll.models.make_workload("mlp", widths=(16,))
  w = WorkloadSpec.from_model(model, batch_size=8, steps=2)
  assert w.num_params == sum(w.layer_params) == jaxcoll.models.count_params(
      model.param_shapes)
  assert len(w.layer_params) == 4 and 0 < w.seconds_per_example < 1
  assert "measured here" in w.source


def test_strategy_from_trainer_strategies():
  assert Strategy.from_trainer(jaxcoll.DataParallel(compression="int8")).name == "DP auto int8"
  z = Strategy.from_trainer(jaxcoll.ZeRO(stage=3, algorithm="native"))
  assert dataclasses.astuple(z)[:1] == (3,) and z.name == "ZeRO-3"
  with pytest.raises(TypeError, match="`strategy`"):
    Strategy.from_trainer(object())


# --------------------------------------------------------------- command line


def run_cli(*args):
  env = dict(os.environ, PYTHONPATH=ROOT)
  return subprocess.run(
      [sys.executable, "-m", "experiments.simulate_training", *args], cwd=ROOT, env=env,
      capture_output=True, text=True, timeout=300, check=False,
  )


def test_command_line_numbers_workload_and_validation(tmp_path):
  ok = run_cli("--workloads=", "--params=7e9", "--flops_per_example=8.6e13",
               "--per_device_batch=4", "--max_gpus=128", "--validate", f"--out={tmp_path}")
  assert ok.returncode == 0, ok.stderr
  out = ok.stdout
  assert "| Goyal et al. 2017 | ResNet-50 | pascal-nvlink-50gbe | 256 | 90% |" in out
  assert "== 7e+09 params" in out
  for name in ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "hybrid ZeRO-3"):
    assert f"\n{name:<18}" in out
  assert "knee (first GPU count with efficiency < 80%)" in out
  assert "DP, hierarchical all-reduce" in out and "hybrid ZeRO-3 (shard in node)" in out
  record = json.loads((tmp_path / "simulate_training.json").read_text())
  rows = record["workloads"][0]["rows"]
  assert len(rows) == 5 * 5  # 5 strategies x 8..128
  assert all(0 < r["efficiency"] <= 1 for r in rows)
  dp = next(r for r in rows if r["strategy"] == "DP")
  assert dp["memory_bytes"] == pytest.approx(7e9 * 16)  # 4 + 4 + 8 B/param, float32 Adam
  assert "112.000  NO" in out  # 112 GB of DP state does not fit an 80 GB H100
  assert (tmp_path / "table.txt").exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--preset=nope"], "Unknown `--preset` 'nope'"),
        (["--workloads=", "--params=7e9"], "together"),
        (["--strategies=dp,zero4"], "`--strategies`"),
        (["--per_device_batch=0"], "`--per_device_batch` must be >= 1"),
        (["--params=-1", "--flops_per_example=1"], "`--params` must be > 0"),
        # a strategy the workload cannot use: ZeRO-3 has no halving-doubling all-gather
        (["--workloads=", "--params=7e9", "--flops_per_example=1e12", "--strategies=zero3",
          "--algorithm=halving_doubling"], "valid choices"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path):
  out_dir = tmp_path / "out"
  bad = run_cli(*args, f"--out={out_dir}")
  assert not out_dir.exists()  # nothing written
  assert bad.returncode == 2
  lines = bad.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("simulate_training: error:"), bad.stderr
  assert message in lines[0]
  assert bad.stdout == ""


def test_zero3_keeps_the_compute_of_parameter_free_layers():
  w = WorkloadSpec("pool", (1e6, 0.0, 1e6), 3.0, layer_compute=(1.0, 1.0, 1.0),
                   optimizer_traffic_bytes_per_param=0)
  topo = Topology.cluster("dgx-h100", 8)
  for stage in (0, 3):
    t = step_time(w, Strategy(stage=stage, bucket_bytes=1), topo, per_device_batch=2,
                  interference=1.0)
    assert t.step_s == pytest.approx(6.0 + t.comm_s, rel=1e-9)  # no overlap: the sum
