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
    DEFAULT_PARAMS,
    ModelParams,
    expected_max_normal,
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


# The figures the held-out published rows reach with DEFAULT_PARAMS (README,
# "Validation against published scaling results"). The targets (>= 90%
# within 5 points, median <= 3) are NOT reached; these pin what is.
HELD_OUT_WITHIN_5, HELD_OUT_MEDIAN = 124, 2.32   # all 152 held-out rows
FIRST_WITHIN_5, FIRST_MEDIAN = 16, 3.45          # the 24 held out before the added tables
ADDED_WITHIN_5, ADDED_MEDIAN = 108, 2.21         # the 128 rows of the added tables
FITTED_WITHIN_5, FITTED_MEDIAN = 11, 0.65


def test_held_out_table_from_the_recorded_inputs():
  results = published.validate()
  assert len(results) == len(published.ROWS) >= 20
  fitted = [r for r in results if r.fitted_here]
  held = [r for r in results if not r.fitted_here]
  assert 3 * len(fitted) <= len(results) and len(held) == 152
  s = published.summary(results)
  assert s["held_out"].rows == 152 and s["fitted"].rows == 12
  first = published._errors([r for r in held if r.row in published._FIRST_ROWS])
  added = published._errors([r for r in held if r.row not in published._FIRST_ROWS])
  assert (first.rows, first.within_5, added.rows, added.within_5) == (
      24, FIRST_WITHIN_5, 128, ADDED_WITHIN_5)
  assert first.median_pp == pytest.approx(FIRST_MEDIAN, abs=0.05)
  assert added.median_pp == pytest.approx(ADDED_MEDIAN, abs=0.05)
  assert s["held_out"].within_5 == HELD_OUT_WITHIN_5
  assert s["held_out"].median_pp == pytest.approx(HELD_OUT_MEDIAN, abs=0.05)
  assert s["fitted"].within_5 == FITTED_WITHIN_5
  assert s["fitted"].median_pp == pytest.approx(FITTED_MEDIAN, abs=0.05)
  # Rows the model does capture, one per kind of loss, within 5 points:
  by_key = {r.row.key: r for r in results}
  for key in ("tf-vgg16-b64-8", "tf-vgg16-b32-8", "horovod-vgg16-512", "dle-pt-rn50-dgx1-fp32-8",
              "dle-pt-rn50-a100-amp-8", "dle-pt-rn50-dgx1-32g-amp-8",
              "dle-tf-bert-a100-mixed-32n", "dle-tf-bert-a100-tf32-8n"):
    assert not by_key[key].fitted_here and abs(by_key[key].error_pp) <= 5, by_key[key]
  # ...and ones it does not (tf.data's input rate; the DGX-2H cluster at >= 16 nodes):
  for key in ("dle-tf-rn50-dgx2-amp-16", "dle-tf-bert-dgx2h-mixed-16n"):
    assert by_key[key].error_pp > 8
  assert 5 < by_key["tf-alexnet-b512-8"].error_pp < 8  # NCCL 1 at 8 P100: AlexNet still high


def test_nccl1_ring_on_8_p100_runs_at_the_cross_socket_shared_memory_rate():
  # NCCL 1 rings the 8 GPUs in device order; 3->4 and 7->0 cross the sockets through host
  # memory, 5 GB/s (NVIDIA's NCCL blog): the whole ring's busbw. A quad keeps its NVLink.
  eight = published.CLUSTERS["dgx1-p100"].topology(8, 1.0)
  quad = published.CLUSTERS["dgx1-p100-quad"].topology(4, 1.0)
  nbytes = 1 << 30
  busbw = {n: nbytes / cost.estimate("all_reduce", nbytes, t, "native")
           * cost.bus_bandwidth_factor("all_reduce", n) for n, t in ((8, eight), (4, quad))}
  assert busbw[8] == pytest.approx(5e9, rel=0.02) and busbw[4] == pytest.approx(20e9, rel=0.02)
  assert "5GB/s" in published.CLUSTERS["dgx1-p100"].source
  # VGG-16 at batch 32 on 8 P100: published 71.2%; 87.6% with the PCIe line rate before.
  assert published.predict(published.row("tf-vgg16-b32-8")) == pytest.approx(0.677, abs=0.005)


def test_published_efficiency_is_the_sources_own_scaling_figure():
  # The README's own columns: PyTorch ResNet-50 DGX-1 FP32 "7.76 x" on 8 GPUs,
  # TF BERT DGX A100 mixed "28.99" on 32 nodes (vs 1), TF benchmarks VGG16 1081 / (8 x 154).
  assert published.row("dle-pt-rn50-dgx1-fp32-8").published_efficiency == pytest.approx(
      7.76 / 8, abs=0.003)
  assert published.row("dle-tf-bert-a100-mixed-32n").published_efficiency == pytest.approx(
      28.99 / 32, abs=0.002)
  assert published.row("tf-vgg16-b64-8").published_efficiency == pytest.approx(
      1081 / (8 * 154))
  # the added tables, against their own weak-scaling columns: PyTorch BERT "30.37" on 32 DGX
  # A100 nodes, MXNet ResNet-50 "14.39" on a DGX-2, TF1 BERT "15.65" on 16 DGX-2H nodes
  for key, scaled, n in (("pt-bert-a100-mixed-s128-32n", 30.37, 32), ("mx-rn50-dgx2-amp-16",
                         14.39, 16), ("tf1-bert-dgx2h-mixed-s128-16n", 15.65, 16)):
    assert published.row(key).published_efficiency == pytest.approx(scaled / n, abs=0.002)
  for r in published.ROWS:
    assert ("@" in r.source and ":" in r.source) or "http" in r.source  # repo@commit:path, URL
    assert r.cluster in published.CLUSTERS and r.gpu_rate > 0
  with pytest.raises(ValueError, match="Unknown published row 'nope'"):
    published.row("nope")


def test_gradient_bytes_on_the_wire_are_what_each_bert_code_sends():
  # Read in each row's training code (published.py docstring): PaddlePaddle's AMP O1 keeps
  # float32 parameters, so its gradients go on the wire in float32 in both precisions (the
  # mixed rows were entered as fp16); PyTorch (an fp16 model) and both TensorFlows (Horovod's
  # Compression.fp16) send fp16 in mixed precision.
  wire = {}
  for r in published.ROWS:
    family = r.key.split("-")[0]
    if r.model.startswith("bert") and family in ("pd", "pt", "tf1", "tf2", "dle"):
      wire.setdefault((family, r.precision), set()).add(r.grad_bytes)
  assert wire[("pd", "mixed")] == {4} and wire[("pd", "tf32")] == {4}
  for family in ("pt", "tf1", "tf2", "dle"):
    assert wire[(family, "mixed")] == {2}, family
  assert "paddle.optimizer.Lamb" in published.PD_BERT and "DistributedFusedLamb" not in (
      published.PD_BERT)


def test_fit_keys_are_every_third_of_the_first_rows_and_added_tables_are_held_out():
  assert published.FIT_KEYS == tuple(r.key for r in published.ROWS[:36:3])
  assert not set(published.FIT_KEYS) & {r.key for r in published._ADDED_TABLES}
  # whole tables: every added row is in ROWS unless super-linear (LEFT_OUT)
  assert len(published._ADDED_TABLES) == 149 and len(published.LEFT_OUT) == 21
  assert all(v > 1 for v in published.LEFT_OUT.values())
  assert len(published.ROWS) == 36 + 149 - 21


def test_default_params_are_a_minimum_of_the_fit_loss():
  # Fast sibling of the (slow) refit: moving any parameter off DEFAULT_PARAMS
  # makes the fitted rows' absolute error larger.
  rows = [r for r in published.ROWS if r.key in published.FIT_KEYS]
  p = DEFAULT_PARAMS
  best = published._loss((p.straggler_sigma, p.sync_s, p.loader_rate), rows)
  for x in ((p.straggler_sigma * 1.15, p.sync_s, p.loader_rate),
            (p.straggler_sigma * 0.85, p.sync_s, p.loader_rate),
            (p.straggler_sigma, p.sync_s + 0.002, p.loader_rate),
            (p.straggler_sigma, max(p.sync_s - 0.002, 0), p.loader_rate),
            (p.straggler_sigma, p.sync_s, p.loader_rate * 1.02),
            (p.straggler_sigma, p.sync_s, p.loader_rate * 0.98)):
    assert published._loss(x, rows) > best
  assert p.bus_fraction == 1.0  # held at the line rate, not fitted


@pytest.mark.slow
def test_fit_reproduces_default_params():
  assert published.fit() == DEFAULT_PARAMS


def test_held_out_bands_by_where_a_prediction_falls():
  bands = published.held_out_bands()
  assert sum(b.rows for b in bands.values()) == 152
  # Across nodes below 128 GPUs all but two held-out rows are within 5 points (TensorFlow 2's
  # DGX A100 TF32 seq-512 column); from 128 GPUs a third miss (the published efficiency
  # falls faster than the model's).
  assert (bands["2+ nodes, < 128 GPUs"].within_5, bands["2+ nodes, < 128 GPUs"].rows) == (30, 32)
  assert (bands["128+ GPUs"].within_5, bands["128+ GPUs"].rows) == (22, 36)
  assert bands["128+ GPUs"].median_pp == pytest.approx(4.30, abs=0.05)
  assert published.regime(8, 8) == "one node" and published.regime(16, 16) == "one node"
  assert published.regime(16, 8) == "2+ nodes, < 128 GPUs"
  assert published.regime(512, 16) == "128+ GPUs"
  assert published.MAX_PUBLISHED_DEVICES == 512 and published.regime(1024, 8) is None
  assert published.held_out_band(64, gpus_per_node=8) == (
      "±1.6 pts median, 30 of 32 within 5 pts on 32 held-out published rows (2+ nodes, < 128 "
      "GPUs)")
  assert published.held_out_band(2048, gpus_per_node=8).startswith("extrapolated: no published")
  with pytest.raises(ValueError, match="`gpus_per_node` is needed"):
    published.held_out_band(8)
  with pytest.raises(ValueError, match=r"`num_devices` must be a whole number >= 1; got 0\."):
    published.regime(0, 8)


def test_validation_table_splits_fitted_and_held_out_with_sources():
  table = published.validation_table()
  assert table.index("Fitted rows (12;") < table.index("Held-out rows (152;")
  assert "| tf-vgg16-b64-8 | VGG-16 | DGX-1 (8 P100), NCCL 1 ring | 8 | 64 | fp32 | 87.7% |" in (
      table)
  assert "horovod/horovod@27743d08ca7a59290b52154c8cddc807006436d3:docs/benchmarks.rst" in table
  assert published.held_out_band().startswith("±2.3 pts median, 124 of 152 within 5 pts")


def test_readme_validation_tables_are_validation_table():
  # README "Predicting training at scale" shows exactly what validation_table() gives now.
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
    assert published.validation_table() in fh.read()


def test_host_input_pipeline_caps_a_shared_node_at_workers_times_loader_rate():
  w = WorkloadSpec("w", (1e3,), 1e-3, optimizer_traffic_bytes_per_param=0)
  p = ModelParams(loader_rate=100.0)
  topo = Topology.from_hardware(nodes=1, gpus_per_node=8, intra_links=12, intra_link_GBps=25,
                                hbm_Bps=2e12)
  # 8 GPUs share the host: 64 examples / (4 workers x 100 per s) = 0.16 s > 0.064 s compute.
  eight = step_time(w, Strategy(), topo, per_device_batch=64, params=p, input_workers=4)
  assert eight.input_s == pytest.approx(0.16) and eight.step_s == pytest.approx(0.16)
  assert eight.host_bound and eight.compute_s == pytest.approx(0.064)
  # Enough workers: the GPU sets the pace again.
  fast = step_time(w, Strategy(), topo, per_device_batch=64, params=p, input_workers=16)
  assert not fast.host_bound and fast.step_s < 0.16
  # One GPU has the host to itself (its published rate includes its loader), and no
  # input_workers means the input is not modelled.
  one = step_time(w, Strategy(), topo.resized(1), per_device_batch=64, params=p,
                  input_workers=4)
  assert one.input_s == 0.0 and one.step_s == pytest.approx(0.064)
  assert step_time(w, Strategy(), topo, per_device_batch=64, params=p).input_s == 0.0
  with pytest.raises(ValueError, match="`input_workers` must be a finite number > 0; got 0"):
    step_time(w, Strategy(), topo, per_device_batch=64, params=p, input_workers=0)
  with pytest.raises(ValueError, match="`loader_rate` must be a number > 0"):
    ModelParams(loader_rate=-1.0)


def test_the_loader_rate_fitted_on_dgx1_predicts_the_dgx_a100_row():
  # The PyTorch ResNet-50 rows' own configuration: 8 DataLoader workers per GPU on DGX-1
  # (fitted row), 16 on DGX A100 (held out): the A100 node is predicted host-bound at
  # 8 x 16 x loader_rate img/s, against 16,621 published.
  a100 = published.row("dle-pt-rn50-a100-amp-8")
  assert a100.input_workers == 16 and a100.key not in published.FIT_KEYS
  assert published.row("dle-pt-rn50-dgx1-amp-8").key in published.FIT_KEYS
  eff = published.predict(a100)
  assert eff * 8 * a100.gpu_rate == pytest.approx(8 * 16 * DEFAULT_PARAMS.loader_rate, rel=0.005)
  assert abs(eff - a100.published_efficiency) < 0.01
  # FP32/TF32 at a third of the speed stays GPU-bound.
  tf32 = published.row("dle-pt-rn50-a100-tf32-8")
  assert published.predict(tf32) > published.predict(a100) + 0.1


def test_straggler_wait_is_the_expected_maximum_of_n_normals():
  assert expected_max_normal(1) == 0.0
  assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-4)
  assert expected_max_normal(8) == pytest.approx(1.4236, abs=1e-3)  # tables of normal order stats
  values = [expected_max_normal(n) for n in (2, 16, 512, 1 << 14)]
  assert values == sorted(values)
  assert all(v < math.sqrt(2 * math.log(n)) for v, n in zip(values, (2, 16, 512, 1 << 14)))
  p = ModelParams(straggler_sigma=0.02, sync_s=0.01)
  assert p.sync_cost(1.0, 1) == 0.0
  assert p.sync_cost(1.0, 8) == pytest.approx(0.01 + 0.02 * expected_max_normal(8))


def test_efficiency_falls_with_node_count_and_a_node_is_below_one():
  # What the issue found missing: BERT-large over 2 -> 8 -> 32 DGX A100 nodes
  # (published 99.3, 97.6, 90.6%), and one 8-GPU node under 100%.
  effs = [published.predict(published.row(f"dle-tf-bert-a100-mixed-{n}n")) for n in (2, 8, 32)]
  assert effs[0] > effs[1] > effs[2] and effs[0] - effs[2] > 0.04
  assert published.predict(published.row("dle-pt-rn50-dgx1-fp32-8")) < 0.97


def test_gradient_accumulation_reduces_once_after_the_last_micro_batch():
  w = WorkloadSpec("two", (1e6, 1e6), 3.0, optimizer_traffic_bytes_per_param=0)
  topo = two_level()
  p0 = ModelParams()
  one = step_time(w, Strategy(), topo, per_device_batch=1, params=p0, interference=0)
  four = step_time(w, Strategy(), topo, per_device_batch=1, accumulation_steps=4, params=p0,
                   interference=0)
  assert four.compute_s == pytest.approx(4 * one.compute_s)
  assert four.comm_s == pytest.approx(one.comm_s)  # one reduction per optimizer step
  assert four.step_s == pytest.approx(one.step_s + 3 * one.compute_s)
  with pytest.raises(ValueError, match="`accumulation_steps`=2 is modelled for data parallel"):
    step_time(w, Strategy(stage=3), topo, per_device_batch=1, accumulation_steps=2)


def test_from_hardware_defaults_to_the_fitted_bus_fraction():
  import inspect

  default = inspect.signature(Topology.from_hardware).parameters["bus_fraction"].default
  assert default == DEFAULT_PARAMS.bus_fraction


def test_topology_from_hardware_and_resized():
  t = Topology.from_hardware(nodes=4, gpus_per_node=8, intra_links=12, intra_link_GBps=25,
                             inter_links=8, inter_link_Gbps=200, bus_fraction=0.8)
  assert t.sizes == (4, 8) and t.names == ("node", "local")
  assert t.level("local").bandwidth_Bps == pytest.approx(12 * 25e9 * 0.8)
  assert t.level("node").bandwidth_Bps == pytest.approx(8 * 200e9 / 8 * 0.8 / 8)  # NIC share
  # nccl-tests busbw of a big ring all-reduce across the nodes: all 8 NICs of a node.
  nbytes = 1 << 30
  busbw = nbytes / cost.estimate("all_reduce", nbytes, t, "native") * cost.bus_bandwidth_factor(
      "all_reduce", 32)
  assert busbw == pytest.approx(8 * 25e9 * 0.8, rel=0.05)
  assert t.resized(8).sizes == (8,) and t.resized(3).sizes == (3,)
  assert t.resized(128).sizes == (16, 8) and t.resized(8).resized(32) == t
  one = Topology.from_hardware(nodes=1, gpus_per_node=4, intra_links=1, intra_link_GBps=15.75,
                               inter_links=1, inter_link_Gbps=25)
  assert one.resized(512).sizes == (128, 4)
  assert Topology.preset("dgx-h100").resized(64) == Topology.cluster("dgx-h100", 64)
  with pytest.raises(ValueError, match="not a whole number of nodes of 8"):
    t.resized(12)
  lonely = Topology.from_hardware(nodes=1, gpus_per_node=8, intra_links=6, intra_link_GBps=25)
  with pytest.raises(ValueError, match="links between nodes are unknown"):
    lonely.resized(16)
  with pytest.raises(ValueError, match="`bus_fraction` must be in"):
    Topology.from_hardware(nodes=1, gpus_per_node=8, intra_links=6, intra_link_GBps=25,
                           bus_fraction=1.5)
  with pytest.raises(ValueError, match="inter_links"):
    Topology.from_hardware(nodes=2, gpus_per_node=8, intra_links=6, intra_link_GBps=25)


def test_from_hardware_takes_numpy_numbers_and_writes_json():
  # Figures computed with numpy (np.int64 link counts, np.float32 rates read from a table)
  # were refused: "`intra_link_GBps` must be a finite number > 0; got np.int64(25)".
  import numpy as np

  t = Topology.from_hardware(nodes=np.int64(3), gpus_per_node=np.int64(6),
                             intra_links=np.int64(6), intra_link_GBps=np.int64(50),
                             inter_links=np.int64(4), inter_link_Gbps=np.float32(200))
  plain = Topology.from_hardware(nodes=3, gpus_per_node=6, intra_links=6, intra_link_GBps=50,
                                 inter_links=4, inter_link_Gbps=200)
  assert t == plain and t.resized(12).sizes == (2, 6)
  back = Topology.from_dict(json.loads(json.dumps(t.to_dict())))  # floats, not numpy scalars
  assert back == plain
  assert Level("x", 2, np.float32(1e-6), np.int64(10**9)).bandwidth_Bps == 1e9
  with pytest.raises(ValueError, match="`intra_link_GBps` must be a finite number > 0"):
    Topology.from_hardware(nodes=1, gpus_per_node=8, intra_links=6, intra_link_GBps=np.nan)


def test_nodes_of_one_gpu_need_no_links_inside_them():
  # A cluster of one-GPU VMs (one GPU and one NIC each) could not be built: intra_links=0 was
  # refused although such a node has no links inside it.
  vm = Topology.from_hardware(nodes=4, gpus_per_node=1, intra_links=0, intra_link_GBps=0,
                              inter_links=1, inter_link_Gbps=100)
  assert vm.sizes == (4, 1) and vm.resized(16).sizes == (16, 1) and vm.resized(1).sizes == (1,)
  assert Topology.from_dict(vm.resized(1).to_dict()).resized(8).sizes == (8, 1)
  w = published.DEFAULT_WORKLOADS["resnet50"]
  effs = [efficiency(w, Strategy(), vm, n, per_device_batch=256) for n in (2, 4, 16, 64)]
  assert 1 > effs[0] > effs[1] > effs[2] > effs[3] > 0.5
  # the same one-GPU nodes through the whole-node path agree (inner links do not matter)
  linked = Topology.from_hardware(nodes=4, gpus_per_node=1, intra_links=1, intra_link_GBps=25,
                                  inter_links=1, inter_link_Gbps=100)
  assert efficiency(w, Strategy(), linked, 16, per_device_batch=256) == pytest.approx(
      effs[2], rel=1e-3)
  with pytest.raises(ValueError, match="`intra_links` must be a positive integer, got 0"):
    Topology.from_hardware(nodes=4, gpus_per_node=2, intra_links=0, intra_link_GBps=0,
                           inter_links=1, inter_link_Gbps=100)


def test_a_part_of_a_node_resized_again_builds_whole_nodes():
  # 12 nodes x 4 GPUs, 2 NICs of 200 Gb/s: resized to part of a node and back, the nodes keep
  # their 4 GPUs (the part remembered 2 GPUs per node before: 24 nodes of 2 at 48).
  c = Topology.from_hardware(nodes=12, gpus_per_node=4, intra_links=4, intra_link_GBps=25,
                             inter_links=2, inter_link_Gbps=200)
  assert c.resized(2).node_size == 4 and c.resized(4).node_size is None
  assert c.resized(2).resized(48) == c and c.resized(1).resized(8).sizes == (2, 4)
  assert c.resized(3).resized(4).sizes == (4,) and c.resized(2).resized(3).sizes == (3,)
  assert c.resized(2).resized(48).level("node").bandwidth_Bps == pytest.approx(2 * 25e9 / 4)
  with pytest.raises(ValueError, match="not a whole number of nodes of 4"):
    c.resized(2).resized(6)
  # a step on the resized part equals one on the cluster resized directly
  w = published.WORKLOADS["resnet50"]
  assert step_time(w, Strategy(), c.resized(1).resized(48), per_device_batch=64).step_s == (
      step_time(w, Strategy(), c, per_device_batch=64).step_s)
  with pytest.raises(ValueError, match="node_size"):
    Topology(c.levels[-1:], node_size=0)
  # written to JSON and read back, a part of a node and one node still grow to whole nodes
  for part in (c.resized(2), c.resized(4)):
    back = Topology.from_dict(json.loads(json.dumps(part.to_dict())))
    assert (back.node_size, back.node_link) == (part.node_size, part.node_link)
    assert back.resized(48) == c and back.resized(48).levels == c.levels
  assert "node_link" not in c.to_dict() and "node_size" not in c.resized(4).to_dict()
  with pytest.raises(ValueError, match="node_size"):
    Topology.from_dict({**c.resized(2).to_dict(), "node_size": 0})
  with pytest.raises(ValueError, match="level must be a mapping"):
    Topology.from_dict({**c.resized(2).to_dict(), "node_link": 5})


def test_presets_busbw_unchanged():
  # The collective-level figures of the presets (nccl-tests busbw of a 1 GiB
  # all-reduce), as main computed them before the scale-model changes.
  want = {("dgx-h100", 4): (46.08, 347.33), ("dgx-a100", 4): (23.22, 178.84),
          ("dgx-h100", 1): (344.16, 349.66), ("dgx-a100", 1): (215.21, 217.34),
          ("tpu-v5e", 1): (42.9, 83.61)}
  for (preset, nodes), figures in want.items():
    topo = Topology.preset(preset, nodes=nodes)
    factor = cost.bus_bandwidth_factor("all_reduce", topo.num_devices)
    got = tuple(round((1 << 30) / cost.estimate("all_reduce", 1 << 30, topo, a) * factor / 1e9, 2)
                for a in ("ring", "native"))
    assert got == figures, (preset, nodes)


@pytest.mark.parametrize(
    "name,params",
    [("vgg16", 138_357_544), ("resnet50", 25_557_032), ("resnet101", 44_549_160),
     ("inception_v3", 23_851_784), ("alexnet", 61_100_840), ("bert_large", 336_224_058)],
)
def test_layer_tables_have_the_published_parameter_counts(name, params):
  assert published.WORKLOADS[name].num_params == pytest.approx(params, abs=1)


def test_bucket_size_effect_giant_bucket_loses_the_overlap():
  # 8 servers of 4 Pascal GPUs on 25 Gb/s (Horovod's cluster), the overlap alone
  sweep = published.bucket_sweep("resnet50", cluster="horovod-pascal", params=ModelParams())
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
                  per_device_batch=1, interference=kappa, params=ModelParams())
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
  # The fitted synchronization cost comes on top: the wait for the slowest of
  # the 16 devices and the fixed per-step cost.
  p = DEFAULT_PARAMS
  t = step_time(w, Strategy(bucket_bytes=4_000_000, algorithm="ring"), topo, per_device_batch=1,
                interference=0.0)
  sync = p.sync_s + p.straggler_sigma * expected_max_normal(16) * 3.0
  assert t.sync_s == pytest.approx(sync)
  assert t.step_s == pytest.approx(max(3.0, 2.0 + c) + c + sync)


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
                     interference=1.0, params=ModelParams()) for n in COUNTS[1:]]
  assert effs == sorted(effs, reverse=True)
  assert all(e >= bound for e in effs)
  assert effs[-1] == pytest.approx(bound, rel=1e-3)
  # with overlap the curve flattens too, at (compute + optimizer) / (that + exposed comm)
  rows = scaling(SEVEN_B, [Strategy()], "dgx-h100", COUNTS, per_device_batch=4,
                 params=ModelParams())
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
      # XLA:CPU: no overlap; emulated devices share one clock, so no
      # straggler or per-step sync figures (those are fitted on GPU clusters).
      predicted = step_time(w, strategy, topo, global_batch=record["global_batch"],
                            interference=1.0, params=ModelParams()).step_s
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
        # A baseline or a sweep entry that is not whole nodes is named as the caller gave it
        # (it was "`num_devices`=12", the name of an argument that was 16 here).
        (lambda: efficiency(SEVEN_B, Strategy(), "dgx-h100", 16, per_device_batch=1,
                            baseline=12),
         ValueError, "^`baseline`=12 is not a whole number of dgx-h100 nodes"),
        (lambda: scaling(SEVEN_B, [Strategy()], Topology.cluster("dgx-h100", 16), [8, 12],
                         per_device_batch=1),
         ValueError, "^an entry of `device_counts`, 12, is not a whole number of nodes of 8"),
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


def test_workload_from_params_takes_the_bytes_of_their_dtypes():
  # A bfloat16 pytree was a float32 model to the step model (param_bytes=grad_bytes=4 by
  # default): twice its gradient traffic and model-state memory, silently.
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  half = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16),
          "b": jax.ShapeDtypeStruct((1024,), jnp.bfloat16)}
  full = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), half)
  w16, w32 = (WorkloadSpec.from_params("m", p, 1e-3) for p in (half, full))
  assert (w16.param_bytes, w16.grad_bytes) == (2, 2)
  assert (w32.param_bytes, w32.grad_bytes) == (4, 4)
  topo = Topology.cluster("dgx-a100", 16)
  t16, t32 = (step_time(w, Strategy(), topo, per_device_batch=8) for w in (w16, w32))
  psi = 1024 * 1024 + 1024
  assert t16.memory_bytes == (2 + 2 + 8) * psi  # params, grads, float32 Adam moments
  assert t32.memory_bytes == (4 + 4 + 8) * psi
  assert t16.comm_s < t32.comm_s
  assert WorkloadSpec.from_params("m", half, 1e-3, grad_bytes=4).grad_bytes == 4  # as given


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


def test_every_all_reduce_algorithm_of_the_command_line_runs_a_dp_sweep():
  # --algorithm=ring (or any name but native) failed the whole run with "Unknown all_to_all
  # `algorithm` 'ring'": the int8 line priced its all-to-all with the all-reduce's name, and
  # the ZeRO-3 lines of the knee list used names reduce-scatter / all-gather do not have;
  # --algorithm=hierarchical failed on one node (8 GPUs), where Hierarchical() runs its inner.
  w = published.DEFAULT_WORKLOADS["resnet50"]
  one_node = Topology.preset("dgx-a100")
  by_name = efficiency(w, Strategy(algorithm="hierarchical"), one_node, 8, per_device_batch=256)
  assert by_name == efficiency(w, Strategy(algorithm=Hierarchical()), one_node, 8,
                               per_device_batch=256)
  two = Topology.preset("dgx-a100", nodes=2)
  int8 = efficiency(w, Strategy(algorithm="ring", compression="int8"), two, 16, per_device_batch=256)
  assert int8 == efficiency(w, Strategy(algorithm="auto", compression="int8"), two, 16,
                            per_device_batch=256)  # as the trainer runs it: auto
  for algorithm in ("ring", "tree", "hierarchical"):
    ran = run_cli("--workloads=resnet50", "--strategies=dp", f"--algorithm={algorithm}",
                  "--max_gpus=16")
    assert ran.returncode == 0 and "DP, int8 compression" in ran.stdout, (algorithm, ran.stderr)
    assert ("ZeRO-3 " in ran.stdout) == (algorithm != "tree")  # tree has no all-gather


def test_command_line_numbers_workload_and_validation(tmp_path):
  ok = run_cli("--workloads=", "--params=7e9", "--flops_per_example=8.6e13",
               "--per_device_batch=4", "--max_gpus=1024", "--validate", f"--out={tmp_path}")
  assert ok.returncode == 0, ok.stderr
  out = ok.stdout
  goyal = ("| goyal-resnet50-256 | ResNet-50 | Big Basin (8 P100), 50 GbE | 256 | 32 | fp32 "
           "| 90.0% |")
  assert goyal in out
  assert "Held-out rows (152;" in out
  assert "== 7e+09 params" in out
  # the held-out error band beside every prediction: that of the held-out rows where it falls
  # (one node, across nodes, 128+ GPUs), none beyond the largest published count (512)
  assert ("±held-out: the model's median error on published rows it was not fitted to, where "
          "the prediction falls: one node ±2.1 pts (72 of 84 within 5); 2+ nodes, < 128 GPUs "
          "±1.6 pts (30 of 32 within 5); 128+ GPUs ±4.3 pts (22 of 36 within 5); all 152: "
          "±2.3 pts, max 21; 'extrap.': beyond 512 GPUs") in out
  dp = [line.split() for line in out.splitlines() if line.startswith("DP ")]
  assert [(int(d[1]), " ".join(d[8:10])) for d in dp] == [
      (8, "±2.1 pts"), (16, "±1.6 pts"), (32, "±1.6 pts"), (64, "±1.6 pts"), (128, "±4.3 pts"),
      (256, "±4.3 pts"), (512, "±4.3 pts"), (1024, "extrap. 112.000")]
  for name in ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "hybrid ZeRO-3"):
    assert f"\n{name:<18}" in out
  assert "knee (first GPU count with efficiency < 80%)" in out
  assert "DP, hierarchical all-reduce" in out and "hybrid ZeRO-3 (shard in node)" in out
  record = json.loads((tmp_path / "simulate_training.json").read_text())
  assert record["held_out_error_pp"]["rows"] == 152
  assert {k: v["rows"] for k, v in record["held_out_error_pp_by_regime"].items()} == {
      "one node": 84, "2+ nodes, < 128 GPUs": 32, "128+ GPUs": 36}
  rows = record["workloads"][0]["rows"]
  assert len(rows) == 5 * 8  # 5 strategies x 8..1024
  assert [(r["num_devices"], r["held_out_regime"]) for r in rows[:8:3]] == [
      (8, "one node"), (64, "2+ nodes, < 128 GPUs"), (512, "128+ GPUs")]
  assert rows[7]["held_out_regime"] is None and rows[7]["held_out_median_pp"] is None
  assert all(0 < r["efficiency"] <= 1 for r in rows)
  dp = next(r for r in rows if r["strategy"] == "DP")
  assert dp["memory_bytes"] == pytest.approx(7e9 * 16)  # 4 + 4 + 8 B/param, float32 Adam
  assert "112.000  NO" in out  # 112 GB of DP state does not fit an 80 GB A100 (the default)
  assert (tmp_path / "table.txt").exists()


_BAD_INPUT = [
    (["--preset=nope"], "Unknown `--preset` 'nope'"),
    (["--workloads=", "--params=7e9"], "together"),
    (["--strategies=dp,zero4"], "`--strategies`"),
    (["--per_device_batch=0"], "`--per_device_batch` must be >= 1"),
    (["--compute_scale=0"], "`--compute_scale` must be > 0"),
    (["--workloads=gpt5"], "Unknown `--workloads` ['gpt5']"),
    (["--params=-1", "--flops_per_example=1"], "`--params` must be > 0"),
    (["--input_workers=0"], "`--input_workers` must be >= 1; got 0"),
    (["--cluster=4,4,25"], "`--cluster`='4,4,25' needs 5 or 6"),
    (["--cluster=4.5,4,25,2,200"], "GPUS_PER_NODE must be a whole number >= 1; got 4.5"),
    # a strategy the workload cannot use: ZeRO-3 has no halving-doubling all-gather
    (["--workloads=", "--params=7e9", "--flops_per_example=1e12", "--strategies=zero3",
      "--algorithm=halving_doubling"], "valid choices"),
    (["--bucket_mb=x"], "--bucket_mb"),  # a malformed flag: absl's parser, one line too
    (["--cluster=6,4,25,2,200", "--workloads=resnet50"], "`--min_gpus`=8 is not a whole number"),
    # The sweep doubles --min_gpus: every count must be part of one node or whole nodes (was:
    # nothing printed, then an error naming `num_devices`, which is not a flag).
    (["--cluster=4,4,25,2,200", "--min_gpus=3"],
     "`--min_gpus`=3 doubles to 6 GPUs, not a whole number of the --cluster's nodes of 4 GPUs; "
     "use e.g. --min_gpus=4, or --max_gpus=3."),
    (["--cluster=3,2,50,1,100,2000", "--min_gpus=1", "--max_gpus=64"],
     "`--min_gpus`=1 doubles to 4 GPUs"),
    # sweeps that fit the nodes pass that check: the next one they meet is --strategies'
    *((["--cluster=" + cluster, f"--min_gpus={lo}", f"--max_gpus={hi}", "--strategies=x"],
       "`--strategies`")
      for cluster, lo, hi in [("4,4,25,2,200", 3, 3), ("6,4,25,2,200", 6, 48),
                              ("4,4,25,2,200", 1, 64)]),
    # --preset was silently ignored beside --cluster
    (["--preset=dgx-h100", "--cluster=4,4,25,2,200"], "name two clusters; pass one"),
    # no links inside a node: only for nodes of one GPU (which then run; the strategy is bad)
    (["--cluster=2,0,0,1,100"], "field INTRA_LINKS must be a whole number >= 1; got 0"),
    (["--cluster=1,0,0,1,100", "--min_gpus=1", "--strategies=x"], "`--strategies`"),
    # the check that the sweep fits the nodes doubled --min_gpus=0 forever (a hang)
    (["--cluster=4,4,25,2,200", "--min_gpus=0"], "`--min_gpus` must be >= 1; got 0"),
    (["--cluster=6,6,50,4,200", "--min_gpus=-6"], "`--min_gpus` must be >= 1; got -6"),
]

# Every bad-input case of _BAD_INPUT in ONE fresh interpreter (not one Python + JAX start per
# case): the command's own flag parser and main, flags reset between cases.
_BAD_INPUT_RUNNER = """if True:
  import contextlib, io, json, sys
  from absl import flags
  from experiments import _cli, simulate_training as st
  results = []
  for args in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    status = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      try:
        flags.FLAGS.unparse_flags()
        st.main(_cli.flags_parser(st._PROG)(["simulate_training", *args]))
      except SystemExit as e:
        status = e.code
    results.append({"status": status, "stdout": out.getvalue(), "stderr": err.getvalue()})
  print(json.dumps(results))
"""


def test_bad_input_is_one_line_and_exit_2(tmp_path):
  # One case through the real entry point (python -m), the rest through its parser and main.
  out_dir = tmp_path / "out"
  real = run_cli("--preset=nope", f"--out={out_dir}")
  assert real.returncode == 2 and real.stdout == "" and not out_dir.exists()
  lines = real.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(
      "simulate_training: error: Unknown `--preset` 'nope'"), real.stderr
  cases = [[*args, f"--out={out_dir}"] for args, _ in _BAD_INPUT]
  env = dict(os.environ, PYTHONPATH=ROOT)
  done = subprocess.run([sys.executable, "-c", _BAD_INPUT_RUNNER, json.dumps(cases)], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  results = json.loads(done.stdout.strip().splitlines()[-1])
  for (args, message), got in zip(_BAD_INPUT, results, strict=True):
    lines = got["stderr"].strip().splitlines()
    assert got["status"] == 2, (args, got)
    assert len(lines) == 1 and lines[0].startswith("simulate_training: error:"), (args, got)
    assert message in lines[0], (args, lines)
    assert got["stdout"] == "", (args, got)
  assert not out_dir.exists()  # nothing written


def test_zero3_keeps_the_compute_of_parameter_free_layers():
  w = WorkloadSpec("pool", (1e6, 0.0, 1e6), 3.0, layer_compute=(1.0, 1.0, 1.0),
                   optimizer_traffic_bytes_per_param=0)
  topo = Topology.cluster("dgx-h100", 8)
  for stage in (0, 3):
    t = step_time(w, Strategy(stage=stage, bucket_bytes=1), topo, per_device_batch=2,
                  interference=1.0, params=ModelParams())
    assert t.step_s == pytest.approx(6.0 + t.comm_s, rel=1e-9)  # no overlap: the sum


def test_command_line_default_workloads_are_real_models_at_published_rates():
  ok = run_cli("--max_gpus=16", "--strategies=dp")
  assert ok.returncode == 0, ok.stderr
  for title in ("== ResNet-50 (25,557,032 params; 256 per GPU; 2,470 img/s per A100",
                "== BERT-large (336,224,058 params; 64 per GPU; 485.6 seq/s per A100",
                "== 1.3B decoder (", "== 7B decoder (6,738,"):
    assert title in ok.stdout
  assert "3,014 tokens/s per A100 (Llama 2 7B: 184,320 GPU-hours for 2T tokens)" in ok.stdout
  # without --input_workers the input is not modelled: nothing is host-bound
  assert "host-bound" not in ok.stdout and "input: not modelled" in ok.stdout


def test_command_line_input_workers_make_resnet50_host_bound_on_a100():
  # DeepLearningExamples' own configuration (16 DataLoader workers per A100): 8 x 2,470 img/s
  # of GPUs against 16 x loader_rate per GPU from the host: 84% (published: 84.1%).
  ok = run_cli("--workloads=resnet50", "--strategies=dp", "--max_gpus=16", "--input_workers=16")
  assert ok.returncode == 0, ok.stderr
  assert "input: 16 CPU loader workers per GPU" in ok.stdout
  dp8 = next(line for line in ok.stdout.splitlines() if line.startswith("DP ") and " 8 " in line)
  assert "84.2%" in dp8 and "host-bound (input 123.36ms)" in dp8


def test_command_line_cluster_of_your_own_links_equals_the_python_api():
  # 4 GPUs per node on 4 x 25 GB/s links, 2 x 200 Gb/s NICs per node, 1.6 TB/s HBM: the
  # printed efficiencies are Topology.from_hardware's, resized to each count.
  ok = run_cli("--cluster=4,4,25,2,200,1600", "--workloads=resnet50", "--strategies=dp",
               "--min_gpus=4", "--max_gpus=16")
  assert ok.returncode == 0, ok.stderr
  assert ok.stdout.startswith("jaxcoll step model on cluster 4,4,25,2,200,1600:")
  topo = Topology.from_hardware(nodes=1, gpus_per_node=4, intra_links=4, intra_link_GBps=25,
                                inter_links=2, inter_link_Gbps=200, hbm_Bps=1.6e12)
  w = published.DEFAULT_WORKLOADS["resnet50"]
  for n in (4, 8, 16):
    line = next(x for x in ok.stdout.splitlines() if x.startswith("DP ") and f" {n} " in x)
    assert f"{efficiency(w, Strategy(), topo, n, per_device_batch=256):.1%}" in line, line


def test_published_default_workloads_and_their_rates():
  w = published.DEFAULT_WORKLOADS
  assert w["resnet50"].seconds_per_example == pytest.approx(1 / 2470)
  assert w["bert_large"].grad_bytes == 2 and w["bert_large"].num_params == 336_224_058
  assert w["decoder_7b"].num_params == pytest.approx(6.74e9, rel=0.002)  # Llama 2 7B
  assert w["decoder_1.3b"].num_params == pytest.approx(1.31e9, rel=0.005)  # GPT-3 XL
  tokens_per_s = 4096 / w["decoder_7b"].seconds_per_example
  assert tokens_per_s == pytest.approx(2e12 / (184_320 * 3600))
  # the 1.3B decoder runs at the 7B's FLOP/s
  flops_7b = 6 * w["decoder_7b"].num_params * tokens_per_s
  assert 6 * w["decoder_1.3b"].num_params * 2048 / w["decoder_1.3b"].seconds_per_example == (
      pytest.approx(flops_7b))


def test_workload_from_a_flax_model_counts_params_and_xla_flops_per_layer():
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Conv(16, (3, 3))(x)).reshape(x.shape[0], -1)
      return nn.Dense(10)(nn.Dense(32)(x))

  batch = jax.ShapeDtypeStruct((4, 8, 8, 3), jnp.float32)
  w = WorkloadSpec.from_flax(Net(), batch, achieved_flops=1e12)
  assert w.layer_params == (3 * 3 * 3 * 16 + 16, 1024 * 32 + 32, 32 * 10 + 10)  # call order
  # forward + backward FLOPs of each layer: 3x its forward multiply-adds x 2, roughly
  conv_fwd = 2 * 3 * 3 * 3 * 16 * 8 * 8 * 4
  assert 2.5 * conv_fwd < w.layer_compute[0] < 4 * conv_fwd
  assert w.layer_compute[1] > w.layer_compute[0] > w.layer_compute[2]
  assert w.param_bytes == 4 and w.grad_bytes == 4
  assert 1e-7 < w.seconds_per_example < 1e-6  # ~3.5e5 FLOPs per example at 1 TFLOP/s
  topo = Topology.from_hardware(nodes=2, gpus_per_node=8, intra_links=12, intra_link_GBps=25,
                                inter_links=8, inter_link_Gbps=200)
  assert 0 < efficiency(w, Strategy(), topo, 16, per_device_batch=4) < 1
  with pytest.raises(ValueError, match=r"`achieved_flops` must be a finite number > 0; got 0\. "
                                       r"Pass e\.g\. 1\.5e14 \(FLOP/s"):  # was: e.g. 1
    WorkloadSpec.from_flax(Net(), batch, achieved_flops=0)


def test_from_flax_of_a_dict_batch_whose_leaves_differ_in_axis_0_needs_batch_size():
  # The batch was axis 0 of the first leaf in key order: a per-batch "bias" (4,) beside 16
  # examples made FLOPs per example 4x too many, silently.
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  class Net(nn.Module):
    @nn.compact
    def __call__(self, batch):
      return nn.Dense(8)(nn.Dense(32)(batch["x"])) + batch["bias"][0]

  x = jax.ShapeDtypeStruct((16, 8), jnp.float32)
  bias = jax.ShapeDtypeStruct((4,), jnp.float32)
  with pytest.raises(ValueError, match=r"^The leaves of the first of `example_args` differ in "
                                       r"axis 0 \(\[4, 16\]\).*give `batch_size=`"):
    WorkloadSpec.from_flax(Net(), {"bias": bias, "x": x}, achieved_flops=1e12)
  w = WorkloadSpec.from_flax(Net(), {"bias": bias, "x": x}, achieved_flops=1e12, batch_size=16)
  scalar = jax.ShapeDtypeStruct((), jnp.float32)  # an unbatched scalar leaf is not the batch
  per_example = jax.ShapeDtypeStruct((16,), jnp.float32)
  same = WorkloadSpec.from_flax(Net(), {"bias": per_example, "t": scalar, "x": x},
                                achieved_flops=1e12)
  assert w.layer_params == same.layer_params
  assert w.seconds_per_example == pytest.approx(same.seconds_per_example, rel=0.05)


def test_from_flax_charges_a_layer_called_again_every_call():
  # A layer called a second time (a tied embedding's attend at the head; one block shared
  # by every layer, as ALBERT does) got the FLOPs of its first call only: the GPT-style LM's
  # head, 89% of its compute, weighed 0.3% of the step in the overlap timeline.
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  V, D = 512, 64

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return x + nn.Dense(D)(x)

  class Tied(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      embed = nn.Embed(V, D)
      return embed.attend(nn.Dense(D)(embed(tokens)))

  class Shared(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      x, block = nn.Embed(V, D)(tokens), Block()
      for _ in range(3):
        x = block(x)
      return x

  tokens = jax.ShapeDtypeStruct((4, 16), jnp.int32)
  tied = WorkloadSpec.from_flax(Tied(), tokens, achieved_flops=1e12)
  shared = WorkloadSpec.from_flax(Shared(), tokens, achieved_flops=1e12)
  assert tied.layer_params == (V * D, D * D + D)  # the embedding once
  head = 6 * 4 * 16 * D * V  # the attend matmul, forward and backward
  assert 0.95 * head < tied.layer_compute[0] < 1.1 * head  # was its gather alone: ~0
  for w in (tied, shared):  # every FLOP of the model is in some layer
    assert sum(w.layer_compute) == pytest.approx(w.seconds_per_example * 1e12 * 4, rel=1e-3)
  one_call = 6 * 4 * 16 * D * D
  assert 3 * one_call < shared.layer_compute[1] < 3.3 * one_call  # three calls, not one


def test_from_flax_counts_the_parameters_of_blocks_and_scanned_layers():
  # A top-level submodule whose parameters live in its children (a transformer-style block of
  # Dense layers, an nn.scan of blocks) counted 0 parameters: only a module's own variables
  # were read, so every block of a real model weighed nothing in the bucket plan.
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _=None):
      return h + nn.Dense(32)(nn.relu(nn.Dense(128)(h))), None

  class Net(nn.Module):
    remat: bool = False

    @nn.compact
    def __call__(self, x):
      h = nn.Dense(32)(x)
      h, _ = Block()(h)
      scanned = nn.remat(Block) if self.remat else Block
      h, _ = nn.scan(scanned, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=5)()(h, None)
      return nn.Dense(3)(h)

  class Unrolled(nn.Module):  # the same computation, the 5 blocks written out
    @nn.compact
    def __call__(self, x):
      h = nn.Dense(32)(x)
      for _ in range(6):
        h, _ = Block()(h)
      return nn.Dense(3)(h)

  batch = jax.ShapeDtypeStruct((4, 16), jnp.float32)
  w = WorkloadSpec.from_flax(Net(), batch, achieved_flops=1e12)
  block = 32 * 128 + 128 + 128 * 32 + 32
  assert w.layer_params == (16 * 32 + 32, block, 5 * block, 32 * 3 + 3)
  shapes = jax.eval_shape(Net().init, jax.random.key(0), jnp.zeros((4, 16)))
  assert w.num_params == sum(x.size for x in jax.tree.leaves(shapes))
  # XLA's cost analysis counts a loop's body once: the scan weighed one block, and the whole
  # step's compute (seconds_per_example) left out 4 of its 5 blocks.
  assert w.layer_compute[2] == 5 * w.layer_compute[1]
  unrolled = WorkloadSpec.from_flax(Unrolled(), batch, achieved_flops=1e12)
  assert w.seconds_per_example == pytest.approx(unrolled.seconds_per_example, rel=1e-3)
  assert sum(w.layer_compute) == pytest.approx(sum(unrolled.layer_compute), rel=1e-3)
  remat = WorkloadSpec.from_flax(Net(remat=True), batch, achieved_flops=1e12)
  # remat recomputes the blocks' forward in the backward: more FLOPs, still all 5 blocks
  assert remat.layer_compute[2] == 5 * remat.layer_compute[1]
  assert remat.seconds_per_example >= w.seconds_per_example


def test_from_flax_charges_a_models_own_parameters_only_its_own_compute():
  # A model with parameters of its own (a ViT's class token and position embedding) got the
  # WHOLE model's FLOPs as the compute of its first layer (flax's root row counts every
  # child): half of all the compute (51.5% here) ran last in backward, after every other
  # gradient was ready, so the overlap of the gradient buckets looked far better than it is.
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  class TinyViT(nn.Module):
    @nn.compact
    def __call__(self, img):
      x = nn.Conv(24, (4, 4), strides=(4, 4))(img).reshape(img.shape[0], -1, 24)
      cls = self.param("cls", nn.initializers.zeros, (1, 1, 24))
      pos = self.param("pos", nn.initializers.zeros, (1, x.shape[1] + 1, 24))
      x = jnp.concatenate([jnp.broadcast_to(cls, (x.shape[0], 1, 24)), x], axis=1) + pos
      x = x + nn.Dense(24)(nn.gelu(nn.Dense(72)(x)))
      return nn.Dense(10)(x[:, 0])

  batch = jax.ShapeDtypeStruct((2, 16, 16, 3), jnp.float32)
  w = WorkloadSpec.from_flax(TinyViT(), batch, achieved_flops=1e12)
  assert w.layer_params == (24 + 17 * 24, 4 * 4 * 3 * 24 + 24, 24 * 72 + 72, 72 * 24 + 24,
                            24 * 10 + 10)
  total = sum(w.layer_compute)
  assert total == pytest.approx(w.seconds_per_example * 1e12 * 2, rel=1e-6)  # the whole VJP
  assert 0 < w.layer_compute[0] < 0.1 * total  # its gelu, concatenate and adds, not everything
  # A batch given as a dict of arrays (axis 0 of its first leaf is the batch) was refused.

  class DictNet(nn.Module):
    @nn.compact
    def __call__(self, b):
      return nn.Dense(3)(b["x"])

  batch = {"x": jax.ShapeDtypeStruct((5, 19), jnp.float32)}
  d = WorkloadSpec.from_flax(DictNet(), batch, achieved_flops=1e12)
  assert d.layer_params == (19 * 3 + 3,) and d.seconds_per_example > 0
  with pytest.raises(ValueError, match="must start with a batched array, or a pytree"):
    WorkloadSpec.from_flax(DictNet(), {"x": jnp.float32(1)}, achieved_flops=1e12)


def test_simulate_training_strategies_are_the_kinds_names_and_hybrid_is_zero3():
  """experiments.simulate_training maps --strategy through jaxcoll.train.kinds (no copy).

  In a fresh interpreter: the experiments' absl flags (``--preset``) are defined at
  import, and another experiments module imported by this worker defines them too."""
  code = """if True:
    from experiments import simulate_training
    from jaxcoll.train import kinds
    from jaxcoll.scale.step_model import StepStrategy
    assert simulate_training._STRATEGIES == tuple(kinds.STAGES_WITH_HYBRID)
    assert kinds.STAGES_WITH_HYBRID == {**kinds.STAGES, "hybrid": 3}
    for name, stage in kinds.STAGES_WITH_HYBRID.items():
      s = simulate_training._strategy(name, 2**20, "native")
      assert isinstance(s, StepStrategy), s
      assert (s.stage, s.hybrid) == (stage, name == "hybrid"), (name, s)
    print("ok")
  """
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
    [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300, check=False)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]

def test_from_flax_counts_every_backward_matmul_of_an_nnx_model():
  """An nnx model's FLOPs came from the gradient of sum(output): a cotangent of ones, which
  XLA folds into the last layer's backward matmuls (they become sums and count ~0), so a
  two-layer MLP counted 0.67x its matmuls and a user's nnx LM 10% less than the same linen
  model. The count is a training step's: forward 2P per layer, the weight gradient 2P per
  layer, the input gradient 2P for every layer but the first."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(256, 1024, use_bias=False, rngs=rngs)
      self.b = nnx.Linear(1024, 256, use_bias=False, rngs=rngs)

    def __call__(self, x):
      return self.b(jax.nn.relu(self.a(x)))

  batch = jnp.zeros((32, 256))
  w = WorkloadSpec.from_flax(MLP(nnx.Rngs(0)), batch, achieved_flops=1e12)
  p1 = p2 = 256 * 1024
  per_example = w.seconds_per_example * 1e12
  assert per_example == pytest.approx(4 * p1 + 6 * p2, rel=0.02), per_example / (4 * p1 + 6 * p2)


def test_efficiency_of_a_three_level_topology_names_efficiency_not_resized():
  """A user's pod x node x local topology: `efficiency` said "`resized` needs a topology of one
  or two levels", a method they never called; at its own size the run side is not resized."""
  pods = Topology((Level("pod", 2, 5e-6, 1e9, math.inf), Level("node", 2, 2e-6, 1e10, math.inf),
                   Level("local", 4, 1e-6, 1e11, math.inf)), name="pods")
  w = WorkloadSpec.from_numbers("m", num_params=1e8, flops_per_example=6e8 * 128,
                                achieved_flops=1e14)
  assert step_time(w, Strategy(), pods, per_device_batch=8).step_s > 0
  with pytest.raises(ValueError, match=r"^`preset` 'pods' has 3 levels and cannot be resized to "
                                       r"1 devices \(efficiency, scaling and knee"):
    efficiency(w, Strategy(), pods, 16, per_device_batch=8)
