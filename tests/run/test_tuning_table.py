"""`--config.tuning_table=PATH`: the run's `algorithm=auto` consults the table the user
measured (`jaxcoll tune --out=PATH`), not only the shipped one."""

import jax
import jobs
import pytest

from configs import minimal
from jaxcoll.comm_model import tuning
from jaxcoll.run import loop
from jaxcoll.run.config_error import ConfigError


def _table(path, algorithm: str) -> str:
  entries = {"all_reduce": {str(jax.device_count()): {"float32": [
      {"algorithm": algorithm, "max_bytes": None}]}}}
  tuning.save(tuning.TuningTable(tuning.device_kind(), entries), str(path))
  return str(path)


def _run(tmp_path, name, **fields):
  config = minimal.get_config("smoke")
  config.steps, config.log_every, config.checkpoint_every = 3, 3, 0
  for key, value in fields.items():
    setattr(config, key, value)
  return loop.train_and_evaluate(config, str(tmp_path / name))


def test_auto_trains_with_the_users_table_and_the_table_in_use_comes_back(tmp_path):
  # The shipped CPU table picks native; the user's table picks ring, and auto then trains
  # exactly as algorithm=ring does (the tree of sums differs from native's).
  ring = _run(tmp_path, "ring", algorithm="ring")["params_sha256"]
  native = _run(tmp_path, "native", algorithm="native")["params_sha256"]
  assert ring != native  # else the test could not tell which table auto read
  before = tuning.active_table()
  table = _table(tmp_path / "mine.json", "ring")
  assert _run(tmp_path, "auto_mine", tuning_table=table)["params_sha256"] == ring
  assert tuning.active_table() is before  # the run's table was for that run only
  assert _run(tmp_path, "auto", algorithm="auto")["params_sha256"] == native


@pytest.mark.parametrize("what,says", [
    ("missing", "`config.tuning_table`=.* cannot be read"),
    ("not_a_table", "Not a jaxcoll tuning table"),
    ("not_auto", "only algorithm=auto reads a tuning table"),
])
def test_a_bad_tuning_table_is_one_line_before_anything_is_written(tmp_path, what, says):
  path = tmp_path / "t.json"
  if what == "not_a_table":
    path.write_text('{"rows": []}')
  elif what == "not_auto":
    _table(path, "ring")
  fields = dict(tuning_table=str(path))
  if what == "not_auto":
    fields["algorithm"] = "ring"
  with pytest.raises((ConfigError, ValueError), match=says) as e:
    _run(tmp_path, "run", **fields)
  assert "\n" not in str(e.value)
  assert not (tmp_path / "run").exists()


def test_the_command_line_takes_a_tuning_table(tmp_path):
  table = _table(tmp_path / "mine.json", "ring")
  out = jobs.train_forked(jobs.SMOKE, f"--workdir={tmp_path}/run", "--config.steps=2",
                          f"--config.tuning_table={table}")
  assert out.returncode == 0, out.stderr[-2000:]
  bad = jobs.train_forked(jobs.SMOKE, f"--workdir={tmp_path}/bad", "--config.steps=2",
                          f"--config.tuning_table={tmp_path}/nope.json")
  line = jobs.one_line(bad, prefix="train: error: ")
  assert "nope.json" in line and "No such file" in line, line


def test_processes_whose_tables_differ_are_one_line(tmp_path, monkeypatch):
  # Another file at that path on process 1's host: its digest differs from process 0's.
  import numpy as np  # noqa: PLC0415

  table = _table(tmp_path / "mine.json", "ring")
  monkeypatch.setattr(loop.jax, "process_count", lambda: 2)
  monkeypatch.setattr(loop.multihost_utils, "process_allgather",
                      lambda row: np.stack([row, 255 - row]))
  with pytest.raises(ConfigError, match=r"differs between processes 0 and 1 \(another file "
                     r"at that path on their hosts\)"):
    loop._use_tuning_table(table)
  monkeypatch.setattr(loop.multihost_utils, "process_allgather",
                      lambda row: np.stack([row, row]))
  with tuning.kept():
    loop._use_tuning_table(table)  # the same everywhere: used
    assert tuning.active_table().lookup("all_reduce", jax.device_count(), "float32", 64) == "ring"


def test_a_process_that_cannot_read_the_table_still_takes_part_in_the_check(tmp_path,
                                                                            monkeypatch):
  # The file missing on process 1's host only: process 1 must join the digest allgather the
  # others are in (it went straight to _decided_together's allgather, of another size: gloo
  # aborted the job, "Received data size doesn't match expected size", exit 134), and the
  # process that could read it says which one could not.
  import numpy as np  # noqa: PLC0415

  table = _table(tmp_path / "mine.json", "ring")
  calls = []

  def allgather(row, good):
    calls.append(row)
    return np.stack([row, good])

  monkeypatch.setattr(loop.jax, "process_count", lambda: 2)
  real_load = tuning.load
  monkeypatch.setattr(tuning, "load", lambda path: (_ for _ in ()).throw(
      FileNotFoundError(2, "No such file or directory", path)))
  good = np.ones(33, np.uint8)
  monkeypatch.setattr(loop.multihost_utils, "process_allgather", lambda r: allgather(r, good))
  with tuning.kept(), pytest.raises(ConfigError, match="No such file"):
    loop._use_tuning_table(table)  # this process cannot read it
  assert len(calls) == 1 and calls[0][0] == 0  # it took part, flagged as unread
  monkeypatch.setattr(tuning, "load", real_load)
  unread = np.zeros(33, np.uint8)
  monkeypatch.setattr(loop.multihost_utils, "process_allgather",
                      lambda r: allgather(r, unread))
  with tuning.kept(), pytest.raises(ConfigError, match=r"cannot be read on process 1"):
    loop._use_tuning_table(table)  # this one can; process 1 cannot


def test_a_run_trained_with_a_table_evaluates_with_another_algorithm(tmp_path):
  # The saved config's table came with it into eval, where --config.algorithm=native was
  # refused ("only algorithm=auto reads a tuning table"), a flag the user never gave.
  from jaxcoll.run import eval_only  # noqa: PLC0415

  table = _table(tmp_path / "mine.json", "ring")
  config = minimal.get_config("smoke")
  config.steps, config.checkpoint_every, config.tuning_table = 2, 2, table
  loop.train_and_evaluate(config, str(tmp_path / "run"))
  row = eval_only.evaluate_checkpoint(str(tmp_path / "run"), overrides={"algorithm": "native"})
  assert row["step"] == 2 and row["eval_loss"] > 0
  with pytest.raises(ConfigError, match="`config.tuning_table`=.* cannot be read"):
    eval_only.evaluate_checkpoint(str(tmp_path / "run"),
                                  overrides={"tuning_table": str(tmp_path / "nope.json")})
  before = tuning.active_table()
  eval_only.evaluate_checkpoint(str(tmp_path / "run"), overrides={"tuning_table": table})
  assert tuning.active_table() is before  # the evaluation's table was for it only
