"""Error-feedback residuals in checkpoints: a plain resume continues exactly.

The model is tests/mlp_task.py's tiny MLP. A checkpoint keeps the
compressed data parallelism's residuals next to the layout-free canonical
state; a trainer of the same residual layout gets them back, another one
(device count, compression, buckets) starts them at zero with a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import warnings
import jax
import jobs
import numpy as np
import optax
import pytest
from mlp_task import GLOBAL_BATCH, WIDTHS, init_mlp, mse

def batch_at(step, size=GLOBAL_BATCH, widths=WIDTHS):
  rng = np.random.default_rng(1000 + step)
  x = rng.normal(size=(size, widths[0])).astype(np.float32)
  y = np.tanh(x @ np.ones((widths[0], widths[-1]), np.float32)) + 0.1 * rng.normal(
    size=(size, widths[-1]))
  return {"x": x, "y": y.astype(np.float32)}


def run(trainer, state, start, stop):
  for step in range(start, stop):
    state, _ = trainer.step(state, batch_at(step))
  return state


def sha(tree) -> str:
  h = hashlib.sha256()
  for x in jax.tree.leaves(tree):
    h.update(np.asarray(x, np.float32).tobytes())
  return h.hexdigest()


def trainer_for(compression, n=8, **kwargs):
  import jaxcoll
  from jaxcoll.train import DataParallel, Trainer

  return Trainer(mse, optax.adam(3e-2), jaxcoll.devices.flat_mesh(n),
                 DataParallel(compression=compression, **kwargs))


def save_at(directory, trainer, state, step):
  from jaxcoll.train.checkpoint import Checkpointer

  with Checkpointer(directory, async_save=False) as ckpt:
    ckpt.save(step, trainer, state, data_position=step)


def restore(directory, trainer):
  from jaxcoll.train.checkpoint import Checkpointer

  with Checkpointer(directory, read_only=True) as ckpt:
    return ckpt.restore(trainer)


def zeros(tree) -> bool:
  return all(not np.any(np.asarray(x)) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("compression", ["bf16", "int8"])
def test_stop_and_resume_equals_the_uninterrupted_run(compression, tmp_path):
  trainer = trainer_for(compression)
  state = run(trainer, trainer.init(init_mlp()), 0, 4)
  save_at(tmp_path / "ckpt", trainer, state, 4)
  assert not zeros(state.residual)
  expected = run(trainer, state, 4, 8)

  again = trainer_for(compression)
  again.init(init_mlp(seed=1))  # another model's values: all comes from the checkpoint
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # same layout: no warning
    resumed, position, _ = restore(tmp_path / "ckpt", again)
  assert position == 4
  resumed = run(again, resumed, 4, 8)
  assert sha(resumed.params) == sha(expected.params)
  assert sha(resumed.residual) == sha(expected.residual)
  assert int(resumed.step) == 8


def test_residuals_are_saved_with_their_layout_and_fingerprints(tmp_path):
  from jaxcoll.train.checkpoint import Checkpointer

  trainer = trainer_for("int8")
  state = run(trainer, trainer.init(init_mlp()), 0, 2)
  save_at(tmp_path / "ckpt", trainer, state, 2)
  with Checkpointer(tmp_path / "ckpt", read_only=True) as ckpt:
    meta = ckpt.metadata(2)
  layout = meta["residual"]["layout"]
  assert layout == {"strategy": "DataParallel", "compression": "int8",
                    "data_parallel_size": 8, "buckets": [[5, 4, 3, 2, 1, 0]]}
  leaves = meta["residual"]["leaves"]
  # int8: one worker row (the 91-value bucket) and one server segment per device
  assert [(d["path"], d["shape"]) for d in leaves] == [
    ("['bucket_0000']['server']", [8, 12]), ("['bucket_0000']['worker']", [8, 91])]
  # The canonical state itself stays layout-free: no residual among its leaves.
  assert not any("residual" in d["path"] for d in meta["leaves"])


def test_restore_on_another_device_count_starts_residuals_at_zero_and_says_why(tmp_path):
  trainer = trainer_for("bf16")
  state = run(trainer, trainer.init(init_mlp()), 0, 3)
  save_at(tmp_path / "ckpt", trainer, state, 3)

  four = trainer_for("bf16", n=4)
  four.init(init_mlp())
  with pytest.warns(UserWarning, match=r"restart at zero.*data_parallel_size=8 there, 4 here"):
    restored, _, _ = restore(tmp_path / "ckpt", four)
  assert zeros(restored.residual)
  assert restored.residual[0]["worker"].shape == (4, 91)
  assert sha(restored.params) == sha(state.params)
  run(four, restored, 3, 4)  # and it trains

  other = trainer_for("int8")  # same device count, other compression
  other.init(init_mlp())
  with pytest.warns(UserWarning, match=r"compression='bf16' there, 'int8' here"):
    restored, _, _ = restore(tmp_path / "ckpt", other)
  assert zeros(restored.residual)

  buckets = trainer_for("bf16", bucket_bytes=64)  # same devices, another bucket plan
  buckets.init(init_mlp())
  with pytest.warns(UserWarning, match=r"buckets: 1 there, \d+ here"):
    restored, _, _ = restore(tmp_path / "ckpt", buckets)
  assert zeros(restored.residual)

  plain = trainer_for(None)  # no residuals to restore: nothing to say
  plain.init(init_mlp())
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    restored, _, _ = restore(tmp_path / "ckpt", plain)
  assert restored.residual == ()
  assert sha(restored.params) == sha(state.params)


def test_a_checkpoint_without_residuals_restores_with_zero_residuals(tmp_path, monkeypatch):
  trainer = trainer_for("bf16")
  state = run(trainer, trainer.init(init_mlp()), 0, 3)
  # Written as before residuals were kept: no `residual` in meta, no residual item.
  with monkeypatch.context() as m:
    m.setattr(type(trainer), "residual_layout", lambda self: None)
    save_at(tmp_path / "ckpt", trainer, state, 3)
  assert not (tmp_path / "ckpt" / "3" / "residual").exists()

  again = trainer_for("bf16")
  again.init(init_mlp())
  with pytest.warns(UserWarning, match="holds no error-feedback residuals"):
    restored, position, _ = restore(tmp_path / "ckpt", again)
  assert position == 3 and zeros(restored.residual)
  assert sha(restored.params) == sha(state.params)


def test_damaged_residuals_are_skipped_like_any_damaged_leaf(tmp_path):
  from jaxcoll.train import checkpoint

  trainer = trainer_for("bf16")
  state = run(trainer, trainer.init(init_mlp()), 0, 2)
  save_at(tmp_path / "ckpt", trainer, state, 2)
  state = run(trainer, state, 2, 4)
  save_at(tmp_path / "ckpt", trainer, state, 4)
  # Step 4's residual fingerprint no longer matches its bytes (the meta's own sha256 redone).
  path = tmp_path / "ckpt" / "4" / "meta" / "metadata"
  meta = json.loads(path.read_text())
  meta["residual"]["leaves"][0]["fingerprint"] += 1
  meta["sha256"] = checkpoint._json_sha256(meta)
  path.write_text(json.dumps(meta))

  again = trainer_for("bf16")
  again.init(init_mlp())
  with pytest.warns(checkpoint.CorruptCheckpointWarning, match=re.escape("residual/['bucket_0000']")):
    _, position, _ = restore(tmp_path / "ckpt", again)
  assert position == 2


def test_import_state_takes_residuals_of_the_same_layout_only():
  trainer = trainer_for("int8")
  state = run(trainer, trainer.init(init_mlp()), 0, 2)
  other = trainer_for("bf16")
  other.init(init_mlp())
  with pytest.raises(ValueError, match=r"`residual` does not match.*'server'\]: not in the model"):
    other.import_state(trainer.export_state(state), residual=state.residual)
  again = trainer.import_state(trainer.export_state(state), residual=state.residual)
  assert sha(again.residual) == sha(state.residual)
  ahead = sha(run(trainer, again, 2, 3).params)  # donates `again`, not `state`
  assert ahead == sha(run(trainer, state, 2, 3).params)


def _train(workdir, steps, compression="bf16"):
  done = jobs.train("--config=configs/default.py:smoke", f"--config.compression={compression}",
                    f"--config.steps={steps}", "--config.checkpoint_every=3",
                    f"--workdir={workdir}")
  assert done.returncode == 0, done.stderr[-3000:]
  return jobs.summary(workdir), done.stderr


@pytest.mark.slow  # three runs of the command line; the Trainer-level test above is fast
def test_cli_stop_and_resume_with_bf16_equals_the_uninterrupted_run(tmp_path):
  whole, _ = _train(tmp_path / "whole", 6)
  _train(tmp_path / "parts", 3)
  resumed, stderr = _train(tmp_path / "parts", 6)
  assert "restart at zero" not in stderr
  assert resumed["params_sha256"] == whole["params_sha256"]


@pytest.mark.slow  # a 2-process job; the 1-process tests above are fast
def test_two_processes_save_and_resume_their_own_residual_rows(tmp_path):
  """bf16 over 2 processes x 4 devices: each process saves and restores its own
  devices' residual rows; the resumed job ends bit-identical, and one process of 8
  devices (the same residual layout) reads back the same residuals."""
  r = jobs.launch(
    sys.executable, __file__, "mp", str(tmp_path), processes=2, devices=4,
    launcher_flags=("--init_timeout_s=60", "--timeout_s=150", "--grace_s=2"), timeout=180,
  )
  log = (r.stdout + r.stderr)[-6000:]
  assert r.returncode == 0, log
  results = [json.loads(line.split("RESULT ", 1)[1])
             for line in r.stdout.splitlines() if "RESULT " in line]
  assert sorted(x["process"] for x in results) == [0, 1], log
  for x in results:
    assert x["resumed_params"] == x["whole_params"]
    assert x["resumed_residual"] == x["whole_residual"]
    assert x["saved_residual"] != sha([])  # not empty

  one = trainer_for("bf16")
  one.init(init_mlp())
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    restored, position, _ = restore(tmp_path / "ckpt", one)
  assert position == 3
  assert sha(restored.residual) == results[0]["saved_residual"]
  four = trainer_for("bf16", n=4)  # another data-parallel size: zeros, and why
  four.init(init_mlp())
  with pytest.warns(UserWarning, match="data_parallel_size=8 there, 4 here"):
    restored, _, _ = restore(tmp_path / "ckpt", four)
  assert zeros(restored.residual)


def _mp_worker(directory: str) -> None:
  from jax.experimental import multihost_utils

  from jaxcoll.runtime import distributed

  info = distributed.initialize()
  from jaxcoll.train.checkpoint import Checkpointer

  def global_sha(tree):
    return sha(multihost_utils.process_allgather(tree, tiled=True))

  trainer = trainer_for("bf16", n=jax.device_count())
  state = run(trainer, trainer.init(init_mlp()), 0, 3)
  saved = global_sha(state.residual)
  with Checkpointer(os.path.join(directory, "ckpt"), async_save=False) as ckpt:
    ckpt.save(3, trainer, state, data_position=3)
  whole = run(trainer, state, 3, 6)
  again = trainer_for("bf16", n=jax.device_count())
  again.init(init_mlp(seed=1))
  with Checkpointer(os.path.join(directory, "ckpt")) as ckpt, warnings.catch_warnings():
    warnings.simplefilter("error", UserWarning)
    resumed, position, _ = ckpt.restore(again)
  assert position == 3
  assert global_sha(resumed.residual) == saved
  resumed = run(again, resumed, 3, 6)
  result = {
    "process": info.process_id,
    "saved_residual": saved,
    "whole_params": global_sha(whole.params), "resumed_params": global_sha(resumed.params),
    "whole_residual": global_sha(whole.residual),
    "resumed_residual": global_sha(resumed.residual),
  }
  jobs.say_result(json.dumps(result))


if __name__ == "__main__":
  if sys.argv[1] == "mp":
    _mp_worker(sys.argv[2])
