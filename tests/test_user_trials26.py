"""Cases a user brought that no other test had tried (engineer trial26): their own data,
cluster and jobs; evaluation and the run report on run directories a user handled by hand.
Each test of a fix fails without it."""

import json
import os
import shutil
import signal
import warnings

import pytest

from jaxcoll.observe import metrics, run_report
from jaxcoll.run import attempts, config, eval_only, hooks, loop, watchdog

# Orbax's asynchronous saves can complete into its closed event loop (harmless; see
# tests/train/test_checkpoint.py).
pytestmark = pytest.mark.filterwarnings(
  "ignore:(?s).*Event loop is closed:pytest.PytestUnraisableExceptionWarning"
)


def _eval_row(step, evaluated_at):
  return {"step": step, "eval_loss": 1.0 / step, "eval_examples": 10, "eval_data": "synthetic",
          "strategy": "DP(auto)", "num_devices": 8, "eval_time_s": 0.1,
          "evaluated_at": evaluated_at}


def test_an_eval_row_appended_after_a_torn_line_is_kept(tmp_path):
  """`experiments.eval` killed mid-write leaves a torn last line in evals.jsonl; the next
  `experiments.eval` said `recorded in .../evals.jsonl` but its row was glued to the torn
  line, and every reader (the report's `eval-only` line) dropped both: the newest evaluation
  lost without a word. Now the torn line is ended first: the row is read, the torn line is
  named and dropped."""
  (tmp_path / "metrics.jsonl").write_text('{"step": 10, "loss": 0.5, "step_time_s": 0.01}\n')
  metrics.append_eval_row(_eval_row(5, 1.0), str(tmp_path))
  with open(tmp_path / metrics.EVALS_NAME, "a") as f:
    f.write('{"step": 7, "eval_lo')  # killed mid-write
  metrics.append_eval_row(_eval_row(10, 3.0), str(tmp_path))
  with pytest.warns(metrics.TornLineWarning, match=r"line 2 \(not a JSON row\)"):
    rows = metrics.read_eval_rows(str(tmp_path))
  assert [r["step"] for r in rows] == [5, 10]
  with pytest.warns(metrics.TornLineWarning):
    run = run_report.load_run(str(tmp_path))
  assert "at checkpoint 10" in run_report.summarize(run)


@pytest.mark.parametrize("line", ["garbage{", "[1, 2]", '"text"', '{"eval_loss": 0.5}',
                                  '{"step": "3", "eval_loss": 0.5}'])
def test_a_line_of_evals_jsonl_that_is_not_a_row_is_a_warning_naming_it(line, tmp_path):
  """A line of evals.jsonl (or incidents.jsonl) that is not a JSON object with an integer
  step (a hand edit, a line of another tool) was skipped without a word, where the same
  line in metrics.jsonl is a TornLineWarning naming it. Now it is the same warning, with
  the file's own line number."""
  path = tmp_path / metrics.EVALS_NAME
  good = json.dumps(_eval_row(4, 1.0))
  path.write_text(f"{good}\n\n{line}\n{good}\n")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    rows = metrics.read_eval_rows(str(tmp_path))
  assert [r["step"] for r in rows] == [4, 4]
  (warning,) = caught
  assert warning.category is metrics.TornLineWarning
  assert f"line 3 (not a JSON row) of {path}" in str(warning.message), warning.message
  assert line[:8] in str(warning.message)


class _SigtermBefore(hooks.Hook):
  """A preemption notice (SIGTERM to this process) just before step ``step``."""

  def __init__(self, step):
    self.step = step

  def before_step(self, step, batch, state):
    if step == self.step:
      os.kill(os.getpid(), signal.SIGTERM)
    return batch, state


def test_a_stopped_attempt_names_the_digest_of_the_params_it_saved(tmp_path):
  """A job preempted (SIGTERM) saves a final checkpoint and exits 143, but its summary.json
  named no parameters at all: `attempts[-1]` said `"stopped"` at step 3, and with no
  completed attempt before it there was no `params_sha256` anywhere, so nothing told which
  params the final checkpoint holds (to compare with `experiments.eval`'s row, or a rerun).
  Now the stopped attempt carries the digest of the params it stopped with: the same as
  the checkpoint restores."""
  c = config.RunConfig(model_overrides={"widths": (16,), "input_dim": 8}, steps=8,
                       global_batch_size=16, checkpoint_every=5, log_every=1)
  with pytest.raises(watchdog.StopRequested) as stopped:
    loop.train_and_evaluate(c, str(tmp_path), hooks=[_SigtermBefore(3)])
  assert (stopped.value.step, stopped.value.saved) == (3, True)
  summary = attempts.read_summary(str(tmp_path))
  (attempt,) = summary["attempts"]
  assert (attempt["status"], attempt["end_step"]) == ("stopped", 3)
  row = eval_only.evaluate_checkpoint(str(tmp_path), step=3)
  assert attempt["params_sha256"] == row["params_sha256"]
  assert attempt["params_global_norm"] == pytest.approx(row["params_global_norm"], rel=1e-6)
  assert "params_sha256" not in summary  # the top level stays the last completed attempt's


@pytest.mark.parametrize("uri", ["123;tcp://10.0.0.1:34911", "1531576320.0;udp://10.0.0.1"],
                         ids=["job_id_not_a_number", "no_tcp_address"])
def test_a_malformed_open_mpi_uri_is_one_line_naming_it(fresh, uri):
  """An `OMPI_MCA_orte_hnp_uri` that is not Open MPI's form (a stale or hand-set value in a
  shell or module file) was JAX's traceback from inside `settings()`: `ValueError: invalid
  literal for int() with base 10: '123;tcp://10'` (or its `RuntimeError: Could not parse
  coordinator IP address`), where the Slurm variables are each one line naming them. Now it
  is one line naming the variable, its value, the form and the fix (the CLI's exit 2)."""
  from jaxcoll.runtime import distributed  # noqa: PLC0415

  fresh.setenv("OMPI_MCA_orte_hnp_uri", uri)
  fresh.setenv("OMPI_COMM_WORLD_SIZE", "2")
  fresh.setenv("OMPI_COMM_WORLD_RANK", "0")
  with pytest.raises(ValueError, match=r"`OMPI_MCA_orte_hnp_uri`=.* is not Open MPI's") as e:
    distributed.settings()
  assert uri in str(e.value) and "unset OMPI_MCA_orte_hnp_uri" in str(e.value)
  fresh.setenv("OMPI_MCA_orte_hnp_uri", "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911")
  assert distributed.settings().coordinator == "10.96.0.1:62624"  # JAX's rule, as before


@pytest.fixture(scope="module")
def trained_with_checkpoints(tmp_path_factory):
  """A finished run with checkpoints 2 and 4 (trained once, copied by each test)."""
  workdir = tmp_path_factory.mktemp("trained")
  c = config.RunConfig(model_overrides={"widths": (16,), "input_dim": 8}, steps=4,
                       global_batch_size=16, checkpoint_every=2, log_every=2)
  loop.train_and_evaluate(c, str(workdir))
  return workdir


@pytest.mark.parametrize("damage", ["intact", "state_of_another_step", "bytes_overwritten",
                                    "meta_deleted"])
def test_the_report_does_not_name_a_damaged_checkpoint_as_the_resume_point(
    trained_with_checkpoints, tmp_path, damage):
  """`experiments.report` said `checkpoints on disk: 2, 4 (newest 4: a resume starts there)`
  for a checkpoint 4 whose arrays were damaged (overwritten bytes; its state/ copied from
  another step, or its meta/ deleted, a hand-mended run directory), which a resume and
  `experiments.eval` skip as
  damaged and go back to 2. Now the report checks the newest checkpoints' arrays against the
  fingerprints of their save, as a resume does, and names the damaged one and why."""
  workdir = tmp_path / "run"
  shutil.copytree(trained_with_checkpoints, workdir)
  four = workdir / "checkpoints" / "4"
  if damage == "state_of_another_step":
    shutil.rmtree(four / "state")
    shutil.copytree(workdir / "checkpoints" / "2" / "state", four / "state")
  elif damage == "meta_deleted":
    shutil.rmtree(four / "meta")
  elif damage == "bytes_overwritten":
    for root, _, files in os.walk(four / "state"):
      for name in files if os.path.basename(root) == "d" else ():
        with open(os.path.join(root, name), "r+b") as f:
          f.seek(f.seek(0, os.SEEK_END) // 2)
          f.write(bytes(range(256)) * 4)
  line = run_report.checkpoints_on_disk(str(workdir))
  if damage == "intact":
    assert line == "checkpoints on disk: 2, 4 (newest 4: a resume starts there)"
    return
  assert line.startswith("checkpoints on disk: 2 (newest 2: a resume starts there); damaged: 4 ("
                         ), line
  assert line.endswith(": a resume skips it)"), line
  why = {"state_of_another_step": "the bytes of 15 leaf(s) differ from what was saved: "
                                  "['opt_state'][0].count, ",
         "bytes_overwritten": "its arrays cannot be read",
         "meta_deleted": "its meta/ directory is gone"}[damage]
  assert why in line, line
  restored = eval_only.evaluate_checkpoint(str(workdir))  # what a restore finds: step 2
  assert restored["step"] == 2



def test_the_report_counts_any_failure_to_read_arrays_as_damage(trained_with_checkpoints,
                                                                 tmp_path, monkeypatch):
  """A restore counts any failure to read a checkpoint's arrays as damage; the report's check
  caught only OSError / ValueError, so orbax raising a KeyError (or TypeError, RuntimeError)
  on a damaged array was a traceback from `experiments.report` (review of stop 41)."""
  workdir = tmp_path / "run"
  shutil.copytree(trained_with_checkpoints, workdir)

  def broken(state):
    raise KeyError("d/3a4b")

  monkeypatch.setattr(run_report, "_read_arrays", broken)
  line = run_report.checkpoints_on_disk(str(workdir))
  assert line == (
      "checkpoints on disk: none complete (a resume starts from step 0); damaged: 2 (its "
      "arrays cannot be read (KeyError: 'd/3a4b'): a resume skips it); damaged: 4 (its arrays "
      "cannot be read (KeyError: 'd/3a4b'): a resume skips it)")

def _clicks(n, seed):
  import numpy as np  # noqa: PLC0415
  import pyarrow as pa  # noqa: PLC0415

  x = np.random.default_rng(seed).normal(size=(n, 4)).astype(np.float32)
  return pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 4),
                   "label": (x[:, 0] > 0).astype(np.int32)})


def test_parquet_files_named_pq_or_parq_are_read_by_the_trainer_and_by_make_shards(tmp_path):
  """Dask and fastparquet name Parquet files `.parq`: in a directory beside `.parquet` files
  they were skipped without a word (the trainer and make_shards read half the rows), and
  alone the directory "holds no data file". `make_shards --input` refused `.pq` files
  (`must be files of one kind ... got ['.pq']`, a directory of them "matches no file"),
  the very name the trainer reads. Now both read Parquet under all three names."""
  import pyarrow.parquet as pq  # noqa: PLC0415

  from jaxcoll.data import convert, sources  # noqa: PLC0415

  data = tmp_path / "clicks"
  data.mkdir()
  pq.write_table(_clicks(30, 0), data / "a.parquet")
  pq.write_table(_clicks(20, 1), data / "b.parq")
  pq.write_table(_clicks(10, 2), data / "c.pq")
  assert [os.path.basename(p) for p in sources.directory_files(str(data))] == [
      "a.parquet", "b.parq", "c.pq"]
  assert len(sources.open_source(str(data))) == 60
  assert convert.open_input(str(data)).rows == 60
  assert convert.open_input(str(data / "c.pq")).rows == 10
  assert convert.open_input(str(data / "*.pq")).rows == 10


def test_make_shards_reads_hive_parquet_files_without_an_extension_as_the_trainer_does(tmp_path):
  """A Hive / Impala table's files are Parquet named `000000_0`: the trainer reads them by
  their PAR1 magic (in a directory or a glob), but `make_shards --input` said the directory
  "matches no file" and the glob "must be files of one kind ..., got ['']", so such a table
  could not be rewritten with other row groups (`--row_group_size`, what the trainer's
  warning about large row groups advises). Now make_shards reads them as the trainer does."""
  import pyarrow.parquet as pq  # noqa: PLC0415

  from jaxcoll.data import convert, sources  # noqa: PLC0415

  table = tmp_path / "warehouse" / "clicks" / "dt=2024-01-01"
  table.mkdir(parents=True)
  pq.write_table(_clicks(30, 0), table / "000000_0")
  pq.write_table(_clicks(20, 1), table / "000001_0")
  (table / "_SUCCESS").write_text("")
  top = tmp_path / "warehouse" / "clicks"
  assert len(sources.open_source(str(top))) == 50  # the trainer's reading
  assert convert.open_input(str(top)).rows == 50
  assert convert.open_input(str(table / "0*")).rows == 50


def test_a_line_of_incidents_jsonl_that_is_not_a_row_is_skipped_with_a_warning(tmp_path):
  """incidents.jsonl with a line that is JSON but not an object (a hand edit: `[1, 2]`)
  stopped the resume (`AttributeError: 'list' object has no attribute 'get'`) and the
  summary (`TypeError`); and a row appended after a torn last line (a kill mid-write) was
  glued to it and lost, to the resume's replay of incidents and to the report. Now such a
  line is skipped with a TornLineWarning naming it, and every row starts a line of its own."""
  from jaxcoll.run import incidents  # noqa: PLC0415

  watch = incidents.Watch(incidents.DEFAULTS, str(tmp_path), is_chief=True, process_count=1)
  row = {"step": 3, "signal": "loss_spike", "value": 9.0, "threshold": 4.0, "action": "warn"}
  watch._write(row)
  with open(tmp_path / incidents.LOG_NAME, "a") as f:
    f.write("[1, 2]\n")
    f.write('{"step": 4, "signal": "loss_sp')  # killed mid-write
  watch._write({**row, "step": 5})
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert [r["step"] for r in incidents.read_log(str(tmp_path))] == [3, 5]
    assert watch.summary()["incidents"]["total"] == 2
  said = [str(w.message) for w in caught if w.category is metrics.TornLineWarning]
  assert len(said) == 4, said  # lines 2 and 3, by each of the two reads
  assert "line 2 (not a JSON row)" in said[0] and "line 3 (not a JSON row)" in said[1], said


def test_npy_files_are_one_line_that_says_how_to_convert_them(tmp_path, monkeypatch):
  """`--config.data.train=x.npy` said "rename them or write them with python -m
  experiments.make_shards", and make_shards then refused them ("must be files of one kind
  ..., got ['.npy']"): a dead end for the most common array file. Both now say what to do
  (one .npz, a name each, then make_shards), and that command works."""
  import numpy as np  # noqa: PLC0415

  from jaxcoll.data import convert, sources  # noqa: PLC0415

  x = np.random.default_rng(0).normal(size=(40, 4)).astype(np.float32)
  np.save(tmp_path / "x.npy", x)
  np.save(tmp_path / "y.npy", (x[:, 0] > 0).astype(np.int32))
  for call in (lambda: sources.open_source(str(tmp_path / "x.npy")),
               lambda: convert.open_input(str(tmp_path / "*.npy"))):
    with pytest.raises(ValueError, match=r"names \.npy files.*np\.savez\('data\.npz', "
                                         r"features=np\.load\('x\.npy'\)"):
      call()
  monkeypatch.chdir(tmp_path)  # the line's own commands, pasted
  np.savez("data.npz", features=np.load("x.npy"), label=np.load("y.npy"))
  assert convert.open_input("data.npz").rows == 40


def test_eval_only_on_eval_files_that_moved_says_to_pass_where_they_are_now(tmp_path):
  """The eval files a run trained with moved (a scratch directory purged, the data copied to
  the project space): `experiments.eval` said `data.eval`=... matches no file; give a glob
  ... (write them with make_shards)`, though the glob was the checkpoint's saved config, not
  one the user gave. The line now says so and names the flag that points it elsewhere, and
  that flag evaluates."""
  import numpy as np  # noqa: PLC0415
  import pyarrow as pa  # noqa: PLC0415
  import pyarrow.parquet as pq  # noqa: PLC0415

  data = tmp_path / "scratch"
  data.mkdir()
  x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
  pq.write_table(pa.table({"inputs": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 4),
                           "labels": (x[:, 0] > 0).astype(np.int32)}), data / "eval.parquet")
  c = config.RunConfig(model_overrides={"widths": (16,), "input_dim": 4}, steps=2,
                       global_batch_size=16, checkpoint_every=2, log_every=1,
                       data=config.DataConfig(eval=str(data / "*.parquet")))
  workdir = tmp_path / "run"
  loop.train_and_evaluate(c, str(workdir))
  moved = tmp_path / "project"
  data.rename(moved)
  with pytest.raises(config.ConfigError) as e:
    eval_only.evaluate_checkpoint(str(workdir))
  assert str(e.value).startswith(f"`data.eval`={str(data / '*.parquet')!r} matches no file")
  assert str(e.value).endswith("; it is the glob of checkpoint 2's saved config: pass "
                               "--config.data.eval=GLOB where the files are now.")
  row = eval_only.evaluate_checkpoint(
      str(workdir), overrides={"data.eval": str(moved / "*.parquet")})
  assert (row["step"], row["eval_examples"]) == (2, 64)


@pytest.mark.parametrize("name", ["Inputs", "input"])
def test_a_column_named_almost_as_the_model_reads_it_is_named_in_the_line(tmp_path, name):
  """Files written by another team's pipeline name the column `Inputs` (or `input`): the line
  said the files lack 'inputs' and listed their columns, as for data that is not there.
  Now it names the near one and says names are matched exactly, with the two fixes."""
  import numpy as np  # noqa: PLC0415
  import pyarrow as pa  # noqa: PLC0415
  import pyarrow.parquet as pq  # noqa: PLC0415

  x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
  pq.write_table(pa.table({name: pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 4),
                           "labels": (x[:, 0] > 0).astype(np.int32)}), tmp_path / "a.parquet")
  c = config.RunConfig(model_overrides={"widths": (16,), "input_dim": 4}, steps=2,
                       global_batch_size=16, data=config.DataConfig(train=str(tmp_path)))
  with pytest.raises(config.ConfigError) as e:
    loop.train_and_evaluate(c, str(tmp_path / "run"))
  assert (f"the model needs column 'inputs', which the files lack; they have {name!r} (column "
          "names are matched exactly") in str(e.value), e.value
  assert "rename it in the files" in str(e.value) and not (tmp_path / "run").exists()


def test_a_launcher_command_without_the_separator_says_to_put_it(capfd):
  """`python -m jaxcoll.launch --num_processes=3 --devices_per_process=2 python -m
  experiments.train ...` (the `--` forgotten, as torchrun needs none) was argparse's
  "unrecognized arguments: python -m experiments.train ...". Now the line says that looks
  like the command and shows the whole command line with `--` in place (exit 2)."""
  from jaxcoll.runtime import launch  # noqa: PLC0415

  status = launch.main(["--num_processes=3", "--devices_per_process=2", "python", "-m",
                        "experiments.train", "--workdir=/tmp/x y"])
  assert status == 2
  err = capfd.readouterr().err
  assert ("looks like the command to run: put `--` before it, `python -m jaxcoll.launch "
          "--num_processes=3 --devices_per_process=2 -- python -m experiments.train "
          "'--workdir=/tmp/x y'`") in err, err
  assert len(err.strip().splitlines()) == 1


def test_a_run_directory_given_without_its_flag_is_shown_as_the_flag(tmp_path, capsys):
  """`python -m experiments.report /tmp/run` (as `tensorboard --logdir` users type it, or
  `ls`-style) said "unexpected arguments ['/tmp/run']; every option is a --flag": the fix
  left to guess. A single argument that is an existing path is now shown as the flag that
  takes it (report, eval, train: --workdir; make_shards: --input), quoted for the shell."""
  from experiments import _cli  # noqa: PLC0415

  run = tmp_path / "my run"
  run.mkdir()
  with pytest.raises(SystemExit) as e:
    _cli.no_positional("report", ["report", str(run)], path_flag="workdir")
  assert e.value.code == 2
  assert capsys.readouterr().err == (
      f"report: error: unexpected argument {str(run)!r}; every option is a --flag: "
      f"--workdir='{run}'\n")
  with pytest.raises(SystemExit):  # not a path: as before
    _cli.no_positional("report", ["report", "foo", "bar"], path_flag="workdir")
  assert "unexpected arguments ['foo', 'bar']; every option is a --flag." in capsys.readouterr().err
  _cli.no_positional("report", ["report"], path_flag="workdir")  # nothing extra: goes on
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415

  out = subprocess.run([sys.executable, "-m", "experiments.report", str(run)],
                       capture_output=True, text=True, timeout=300, check=False)
  assert out.returncode == 2 and out.stderr.endswith(f"--workdir='{run}'\n"), out.stderr
