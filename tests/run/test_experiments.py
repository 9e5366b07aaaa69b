"""`python -m experiments.train`: configs, outputs, resume, reshard, multi-host."""

import importlib.util
import json
import logging
import os
import shutil
import signal
import sys

import jobs
import pytest

import jaxcoll
from configs import bert_zero3, default, minimal, resnet_dp8
from experiments import _cli
from jaxcoll.observe import metrics
from jaxcoll.run import loop


def _train(*flags, check=True, real=False, **kwargs):
  """A one-process run forked from a warm Python (jobs.train_forked: the same module, argv
  and environment, ~2.5 CPU-s less); ``real``: a fresh ``python -m experiments.train``."""
  out = (jobs.train if real else jobs.train_forked)(*flags, **kwargs)
  if check:
    assert out.returncode == 0, out.stderr[-3000:]
  return out


def _launch(*cmd):
  return jobs.launch(*cmd)


_summary = jobs.summary


@pytest.mark.parametrize(
    "module",
    # resnet_dp8's smoke with -m slow: tests/models/test_models.py trains ResNet by default.
    [default, pytest.param(resnet_dp8, marks=pytest.mark.slow), bert_zero3, minimal],
    ids=lambda m: m.__name__.split(".")[-1]
)
def test_smoke_variant_trains_and_writes_outputs(module, tmp_path):
  config = module.get_config("smoke")
  summary = loop.train_and_evaluate(config, str(tmp_path))
  assert summary["steps"] == config.steps and summary["final_loss"] > 0
  assert len(summary["params_sha256"]) == 64 and summary["params_global_norm"] > 0
  rows = metrics.read_metrics(str(tmp_path))
  train = [r for r in rows if "loss" in r]
  logged = [s for s in range(1, config.steps + 1) if s % config.log_every == 0 or s == config.steps]
  assert [r["step"] for r in train] == logged
  for key in ("loss", "step_time_s", "examples_per_s", "slowest_process_time_s"):
    assert train[-1][key] is not None and train[-1][key] > 0, key
  assert train[-1]["data_time_s"] >= 0 and train[-1]["process_time_s"] == [
      train[-1]["fastest_process_time_s"]]
  assert train[-1]["slowest_process"] == train[-1]["fastest_process"] == 0  # one process
  # The one-off figures of the step program are in summary.json, not in every row.
  for key in ("comm_bytes_per_step", "memory_bytes_per_device"):
    assert summary[key] > 0 and not any(key in r for r in rows), key
  saved = [s for s in range(1, config.steps + 1) if config.checkpoint_every and (
      s % config.checkpoint_every == 0 or s == config.steps)]
  saves = [r for r in rows if "checkpoint_time_s" in r]
  assert [r["step"] for r in saves] == saved and all(r["checkpoint_time_s"] > 0 for r in saves)
  assert os.listdir(tmp_path / "tensorboard")
  assert _summary(str(tmp_path))["params_sha256"] == summary["params_sha256"]
  if config.checkpoint_every:
    assert os.listdir(tmp_path / "checkpoints")


# The default run covers resuming after a lost process through the launcher
# (test_reliability), the interrupted-then-resumed chain (test_messages) and
# bit-identical stop/resume (test_checkpoint); this one is the 1-process CLI form.
@pytest.mark.slow
def test_resume_after_stop_matches_uninterrupted_run(tmp_path):
  """Killed at step 7 (checkpoints every 3 steps), started again: same params."""
  flags = ["--config=configs/default.py:smoke", "--config.steps=9", "--config.checkpoint_every=3"]
  straight = tmp_path / "straight"
  _train(*flags, f"--workdir={straight}")
  broken = tmp_path / "broken"
  first = _train(*flags, "--config.fail_at_step=7", f"--workdir={broken}", check=False)
  assert first.returncode == loop.EXIT_INJECTED_FAULT
  assert "params_sha256" not in _summary(broken)  # only the attempt, left "running"
  # The step-6 save may have died with the process; step 3's was complete
  # before step 6's began (orbax finishes one save before the next).
  _train(*flags, "--config.fail_at_step=7", f"--workdir={broken}", JAXCOLL_RESTART="1")
  assert _summary(broken)["start_step"] in (3, 6)
  assert _summary(broken)["params_sha256"] == _summary(straight)["params_sha256"]


def test_zero3_checkpoint_resumes_as_dp_on_four_devices(tmp_path):
  """Saved by ZeRO-3 on 8 devices at step 3, resumed by DP on 4 for steps 4-6:
  the params of ZeRO-3 on 8 for all six steps (the same update, up to float
  reduction order)."""
  workdir = tmp_path / "run"
  _train("--config=configs/default.py:smoke", "--config.strategy=zero3", f"--workdir={workdir}")
  saved = _summary(workdir)
  shutil.rmtree(workdir / "checkpoints" / "6")  # as if it had stopped at step 3
  _train("--config=configs/default.py:smoke", "--config.strategy=dp", f"--workdir={workdir}",
         devices=4)
  restored = _summary(workdir)
  assert restored["num_devices"] == 4 and restored["start_step"] == 3 == saved["steps"] // 2
  assert restored["params_global_norm"] == pytest.approx(saved["params_global_norm"], rel=1e-5)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
  """``launched(strategy)``: the smoke config as 2 processes x 4 devices through
  the launcher, (output, workdir), run once per strategy for this module's tests."""
  done = {}

  def run(strategy):
    if strategy not in done:
      two = tmp_path_factory.mktemp(f"launched_{strategy}")
      out = _launch(sys.executable, "-m", "experiments.train", "--config=configs/default.py:smoke",
                    f"--config.strategy={strategy}", f"--workdir={two}")
      assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
      done[strategy] = out, two
    return done[strategy]

  return run


# DP with -m slow: ZeRO-3 by default, and DP across processes in test_mpirun_matches_the_launcher
# (ring) and test_reliability's restart test (ring, through the launcher).
@pytest.mark.parametrize("strategy", [pytest.param("dp", marks=pytest.mark.slow), "zero3"])
def test_two_processes_match_one_process(strategy, tmp_path, launched):
  one = tmp_path / "one"
  _train("--config=configs/default.py:smoke", f"--config.strategy={strategy}",
         f"--workdir={one}")
  out, two = launched(strategy)
  a, b = _summary(one), _summary(two)
  assert b["num_processes"] == 2 and a["num_processes"] == 1
  assert b["params_global_norm"] == pytest.approx(a["params_global_norm"], rel=1e-5)
  for p in (0, 1):  # gloo's connection chatter: one line per process
    gloo = [line for line in out.stdout.splitlines()
            if line.startswith(f"[p{p}] ") and "gloo" in line.lower()]
    assert len(gloo) == 1 and gloo[0].startswith(f"[p{p}] gloo: connected"), out.stdout[-3000:]
  # summary.json is written once, by process 0 (no temporary files left behind).
  assert sorted(p for p in os.listdir(two) if p.startswith("summary")) == ["summary.json"]


@pytest.mark.skipif(shutil.which("mpirun") is None,
                    reason="Open MPI's mpirun is not installed (.ci/run installs openmpi-bin)")
def test_mpirun_matches_the_launcher(tmp_path):
  """Issue 12.13: a real Open MPI launch (`mpirun -np 2`, detected as JAX
  does) trains to the launcher's params, bit for bit. With the ring all-reduce a 2 x 4
  job ends with one process's params bit for bit (the launcher's 2 x 4 ring runs:
  test_reliability's restart test, test_incidents_durable's 2x4 test), so the reference is
  one process (forked, ~3 CPU-s), not a second launched job (~12)."""
  flags = ["-m", "experiments.train", "--config=configs/default.py:smoke",
           "--config.strategy=dp", "--config.algorithm=ring"]
  _train(*flags[2:], f"--workdir={tmp_path / 'one'}")
  root = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
  out = jobs.run(
      ["mpirun", "-np", "2", "--oversubscribe", "--mca", "oob_tcp_if_include", "lo",
       "-x", "JAXCOLL_CPU_DEVICES=4", "-x", "PYTHONPATH", "-x", "PATH",
       sys.executable, *flags, f"--workdir={tmp_path / 'mpi'}"],
      devices=4, timeout=300, **(root if os.geteuid() == 0 else {}),
  )
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  mpi = _summary(tmp_path / "mpi")
  assert (mpi["num_processes"], mpi["num_devices"]) == (2, 8)
  assert mpi["params_sha256"] == _summary(tmp_path / "one")["params_sha256"]


@pytest.mark.slow  # the fast sibling: tests/run/test_stop_and_bad_input.py's SIGUSR1, 1 process
@pytest.mark.skipif(shutil.which("mpirun") is None,
                    reason="Open MPI's mpirun is not installed (.ci/run installs openmpi-bin)")
def test_sigusr1_to_mpirun_stops_every_rank_at_one_step_with_a_final_checkpoint(tmp_path,
                                                                              monkeypatch):
  """mpirun passes SIGTERM and Ctrl-C on to the ranks 1 s before SIGKILL
  (odls_base_sigkill_timeout): a job lost every step since its last checkpoint and left its
  attempt "running". It forwards SIGUSR1, which stops every rank as SIGTERM does."""
  if os.geteuid() == 0:  # jobs.stop_with's environment is this one's
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT", "1")
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
  cmd = ["mpirun", "-np", "2", "--oversubscribe", "--mca", "oob_tcp_if_include", "lo",
         "-x", "JAXCOLL_CPU_DEVICES=2", "-x", "PYTHONPATH", "-x", "PATH", sys.executable,
         "-m", "experiments.train", "--config=configs/default.py:smoke",
         "--config.steps=100000", "--config.log_every=1", "--config.checkpoint_every=100000",
         f"--workdir={tmp_path}"]
  status, err, _ = jobs.stop_with(cmd, signal.SIGUSR1, workdir=tmp_path, devices=2,
                                  timeout=120)
  assert status == 138, err[-3000:]
  steps = {line.split("after step ")[1].split(";")[0] for line in err.splitlines()
           if line.startswith("train: stopped by SIGUSR1 after step ")
           and line.endswith("; final checkpoint saved.")}
  assert len(steps) == 1, err[-3000:]
  assert os.listdir(tmp_path / "checkpoints") == list(steps)
  assert [a["status"] for a in jobs.summary(tmp_path)["attempts"]] == ["stopped"]


@pytest.mark.slow  # the recommender trains in tests/models/test_models.py, 2x4 launches elsewhere
def test_recommender_2x4_smoke_through_launcher(tmp_path):
  out = _launch(sys.executable, "-m", "experiments.train",
                "--config=configs/recommender_2x4.py:smoke", f"--workdir={tmp_path}")
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  summary = _summary(tmp_path)
  assert summary["num_processes"] == 2 and summary["config"]["algorithm"] == "hierarchical"
  assert "[p0]" in out.stdout and "[p1]" in out.stdout


def test_no_flags_runs_default_config(tmp_path):
  """`python -m experiments.train` alone, from any directory."""
  out = _train(cwd=str(tmp_path), real=True)  # the command line as a user types it
  assert "done: 200 steps" in out.stdout
  summary = _summary(tmp_path / "runs" / "default")
  assert summary["config"]["global_batch_size"] == 256 and summary["config"]["strategy"] == "dp"


def test_metrics_have_one_row_per_step_after_a_resume(tmp_path):
  """Rows logged after the last checkpoint, before a crash, are not repeated."""
  config = default.get_config("smoke")
  config.steps, config.checkpoint_every, config.log_every = 6, 3, 1
  loop.train_and_evaluate(config, str(tmp_path))
  ckpts = tmp_path / "checkpoints"
  for step_dir in ckpts.iterdir():  # as if the run had died after step 5's row
    if step_dir.name == "6":
      shutil.rmtree(step_dir)
  rows = metrics.read_metrics(str(tmp_path))
  rows_path = tmp_path / "metrics.jsonl"
  rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= 5))
  summary = loop.train_and_evaluate(config, str(tmp_path))
  assert summary["start_step"] == 3
  rows = metrics.read_metrics(str(tmp_path))
  assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]
  assert [r["step"] for r in rows if "checkpoint_time_s" in r] == [3, 6]  # 3's row kept once
  # A checkpoint newer than config.steps is not undone: the summary says so.
  config.steps = 4
  assert loop.train_and_evaluate(config, str(tmp_path))["steps"] == 6



@pytest.mark.parametrize("module,args,flag", [
    ("bench_collectives", ["-e", "4K", "-n", "1", "-w", "0", "--algorithms=native"], "--json"),
    ("bench_collectives", ["-e", "4K", "-n", "1", "-w", "0", "--algorithms=native"], "--csv"),
    ("tune", ["--collectives=broadcast", "--min_bytes=4K", "--max_bytes=4K", "--iters=1",
              "--warmup_iters=0"], "--out"),
    ("tune", ["--collectives=broadcast", "--min_bytes=4K", "--max_bytes=4K", "--iters=1",
              "--warmup_iters=0", "--out=OK"], "--json"),
    ("simulate", ["--max_bytes=4K", "--max_gpus=16"], "--out"),
    ("memory_plan", ["--budget_mb=0.5", "--width=32", "--max_layers=2"], "--json"),
    ("bench_trainer", ["--steps=1", "--warmup=0"], "--json"),
    ("compile_time", ["--devices=2"], "--json"),
    ("bench_pytree", ["--leaves=2", "--mbytes=0.01", "--iters=1"], "--json"),
    ("scale_ceiling", [], "--out"),
    ("zero3_memory", [], "--json"),
    ("bench_incidents", [], "--json"),
], ids=["bench-json", "bench-csv", "tune-out", "tune-json", "simulate-out", "memory_plan-json",
        "bench_trainer-json", "compile_time-json", "bench_pytree-json", "scale_ceiling-out", "zero3_memory-json",
        "bench_incidents-json"])
def test_an_output_path_that_cannot_be_written_is_one_line_before_measuring(
    tmp_path, module, args, flag):
  # Each wrote its results at the end: a path under a file was a FileNotFoundError /
  # NotADirectoryError traceback (exit 1) after every measurement, the results lost; tune's
  # --out=DIR left DIR.tmp behind.
  afile = tmp_path / "a_file"
  afile.write_text("")
  args = [a.replace("OK", str(tmp_path / "t.json")) for a in args]
  cases = ((f"{afile}/x.json", "is a file, not a directory"),
           (str(tmp_path), "is a directory; give the"))
  if flag == "--out" and module != "tune":  # a directory
    cases = ((str(afile), "is a file, not a directory"),
             (f"{afile}/sub", "cannot write in the directory"))
  for bad, says in cases:
    out = jobs.forked([sys.executable, "-m", f"experiments.{module}", *args, f"{flag}={bad}"],
                      timeout=300)
    line = jobs.one_line(out, prefix=f"{module}: error: `{flag}`=")
    assert says in line, line
  if flag == "--json" and module != "bench_collectives":  # (bench's: tests/observe/test_bench)
    # An empty --json= measured everything, wrote nothing and exited 0.
    out = jobs.forked([sys.executable, "-m", f"experiments.{module}", *args, f"{flag}="],
                      timeout=300)
    line = jobs.one_line(out, prefix=f"{module}: error: `{flag}` is empty; give the JSON file")
  if flag == "--out" and module in ("simulate", "scale_ceiling"):
    # An empty --out= simulated everything, wrote nothing and exited 0.
    out = jobs.forked([sys.executable, "-m", f"experiments.{module}", *args, f"{flag}="],
                      timeout=300)
    line = jobs.one_line(out, prefix=f"{module}: error: `{flag}` is empty; give the directory")
  assert sorted(os.listdir(tmp_path)) == ["a_file"]  # nothing written, nothing left behind


def test_bench_pytree_runs_a_packed_tree_as_one_ring_and_leaf_by_leaf_as_one_per_leaf(tmp_path):
  out = jobs.forked([sys.executable, "-m", "experiments.bench_pytree", "--leaves=3",
                     "--mbytes=0.01", "--iters=1", "--algorithms=ring,native",
                     f"--json={tmp_path}/b.json"], timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  rows = {r["mode"]: r for r in json.loads((tmp_path / "b.json").read_text())}
  assert sorted(rows) == ["packed", "per_leaf", "xla"]
  # 8 devices: a ring all-reduce is 2 * 7 collective-permutes; leaf by leaf, one ring a leaf.
  assert rows["packed"]["collective_permutes"] == 14
  assert rows["per_leaf"]["collective_permutes"] == 3 * 14
  assert rows["xla"]["collective_permutes"] == 0 and rows["xla"]["compile_vs_native"] == 1.0
  assert "ring       packed" in out.stdout
  line = jobs.one_line(jobs.forked([sys.executable, "-m", "experiments.bench_pytree",
                                    "--algorithms=rign"]), prefix="bench_pytree: error: ")
  assert "`--algorithms`='rign': valid choices: native, ring" in line, line


@pytest.mark.parametrize("given,says", [
    ("default:smok", "variant 'smok' of"),  # a typo of a shipped config's variant
    ("configs/default.py:smoke,smok", "variant 'smok' (of 'smoke,smok') of"),
    ("configs/big_zero3.py:smoke", "variants it handles: small;"),  # it has no smoke variant
    # A file that reads `variant == "smoke"` has no :files: the whole variant is named.
    ("configs/minimal.py:smoke,files", "variant 'smoke,files' of"),
], ids=["typo", "typo_in_a_list", "big_zero3_smoke", "no_files_variant"])
def test_a_config_variant_that_changes_nothing_is_one_line_naming_the_ones_it_has(
    given, says, tmp_path):
  """`default:smok` ran the full 200-step config, and the line said the file handles no
  variant; `:smoke,smok` ran the smoke one silently; big_zero3's `:smoke`, the 168M model."""
  line = jobs.one_line(jobs.train_forked(f"--config={given}", f"--workdir={tmp_path}/run"),
                       prefix="train: error: ")
  assert says in line and "changes nothing" in line, line
  if "default" in given:
    assert "variants it handles: files, smoke; e.g. --config=" in line and line.endswith(
        "default.py:smoke"), line
  assert not os.listdir(tmp_path)  # nothing written
  shards = jobs.forked([sys.executable, "-m", "experiments.make_shards", f"--config={given}",
                        f"--out={tmp_path}/shards"])
  assert says in jobs.one_line(shards, prefix="make_shards: error: ")
  assert not os.listdir(tmp_path)


def test_a_config_variant_part_another_part_makes_redundant_is_a_variant(tmp_path,
                                                                        monkeypatch):
  """`:smoke,tiny` where `smoke` sets what `tiny` sets: the config without `tiny` was the
  whole one, so `tiny`, a variant the file has, was refused as changing nothing. A typo
  beside it is still named, and so is one given as `--config FILE:VARIANT` (absl reads
  that form too; the check read only `--config=`, and ran `default.py:smok`, the full
  200-step config)."""
  path = tmp_path / "two.py"
  path.write_text(
      "import ml_collections\n\n\n"
      "def get_config(variant=None):\n"
      "  c = ml_collections.ConfigDict({'steps': 100, 'width': 64})\n"
      "  if 'tiny' in (variant or '').split(','):\n"
      "    c.width = 8\n"
      "  if 'smoke' in (variant or '').split(','):\n"
      "    c.steps, c.width = 2, 8\n"
      "  return c\n")
  spec = importlib.util.spec_from_file_location("config_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  monkeypatch.setitem(sys.modules, "config_config", module)  # as config_flags keeps it
  for given in ([f"--config={path}:smoke,tiny"], ["--config", f"{path}:smoke,tiny"]):
    _cli.check_config_variant(["train", *given])
  for given in ([f"--config={path}:smoke,tin"], ["--config", f"{path}:smoke,tin"]):
    with pytest.raises(ValueError, match=r"variant 'tin' \(of 'smoke,tin'\) of .*two.py "
                       r"changes nothing .*variants it handles: smoke, tiny;"):
      _cli.check_config_variant(["train", *given])


def test_demo_and_compile_time_are_quiet_and_say_bad_flags_in_one_line():
  """`make demo` printed JAX's `Unable to initialize backend 'tpu'` INFO line above its table
  (every other command hides it), and these two commands answered a bad flag with absl's
  `FATAL Flags parsing error`, exit 1; `compile_time --devices=abc`, a ValueError traceback."""
  demo = jobs.forked([sys.executable, "-m", "experiments.demo_collectives", "--bytes=4K",
                      "--iters=1"])
  assert demo.returncode == 0, demo.stderr[-2000:]
  assert "Unable to initialize backend" not in demo.stderr, demo.stderr[-2000:]
  rows = demo.stdout.splitlines()[2:]
  assert [r.split()[:2] for r in rows] == [[a, "OK"] for a in jaxcoll.algorithms("all_reduce")]
  assert all(r.split()[3] == r.split()[4] for r in rows)  # sent/device equals the textbook's
  for cmd, says in ((["experiments.demo_collectives", "--nosuch"], "'nosuch'"),
                    (["experiments.compile_time", "--devices=abc"], "`--devices`='abc'")):
    out = jobs.forked([sys.executable, "-m", *cmd])
    assert says in jobs.one_line(out, prefix=f"{cmd[0].split('.')[1]}: error: ")


def test_a_resume_with_checkpoint_every_0_saves_its_last_step_and_says_so(tmp_path, caplog):
  """README: a run with checkpoint_every=0 that resumes from a checkpoint also saves its last
  step "and says so once"; the line went to absl's INFO, which the command line hides (it
  shows the `jaxcoll` logger's, as the resume line)."""
  config = minimal.get_config("smoke")
  config.steps, config.checkpoint_every = 2, 2
  loop.train_and_evaluate(config, str(tmp_path))
  with caplog.at_level(logging.INFO, logger="jaxcoll"):
    loop.train_and_evaluate(minimal.get_config("smoke"), str(tmp_path))  # 4 steps, every 0
  assert sorted(int(d) for d in os.listdir(tmp_path / "checkpoints")) == [2, 4]
  said = [m for m in caplog.messages if "checkpoint_every is 0" in m]
  assert len(said) == 1 and "resumes from checkpoint 2: its last step is saved too" in said[0], \
      caplog.messages
