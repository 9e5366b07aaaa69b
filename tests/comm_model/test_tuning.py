"""`auto`: tuning tables (build, save, load, lookup) and the cost-model fallback."""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxcoll
from jaxcoll.observe import analysis
from jaxcoll.comm_model import cost, tuning
from jaxcoll.comm_model.topology import Topology


def _rows(times_by_algo, sizes, collective="all_reduce", n=8):
  return [
      dict(collective=collective, group_size=n, dtype="float32", algorithm=a, size_bytes=s,
           time_us=t(s))
      for a, t in times_by_algo.items()
      for s in sizes
  ]


def test_table_from_measurements_picks_fastest_with_midpoint_boundaries():
  sizes = [1024, 4096, 16384, 65536]
  rows = _rows(
      {
          "native": lambda s: 100 + s / 100,
          "recursive_doubling": lambda s: 20 + s / 200 * 3,
          "ring": lambda s: 500 + s / 1000,
      },
      sizes,
  )
  entries = tuning.table_from_measurements(rows)
  ranges = entries["all_reduce"]["8"]["float32"]
  table = tuning.TuningTable("cpu", entries)
  picks = [table.lookup("all_reduce", 8, "float32", s) for s in sizes]
  # the fastest algorithm at every measured size
  for s, pick in zip(sizes, picks):
    times = {r["algorithm"]: r["time_us"] for r in rows if r["size_bytes"] == s}
    assert times[pick] <= tuning.NATIVE_PREFERENCE * min(times.values())
  assert ranges[-1]["max_bytes"] is None
  assert table.lookup("all_reduce", 8, "bfloat16", 10**9) == ranges[-1]["algorithm"]
  assert table.lookup("all_reduce", 4, "float32", 1024) is None  # no entry
  boundary = ranges[0]["max_bytes"]
  assert boundary is not None and 1024 <= boundary < 65536


def test_native_preferred_within_three_percent():
  entries = tuning.table_from_measurements(
      _rows({"native": lambda s: 102.0, "ring": lambda s: 100.0}, [4096])
  )
  assert entries["all_reduce"]["8"]["float32"][0]["algorithm"] == "native"


def test_save_load_use_and_auto_follows_table(tmp_path):
  entries = {
      "all_reduce": {
          "8": {
              "float32": [
                  {"max_bytes": 4096, "algorithm": "recursive_doubling"},
                  {"max_bytes": None, "algorithm": "ring"},
              ]
          }
      }
  }
  path = str(tmp_path / "table.json")
  tuning.save(tuning.TuningTable("cpu", entries, Topology.preset("cpu-sim")), path)
  loaded = tuning.load(path)
  assert loaded.topology == Topology.preset("cpu-sim")
  mesh = jaxcoll.devices.flat_mesh(8)
  body = lambda v: jaxcoll.all_reduce(v, "data")  # noqa: E731
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
  try:
    tuning.use(path)
    small = analysis.comm_report(f, jnp.ones((8 * 256,)))  # 1 KiB per device
    large = analysis.comm_report(f, jnp.ones((8 * 4096,)))  # 16 KiB per device
  finally:
    tuning.use(None)
  # recursive doubling: 3 permutes of S; ring: 14 permutes of S/8
  assert [op.kind for op in small.ops] == ["collective-permute"] * 3
  assert len(large.ops) == 14 and small.total_bytes_sent_per_device == 3 * 1024
  out = f(jnp.arange(8 * 4.0))
  np.testing.assert_allclose(np.asarray(out).reshape(8, 4)[0], np.arange(32.0).reshape(8, 4).sum(0))


def test_bad_tables_raise_value_error(tmp_path):
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  with pytest.raises(ValueError, match="not valid JSON"):
    tuning.load(str(bad))
  bad.write_text(json.dumps({"entries": {}}))
  with pytest.raises(ValueError, match="device_kind"):
    tuning.load(str(bad))
  wrong = {"device_kind": "cpu", "entries": {"all_reduce": {"8": {"float32": [
      {"max_bytes": None, "algorithm": "fastest"}]}}}}
  bad.write_text(json.dumps(wrong))
  with pytest.raises(ValueError, match="algorithm 'fastest'; valid: native"):
    tuning.load(str(bad))
  with pytest.raises(ValueError, match="`table` must be"):
    tuning.use(3)


@pytest.mark.parametrize("entries,where", [
    ({"all_reduce": {"8": {"float32": ["ring"]}}}, r"\['float32'\] must be a list of"),
    ({"all_reduce": {"8": {"float32": [{"algorithm": "ring"}]}}}, "max_bytes: a whole number"),
    ({"all_reduce": {"8": {"float32": [{"algorithm": "ring", "max_bytes": "64K"}]}}},
     "max_bytes: a whole number"),
    ({"all_reduce": {"8": ["ring"]}}, r"\['8'\] must be a mapping of dtype names"),
    ({"all_reduce": ["ring"]}, "must be a mapping of group sizes"),
    ({"all_reduce": {"eight": {}}}, "keyed by group sizes written as text"),
    # str.isdigit() takes it for a digit, int() does not: was int()'s "invalid literal".
    ({"all_reduce": {"\u00b2": {}}}, "keyed by group sizes written as text"),
    # never matched: lookup asks for numpy's name of the array's dtype
    ({"all_reduce": {"8": {"fp32": [{"algorithm": "ring", "max_bytes": None}]}}},
     r"\['8'\] must be keyed by dtype names as numpy spells them.*got 'fp32'"),
    ({"all_reduce": {"8": {"float": [{"algorithm": "ring", "max_bytes": None}]}}},
     "got 'float'"),
    # lookup() takes the first range holding the size: these loaded, and `auto` never
    # picked the tree the user wrote for small sizes.
    ({"all_reduce": {"8": {"float32": [{"algorithm": "ring", "max_bytes": 1 << 20},
                                       {"algorithm": "tree", "max_bytes": 4096}]}}},
     r"\['float32'\] must be size ranges in increasing max_bytes.*got \[1048576, 4096\]"),
    ({"all_reduce": {"8": {"float32": [{"algorithm": "ring", "max_bytes": None},
                                       {"algorithm": "tree", "max_bytes": 4096}]}}},
     r"null \(no limit\) only last"),
], ids=["range-not-a-mapping", "no-max_bytes", "max_bytes-text", "dtypes-a-list",
        "sizes-a-list", "size-not-a-number", "size-a-superscript", "dtype-fp32", "dtype-float",
        "ranges-out-of-order", "unlimited-range-first"])
def test_a_hand_written_table_of_another_shape_is_one_line_at_load(tmp_path, entries, where):
  # These loaded (or raised AttributeError) and then failed inside `auto`, at trace time of
  # the user's jit, with KeyError 'max_bytes' or a TypeError comparing int and str.
  bad = tmp_path / "hand.json"
  bad.write_text(json.dumps({"device_kind": "cpu", "topology": None, "entries": entries}))
  with pytest.raises(ValueError, match=where):
    tuning.load(str(bad))


def test_fit_topology_recovers_known_figures():
  truth = Topology.preset("cpu-sim")
  truth = truth.with_level(truth.names[-1], latency_s=80e-6, bandwidth_Bps=2e9, reduce_Bps=5e9)
  rows = []
  for algo in ("ring", "recursive_doubling", "halving_doubling", "tree"):
    for s in (4096, 65536, 1 << 20, 16 << 20):
      t = cost.estimate("all_reduce", s, truth.for_axes(truth.names[-1:], [8]), algo)
      rows.append(dict(collective="all_reduce", group_size=8, dtype="float32",
                       algorithm=algo, size_bytes=s, time_us=t * 1e6))
  fitted, median_error = tuning.fit_topology(rows, Topology.preset("cpu-sim"))
  assert median_error < 1e-6
  level = fitted.levels[-1]
  assert level.latency_s == pytest.approx(80e-6, rel=1e-3)
  assert level.bandwidth_Bps == pytest.approx(2e9, rel=1e-3)
  with pytest.raises(ValueError, match="at least 3"):
    tuning.fit_topology(rows[:2], Topology.preset("cpu-sim"))


def test_fit_leaves_out_an_algorithm_the_user_registered(monkeypatch):
  # One measured algorithm without a cost formula (registered with collectives.register)
  # raised in the fit, and `tune` wrote its table without any fitted topology.
  from jaxcoll.collectives import _dispatch, ring  # noqa: PLC0415

  monkeypatch.setitem(_dispatch._REGISTRY["all_reduce"], "my_ring", ring.ring_all_reduce)
  assert "my_ring" in jaxcoll.algorithms("all_reduce")
  truth = Topology.preset("cpu-sim")
  truth = truth.with_level(truth.names[-1], latency_s=80e-6, bandwidth_Bps=2e9, reduce_Bps=5e9)
  rows = []
  for algo in ("ring", "tree", "recursive_doubling", "my_ring"):
    for s in (4096, 1 << 20, 16 << 20):
      t = cost.estimate("all_reduce", s, truth, "ring" if algo == "my_ring" else algo)
      rows.append(dict(collective="all_reduce", group_size=8, dtype="float32",
                       algorithm=algo, size_bytes=s, time_us=t * 1e6 * (3 if algo == "my_ring"
                                                                      else 1)))
  fitted, median_error = tuning.fit_topology(rows, Topology.preset("cpu-sim"))
  assert median_error < 1e-6  # my_ring's (3x slower) rows are not in the fit
  assert fitted.levels[-1].bandwidth_Bps == pytest.approx(2e9, rel=1e-3)


def test_auto_without_table_uses_cost_model():
  tuning.use(None)
  group = jaxcoll.collectives._dispatch.Group(("data",), (8,))
  topo = tuning.default_topology()
  for nbytes in (1024, 1 << 24):
    want = cost.choose("all_reduce", nbytes, topo.for_axes(("data",), (8,)),
                       candidates=[a for a in cost.modelled_algorithms("all_reduce")
                                   if a != "hierarchical"])
    if tuning.active_table() is None:
      assert tuning.choose("all_reduce", nbytes, group, np.float32) == want


def test_table_naming_auto_is_refused(tmp_path):
  bad = tmp_path / "auto.json"
  bad.write_text(json.dumps({"device_kind": "cpu", "entries": {"all_reduce": {"8": {
      "float32": [{"max_bytes": None, "algorithm": "auto"}]}}}}))
  with pytest.raises(ValueError, match="algorithm 'auto'"):
    tuning.load(str(bad))


def test_fit_is_non_negative_least_squares():
  # Times below what the bytes alone cost: unconstrained least squares gives
  # a negative latency here (-5.9 us, measured); the fit must give 0 and still
  # a bandwidth.
  truth = Topology.preset("cpu-sim")
  truth = truth.with_level(truth.names[-1], latency_s=0.0, bandwidth_Bps=1e9)
  flat = truth.for_axes(truth.names[-1:], [8])
  rows = []
  for algo in ("ring", "recursive_doubling", "tree"):
    for s in (1 << 20, 4 << 20, 16 << 20):
      t = cost.estimate("all_reduce", s, flat, algo) - 40e-6 * (1 + (algo == "ring"))
      rows.append(dict(collective="all_reduce", group_size=8, dtype="float32",
                       algorithm=algo, size_bytes=s, time_us=t * 1e6))
  fitted, _ = tuning.fit_topology(rows, truth)
  level = fitted.levels[-1]
  assert level.latency_s >= 0.0
  assert 0 < level.bandwidth_Bps < float("inf")


def test_shipped_cpu_table_has_a_plausible_per_message_latency():
  table = tuning.load(f"{tuning.TABLES_DIR}/cpu.json")
  level = table.topology.levels[-1]
  assert level.latency_s > 0  # fitted, not clipped to 1e-15
  assert 10e-6 <= table.topology.launch_s + level.latency_s <= 1e-3  # tens to hundreds of us
  assert 1e7 < level.bandwidth_Bps < 1e11


def test_tune_needs_out_and_leaves_the_shipped_table(tmp_path):
  import sys  # noqa: PLC0415

  import jobs  # noqa: PLC0415

  # Forked from a warm Python (jobs.forked: clean_env()'s environment, ~1.4 CPU-s less).
  out = jobs.forked([sys.executable, "-m", "experiments.tune", "--collectives=all_reduce"],
                    cwd=tmp_path, timeout=120)
  assert out.returncode == 2
  assert out.stderr.count("\n") == 1 and "--out" in out.stderr, out.stderr
  assert list(tmp_path.iterdir()) == []


def test_set_and_reset_auto_chooser():
  from jaxcoll.collectives import _dispatch  # noqa: PLC0415

  group = _dispatch.Group(("data",), (8,))
  try:
    jaxcoll.collectives.set_auto_chooser(lambda *args: "ring")
    assert _dispatch.choose_algorithm("all_reduce", 1 << 20, group, "float32") == "ring"
    jaxcoll.collectives.set_auto_chooser(None)
    assert _dispatch.choose_algorithm("all_reduce", 1 << 20, group, "float32") == "native"
    with pytest.raises(TypeError, match="`chooser` must be a callable or None"):
      jaxcoll.collectives.set_auto_chooser("ring")
  finally:
    jaxcoll.collectives.reset_auto_chooser()
  want = tuning.choose("all_reduce", 1 << 20, group, "float32")
  assert _dispatch.choose_algorithm("all_reduce", 1 << 20, group, "float32") == want


def test_a_table_naming_hierarchical_serves_tuple_groups_and_leaves_one_axis_to_the_model(
    tmp_path):
  # Entries are keyed by group size: a table naming `hierarchical` for 8 (valid at load, and
  # right for a ("node", "local") group of 8) made every `auto` over one axis of 8 fail at
  # trace time: "`algorithm`='hierarchical' needs a tuple of >= 2 axes ... got axis_name='data'".
  path = tmp_path / "hier.json"
  path.write_text(json.dumps({"device_kind": "cpu", "topology": None, "entries": {
      "all_reduce": {"8": {"float32": [{"max_bytes": None, "algorithm": "hierarchical"}]}}}}))
  x = jnp.arange(8 * 4.0)
  want = np.arange(32.0).reshape(8, 4).sum(0)

  def over(mesh, axes, algorithm="auto"):
    return jax.jit(jax.shard_map(lambda v: jaxcoll.all_reduce(v, axes, algorithm=algorithm),
                                 mesh=mesh, in_specs=P(axes), out_specs=P(axes)))

  def ops(f):
    return [(op.kind, op.shape, op.group_size) for op in analysis.comm_report(f, x).ops]

  two_level = jaxcoll.devices.node_local_mesh(2, 4)
  try:
    tuning.use(str(path))
    flat = over(jaxcoll.devices.flat_mesh(8), "data")
    two = over(two_level, ("node", "local"))
    flat_out, two_out = np.asarray(flat(x)), np.asarray(two(x))
    two_ops = ops(two)
    hierarchical_ops = ops(over(two_level, ("node", "local"), jaxcoll.Hierarchical()))
    picked = tuning.choose("all_reduce", 16, jaxcoll.collectives._dispatch.Group(
        ("data",), (8,)), np.float32)
  finally:
    tuning.use(None)
  np.testing.assert_allclose(flat_out.reshape(8, 4), np.tile(want, (8, 1)))
  np.testing.assert_allclose(two_out.reshape(8, 4), np.tile(want, (8, 1)))
  assert picked != "hierarchical"  # one axis: the cost model's flat pick
  assert two_ops == hierarchical_ops  # the tuple group of 8 runs the table's hierarchical


def test_use_takes_a_pathlib_path(tmp_path):
  # `use(tmp_path / "t.json")` was refused: "`table` must be a TuningTable, a path or None;
  # got PosixPath(...)" (load() took it).
  entries = {"all_gather": {"8": {"float32": [{"max_bytes": None, "algorithm": "bruck"}]}}}
  path = tmp_path / "t.json"
  tuning.save(tuning.TuningTable("cpu", entries), str(path))
  try:
    tuning.use(path)
    picked = tuning.choose("all_gather", 1 << 20, jaxcoll.collectives._dispatch.Group(
        ("data",), (8,)), np.float32)
  finally:
    tuning.use(None)
  assert picked == "bruck"


def test_a_table_built_in_python_is_checked_and_takes_int_group_sizes():
  # TuningTable(...) given to use() was not checked: a group size written as an int (8, as
  # Python code writes it) never matched (lookup reads '8', the JSON form), so `auto` ran the
  # cost model's pick, and a misspelt algorithm failed inside `auto` at trace time.
  table = tuning.TuningTable("cpu", {"all_reduce": {8: {"float32": [
      {"max_bytes": None, "algorithm": "ring"}]}}})
  assert table.lookup("all_reduce", 8, "float32", 1024) == "ring"
  assert list(table.to_dict()["entries"]["all_reduce"]) == ["8"]
  typed = tuning.TuningTable("cpu", {"all_reduce": {8: {jnp.bfloat16: [
      {"max_bytes": None, "algorithm": "tree"}]}}})
  assert typed.lookup("all_reduce", 8, "bfloat16", 1024) == "tree"
  with pytest.raises(ValueError, match="algorithm 'rnig'; valid: native"):
    tuning.TuningTable("cpu", {"all_reduce": {"8": {"float32": [
        {"max_bytes": None, "algorithm": "rnig"}]}}})


def test_a_table_of_another_device_kind_warns_once_at_its_first_lookup():
  # use() of a table measured on another device kind (an H100 table on a CPU run, a laptop's
  # on a cluster) was silent: `auto` took that hardware's picks as this one's.
  entries = {"all_gather": {"8": {"float32": [{"max_bytes": None, "algorithm": "bruck"}]}}}
  group = jaxcoll.collectives._dispatch.Group(("data",), (8,))
  for kind, warns in [("nvidia_h100_80gb_hbm3", True), ("cpu", False)]:
    table = tuning.TuningTable(kind, entries)
    try:
      tuning.use(table)
      with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        picks = [tuning.choose("all_gather", 1 << 20, group, np.float32) for _ in range(2)]
    finally:
      tuning.use(None)
    said = [str(w.message) for w in seen if "device kind" in str(w.message)]
    assert picks == ["bruck", "bruck"]  # still used: the user asked for it
    assert len(said) == (1 if warns else 0), said
    if warns:
      assert f"measured on device kind {kind!r}, but this process runs on 'cpu'" in said[0]
