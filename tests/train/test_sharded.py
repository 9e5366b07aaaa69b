"""A model that fits only sharded (issue 19): sharded init two ways, eval and the
summary digest on the sharded state, the abstract state the planner uses, and the
planner for a user's own model (`sharded_model:make`)."""

import json
import os
import sys

import jax
import jax.numpy as jnp
import jobs
import numpy as np
import optax
import pytest

import jaxcoll
from jaxcoll import models
from jaxcoll.run import evaluate, loop
from jaxcoll.scale import memory
from jaxcoll.train import baselines

TESTS = os.path.dirname(os.path.abspath(__file__))
MIB = 2**20


def _workload(depth=4, width=24):
  return models.make_workload("mlp", depth=depth + 1, width=width, scan_layers=True)


def _trainer(workload, strategy, mesh=None):
  return jaxcoll.Trainer(workload.loss_fn, optax.adam(1e-3), mesh or jaxcoll.devices.flat_mesh(8),
                         strategy, has_aux=True)


STRATEGIES = {
    "zero3": lambda: jaxcoll.ZeRO(stage=3),
    "zero1": lambda: jaxcoll.ZeRO(stage=1),
    "dp": lambda: jaxcoll.DataParallel(),
}


def _same(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y))
                                    for x, y in zip(la, lb))


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_init_gives_the_same_state_and_abstract_state_its_layout(name):
  w = _workload(width=20)  # 20 rows do not split into 8: padded rows too
  trainer = _trainer(w, STRATEGIES[name]())
  abstract = trainer.abstract_state(w.param_shapes)
  host = trainer.init(w.init_params(1))
  on_one_device = trainer.init(jax.jit(w.init_params)(jax.random.key(1)))
  sharded = trainer.init(jax.device_put(w.init_params(1), jax.sharding.NamedSharding(
      trainer.mesh, jax.sharding.PartitionSpec())))
  never_full = trainer.init_from(w.init_params, jax.random.key(1))
  for other in (on_one_device, sharded, never_full):
    assert _same(host, other)
  for real, shape in zip(jax.tree.leaves(host), jax.tree.leaves(abstract)):
    assert isinstance(shape, jax.ShapeDtypeStruct)
    assert (real.shape, real.dtype) == (shape.shape, shape.dtype)
    assert real.sharding.is_equivalent_to(shape.sharding, real.ndim)
  # What a device holds, from the abstract state alone (it counted 8 bytes a leaf).
  assert trainer.state_bytes_per_device(abstract) == trainer.state_bytes_per_device(host)
  state, _ = trainer.step(never_full, w.make_batch(0, 16))  # and it trains
  assert int(state.step) == 1


def _make_mesh(kind, shape=(8,)):
  names = ("data",) if len(shape) == 1 else ("node", "local")
  axis_type = getattr(jax.sharding.AxisType, kind)
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


MESH_STRATEGIES = {
    "dp": (lambda: jaxcoll.DataParallel(), (8,)),
    "zero1": (lambda: jaxcoll.ZeRO(stage=1), (8,)),
    "zero2": (lambda: jaxcoll.ZeRO(stage=2), (8,)),
    "zero3": (lambda: jaxcoll.ZeRO(stage=3), (8,)),
    "hybrid_zero3": (lambda: jaxcoll.ZeRO(stage=3, axis="local", replica_axis="node"), (2, 4)),
}


# The Auto variants are slow-marked: test_every_init_gives_the_same_state_and_abstract_state_
# its_layout covers DP, ZeRO-1 and ZeRO-3 on jaxcoll's (Auto) mesh in the default run.
@pytest.mark.parametrize("kind", ["Explicit", pytest.param("Auto", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", list(MESH_STRATEGIES))
def test_abstract_state_and_init_from_on_explicit_and_auto_meshes(name, kind):
  """jax.make_mesh's default (Explicit axes): ZeRO-3's abstract_state/init_from failed
  with "in_specs P('data') does not match P(None)"; now every strategy's abstract state
  has the real init's shapes, dtypes and shardings, and init_from its values."""
  make, shape = MESH_STRATEGIES[name]
  mesh = _make_mesh(kind, shape)
  w = _workload(depth=2, width=20)
  trainer = _trainer(w, make(), mesh)
  abstract = trainer.abstract_state(w.param_shapes)
  real = trainer.init(w.init_params(1))
  never_full = trainer.init_from(w.init_params, jax.random.key(1))
  assert _same(real, never_full)
  assert jax.tree.structure(abstract) == jax.tree.structure(real)
  for a, r in zip(jax.tree.leaves(abstract), jax.tree.leaves(real)):
    assert (a.shape, a.dtype) == (r.shape, r.dtype)
    assert a.sharding.is_equivalent_to(r.sharding, r.ndim)  # P() is P(None,) here
    assert a.sharding.mesh == r.sharding.mesh == mesh  # the user's mesh, axis types kept
  assert trainer.state_bytes_per_device(abstract) == trainer.state_bytes_per_device(real)
  if kind == "Explicit" and "zero3" in name:  # the planner's use: the step compiles on it
    assert memory.compiled_peak_bytes(trainer, w.param_shapes, w.make_batch(0, 16)) > 0


def test_gspmd_fsdp_baseline_plans_an_explicit_mesh_like_an_auto_one():
  w = _workload(depth=2, width=24)
  batch = w.make_batch(0, 16)
  peaks = [memory.compiled_peak_bytes(
      baselines.GspmdTrainer(w.loss_fn, optax.adam(1e-3), _make_mesh(kind), fsdp=True,
                             has_aux=True), w.param_shapes, batch) for kind in ("Explicit", "Auto")]
  assert peaks[0] == peaks[1]  # the explicit mesh failed: f32[16@data,24] + f32[1,24@data]


def test_init_from_under_zero3_never_computes_a_whole_leaf():
  w = _workload(depth=8, width=256)
  trainer = _trainer(w, jaxcoll.ZeRO(stage=3))
  stats = trainer.lower_init_from(w.init_params, jax.random.key(0)).compile().memory_analysis()
  largest = max(x.size * 4 for x in jax.tree.leaves(w.param_shapes))  # the 8 stacked layers
  state = trainer.abstract_state(w.param_shapes)
  assert stats.output_size_in_bytes == pytest.approx(memory.state_bytes_per_device(state), rel=0.01)
  assert stats.temp_size_in_bytes < largest / 4, (stats.temp_size_in_bytes, largest)


def test_init_from_refuses_another_model_in_one_line():
  w = _workload()
  trainer = _trainer(w, jaxcoll.ZeRO(stage=3))
  trainer.abstract_state(w.param_shapes)
  with pytest.raises(ValueError, match=r"init_fn's output does not have the model's tree "
                     r"\(1 leaves, the model 6; extra ") as e:
    trainer.init_from(lambda: {"w": jnp.zeros(3)})
  assert "['w']" in str(e.value) and "\n" not in str(e.value)
  wider = _workload(width=32)
  with pytest.raises(ValueError, match=r"init_fn's output: leaf \['params'\]\['Dense_0'\]"
                     r"\['bias'\] is float32\[32\], the model's is float32\[24\]"):
    trainer.init_from(wider.init_params, jax.random.key(0))
  with pytest.raises(ValueError, match="`init_fn` must be callable"):
    trainer.init_from(w.param_shapes)
  with pytest.raises(ValueError, match="`init_fn` must return a pytree of arrays"):
    trainer.init_from(lambda: {})


@pytest.mark.parametrize("name", ["zero3", "dp"])
def test_digest_and_host_params_are_todays_values_without_a_replicated_copy(name):
  w = _workload(width=20)  # rows of 3 (padded) and aligned ones
  trainer = _trainer(w, STRATEGIES[name]())
  state = trainer.init_from(lambda: w.init_params(0))
  state, _ = trainer.step(state, w.make_batch(0, 16))
  full = trainer.params(state)
  assert trainer.params_digest(state) == (*loop.params_digest(full), [])
  for (path, leaf), (kpath, ref) in zip(trainer.host_params(state),
                                        jax.tree_util.tree_leaves_with_path(full)):
    assert np.array_equal(leaf, np.asarray(ref)), path
  bad = jax.tree.map(lambda x: x.at[0].set(jnp.nan) if x.ndim else x, state.params)
  assert trainer.params_digest(state._replace(params=bad))[2]  # every leaf with a NaN named


def test_digest_square_sum_is_numpys_bit_for_bit():
  from jaxcoll.train import digest  # noqa: PLC0415

  rng = np.random.default_rng(0)
  for n in (5, 129, 65537, 3_000_001):
    x = (rng.normal(size=n) * 3).astype(np.float32)
    pieces = digest.Piecewise(n, 1000, lambda k, x=x: x[k * 1000:(k + 1) * 1000])
    assert digest.square_sum(pieces.get, n) == np.sum(np.square(x, dtype=np.float64))


def _evaluator(w, mesh):
  examples = w.dataset.examples(np.arange(40), split="eval")
  return evaluate.Evaluator(w, mesh, "data", lambda rows: {k: v[rows] for k, v in
                                                            examples.items()},
                            num_examples=40, global_batch_size=16)


def test_eval_on_the_sharded_state_matches_full_params_and_holds_one_unit():
  w = _workload(depth=8, width=256)
  mesh = jaxcoll.devices.flat_mesh(8)
  trainer = _trainer(w, jaxcoll.ZeRO(stage=3), mesh)
  state = trainer.init_from(lambda: w.init_params(0))
  ev = _evaluator(w, mesh)
  sharded = ev.run(trainer=trainer, state=state)
  full = ev.run(trainer.params(state))
  assert sharded.keys() == full.keys() and sharded["eval_examples"] == 40
  for k in full:
    assert sharded[k] == pytest.approx(full[k], rel=1e-6), k
  stats = ev.compile_on(trainer, state).memory_analysis()
  params = sum(x.size * 4 for x in jax.tree.leaves(w.param_shapes))
  # The replicated evaluation took every parameter as an argument on each device.
  peak = stats.argument_size_in_bytes + stats.temp_size_in_bytes
  assert peak < params / 2, (peak, params)
  with pytest.raises(ValueError, match="pass either `params` or both `trainer` and `state`"):
    ev.run()


def test_the_planner_never_initializes_a_model(monkeypatch):
  def refuse(*args, **kwargs):
    raise AssertionError("the planner initialized a model")

  for cls in (jaxcoll.Trainer, baselines.GspmdTrainer):
    monkeypatch.setattr(cls, "init", refuse)
  monkeypatch.setattr(jaxcoll.Trainer, "init_from", refuse)
  w = _workload(depth=8, width=64)
  batch = w.make_batch(0, 16)
  mesh = jaxcoll.devices.flat_mesh(8)
  trainers = [_trainer(w, s(), mesh) for s in STRATEGIES.values()]
  table = memory.plan(trainers, w.param_shapes, batch)
  zero3 = next(r for r in table.rows if r.stage == 3)
  dp = next(r for r in table.rows if r.stage == 0)
  params = sum(x.size * 4 for x in jax.tree.leaves(w.param_shapes))
  assert dp.state_bytes == 3 * params + 8  # params, Adam's mu and nu, the step and count
  assert zero3.state_bytes < dp.state_bytes / 7
  gspmd = baselines.GspmdTrainer(w.loss_fn, optax.adam(1e-3), mesh, fsdp=True, has_aux=True)
  assert memory.compiled_peak_bytes(gspmd, w.param_shapes, batch) > 0
  assert memory.predict_peak(trainers[0], w.param_shapes, batch).gathered_bytes > 0
  with pytest.raises(ValueError, match="has no `abstract_state"):
    memory.abstract_state(object(), w.param_shapes)


def test_memory_plan_says_whether_a_users_model_fits(tmp_path):
  out = tmp_path / "fit.json"
  common = [sys.executable, "-m", "experiments.memory_plan", "--model=sharded_model:make",
            "--batch_size=16"]
  # Forked from a warm Python (jobs.forked, ~1.4 CPU-s less; clean_env's PYTHONPATH has the
  # repo and tests/, so sharded_model imports); the real start: the bad-model test below.
  proc = jobs.forked([*common, "--budget_mb=0.2", f"--json={out}"], cwd=TESTS, timeout=300)
  assert proc.returncode == 0, proc.stderr
  rows = {r["strategy"]: r for r in json.loads(out.read_text())["rows"]}
  assert rows["ZeRO-3"]["fits"] and not rows["DP"]["fits"], rows
  assert all(r["fits"] == (r["peak_mb"] <= 0.2) for r in rows.values())
  assert "Does sharded_model:make (11,082 params) fit 0.2 MB" in proc.stdout
  assert "GSPMD FSDP on 8 devices: 1 leaf padded to shard" in proc.stdout  # its layout line


@pytest.mark.slow
def test_memory_plan_searches_a_users_size_knob(tmp_path):
  common = [sys.executable, "-m", "experiments.memory_plan", "--model=sharded_model:make",
            "--batch_size=16"]
  out = tmp_path / "scale.json"
  proc = jobs.run([*common, "--budget_mb=0.2", "--scale=model_overrides.depth",
                   "--model_overrides=width=32", "--max_layers=8", f"--json={out}"],
                  cwd=TESTS, timeout=600, PYTHONPATH=os.pathsep.join([jobs.REPO, TESTS]))
  assert proc.returncode == 0, proc.stderr
  rows = {r["strategy"]: r for r in json.loads(out.read_text())["rows"]}
  assert rows["ZeRO-3"]["depth"] > rows["DP"]["depth"] >= 1, rows
  assert all(r["peak_mb"] <= 0.2 for r in rows.values() if r["depth"])


BAD_MODEL = [
    (["--model=mymodel"], "`--model`='mymodel' is neither a jaxcoll model (mlp, resnet, "
     "transformer, recommender) nor a 'module:function' path"),
    (["--model=a:b:c"], "'a:b:c' is not a 'module:function' path"),
    (["--model=sharded_model:nope"], "module 'sharded_model' has no function 'nope'"),
    (["--model=sharded_model:make", "--scale=depth"], "`--scale`='depth' must be "
     "model_overrides.FIELD"),
    (["--model=sharded_model:make", "--model_overrides=depth"], "`--model_overrides` item "
     "'depth' is not FIELD=VALUE"),
]
BAD_MODEL_IDS = ["no-colon", "two-colons", "no-function", "scale", "override"]


def test_memory_plan_bad_model_is_one_line_and_exit_2_from_the_command_line():
  """One case through a real `python -m experiments.memory_plan` (exit status, the one
  stderr line, no traceback); the others in this process (the test below): same code."""
  flags, match = BAD_MODEL[0]
  proc = jobs.run([sys.executable, "-m", "experiments.memory_plan", *flags, "--budget_mb=1"],
                  cwd=TESTS, timeout=120, PYTHONPATH=os.pathsep.join([jobs.REPO, TESTS]))
  assert proc.returncode == 2, proc.stderr
  lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("memory_plan: error:")]
  assert len(lines) == 1 and match in lines[0], proc.stderr
  assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("flags, match", BAD_MODEL, ids=BAD_MODEL_IDS)
def test_memory_plan_bad_model_is_one_line_and_exit_2(flags, match, capsys, monkeypatch):
  """experiments.memory_plan's main on these flags in this process (a Python and jaxcoll
  start fewer each): exit 2 and one `memory_plan: error:` line naming the fix."""
  from absl import flags as absl_flags  # noqa: PLC0415

  from experiments import memory_plan  # noqa: PLC0415

  monkeypatch.syspath_prepend(TESTS)  # sharded_model, as the command line's PYTHONPATH
  absl_flags.FLAGS.unparse_flags()
  try:
    absl_flags.FLAGS(["memory_plan", *flags, "--budget_mb=1"])
    with pytest.raises(SystemExit) as e:
      memory_plan.main(["memory_plan"])
  finally:
    absl_flags.FLAGS.unparse_flags()
  out, err = capsys.readouterr()
  assert e.value.code == 2, err
  assert out == "" and err.count("\n") == 1 and err.startswith("memory_plan: error:"), err
  assert match in err, err


def test_init_eval_and_digest_rss_phase_by_phase():
  """The small version of configs/big_zero3.py's check: each phase's peak RSS in a
  subprocess (VmHWM reset via /proc/self/clear_refs), against the issue's bounds."""
  if not os.path.exists("/proc/self/clear_refs"):
    pytest.skip("needs Linux /proc/self/clear_refs")
  proc = jobs.run([sys.executable, os.path.join(TESTS, "_sharded_rss_worker.py"), "1024", "8"],
                  timeout=600, JAX_COMPILATION_CACHE_DIR="")  # RSS with its compiles, as users see
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = json.loads(next(ln for ln in proc.stdout.splitlines()
                        if ln.startswith("RESULT "))[len("RESULT "):])
  slack = 32 * MIB  # compiled programs and allocator granularity
  leaf = max(out["leaves"])  # the stacked layers: 33.5 MB, replicated 8x before
  outside, _, unit, _ = out["unit_bytes"]
  # (a) from a single-device array: the sharded state plus at most one leaf.
  assert out["init"] <= out["state_bytes"] + leaf + slack, out
  # (b) init_from: the state alone; the parameters never exist in full.
  assert out["init_from"] <= out["state_bytes"] + slack, out
  # eval: each device gathers the leaves outside units and one unit at a time.
  assert out["eval"] <= 8 * (outside + unit) + slack, out
  # digest: one layer at a time on the host, no replicated copy.
  assert out["digest"] <= unit + slack, out
  # save (async, waited for): the bound, the process within 2x the state (the
  # state is resident, so the save adds at most one state), and what is built for: no
  # copy of the state, about one leaf in orbax's buffers (a whole-state copy was 135 MB).
  assert out["save"] <= out["state_bytes"], out
  assert out["save"] <= out["largest_canonical_leaf"] + slack, out


@pytest.mark.slow  # two jax processes (~1 min on 2 loaded cores); the one-process
# sibling is test_every_init_gives_the_same_state_and_abstract_state_its_layout
def test_two_process_zero3_init_reads_each_devices_rows_and_no_leaf_more():
  """2 processes x 4 devices pass the same params (process-local jax arrays, numpy, a
  global array): the state is those values on both, and init holds about this process's
  share of the state, not a 33.5 MB leaf on each of its 4 devices (before: 360 MB)."""
  if not os.path.exists("/proc/self/clear_refs"):
    pytest.skip("needs Linux /proc/self/clear_refs")
  r = jobs.launch(sys.executable, os.path.join(TESTS, "_sharded_mp_worker.py"), "1024", "8",
                  processes=2, devices=4, timeout=280,
                  launcher_flags=("--init_timeout_s=60", "--timeout_s=240", "--grace_s=2"))
  assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
  results = [json.loads(line.split("RESULT ", 1)[1]) for line in r.stdout.splitlines()
             if "RESULT " in line]
  assert sorted(x["process"] for x in results) == [0, 1], r.stdout[-3000:]
  for x in results:
    assert set(x["sha256"].values()) == {x["expected_sha256"]}, x
    assert x["init_rss"] <= x["state_bytes_here"] + x["leaf"] + 32 * MIB, x


def test_a_zero3_run_evaluates_sharded_and_reports_its_peak_rss(tmp_path):
  sys.path.insert(0, jobs.REPO)
  from configs import big_zero3  # noqa: PLC0415
  from jaxcoll.observe import run_report  # noqa: PLC0415

  config = big_zero3.get_config("small")
  config.update(steps=2, checkpoint_every=0, eval_every=2)
  config.model_overrides.update(width=64)
  config.data.eval_examples = 16
  summary = loop.train_and_evaluate(config, str(tmp_path))
  assert summary["eval_examples"] == 16 and np.isfinite(summary["eval_loss"])
  if not os.path.exists("/proc/self/clear_refs"):
    return
  phases = {k for k in summary if k.startswith("rss_") and k.endswith("_peak_bytes")}
  assert {"rss_peak_bytes", "rss_init_peak_bytes", "rss_step_peak_bytes",
          "rss_eval_peak_bytes", "rss_digest_peak_bytes"} <= phases
  assert summary["rss_peak_bytes"] == max(summary[k] for k in phases)
  assert summary["xla_peak_bytes_x_local_devices"] == 8 * summary["memory_bytes_per_device"]
  note = summary["memory_note"]
  assert note.startswith(f"peak RSS {summary['rss_peak_bytes'] / 1e9:.2f} GB (in ")
  assert f"{summary['rss_baseline_bytes'] / 1e9:.2f} GB before init" in note
  assert "8 local devices" in note
  assert f"memory: {note}" in run_report.summarize(run_report.load_run(str(tmp_path)))


@pytest.mark.slow
def test_zero3_memory_benchmark_resumes_bit_identically(tmp_path):
  """configs/big_zero3.py:small through experiments.zero3_memory: each part in its own
  process, the resumed run reaches the straight run's params_sha256."""
  out = tmp_path / "small.json"
  proc = jobs.run([sys.executable, "-m", "experiments.zero3_memory",
                   "--config=configs/big_zero3.py:small", "--only=run,restore", "--steps=1",
                   f"--json={out}"], timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(out.read_text())
  assert result["checks"]["resume_bit_identical"] is True
  phases = result["results"]["run"]["phases"]
  assert {"init", "step", "eval", "save", "digest"} <= set(phases)
  assert all(p["rss_peak_bytes"] > 0 for p in phases.values())
  assert "peak RSS" in proc.stdout and "x the full state" in proc.stdout


_TINY_ZERO3 = '''
from configs import big_zero3


def get_config(variant=None):
  c = big_zero3.get_config("small")
  c.model_overrides.depth, c.model_overrides.width = 5, 64  # 64 divides by 8, not by 6
  return c
'''


def test_zero3_memory_plans_the_gspmd_fsdp_baseline_padded_and_not(tmp_path):
  """The plan part on 6 devices: ZeRO-3 against the baseline that pads the width-64
  leaves to shard them and against pad=False (all replicated), each with its layout line."""
  config, out = tmp_path / "tiny_zero3.py", tmp_path / "plan.json"
  config.write_text(_TINY_ZERO3)
  common = [sys.executable, "-m", "experiments.zero3_memory", f"--config={config}", "--only=plan"]
  # The command line forked from a warm Python (jobs.forked, ~1.4 CPU-s less each; the plan
  # worker it starts is a real start).
  bad = jobs.forked([*common, "--devices=6"], timeout=120)  # the config's batch is 16
  assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
  assert "global_batch_size=16 does not divide by `--devices`=6; pass --batch_size=12" in bad.stderr
  bad = jobs.forked(common, devices=6, timeout=120)  # was the plan worker's traceback
  assert bad.returncode == 2 and "does not divide by JAXCOLL_CPU_DEVICES=6" in bad.stderr
  proc = jobs.forked([*common, "--devices=6", "--batch_size=12", f"--json={out}"], timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(out.read_text())
  rows = result["results"]["plan"]["strategies"]
  peak = {k: r["xla_peak_bytes_per_device"] for k, r in rows.items()}
  # Without padding no leaf divides by 6: the baseline holds what GSPMD DP would.
  assert peak["GSPMD FSDP"] < peak["GSPMD FSDP (pad=False)"] / 2, peak
  checks = result["checks"]
  assert checks["zero3_over_gspmd_fsdp_peak"] == peak["ZeRO-3"] / peak["GSPMD FSDP"]
  assert checks["zero3_over_gspmd_fsdp_unpadded_peak"] < checks["zero3_over_gspmd_fsdp_peak"]
  assert "GSPMD FSDP on 6 devices: 6 leaves padded to shard (+608 zeros" in proc.stdout
  assert "GSPMD FSDP (pad=False) on 6 devices: 0 leaves padded" in proc.stdout
  assert "step peak per device, ZeRO-3 / GSPMD FSDP: " in proc.stdout
