"""Checkpointer.close on an error's way out: no collective (issue 22 Build 5)."""

from __future__ import annotations

import optax
import pytest
from mlp_task import init_mlp, mse


def _saved(tmp_path, ckpt, steps):
  from jaxcoll import DataParallel, Trainer, devices

  trainer = Trainer(mse, optax.sgd(0.1), devices.flat_mesh(8), DataParallel())
  state = trainer.init(init_mlp())
  for step in steps:
    ckpt.save(step, trainer, state, data_position=step)
  return trainer


def test_close_after_an_error_does_not_prune_or_enter_the_collective(tmp_path, monkeypatch):
  """Pruning agrees across processes in a broadcast: a process that failed alone
  (a data error the others did not have) would wait there forever. On the error
  path close() waits for the save in flight and prunes nothing; a clean exit prunes."""
  from jaxcoll.train import checkpoint

  pruned = []  # _prune holds the collective (a broadcast from process 0 with > 1 process)
  real = checkpoint.Checkpointer._prune
  monkeypatch.setattr(checkpoint.Checkpointer, "_prune",
                      lambda self: pruned.append(self.all_steps()) or real(self))
  with pytest.raises(RuntimeError, match="a data error"):
    with checkpoint.Checkpointer(tmp_path, keep=1) as ckpt:
      _saved(tmp_path, ckpt, [1, 2, 3])
      pruned.clear()
      raise RuntimeError("a data error on this process only")
  assert pruned == []  # no collective on the way out
  with checkpoint.Checkpointer(tmp_path, keep=1, read_only=True) as view:
    assert view.all_steps() == [2, 3]  # step 2 not pruned on the way out (kept, not lost)
  with checkpoint.Checkpointer(tmp_path, keep=1) as ckpt:  # a clean exit prunes
    pruned.clear()
  assert pruned == [[2, 3]]
  with checkpoint.Checkpointer(tmp_path, keep=1, read_only=True) as view:
    assert view.all_steps() == [3]
