"""Cases a user brought that no other test had tried (engineer trial22): resumes with
something changed (the device count, the strategy, the mesh shape, a hand-edited checkpoint
directory). Each test of a fix fails without it."""

import os
import shutil

import numpy as np
import optax
import pytest
from mlp_task import init_mlp, mse

import jaxcoll
from jaxcoll.train.checkpoint import Checkpointer, CorruptCheckpointWarning

# Orbax's asynchronous saves can complete into its closed event loop (harmless; see
# tests/train/test_checkpoint.py).
pytestmark = pytest.mark.filterwarnings(
  "ignore:(?s).*Event loop is closed:pytest.PytestUnraisableExceptionWarning"
)


def _batch(step, rows=32):
  rng = np.random.default_rng(step)
  return {"x": rng.normal(size=(rows, 4)).astype(np.float32),
          "y": rng.normal(size=(rows, 3)).astype(np.float32)}


@pytest.mark.parametrize("item", ["state", "residual"])
def test_a_step_whose_item_directory_was_deleted_by_hand_is_skipped_as_damaged(item, tmp_path):
  """`rm -rf checkpoints/2/state` (or `2/residual`, bf16 compression's residuals): the
  resume was orbax's `KeyError: 'Item "state" was not found in the checkpoint'` traceback,
  exit 1, "kept: restoring it failed with no sign of damage", so no resume could go on
  without deleting the step by hand. Now the step is damaged (files gone, as a deleted array
  file is): skipped with the warning, step 1 restored, and saving step 2 again replaces it."""
  trainer = jaxcoll.Trainer(mse, optax.adam(1e-2), jaxcoll.devices.flat_mesh(8),
                            jaxcoll.DataParallel(compression="bf16"))
  state = trainer.init(init_mlp())
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    for step in (1, 2):
      state, _ = trainer.step(state, _batch(step))
      ckpt.save(step, trainer, state, data_position=step)
  shutil.rmtree(tmp_path / "2" / item)
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    with pytest.warns(CorruptCheckpointWarning,
                      match=rf"Skipping checkpoint {tmp_path}/2: .*its {item}/ directory is gone"):
      restored, position, _ = ckpt.restore(trainer)
    assert position == 1 and int(restored.step) == 1
    with pytest.warns(CorruptCheckpointWarning, match="Removing the damaged or uncommitted"):
      ckpt.save(2, trainer, trainer.step(restored, _batch(2))[0], data_position=2)
    assert ckpt.restore(trainer)[1] == 2
  assert sorted(os.listdir(tmp_path / "2")) == sorted(
    ["_CHECKPOINT_METADATA", "commit_success.txt", "meta", "state", "residual"])
