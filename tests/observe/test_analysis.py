"""Tests of jaxcoll.analysis: the HLO communication report.

Volumes are checked against each algorithm's textbook bytes per device. Every
jaxcoll algorithm other than ``native`` is unrolled ``ppermute`` steps, which
the XLA CPU backend keeps as one ``collective-permute`` each (it does not
combine them), each charged its operand size ``S`` per sending device.
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll
from jaxcoll.observe import analysis

K = 256  # float32 elements per device: S = 1 KiB, divisible by 2n for n <= 8
S = K * 4


def _shard_map(fn, mesh, axes="data"):
  spec = P(axes)
  return jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec)


def _report(fn, mesh, per_device, axes="data", dtype=jnp.float32):
  n = mesh.devices.size
  x = jnp.zeros((n * per_device,), dtype)
  return analysis.comm_report(_shard_map(fn, mesh, axes), x)


def _all_reduce_report(algorithm, n=8, per_device=K):
  mesh = jaxcoll.devices.flat_mesh(n)
  return _report(
      lambda v: jaxcoll.all_reduce(v, "data", algorithm=algorithm), mesh, per_device
  )


@pytest.fixture(scope="module")
def psum_report(devices):
  del devices
  return _report(lambda v: lax.psum(v, "data"), jaxcoll.devices.flat_mesh(8), K)


# ----------------------------------------------------------------------------
# Real compiles.


def test_native_psum_is_one_all_reduce(psum_report):
  (op,) = psum_report.ops
  assert (op.kind, op.dtype, op.shape) == ("all-reduce", "f32", (K,))
  assert (op.group_size, op.num_groups, op.executions) == (8, 1, 1)
  assert op.size_bytes == S
  assert op.bytes_sent_per_device == 2 * 7 / 8 * S
  assert psum_report.total_bytes_sent_per_device == 2 * 7 / 8 * S
  assert psum_report.num_devices == 8


# Textbook bytes per device for S bytes on n devices. The double binary tree
# (two binomial trees, S/2 each, reduce then broadcast) makes the busiest
# device send 2S: S/2 up and S/2 down in each of the two trees. The report
# counts each collective-permute only for its senders, so it finds that
# maximum instead of charging every device for every step (6S).
ALL_REDUCE_VOLUME = {
    ("ring", 8): 2 * 7 / 8 * S,
    ("bidirectional_ring", 8): 2 * 7 / 8 * S,
    ("recursive_doubling", 8): math.log2(8) * S,
    ("halving_doubling", 8): 2 * 7 / 8 * S,
    ("halving_doubling", 4): 2 * 3 / 4 * S,
    ("tree", 8): 2 * S,
}


@pytest.mark.parametrize(
    "algorithm,n", list(ALL_REDUCE_VOLUME), ids=[f"{a}-n{n}" for a, n in ALL_REDUCE_VOLUME]
)
def test_all_reduce_algorithm_volume(devices, algorithm, n):
  del devices
  report = _all_reduce_report(algorithm, n)
  assert {op.kind for op in report.ops} == {"collective-permute"}
  assert report.total_bytes_sent_per_device == ALL_REDUCE_VOLUME[(algorithm, n)]


def test_ring_all_reduce_odd_size_within_padding(devices):
  del devices
  n, k = 8, 1001  # ring pads 1001 elements to 8 chunks of 126
  report = _all_reduce_report("ring", n, per_device=k)
  textbook = 2 * (n - 1) / n * k * 4
  assert report.total_bytes_sent_per_device == 2 * (n - 1) * 126 * 4
  # Each of the 2(n-1) steps sends ceil(k/n) elements instead of k/n.
  assert abs(report.total_bytes_sent_per_device - textbook) <= 2 * (n - 1) * 4


def test_hierarchical_all_reduce_volume(devices):
  del devices
  m, l = 2, 4
  report = _report(
      lambda v: jaxcoll.all_reduce(v, ("node", "local"), algorithm="hierarchical"),
      jaxcoll.devices.node_local_mesh(m, l),
      K,
      axes=("node", "local"),
  )
  expected = (l - 1) / l * S + 2 * (m - 1) / m * S / l + (l - 1) / l * S
  assert report.total_bytes_sent_per_device == expected  # 1.75 S


@pytest.mark.parametrize(
    "collective,call",
    [
        ("reduce_scatter", lambda v: jaxcoll.reduce_scatter(v, "data", algorithm="ring")),
        ("all_gather", lambda v: jaxcoll.all_gather(v, "data", algorithm="ring")),
        ("all_to_all", lambda v: jaxcoll.all_to_all(v, "data", 0, 0, algorithm="pairwise")),
    ],
    ids=["reduce_scatter-ring", "all_gather-ring", "all_to_all-pairwise"],
)
def test_flat_collective_volumes(devices, collective, call):
  del devices
  n = 8
  report = _report(call, jaxcoll.devices.flat_mesh(n), K)
  # S_full: the input for reduce-scatter and all-to-all, the gathered output
  # (n x the input) for all-gather.
  s_full = n * S if collective == "all_gather" else S
  assert {op.kind for op in report.ops} == {"collective-permute"}
  assert report.total_bytes_sent_per_device == (n - 1) / n * s_full


def test_native_ops_use_their_kind_costs(devices):
  del devices
  n = 8

  def fn(v):
    rs = jaxcoll.reduce_scatter(v, "data", algorithm="native")
    ag = jaxcoll.all_gather(v, "data", algorithm="native")
    a2a = jaxcoll.all_to_all(v, "data", 0, 0, algorithm="native")
    return jnp.concatenate([jnp.tile(rs, n), ag[:K], a2a])

  report = _report(fn, jaxcoll.devices.flat_mesh(n), K)
  by_kind = {op.kind: op for op in report.ops}
  assert sorted(by_kind) == ["all-gather", "all-to-all", "reduce-scatter"]
  assert by_kind["reduce-scatter"].size_bytes == S  # the full input
  assert by_kind["all-gather"].size_bytes == n * S  # the gathered output
  assert by_kind["all-to-all"].size_bytes == S  # summed over its n arrays
  for op in report.ops:
    assert op.group_size == n
    assert op.bytes_sent_per_device == (n - 1) / n * op.size_bytes
  summary = report.by_kind()
  assert summary["all-gather"] == {
      "ops": 1,
      "executions": 1,
      "bytes_sent_per_device": (n - 1) * S,
  }


def test_loops_multiply_executions(devices):
  del devices
  n = 8
  ring = [(i, (i + 1) % n) for i in range(n)]

  def fn(v):
    v = lax.fori_loop(
        0, 5, lambda i, c: jaxcoll.all_reduce(c, "data", algorithm="native") * 0.5, v
    )
    step = lambda c, _: (lax.ppermute(c, "data", ring), None)  # noqa: E731
    return lax.scan(step, v, None, length=7)[0]

  report = _report(fn, jaxcoll.devices.flat_mesh(n), K)
  by_kind = {op.kind: op for op in report.ops}
  assert by_kind["all-reduce"].executions == 5
  assert by_kind["collective-permute"].executions == 7
  assert report.by_kind()["all-reduce"]["bytes_sent_per_device"] == 5 * 2 * 7 / 8 * S
  assert report.total_bytes_sent_per_device == 5 * 2 * 7 / 8 * S + 7 * S


def test_conditional_counts_each_branch_once(devices):
  del devices
  n = 8

  def fn(v):
    return lax.cond(
        v[0] > 0,
        lambda c: jaxcoll.all_reduce(c, "data", algorithm="native"),
        lambda c: lax.ppermute(c, "data", [(i, (i + 1) % n) for i in range(n)]),
        v,
    )

  report = _report(fn, jaxcoll.devices.flat_mesh(n), K)
  assert sorted(op.kind for op in report.ops) == ["all-reduce", "collective-permute"]
  assert all(op.executions == 1 and "conditional" in op.note for op in report.ops)
  assert report.total_bytes_sent_per_device == 2 * 7 / 8 * S + S


def test_gspmd_jit_with_named_sharding_is_reported(devices):
  del devices
  mesh = jaxcoll.devices.flat_mesh(8)
  x = jax.device_put(jnp.zeros((8 * K,), jnp.float32), NamedSharding(mesh, P("data")))
  report = analysis.comm_report(jax.jit(jnp.sum), x)
  (op,) = report.ops
  assert (op.kind, op.group_size, op.shape, op.size_bytes) == ("all-reduce", 8, (), 4)
  assert report.total_bytes_sent_per_device == 2 * 7 / 8 * 4


def test_gspmd_gradient_all_reduce_is_combined(devices):
  """A data-parallel gradient: XLA combines both gradients in one all-reduce."""
  del devices
  mesh = jaxcoll.devices.flat_mesh(8)

  def loss(w, batch):
    return jnp.mean((batch @ w["kernel"] + w["bias"]) ** 2)

  params = {"kernel": jnp.zeros((16, 8)), "bias": jnp.zeros((8,))}
  batch = jax.device_put(jnp.zeros((64, 16)), NamedSharding(mesh, P("data")))
  report = analysis.comm_report(jax.grad(loss), params, batch)
  param_bytes = (16 * 8 + 8) * 4
  assert [op.kind for op in report.ops] == ["all-reduce"]
  assert report.ops[0].size_bytes == param_bytes
  assert report.total_bytes_sent_per_device == 2 * 7 / 8 * param_bytes


def test_pmap_psum(devices):
  del devices
  f = jax.pmap(lambda v: lax.psum(v, "i"), axis_name="i")
  report = analysis.comm_report(f, jnp.zeros((8, K), jnp.float32))
  assert [(op.kind, op.group_size) for op in report.ops] == [("all-reduce", 8)]
  assert report.total_bytes_sent_per_device == 2 * 7 / 8 * S


def test_no_collectives_gives_an_empty_report(devices):
  del devices
  report = analysis.comm_report(lambda v: v * 2, jnp.zeros((K,)))
  assert report.ops == ()
  assert report.total_bytes_sent_per_device == 0
  assert report.by_kind() == {}
  assert "total" in str(report)


def test_a_lowered_or_compiled_program_is_read_as_it_is(devices):
  # Before: a Compiled gave JAX's "input pytree does not match" TypeError, a Lowered
  # "Expected a callable value".
  del devices
  f = jax.jit(_shard_map(lambda v: lax.psum(v, "data"), jaxcoll.devices.flat_mesh(8)))
  x = jnp.zeros((8 * K,), jnp.float32)
  lowered = f.lower(x)
  for program in (lowered, lowered.compile()):
    report = analysis.comm_report(program)
    assert [(op.kind, op.group_size) for op in report.ops] == [("all-reduce", 8)]
    assert report.total_bytes_sent_per_device == 2 * 7 / 8 * S
  with pytest.raises(ValueError, match="already a Compiled program.*without arguments"):
    analysis.comm_report(lowered.compile(), x)
  with pytest.raises(TypeError, match="`fn` must be a function"):
    analysis.comm_report(3)
  from jaxcoll.observe import comm_share  # noqa: PLC0415
  assert len(comm_share.estimate_comm_time(lowered).ops) == 1  # not StableHLO text


def test_lowering_errors_propagate():
  with pytest.raises(TypeError, match="dot_general"):
    analysis.comm_report(lambda a, b: a @ b, jnp.zeros((2, 3)), jnp.zeros((4, 5)))


def test_table_and_json(psum_report):
  table = str(psum_report)
  lines = table.splitlines()
  assert any(line.startswith("all-reduce") and "1,792" in line for line in lines)
  assert lines[-1].startswith("total") and "1,792" in lines[-1]
  for column in ("kind", "dtype", "shape", "group", "executions", "bytes/device"):
    assert column in table
  data = json.loads(json.dumps(psum_report.to_dict()))
  assert data["total_bytes_sent_per_device"] == 1792
  assert data["ops"][0]["shape"] == [K]
  assert data["by_kind"]["all-reduce"]["ops"] == 1


# ----------------------------------------------------------------------------
# Hand-written HLO: forms this CPU build does not emit (GPU async pairs, iota
# and mesh replica groups, loops without a known trip count).

_ADD = """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""

ASYNC_HLO = (
    "HloModule jit_step, is_scheduled=true, num_partitions=8\n"
    + _ADD
    + """
%wrapped_reduce_scatter (p: f32[64]) -> f32[8] {
  %p = f32[64]{0} parameter(0)
  ROOT %rs = f32[8]{0} reduce-scatter(%p), channel_id=3, replica_groups=[1,8]<=[8], \
use_global_device_ids=true, dimensions={0}, to_apply=%add
}

ENTRY %main (x: f32[64]) -> f32[64] {
  %x = f32[64]{0} parameter(0), sharding={devices=[8]<=[8]}
  %ar-start = f32[64]{0} all-reduce-start(%x), channel_id=1, replica_groups=[2,4]<=[8], \
use_global_device_ids=true, to_apply=%add, metadata={op_name="f, replica_groups={{0,1}} }"}
  %ar-done = f32[64]{0} all-reduce-done(%ar-start)
  %slice = f32[32]{0} slice(%ar-done), slice={[0:32]}
  %ag-start = (f32[32]{0}, f32[64]{0}) all-gather-start(%slice), channel_id=2, \
replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true
  %ag-done = f32[64]{0} all-gather-done(%ag-start)
  %rs-start = ((f32[64]{0}), f32[8]{0}, s32[]) async-start(%ag-done), calls=%wrapped_reduce_scatter
  %rs-done = f32[8]{0} async-done(%rs-start), calls=%wrapped_reduce_scatter
  %cp-start = (f32[64]{0}, f32[64]{0}, u32[], u32[]) collective-permute-start(%x), channel_id=4, \
source_target_pairs={{0,1},{1,0}}
  ROOT %cp-done = f32[64]{0} collective-permute-done(%cp-start)
}
"""
)


def test_async_pairs_and_iota_groups():
  report = analysis.report_from_hlo(ASYNC_HLO)
  got = [(op.kind, op.group_size, op.num_groups, op.size_bytes) for op in report.ops]
  assert got == [
      ("all-reduce", 4, 2, 256),  # [2,4]<=[8]: 2 groups of 4
      ("all-gather", 2, 4, 256),  # [4,2]<=[2,4]T(1,0): 4 groups of 2
      ("reduce-scatter", 8, 1, 256),  # inside async-start; S = 8 x 32 bytes
      ("collective-permute", 2, 1, 256),  # 2 source-target pairs
  ]
  assert [op.bytes_sent_per_device for op in report.ops] == [384, 128, 224, 256]
  assert report.total_bytes_sent_per_device == 992
  assert report.num_devices == 8


def test_groups_are_the_device_positions_the_hlo_lists():
  # Which devices a group holds (comm_share prices a group on the links it crosses).
  report = analysis.report_from_hlo(ASYNC_HLO)
  assert [op.groups for op in report.ops] == [
      ((0, 1, 2, 3), (4, 5, 6, 7)),  # [2,4]<=[8]
      ((0, 4), (1, 5), (2, 6), (3, 7)),  # [4,2]<=[2,4]T(1,0)
      ((0, 1, 2, 3, 4, 5, 6, 7),),  # [1,8]<=[8]
      ((0, 1), (1, 0)),  # collective-permute: its (source, target) pairs
  ]
  listed = ASYNC_HLO.replace("replica_groups=[2,4]<=[8]", "replica_groups={{0,2,4,6},{1,3,5,7}}")
  assert analysis.report_from_hlo(listed).ops[0].groups == ((0, 2, 4, 6), (1, 3, 5, 7))
  # replica x partition mode (a channel, no global ids): the listed ids are replicas, not
  # device positions
  mixed = listed.replace("{{0,2,4,6},{1,3,5,7}}, use_global_device_ids=true", "{{0}}")
  assert mixed != listed and analysis.report_from_hlo(mixed).ops[0].groups is None


LOOPS_HLO = (
    "HloModule jit_loops, replica_count=4\n"
    + _ADD
    + """
%inner_body (p: (s32[], bf16[8,2])) -> (s32[], bf16[8,2]) {
  %p = (s32[], bf16[8,2]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = bf16[8,2]{1,0} get-tuple-element(%p), index=1
  %ar = bf16[8,2]{1,0} all-reduce(%v), replica_groups={}, to_apply=%add
  ROOT %t = (s32[], bf16[8,2]{1,0}) tuple(%i, %ar)
}

%inner_cond (p: (s32[], bf16[8,2])) -> pred[] {
  %p = (s32[], bf16[8,2]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%outer_body (p: (s32[], bf16[8,2])) -> (s32[], bf16[8,2]) {
  %p = (s32[], bf16[8,2]{1,0}) parameter(0)
  ROOT %w = (s32[], bf16[8,2]{1,0}) while(%p), condition=%inner_cond, body=%inner_body, \
backend_config={"known_trip_count":{"n":"4"}}
}

%unknown_body (p: (s32[], bf16[8,2])) -> (s32[], bf16[8,2]) {
  %p = (s32[], bf16[8,2]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = bf16[8,2]{1,0} get-tuple-element(%p), index=1
  %a2a = bf16[8,2]{1,0} all-to-all(%v), replica_groups={{0,1},{2,3}}, dimensions={0}
  ROOT %t = (s32[], bf16[8,2]{1,0}) tuple(%i, %a2a)
}

ENTRY %main (x: (s32[], bf16[8,2])) -> (s32[], bf16[8,2]) {
  %x = (s32[], bf16[8,2]{1,0}) parameter(0)
  %w1 = (s32[], bf16[8,2]{1,0}) while(%x), condition=%inner_cond, body=%outer_body, \
backend_config={"known_trip_count":{"n":"3"}}
  ROOT %w2 = (s32[], bf16[8,2]{1,0}) while(%w1), condition=%inner_cond, body=%unknown_body
}
"""
)


def test_nested_loops_and_unknown_trip_count():
  report = analysis.report_from_hlo(LOOPS_HLO)
  all_reduce, all_to_all = report.ops
  # replica_groups={} without channel_id: all 4 replicas.
  assert (all_reduce.kind, all_reduce.dtype, all_reduce.shape) == ("all-reduce", "bf16", (8, 2))
  assert (all_reduce.group_size, all_reduce.executions) == (4, 12)
  assert all_reduce.total_bytes_sent_per_device == 12 * 2 * 3 / 4 * 32
  assert (all_to_all.group_size, all_to_all.num_groups, all_to_all.executions) == (2, 2, 1)
  assert "unknown trip count" in all_to_all.note
  assert report.total_bytes_sent_per_device == 12 * 48 + 16
  assert "unknown trip count" in str(report)


MESH_HLO = (
    "HloModule jit_mesh, num_partitions=8\n"
    + _ADD
    + """
ENTRY %main (x: f32[16]) -> (f32[16], f32[16], f32[16], f32[16]) {
  %x = f32[16]{0} parameter(0)
  %a = f32[16]{0} all-reduce(%x), channel_id=1, \
replica_groups=mesh['data'=2,'model'=4] {'model'}, use_global_device_ids=true, to_apply=%add
  %b = f32[16]{0} all-reduce(%x), channel_id=2, replica_groups=mesh['x'=4,'y'=2], \
device_ids=([2,4]T(1,0)) {'x':(1)2}, use_global_device_ids=true, to_apply=%add
  %c = f32[16]{0} all-reduce(%x), channel_id=3, replica_groups=mesh[p=8] {p}, \
use_global_device_ids=true, to_apply=%add
  %d = f32[16]{0} collective-broadcast(%x), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}
  ROOT %t = (f32[16]{0}, f32[16]{0}, f32[16]{0}, f32[16]{0}) tuple(%a, %b, %c, %d)
}
"""
)


def test_mesh_replica_groups_and_broadcast():
  report = analysis.report_from_hlo(MESH_HLO)
  got = [(op.kind, op.group_size, op.num_groups) for op in report.ops]
  assert got == [
      ("all-reduce", 4, 2),
      ("all-reduce", 2, 4),  # sub-axis 'x':(1)2 of size 2
      ("all-reduce", 8, 1),
      ("collective-broadcast", 8, 1),
  ]
  assert report.ops[-1].bytes_sent_per_device == 64  # S, as nccl-tests
  # Which devices each group holds (they were None in the mesh-axes form): 'model' varies
  # the minor axis; 'x':(1)2 is the major half of x over device_ids [2,4]T(1,0).
  assert report.ops[0].groups == ((0, 1, 2, 3), (4, 5, 6, 7))
  assert sorted(report.ops[1].groups) == [(0, 2), (1, 3), (4, 6), (5, 7)]
  assert report.ops[2].groups == (tuple(range(8)),)


def test_mesh_sub_axis_groups_without_device_ids():
  # A sub-axis with no device_ids: its parentheses are not a device_ids list (groups were
  # None). 'a':(2)2 is the middle factor of a = (2, 2, 2); 'b':(1)2 the major half of b.
  text = MESH_HLO.replace("mesh['data'=2,'model'=4] {'model'}", "mesh['a'=8] {'a':(2)2}")
  text = text.replace("mesh[p=8] {p}", "mesh['a'=2,'b'=4] {'b':(1)2}")
  report = analysis.report_from_hlo(text)
  assert report.ops[0].groups == ((0, 2), (1, 3), (4, 6), (5, 7))
  assert report.ops[2].groups == ((0, 2), (1, 3), (4, 6), (5, 7))


def test_report_from_hlo_rejects_bad_text():
  with pytest.raises(ValueError, match="`hlo_text`.*ENTRY"):
    analysis.report_from_hlo("HloModule empty\n")
  with pytest.raises(ValueError, match="`hlo_text`.*str"):
    analysis.report_from_hlo(b"HloModule m")


def test_real_hlo_text_roundtrip(psum_report):
  """report_from_hlo of compile().as_text() equals comm_report."""
  mesh = jaxcoll.devices.flat_mesh(8)
  fn = jax.jit(_shard_map(lambda v: lax.psum(v, "data"), mesh))
  text = fn.lower(np.zeros((8 * K,), np.float32)).compile().as_text()
  assert analysis.report_from_hlo(text) == psum_report
