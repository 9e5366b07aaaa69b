"""Profiler traces (`config.profile_steps`) and the communication share."""

import glob
import gzip
import json
import os

import jax
import jax.numpy as jnp
import jobs
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import minimal
from jaxcoll.observe import comm_share
from jaxcoll.comm_model import cost, tuning
from jaxcoll.runtime import devices
from jaxcoll.comm_model.topology import Topology
from jaxcoll.run import loop, profiling


def _smoke(**overrides):
  config = minimal.get_config("smoke")  # 4 steps, rows at steps 2 and 4
  for key, value in overrides.items():
    setattr(config, key, value)
  return config


def _runs(workdir):
  return sorted(glob.glob(os.path.join(workdir, "profile", "plugins", "profile", "*")))


def _perfetto_steps(run_dir):
  with gzip.open(os.path.join(run_dir, "perfetto_trace.json.gz"), "rt") as f:
    events = json.load(f)["traceEvents"]
  return sorted(int(e["args"]["step_num"]) for e in events
                if e.get("name") == profiling.STEP_NAME and e.get("ph") == "X")


def _xplane_steps(run_dir):
  """The step annotations as the xplane protobuf (what xprof reads) holds them."""
  (path,) = glob.glob(os.path.join(run_dir, "*.xplane.pb"))
  data = jax.profiler.ProfileData.from_file(path)
  return sorted(int(dict(event.stats)["step_num"]) for plane in data.planes
                for line in plane.lines for event in line.events
                if event.name == profiling.STEP_NAME)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
  """A 4-step run that traces steps 2..3 and saves its last step (to resume)."""
  workdir = str(tmp_path_factory.mktemp("traced"))
  summary = loop.train_and_evaluate(_smoke(profile_steps="2:3", checkpoint_every=4), workdir)
  return workdir, summary


def test_trace_holds_the_named_steps_only(traced):
  workdir, _ = traced
  (run,) = _runs(workdir)
  assert _perfetto_steps(run) == [2, 3]  # not 1 or 4
  assert _xplane_steps(run) == [2, 3]


def test_summary_has_the_communication_share(traced):
  workdir, summary = traced
  written = jobs.summary(workdir)
  for key in ("comm_time_estimate_s", "comm_share_estimate", "comm_share_measured"):
    assert written[key] == summary[key], key
  assert summary["comm_time_estimate_s"] > 0
  assert 0 < summary["comm_share_estimate"] <= 1
  assert 0 < summary["comm_share_measured"] <= 1
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  train_rows = [r for r in rows if "loss" in r]
  assert all("comm_share_estimate" not in r and "comm_share_measured" not in r for r in rows)
  # The estimate over the median step time of the rows after the first (one here).
  assert summary["comm_share_estimate"] == pytest.approx(
      summary["comm_time_estimate_s"] / train_rows[-1]["step_time_s"])


def test_resumed_run_past_the_range_traces_nothing(traced, tmp_path):
  """It measures nothing either: the first attempt's measured share stays, named as its."""
  workdir, first = traced
  before = _runs(workdir)
  summary = loop.train_and_evaluate(_smoke(profile_steps="2:3", checkpoint_every=4, steps=6),
                                    workdir)
  assert summary["start_step"] == 4 and summary["steps"] == 6
  assert _runs(workdir) == before
  assert summary["comm_share_estimate"] > 0
  assert summary["comm_share_measured"] == first["comm_share_measured"]
  assert summary["comm_share_measured_from"] == {"attempt": 1, "steps": [2, 3]}


def test_resumed_run_traces_what_is_left_of_the_range(tmp_path):
  assert profiling.StepProfiler((2, 5), str(tmp_path), start_step=3).first == 4
  assert profiling.StepProfiler((2, 5), str(tmp_path), start_step=5).first is None
  assert profiling.StepProfiler(None, str(tmp_path)).first is None
  assert not os.listdir(tmp_path)  # nothing is written before a trace starts


def test_a_traced_step_that_raises_stops_the_trace(tmp_path):
  with pytest.raises(RuntimeError, match="boom"):
    with profiling.StepProfiler((1, 3), str(tmp_path)) as profiler:
      with profiler.step(1):
        raise RuntimeError("boom")
  assert os.path.exists(profiler.trace_path)  # what was traced is kept
  jax.profiler.start_trace(str(tmp_path / "again"))  # no trace is left running
  jax.profiler.stop_trace()


def test_every_process_of_a_job_traces_into_its_own_directory(monkeypatch):
  assert profiling.profile_dir("/w") == os.path.join("/w", "profile")
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  assert profiling.profile_dir("/w") == os.path.join("/w", "profile", "p1")


BAD = [
    ("no_colon", "5", 'use "A:B"'),
    ("reversed", "3:2", "use --config.profile_steps=2:3"),
    ("zero", "0:4", "steps count from 1; use --config.profile_steps=1:4"),
    ("past_steps", "2:9", "step 9 is past the run's last step (4)"),
    ("words", "a:b", 'use "A:B"'),
]


@pytest.mark.parametrize("value,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_profile_steps_are_config_errors(value, message, tmp_path):
  with pytest.raises(loop.ConfigError) as e:
    loop.train_and_evaluate(_smoke(profile_steps=value), str(tmp_path))
  assert str(e.value).startswith(f"`config.profile_steps`={value!r}: ")
  assert message in str(e.value) and "--config.profile_steps=" in str(e.value)
  assert not os.listdir(tmp_path)


def test_bad_profile_steps_on_the_command_line_is_one_line_and_exit_2(tmp_path):
  out = jobs.train_forked("--config=configs/minimal.py:smoke", "--config.profile_steps=3:2",
                          f"--workdir={tmp_path}")
  assert out.returncode == 2, out.stderr[-2000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and "`config.profile_steps`='3:2'" in lines[0], out.stderr
  assert not os.listdir(tmp_path)


def _psum_program(n):
  mesh = devices.flat_mesh(8)
  f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "data"), mesh=mesh,
                            in_specs=P("data"), out_specs=P("data")))
  return f.lower(jnp.zeros(8 * n, jnp.float32)).compile()


def test_estimate_of_one_all_reduce_is_its_cost_model_time():
  compiled = _psum_program(4096)  # each device all-reduces 4096 float32 = 16 KiB
  estimate = comm_share.estimate_comm_time(compiled)
  (op,) = estimate.ops
  assert (op.op.kind, op.op.size_bytes, op.op.group_size) == ("all-reduce", 4096 * 4, 8)
  expected = cost.estimate("all_reduce", 4096 * 4, tuning.default_topology(), "native")
  assert estimate.seconds == pytest.approx(expected, rel=1e-12) and expected > 0
  slow = Topology.preset("cpu-sim").with_level("local", bandwidth_Bps=1e6)
  assert comm_share.estimate_comm_time(compiled.as_text(), slow).seconds == pytest.approx(
      cost.estimate("all_reduce", 4096 * 4, slow, "native"), rel=1e-12)


def test_estimate_is_zero_without_collectives():
  compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(64)).compile()
  estimate = comm_share.estimate_comm_time(compiled)
  assert estimate.ops == () and estimate.seconds == 0.0
  assert comm_share.comm_share(estimate.seconds, 0.01) == 0.0


def test_estimate_of_a_ppermute_is_one_step():
  mesh = devices.flat_mesh(8)
  perm = [(i, (i + 1) % 8) for i in range(8)]
  f = jax.jit(jax.shard_map(lambda v: jax.lax.ppermute(v, "data", perm), mesh=mesh,
                            in_specs=P("data"), out_specs=P("data")))
  topo = Topology.preset("cpu-sim")
  estimate = comm_share.estimate_comm_time(f.lower(jnp.zeros(8 * 1000)).compile(), topo)
  (level,) = topo.levels
  assert estimate.seconds == pytest.approx(
      topo.launch_s + level.latency_s + 4000 / level.bandwidth_Bps, rel=1e-12)


def test_estimate_prices_a_group_on_the_levels_it_crosses():
  # A psum over the `node` axis of a (node, local) mesh is a group of 2 that crosses the
  # nodes; it was priced by its size alone, as 2 devices inside a node (NVLink), 7x under
  # what the node links cost on dgx-h100 (0.199 ms for 1.45 ms at 64 MiB).
  mesh = devices.node_local_mesh(2, 4)
  topo = Topology.preset("dgx-h100", nodes=2, local=4)
  nbytes = 4 << 20  # per device: big enough that the links, not the latencies, decide
  seconds = {}
  for axis in ("node", "local"):
    f = jax.jit(jax.shard_map(lambda v, a=axis: jax.lax.psum(v, a), mesh=mesh,
                              in_specs=P(("node", "local")), out_specs=P(("node", "local"))))
    x = jax.ShapeDtypeStruct((8 * nbytes // 4,), jnp.float32)
    estimate = comm_share.estimate_comm_time(f.lower(x).compile(), topo)
    (op,) = estimate.ops
    assert (op.op.group_size, op.op.size_bytes) == (mesh.shape[axis], nbytes)
    seconds[axis] = estimate.seconds
    assert estimate.seconds == pytest.approx(cost.estimate(
        "all_reduce", nbytes, topo.for_axes((axis,), (mesh.shape[axis],)), "native"), rel=1e-12)
  assert seconds["node"] > 2 * seconds["local"]  # the slow links, though the smaller group


def test_estimate_prices_a_gspmd_reduction_on_the_levels_it_crosses():
  # The same psums as GSPMD writes them (jit with NamedSharding, as FSDP / DP users shard):
  # XLA prints their groups in its mesh-axes form (replica_groups=mesh['axis_0'=2,
  # 'axis_1'=4] {'axis_0'}), which comm_report read as group sizes only (groups=None),
  # so the sum over `node` was priced as 2 devices inside a node (NVLink), 7x under.
  mesh = devices.node_local_mesh(2, 4)
  topo = Topology.preset("dgx-h100", nodes=2, local=4)
  x = jax.ShapeDtypeStruct((2, 4, 1 << 20), jnp.float32,
                           sharding=NamedSharding(mesh, P("node", "local")))
  for axis, keep in (("node", "local"), ("local", "node")):
    f = jax.jit(lambda a, d=("node", "local").index(axis): a.sum(d),
                out_shardings=NamedSharding(mesh, P(keep)))
    (op,) = comm_share.estimate_comm_time(f.lower(x).compile(), topo).ops
    assert op.op.group_size == mesh.shape[axis]
    assert op.op.groups == tuple(map(tuple, np.moveaxis(
        np.arange(8).reshape(2, 4), ("node", "local").index(axis), -1).reshape(-1, op.op.group_size)))
    assert op.seconds == pytest.approx(cost.estimate(
        "all_reduce", op.op.size_bytes, topo.for_axes((axis,), (mesh.shape[axis],)), "native"),
        rel=1e-12)


def test_estimate_prices_a_ppermute_on_the_level_its_pairs_cross():
  # A ring step over the `local` axis of a (node, local) mesh stays inside the nodes; every
  # collective-permute was priced on the slowest level (the links between nodes).
  mesh = devices.node_local_mesh(2, 4)
  topo = Topology.preset("dgx-h100", nodes=2, local=4)
  nbytes = 4 << 20
  seconds = {}
  for axis in ("node", "local"):
    n = mesh.shape[axis]
    perm = [(i, (i + 1) % n) for i in range(n)]
    f = jax.jit(jax.shard_map(lambda v, a=axis, p=perm: jax.lax.ppermute(v, a, p), mesh=mesh,
                              in_specs=P(("node", "local")), out_specs=P(("node", "local"))))
    x = jax.ShapeDtypeStruct((8 * nbytes // 4,), jnp.float32)
    (op,) = comm_share.estimate_comm_time(f.lower(x).compile(), topo).ops
    level = topo.level(axis)
    seconds[axis] = op.seconds
    assert op.seconds == pytest.approx(
        topo.launch_s + level.latency_s + nbytes / level.bandwidth_Bps, rel=1e-12)
  assert seconds["node"] > 5 * seconds["local"]


def test_share_and_bad_arguments():
  assert comm_share.comm_share(0.002, 0.01) == pytest.approx(0.2)
  assert comm_share.comm_share(0.002, None) is None
  assert comm_share.comm_share(0.002, 0.0) is None
  with pytest.raises(TypeError, match="`compiled` must be a jax.stages.Compiled"):
    comm_share.estimate_comm_time(3)
  with pytest.raises(TypeError, match="`topology` must be a jaxcoll.topology.Topology"):
    comm_share.estimate_comm_time("", topology="cpu-sim")


def test_measured_share_counts_collectives_inside_the_steps(tmp_path):
  compiled = _psum_program(16)
  (name,) = [e.op.name for e in comm_share.estimate_comm_time(compiled).ops]
  module = compiled.as_text().split("HloModule ", 1)[1].split(",", 1)[0].split()[0]

  def op(device, ts, dur, hlo_op=name, hlo_module=module):
    return {"ph": "X", "name": hlo_op, "ts": ts, "dur": dur, "pid": 1, "tid": device,
            "args": {"hlo_op": hlo_op, "hlo_module": hlo_module, "device_ordinal": device}}

  events = [
      {"ph": "X", "name": "train", "ts": 0, "dur": 100, "args": {"step_num": "2"}},
      {"ph": "X", "name": "train", "ts": 200, "dur": 100, "args": {"step_num": "3"}},
      op(0, 10, 20), op(1, 10, 40),  # step 2: 20 and 40 us
      op(0, 290, 20), op(1, 210, 20),  # step 3: 10 us inside (ends at 310), 20 us
      op(0, 150, 30),  # between the steps: not counted
      op(0, 50, 30, hlo_op="add_fusion"),  # not a collective
      op(1, 50, 30, hlo_module="jit_eval"),  # another program
  ]
  path = str(tmp_path / "perfetto_trace.json.gz")
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": events}, f)
  measured = comm_share.measured_comm_share(path, compiled)
  # Device 0: 30 us, device 1: 60 us over 200 us of steps -> mean 45 / 200.
  assert measured == pytest.approx({"comm_share_measured": 45 / 200,
                                    "comm_time_measured_s": 22.5e-6,
                                    "traced_step_time_s": 100e-6, "traced_steps": 2})
  assert comm_share.measured_comm_share(path, compiled, step_name="eval") is None


def _step_through(profiler, steps):
  f = jax.jit(lambda x: x @ x)
  x = jnp.ones((16, 16))
  for n in steps:
    with profiler.step(n):
      jax.block_until_ready(f(x))


def _traces(workdir):
  """{directory under DIR/profile: the steps of each trace there}."""
  found = {}
  for path in sorted(glob.glob(os.path.join(workdir, "profile", "**", "perfetto_trace.json.gz"),
                               recursive=True)):
    run = os.path.dirname(path)
    where = os.path.relpath(run, os.path.join(workdir, "profile")).split(os.sep)[0]
    found.setdefault(where, []).append(_perfetto_steps(run))
  return found


def test_a_rollback_during_a_trace_ends_it_and_traces_the_replay_apart(tmp_path):
  """A rollback while steps 2..4 were traced: the replay's step 2 started a second trace on
  the running one, and the run died (`RuntimeError: Profile has already been started`)."""
  with profiling.StepProfiler((2, 4), str(tmp_path)) as profiler:
    _step_through(profiler, [1, 2, 3])
    profiler.restart(1, rollback=1)  # an incident after step 3: back to checkpoint 1
    _step_through(profiler, [2, 3, 4])
  assert _traces(tmp_path) == {"plugins": [[2, 3]], "rollback_1": [[2, 3, 4]]}
  assert profiler.trace_path.startswith(str(tmp_path / "profile" / "rollback_1"))


def test_a_rollback_after_a_trace_traces_the_replay_into_its_own_directory(tmp_path):
  """Steps 2..3 traced, then a rollback to checkpoint 1 replays them within the same second:
  the second trace was written over the first (one directory named by the second)."""
  with profiling.StepProfiler((2, 3), str(tmp_path)) as profiler:
    _step_through(profiler, [1, 2, 3, 4])
    profiler.restart(1, rollback=1)
    _step_through(profiler, [2, 3, 4])
    profiler.restart(3, rollback=2)  # to a checkpoint past the range: nothing more to trace
    _step_through(profiler, [4])
  assert _traces(tmp_path) == {"plugins": [[2, 3]], "rollback_1": [[2, 3]]}


def test_a_rollback_into_the_range_traces_the_rest_of_it(tmp_path):
  with profiling.StepProfiler((2, 5), str(tmp_path)) as profiler:
    _step_through(profiler, [1, 2, 3, 4])
    profiler.restart(3, rollback=1)  # back to checkpoint 3: steps 4..5 trained again
    _step_through(profiler, [4, 5])
  assert _traces(tmp_path) == {"plugins": [[2, 3, 4]], "rollback_1": [[4, 5]]}


def test_a_run_that_rolls_back_keeps_one_trace_per_stretch(tmp_path):
  """Through the loop: a loss spike at step 25 rolled back to checkpoint 20, then one at
  step 21 of the replay (batch 26) again: profile_steps 22:24 traced by the first stretch and
  by the kept one, each in its own directory (the two traces were written into one
  directory of the same second, or the run died on a second start_trace)."""
  from configs import default  # noqa: PLC0415

  config = default.get_config("smoke")
  config.steps, config.checkpoint_every, config.algorithm = 27, 5, "ring"
  config.corrupt_batches, config.profile_steps, config.log_every = "25:27", "22:24", 100
  config.incidents.loss_spike, config.incidents.skip_batches = "rollback", 4
  config.incidents.spike_min_steps, config.incidents.defer_reads = 10, "off"
  summary = loop.train_and_evaluate(config, str(tmp_path))
  assert summary["incidents"]["rollbacks"] == 2  # the second at step 21: before the range
  assert _traces(tmp_path) == {"plugins": [[22, 23, 24]], "rollback_2": [[22, 23, 24]]}
  assert summary["comm_share_measured"] > 0  # from the kept stretch's trace
