"""Canonical train state and checkpoints: save, resume, reshard, survive damage.

The model is tests/train/test_trainer.py's tiny MLP (copied: test modules are not
imported). Run as a script (``kill``), this file is the process killed with
SIGKILL in the middle of a save; _mp_worker is one part of tests/train's launched
2-process job (test_two_processes.py).
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import jobs
import numpy as np
import optax
import pytest
from mlp_task import GLOBAL_BATCH, WIDTHS, init_mlp, mse

# Reading a truncated checkpoint fails one tensorstore read while others are in
# flight; those complete later into orbax's closed event loop, which Python
# reports as an unraisable "Event loop is closed" (harmless, from orbax).
pytestmark = pytest.mark.filterwarnings(
  "ignore:(?s).*Event loop is closed:pytest.PytestUnraisableExceptionWarning"
)

ROOT = Path(__file__).resolve().parents[2]


def batch_at(step, size=GLOBAL_BATCH, widths=WIDTHS):
  """The batch of ``step``: a pure function of the step, as jaxcoll.data's."""
  rng = np.random.default_rng(1000 + step)
  x = rng.normal(size=(size, widths[0])).astype(np.float32)
  y = np.tanh(x @ np.ones((widths[0], widths[-1]), np.float32)) + 0.1 * rng.normal(
    size=(size, widths[-1])
  )
  return {"x": x, "y": y.astype(np.float32)}


def run(trainer, state, start, stop):
  for step in range(start, stop):
    state, _ = trainer.step(state, batch_at(step))
  return state


def host(tree):
  return jax.tree.map(np.asarray, tree)


def assert_trees_equal(actual, expected):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  jax.tree.map(np.testing.assert_array_equal, host(actual), host(expected))


def mesh(n=8):
  import jaxcoll

  return jaxcoll.devices.flat_mesh(n)


# -- the canonical state -------------------------------------------------------------


OPTIMIZERS = {
  "adam": lambda: optax.adam(1e-2),
  "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
  # No decay on biases: a mask by ndim, which ZeRO's rows (same rank) keep.
  "adamw-ndim-mask": lambda: optax.adamw(
    1e-2, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
  ),
  "sgd-momentum": lambda: optax.sgd(0.1, momentum=0.9),
  "clip-chain-schedule": lambda: optax.chain(
    optax.clip_by_global_norm(1e3),  # inactive: per-row clipping equals global
    optax.adam(optax.linear_schedule(1e-2, 1e-3, 10)),
  ),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_export_is_single_device_optax_state_and_import_steps_identically(name):
  from jaxcoll.train import Trainer, ZeRO

  optimizer = OPTIMIZERS[name]()
  trainer = Trainer(mse, optimizer, mesh(), ZeRO(stage=3))
  state = run(trainer, trainer.init(init_mlp()), 0, 2)
  canonical = trainer.export_state(state)

  # The reference: optax on one device, whole batch; one jitted step (run op by op, the
  # optax update compiled ~60 one-op programs per optimizer).
  @jax.jit
  def one_device(params, opt_state, batch):
    updates, opt_state = optimizer.update(jax.grad(mse)(params, batch), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params, opt_state = init_mlp(), optimizer.init(init_mlp())
  for step in range(2):
    params, opt_state = one_device(params, opt_state, batch_at(step))
  assert jax.tree.structure(canonical["opt_state"]) == jax.tree.structure(opt_state)
  jax.tree.map(
    lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6),
    host(canonical),
    {"step": 2, "params": params, "opt_state": opt_state},
  )
  assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(canonical))

  again = trainer.import_state(canonical)
  expected, _ = trainer.step(state, batch_at(2))  # donates state, not canonical
  actual, _ = trainer.step(again, batch_at(2))
  assert_trees_equal(actual, expected)
  assert trainer.trace_count == 1  # the imported state has the step's layout


def test_import_restarts_error_feedback_at_zero():
  from jaxcoll.train import DataParallel, Trainer

  trainer = Trainer(mse, optax.sgd(0.1), mesh(), DataParallel(compression="int8"))
  state = run(trainer, trainer.init(init_mlp()), 0, 2)
  assert any(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(state.residual))
  again = trainer.import_state(trainer.export_state(state))
  assert jax.tree.structure(again.residual) == jax.tree.structure(state.residual)
  assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(again.residual))
  assert_trees_equal(again.params, state.params)


def test_import_shape_mismatch_names_the_leaf():
  from jaxcoll.train import DataParallel, Trainer

  trainer = Trainer(mse, optax.adam(1e-2), mesh(), DataParallel())
  canonical = trainer.export_state(trainer.init(init_mlp()))
  other = Trainer(mse, optax.adam(1e-2), mesh(), DataParallel())
  other.init(init_mlp(widths=(4, 6, 7, 3)))
  with pytest.raises(
    ValueError,
    match=r"\['params'\]\['layer0'\]\['w'\]: shape \(4, 5\), but the model has shape \(4, 6\)",
  ):
    other.import_state(canonical)


def test_zero_optimizer_whose_structure_follows_exact_shapes_exports_as_dp():
  from jaxcoll.train import DataParallel, Trainer, ZeRO

  # Rows keep the rank, not the size: a mask by size would see another structure on
  # ZeRO's rows (it raised here), so ZeRO updates on the full leaves and the state
  # is the one DP (one device) has.
  large = lambda p: jax.tree.map(lambda x: x.size > 4, p)  # noqa: E731
  momentum_on_large = optax.chain(optax.masked(optax.trace(0.9), large), optax.sgd(0.1))
  zero = Trainer(mse, momentum_on_large, mesh(), ZeRO(stage=1))
  dp = Trainer(mse, momentum_on_large, mesh(), DataParallel())
  got, want = (t.export_state(t.init(init_mlp())) for t in (zero, dp))
  assert jax.tree.structure(got["opt_state"]) == jax.tree.structure(want["opt_state"])


# -- checkpoints ---------------------------------------------------------------


STRATEGIES = {
  "dp": lambda: __import__("jaxcoll").DataParallel(),
  "zero1": lambda: __import__("jaxcoll").ZeRO(stage=1),
  "zero2": lambda: __import__("jaxcoll").ZeRO(stage=2),
  "zero3": lambda: __import__("jaxcoll").ZeRO(stage=3),
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_round_trip_steps_bit_identically(name, tmp_path):
  from jaxcoll.train.checkpoint import Checkpointer
  from jaxcoll.train import Trainer

  trainer = Trainer(mse, optax.adam(1e-2), mesh(), STRATEGIES[name]())
  state = run(trainer, trainer.init(init_mlp()), 0, 2)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(2, trainer, state, data_position=2, extra={"name": name, "lr": 1e-2})
    restored, position, extra = ckpt.restore(trainer)
  assert (position, extra) == (2, {"name": name, "lr": 1e-2})
  assert int(restored.step) == 2
  expected = run(trainer, state, 2, 3)
  assert_trees_equal(run(trainer, restored, 2, 3), expected)


WIDE = (8, 16, 16, 8)  # leaves whose first dimension divides by 8: ZeRO-3 rows align


@pytest.mark.parametrize("name", ["zero3", "dp", "zero1"])
def test_save_shares_the_states_buffers_and_a_donated_step_cannot_change_them(name, tmp_path):
  """The save holds no second copy of the state (canonical leaves are the state's
  buffers where the layout allows), yet the steps that run while it writes, their
  input donated, cannot change what is written: the checkpoint is the saved step."""
  from jaxcoll.train import Trainer
  from jaxcoll.train.checkpoint import Checkpointer

  trainer = Trainer(mse, optax.adam(1e-2), mesh(), STRATEGIES[name]())
  batches = [batch_at(s, widths=WIDE) for s in range(4)]
  state, _ = trainer.step(trainer.init(init_mlp(widths=WIDE)), batches[0])
  copied, shared = trainer.export_state(state), trainer.export_state(state, copy=False)
  assert_trees_equal(shared, copied)
  for a, b in zip(jax.tree.leaves(shared), jax.tree.leaves(copied)):
    assert a.sharding == b.sharding
  buffers = {s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(state)
             for s in x.addressable_shards}
  same = [s.data.unsafe_buffer_pointer() in buffers
          for x in jax.tree.leaves(shared["params"]) for s in x.addressable_shards]
  # ZeRO-3: every aligned row is a view; DP: the leaves themselves; ZeRO-1's
  # canonical params are sharded, its state replicated: computed (a copy).
  assert all(same) if name in ("zero3", "dp") else not any(same)
  saved = host(copied)
  del copied, shared
  with Checkpointer(tmp_path, async_save=True) as ckpt:
    ckpt.save(1, trainer, state, data_position=1)
    for s in (1, 2):
      state, _ = trainer.step(state, batches[s])  # donated while orbax writes
    ckpt.wait()
    restored, _, _ = ckpt.restore(trainer)
  assert_trees_equal(trainer.export_state(restored), saved)
  later = state
  for s in (1, 2):
    restored, _ = trainer.step(restored, batches[s])
  assert_trees_equal(restored, later)


@pytest.mark.parametrize("direction", ["zero3x8-to-dpx4", "dpx4-to-zero3x8",
                                       "zero3x8-to-hybrid-zero3-4x2"])
def test_restore_onto_another_strategy_and_device_count(direction, tmp_path):
  import jaxcoll
  from jaxcoll import DataParallel, Trainer, ZeRO
  from jaxcoll.train.checkpoint import Checkpointer

  zero3 = Trainer(mse, optax.adam(1e-2), mesh(8), ZeRO(stage=3))
  dp = Trainer(mse, optax.adam(1e-2), mesh(4), DataParallel())
  source, target = (zero3, dp) if direction.startswith("zero3") else (dp, zero3)
  if direction.endswith("hybrid-zero3-4x2"):
    # The model known from its shapes alone (nothing allocated), as the restore error says.
    target = Trainer(mse, optax.adam(1e-2), jaxcoll.devices.node_local_mesh(4, 2),
                     ZeRO(stage=3, axis="local", replica_axis="node"))
    target.abstract_state(jax.eval_shape(init_mlp))
  else:
    target.init(init_mlp())
  state = run(source, source.init(init_mlp()), 0, 3)
  saved = host(source.export_state(state))
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(3, source, state, data_position=3)
    restored, position, _ = ckpt.restore(target)
  assert position == 3
  assert_trees_equal(target.export_state(restored), saved)
  # One more step on each layout: the same update (float order differs).
  after_source = source.params(run(source, state, 3, 4))
  after_target = target.params(run(target, restored, 3, 4))
  jax.tree.map(
    lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-7),
    host(after_target),
    host(after_source),
  )


@pytest.mark.parametrize("name", ["dp", "zero3"])
def test_stopped_and_resumed_run_is_bit_identical(name, tmp_path):
  from jaxcoll.train.checkpoint import Checkpointer
  from jaxcoll.train import Trainer

  def new_trainer():
    return Trainer(mse, optax.adamw(1e-2, weight_decay=0.01), mesh(), STRATEGIES[name]())

  trainer = new_trainer()
  uninterrupted = trainer.params(run(trainer, trainer.init(init_mlp()), 0, 10))

  first = new_trainer()
  state = run(first, first.init(init_mlp()), 0, 5)
  ckpt = Checkpointer(tmp_path / "ckpt")
  ckpt.save(5, first, state, data_position=5)
  state = run(first, state, 5, 7)  # work after the checkpoint is lost
  ckpt.close()
  del first, state

  second = new_trainer()
  second.init(init_mlp(seed=123))  # the model's shapes; values get replaced
  ckpt = Checkpointer(tmp_path / "ckpt")
  state, position, _ = ckpt.restore(second)
  ckpt.close()
  assert position == 5
  assert_trees_equal(second.params(run(second, state, position, 10)), uninterrupted)


def test_keep_prunes_to_the_newest(tmp_path):
  from jaxcoll import DataParallel, Trainer
  from jaxcoll.train.checkpoint import Checkpointer

  trainer = Trainer(mse, optax.sgd(0.1), mesh(), DataParallel())
  state = trainer.init(init_mlp())
  with Checkpointer(tmp_path, keep=3) as ckpt:
    for step in range(1, 7):
      state = run(trainer, state, step - 1, step)
      ckpt.save(step, trainer, state, data_position=step)
    ckpt.wait()
    assert ckpt.all_steps() == [4, 5, 6] and ckpt.latest_step() == 6
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
      "4",
      "5",
      "6",
    ]
    restored, position, _ = ckpt.restore(trainer, step=5)
  assert position == 5 and int(restored.step) == 5


def _every_path(directory) -> list[str]:
  """Every file and directory below ``directory``: a refused restore or save changed none."""
  return sorted(glob.glob(str(directory / "**"), recursive=True))


def test_shape_mismatch_raises_and_leaves_checkpoints(tmp_path):
  from jaxcoll import DataParallel, Trainer
  from jaxcoll.train.checkpoint import Checkpointer

  trainer = Trainer(mse, optax.adam(1e-2), mesh(), DataParallel())
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, trainer, trainer.init(init_mlp()), data_position=1)
  before = _every_path(tmp_path)

  wider = Trainer(mse, optax.adam(1e-2), mesh(), DataParallel())
  wider.init(init_mlp(widths=(4, 6, 7, 3)))
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(ValueError) as info:
      ckpt.restore(wider)
  message = str(info.value)
  assert "['params']['layer0']['w']: shape (4, 5), but the model has shape (4, 6)" in message
  assert "['opt_state'][0].mu['layer0']['b']: shape (5,), but the model has shape (6,)" in message
  assert _every_path(tmp_path) == before


def test_another_optimizer_with_the_same_leaves_is_a_mismatch_not_damage(tmp_path, monkeypatch):
  # adam saved, adamw restoring: the same leaves at the same paths (weight decay holds no
  # state, one EmptyState more), so only orbax's array restore saw the trees differ. The
  # step was skipped as damaged ("No intact checkpoint ...; start from trainer.init"),
  # and saving that step again from a fresh start deleted the good checkpoint. The
  # metadata records the empty containers, compared before orbax is asked: orbax's
  # wording of its refusal is not consulted (were it reworded, the step was damage again).
  import warnings  # noqa: PLC0415

  from jaxcoll import DataParallel, Trainer, ZeRO
  from jaxcoll.train import checkpoint
  from jaxcoll.train.checkpoint import Checkpointer

  monkeypatch.setattr(checkpoint, "_orbax_other_containers", lambda error: False)
  trainer = Trainer(mse, optax.adam(1e-2), mesh(4), ZeRO(stage=3))
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, trainer, trainer.init(init_mlp()), data_position=1)
  before = _every_path(tmp_path)

  other = Trainer(mse, optax.adamw(1e-2), mesh(4), DataParallel())
  state = other.init(init_mlp())
  with Checkpointer(tmp_path) as ckpt, warnings.catch_warnings():
    warnings.simplefilter("error")  # no "Skipping checkpoint ... damaged"
    with pytest.raises(ValueError, match=r"^Checkpoint .*/1 does not match the trainer's model: "
                       r"the same leaves, but the optimizer state's containers differ "
                       r"\(\['opt_state'\]\[2\]: an empty EmptyState in this trainer, not in "
                       r"the checkpoint\), e\.g\. adam saved and adamw restoring"):
      ckpt.restore(other)
    with pytest.raises(ValueError, match="`step` 1 is already saved"):  # not deleted
      ckpt.save(1, other, state, data_position=1)
  assert _every_path(tmp_path) == before
  with Checkpointer(tmp_path, read_only=True) as ckpt:  # the way out the message gives
    saved, _, _ = ckpt.restore(trainer)
  state = other.import_state(trainer.export_state(saved))
  assert_trees_equal(other.params(state), trainer.params(saved))


def test_a_checkpoint_saved_before_its_containers_were_recorded_is_a_mismatch_not_damage(
    tmp_path):
  # Metadata without `empty_containers` (an earlier jaxcoll's): orbax's refusal of the
  # trees is the only sign, still read as other containers, never as damage.
  import json  # noqa: PLC0415
  import warnings  # noqa: PLC0415

  from jaxcoll import DataParallel, Trainer
  from jaxcoll.train.checkpoint import Checkpointer, _json_sha256

  trainer = Trainer(mse, optax.adam(1e-2), mesh(), DataParallel())
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, trainer, trainer.init(init_mlp()), data_position=1)
  path = tmp_path / "1" / "meta" / "metadata"
  meta = json.loads(path.read_text())
  del meta["empty_containers"]
  meta["sha256"] = _json_sha256(meta)
  path.write_text(json.dumps(meta))
  before = _every_path(tmp_path)

  other = Trainer(mse, optax.adamw(1e-2), mesh(), DataParallel())
  other.init(init_mlp())
  with Checkpointer(tmp_path) as ckpt, warnings.catch_warnings():
    warnings.simplefilter("error")  # no "Skipping checkpoint ... damaged"
    with pytest.raises(ValueError, match=r"^Checkpoint .*/1 does not match the trainer's model: "
                       r"the same leaves, but the optimizer state's containers differ \(opt_state: "
                       r"this trainer \(<class 'list'>, 3\) vs the checkpoint \(<class 'list'>, "
                       r"2\)\), e\.g\. adam saved and adamw restoring"):
      ckpt.restore(other)
  assert _every_path(tmp_path) == before
  with Checkpointer(tmp_path, read_only=True) as ckpt:  # the legacy step restores as saved
    assert ckpt.restore(trainer)[1] == 1


def test_a_restore_that_fails_with_no_sign_of_damage_keeps_the_step(tmp_path, monkeypatch):
  # XLA out of memory while the restored arrays are checked (or a bug) was taken for damage:
  # step 2 skipped for step 1, and the resumed run's save of step 2 deleted the good one.
  import warnings  # noqa: PLC0415

  from jaxcoll import DataParallel, Trainer
  from jaxcoll.train import checkpoint
  from jaxcoll.train.checkpoint import Checkpointer

  trainer = Trainer(mse, optax.sgd(0.1), mesh(), DataParallel())
  state = trainer.init(init_mlp())
  with Checkpointer(tmp_path) as ckpt:
    for step in (1, 2):
      ckpt.save(step, trainer, state, data_position=step)

  def out_of_memory(restored, like):
    raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4096 bytes.")

  with Checkpointer(tmp_path) as ckpt, warnings.catch_warnings():
    warnings.simplefilter("error")  # no "Skipping checkpoint ... damaged"
    with monkeypatch.context() as patch:
      patch.setattr(checkpoint, "_with_empty", out_of_memory)
      with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED") as info:
        ckpt.restore(trainer)
    assert info.value.__notes__ == [
      f"Checkpoint {tmp_path}/2 is kept: restoring it failed with no sign of damage (a file "
      "that cannot be read or decoded, bytes unlike those saved)."]
    with pytest.raises(ValueError, match="`step` 2 is already saved"):  # not deleted
      ckpt.save(2, trainer, state, data_position=2)
    assert ckpt.restore(trainer)[1] == 2


@pytest.mark.parametrize("damage", ["no-commit-marker", "truncated-file"])
def test_damaged_checkpoint_is_skipped_with_a_warning(damage, tmp_path):
  from jaxcoll import Trainer, ZeRO
  from jaxcoll.train.checkpoint import Checkpointer, CorruptCheckpointWarning

  trainer = Trainer(mse, optax.adam(1e-2), mesh(), ZeRO(stage=2))
  state = trainer.init(init_mlp())
  with Checkpointer(tmp_path) as ckpt:
    for step in (1, 2):
      state = run(trainer, state, step - 1, step)
      ckpt.save(step, trainer, state, data_position=step)
  if damage == "no-commit-marker":
    for marker in glob.glob(str(tmp_path / "2" / "**" / "commit_success.txt"), recursive=True):
      os.remove(marker)
  else:
    data = [
      f
      for f in glob.glob(str(tmp_path / "2" / "state" / "**"), recursive=True)
      if os.path.isfile(f) and os.sep + "d" + os.sep in f
    ]
    assert data
    for f in data:
      with open(f, "r+b") as handle:
        handle.truncate(os.path.getsize(f) // 2)

  with Checkpointer(tmp_path) as ckpt:
    with pytest.warns(CorruptCheckpointWarning, match=r"Skipping checkpoint .*2"):
      restored, position, _ = ckpt.restore(trainer)
    assert position == 1 and int(restored.step) == 1
    with pytest.raises(ValueError, match="`step` 2"):
      ckpt.restore(trainer, step=2)
    # The resumed run saves step 2 again: the damaged directory is replaced.
    with pytest.warns(CorruptCheckpointWarning, match="Removing the damaged or uncommitted"):
      ckpt.save(2, trainer, run(trainer, restored, 1, 2), data_position=2)
    ckpt.wait()
    restored, position, _ = ckpt.restore(trainer)
  assert position == 2 and int(restored.step) == 2


def test_bad_arguments_raise(tmp_path):
  from jaxcoll import DataParallel, Trainer
  from jaxcoll.train.checkpoint import Checkpointer

  blocker = tmp_path / "a-file"
  blocker.write_text("not a directory")
  with pytest.raises(ValueError, match=r"`directory`=.*a-file/ckpt.* is not a writable"):
    Checkpointer(blocker / "ckpt")
  with pytest.raises(ValueError, match="`keep` must be a positive int"):
    Checkpointer(tmp_path, keep=0)
  with pytest.raises(ValueError, match="`bytes_in_flight` must be a positive int"):
    Checkpointer(tmp_path, bytes_in_flight=0)

  trainer = Trainer(mse, optax.sgd(0.1), mesh(), DataParallel())
  with Checkpointer(tmp_path / "ok") as ckpt:
    with pytest.raises(ValueError, match=r"`trainer` has no model yet: call "
                       r"`trainer.abstract_state\(param_shapes\)`"):
      ckpt.restore(trainer)
    state = trainer.init(init_mlp())
    with pytest.raises(FileNotFoundError, match="No intact checkpoint"):
      ckpt.restore(trainer)
    with pytest.raises(ValueError, match="`extra` must be JSON-encodable"):
      ckpt.save(1, trainer, state, data_position=0, extra={"f": object()})
    with pytest.raises(ValueError, match="`data_position` must be a non-negative int"):
      ckpt.save(1, trainer, state, data_position=-1)
    ckpt.save(state.step, trainer, state, data_position=0)  # a jax scalar step
    ckpt.wait()
    with pytest.raises(ValueError, match="`step` 0 is already saved"):
      ckpt.save(0, trainer, state, data_position=0)
    assert ckpt.latest_step() == 0


def test_shards_larger_than_bytes_in_flight_are_saved_and_restored(tmp_path):
  """The in-flight cap rises to fit the largest shard (orbax moves a shard whole)."""
  from jaxcoll import DataParallel, Trainer
  from jaxcoll.train.checkpoint import Checkpointer

  trainer = Trainer(mse, optax.adam(1e-2), mesh(), DataParallel())
  state = run(trainer, trainer.init(init_mlp()), 0, 2)
  with Checkpointer(tmp_path, bytes_in_flight=16) as ckpt:  # every leaf is larger
    ckpt.save(2, trainer, state, data_position=2)
    restored, _, _ = ckpt.restore(trainer)
    assert ckpt._limit > 16
  assert_trees_equal(trainer.export_state(restored), trainer.export_state(state))


LAYOUTS = {  # (mesh shape, spec of a (16, 24) leaf)
  "rows": ((8,), ("data",)),
  "columns": ((8,), (None, "data")),
  "replicated": ((8,), ()),
  "2d": ((2, 4), ("node", "local")),
  "tuple-axis": ((2, 4), (("node", "local"),)),
  "one-of-two-axes": ((2, 4), (None, "local")),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "complex64", "bool"])
def test_sharded_checks_equal_whole_leaf_fingerprints(layout, dtype):
  """Checkpoint checksums summed shard by shard = the fingerprint of the whole leaf."""
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxcoll.train import checkpoint
  from jaxcoll import fingerprint

  shape, spec = LAYOUTS[layout]
  names = ("data",) if len(shape) == 1 else ("node", "local")
  grid = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))
  rng = np.random.default_rng(0)
  values = [(rng.normal(size=(16, 24)) * 50).astype(dtype), np.float32(3.5),
            (rng.normal(size=(8,)) * 50).astype(dtype)]
  if dtype == "complex64":
    values[0] = values[0] + 1j * rng.normal(size=(16, 24)).astype(np.float32)
  specs = [P(*spec), P(), P(spec[0] if spec else None)]
  leaves = [jax.device_put(v, NamedSharding(grid, s)) for v, s in zip(values, specs)]
  prints, finite = checkpoint._LeafChecks()(leaves)
  assert prints == np.asarray(fingerprint.fingerprint(values)).tolist()
  assert finite == [True, True, True]
  if dtype in ("float32", "bfloat16"):
    bad = values[0].copy()
    bad[15, 23] = np.inf
    leaves[0] = jax.device_put(jnp.asarray(bad), leaves[0].sharding)
    assert checkpoint._LeafChecks()(leaves)[1] == [False, True, True]


def test_sharded_checks_hold_no_leaf_sized_temporary():
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxcoll.train import checkpoint

  n = 2**24  # 64 MB of float32: 8 MB per device
  x = jax.device_put(np.zeros((n // 1024, 1024), np.float32), NamedSharding(mesh(), P("data")))
  checks = checkpoint._LeafChecks()
  assert checks([x]) == ([0], [True])
  (program,) = checks._programs.values()
  temp = program.lower(x).compile().memory_analysis().temp_size_in_bytes
  assert temp <= 4 * 2**20, temp  # one program over the whole leaf takes ~8 MB per device


@pytest.mark.parametrize("stage", [1, 3])
def test_explicit_axis_mesh_params_export_and_restore(stage, tmp_path):
  """A plain jax.make_mesh (explicit axis types) works like jaxcoll's own meshes."""
  from jaxcoll import DataParallel, Trainer, ZeRO
  from jaxcoll.train.checkpoint import Checkpointer

  explicit = jax.make_mesh((8,), ("data",))
  assert explicit.axis_types == (jax.sharding.AxisType.Explicit,)
  params = {**init_mlp(), "odd": np.full((3, 7), 0.5, np.float32)}  # no dimension divides

  def loss(p, b):
    return mse({k: v for k, v in p.items() if k != "odd"}, b) + jax.numpy.sum(p["odd"] ** 2)

  trainers = [Trainer(loss, optax.adam(1e-2), m, ZeRO(stage=stage)) for m in (explicit, mesh())]
  states = [run(t, t.init(params), 0, 2) for t in trainers]
  assert_trees_equal(trainers[0].params(states[0]), trainers[1].params(states[1]))
  assert_trees_equal(trainers[0].export_state(states[0]), trainers[1].export_state(states[1]))
  dp = Trainer(loss, optax.adam(1e-2), mesh(4), DataParallel())
  dp.init(params)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(2, trainers[0], states[0], data_position=2)
    restored, _, _ = ckpt.restore(dp)
  assert_trees_equal(dp.params(restored), trainers[1].params(states[1]))
  again = trainers[0].import_state(trainers[0].export_state(states[0]))
  assert_trees_equal(trainers[0].params(run(trainers[0], again, 2, 3)),
                     trainers[1].params(run(trainers[1], states[1], 2, 3)))


def test_non_finite_state_is_never_written_and_keeps_the_good_ones(tmp_path):
  """Issue 12.1: a NaN state must not replace the finite checkpoints."""
  from jaxcoll import DataParallel, Trainer
  from jaxcoll.train.checkpoint import Checkpointer, NonFiniteStateError

  trainer = Trainer(mse, optax.sgd(0.1), mesh(), DataParallel())
  state = trainer.init(init_mlp())
  with Checkpointer(tmp_path, keep=2) as ckpt:
    for step in (1, 2):
      state = run(trainer, state, step - 1, step)
      ckpt.save(step, trainer, state, data_position=step)
    ckpt.wait()
    poisoned = state._replace(params=jax.tree.map(lambda x: x * np.nan, state.params))
    for step in (3, 4, 5):
      with pytest.raises(NonFiniteStateError, match=f"state of step {step} is not finite"):
        ckpt.save(step, trainer, poisoned, data_position=step)
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2]
    restored, position, _ = ckpt.restore(trainer)
  assert position == 2
  assert_trees_equal(restored.params, state.params)


def test_metadata_is_checksummed(tmp_path):
  """Issue 12.3: one changed byte of the metadata (data position 2 -> 3)
  makes the step damaged, not a silently skipped batch."""
  from jaxcoll import DataParallel, Trainer
  from jaxcoll.train.checkpoint import Checkpointer, CorruptCheckpointWarning

  trainer = Trainer(mse, optax.sgd(0.1), mesh(), DataParallel())
  state = trainer.init(init_mlp())
  with Checkpointer(tmp_path) as ckpt:
    for step in (1, 2):
      state = run(trainer, state, step - 1, step)
      ckpt.save(step, trainer, state, data_position=step)
  meta = tmp_path / "2" / "meta" / "metadata"
  text = meta.read_text()
  assert '"data_position": 2,' in text
  meta.write_text(text.replace('"data_position": 2,', '"data_position": 3,'))
  with Checkpointer(tmp_path) as ckpt:
    with pytest.warns(CorruptCheckpointWarning, match="sha256 does not match"):
      _, position, _ = ckpt.restore(trainer)
  assert position == 1


def test_a_checkpoint_of_another_format_version_is_refused_not_skipped_as_damaged(tmp_path):
  """A step another jaxcoll version wrote (its format number) counted as damaged: restore
  fell back past it, and a save of that step then replaced it. It is refused, kept."""
  from jaxcoll import DataParallel, Trainer
  from jaxcoll.train import checkpoint

  trainer = Trainer(mse, optax.sgd(0.1), mesh(), DataParallel())
  state = trainer.init(init_mlp())
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    for step in (1, 2):
      state = run(trainer, state, step - 1, step)
      ckpt.save(step, trainer, state, data_position=step)
  meta = tmp_path / "2" / "meta" / "metadata"
  saved = json.loads(meta.read_text())
  saved["format"] = checkpoint.FORMAT_VERSION + 1
  saved["sha256"] = checkpoint._json_sha256(saved)  # as a newer jaxcoll would sign it
  meta.write_text(json.dumps(saved))
  with warnings.catch_warnings(), checkpoint.Checkpointer(tmp_path) as ckpt:
    warnings.simplefilter("error")  # not skipped with a CorruptCheckpointWarning
    with pytest.raises(ValueError, match=r"2 was written by another version of jaxcoll "
                                         r"\(checkpoint format 3, this version reads 2\): it "
                                         r"is not damaged, and it is left as it is"):
      ckpt.restore(trainer)
  assert json.loads(meta.read_text())["format"] == checkpoint.FORMAT_VERSION + 1


def test_stray_step_directory_never_takes_a_keep_slot(tmp_path):
  """Issue 12.8: an empty `100/` must not make `keep` prune the good steps."""
  from jaxcoll import DataParallel, Trainer
  from jaxcoll.train.checkpoint import Checkpointer

  (tmp_path / "100").mkdir()
  trainer = Trainer(mse, optax.sgd(0.1), mesh(), DataParallel())
  state = trainer.init(init_mlp())
  with Checkpointer(tmp_path, keep=2) as ckpt:
    for step in (1, 2, 3):
      state = run(trainer, state, step - 1, step)
      ckpt.save(step, trainer, state, data_position=step)
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3]
    with pytest.warns(UserWarning, match="100"):
      _, position, _ = ckpt.restore(trainer)
  assert position == 3


# -- processes killed or many ----------------------------------------------------


def test_sigkill_during_save_leaves_the_previous_checkpoint(tmp_path):
  """A process killed after writing step 2's files, before orbax's commit."""
  proc = subprocess.Popen(
    [sys.executable, __file__, "kill", str(tmp_path)],
    cwd=ROOT,
    env=jobs.clean_env(8),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  lines = []
  try:
    deadline = time.monotonic() + 120
    for line in proc.stdout:
      lines.append(line)
      if line.startswith("COMMITTING") or time.monotonic() > deadline:
        break
    assert lines and lines[-1].startswith("COMMITTING"), "".join(lines[-30:])
    proc.send_signal(signal.SIGKILL)
  finally:
    proc.kill()
    proc.wait(timeout=30)
  assert proc.returncode == -signal.SIGKILL
  leftovers = sorted(p.name for p in tmp_path.iterdir())
  assert "1" in leftovers and "2" not in leftovers
  assert any(name.startswith("2.orbax-checkpoint-tmp") for name in leftovers), leftovers

  from jaxcoll import Trainer, ZeRO
  from jaxcoll.train.checkpoint import Checkpointer

  trainer = Trainer(mse, optax.adam(1e-2), mesh(), ZeRO(stage=3))
  expected = run(trainer, trainer.init(init_mlp()), 0, 1)
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() == 1
    state, position, extra = ckpt.restore(trainer)
    assert (position, extra) == (1, {"killed": False})
    assert_trees_equal(trainer.export_state(state), trainer.export_state(expected))
    ckpt.save(2, trainer, run(trainer, state, 1, 2), data_position=2)  # the slot is free
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2]
  assert not any(".orbax-checkpoint-tmp" in p.name for p in tmp_path.iterdir())


def _kill_worker(directory: str) -> None:
  """Saves step 1, then hangs in orbax's commit of step 2 until killed."""
  from orbax.checkpoint._src.path import atomicity

  from jaxcoll import Trainer, ZeRO
  from jaxcoll.train.checkpoint import Checkpointer

  trainer = Trainer(mse, optax.adam(1e-2), mesh(), ZeRO(stage=3))
  state = run(trainer, trainer.init(init_mlp()), 0, 1)
  ckpt = Checkpointer(directory)
  ckpt.save(1, trainer, state, data_position=1, extra={"killed": False})
  ckpt.wait()

  commit = atomicity.AtomicRenameTemporaryPath.finalize

  async def hang_before_commit(self):
    if self.get_final().name == "2":
      print("COMMITTING", self.get(), flush=True)
      time.sleep(600)
    return await commit(self)

  atomicity.AtomicRenameTemporaryPath.finalize = hang_before_commit
  state = run(trainer, state, 1, 2)
  ckpt.save(2, trainer, state, data_position=2, extra={"killed": True})
  ckpt.wait()
  print("NOT KILLED", flush=True)


def _mp_worker(directory: str) -> None:
  from jaxcoll.runtime import distributed

  info = distributed.initialize()
  from jaxcoll import DataParallel, Trainer, ZeRO
  from jaxcoll.train.checkpoint import Checkpointer

  trainer = Trainer(mse, optax.adam(1e-2), mesh(jax.device_count()), ZeRO(stage=3))
  state = run(trainer, trainer.init(init_mlp()), 0, 3)
  with Checkpointer(os.path.join(directory, "ckpt")) as ckpt:
    ckpt.save(3, trainer, state, data_position=3, extra={"saved_by": "2x4"})
  _resave_damaged_step(os.path.join(directory, "damaged"), trainer, state, info.process_id)
  params = host(trainer.params(state))
  # Every process restores too, as data parallel over both processes.
  dp = Trainer(mse, optax.adam(1e-2), mesh(jax.device_count()), DataParallel())
  dp.init(init_mlp())
  with Checkpointer(os.path.join(directory, "ckpt")) as ckpt:
    restored, position, _ = ckpt.restore(dp)
  assert position == 3
  assert_trees_equal(dp.params(restored), params)
  if info.process_id == 0:
    flat = {f"{k}.{leaf}": v for k, d in params.items() for leaf, v in d.items()}
    np.savez(os.path.join(directory, "params.npz"), **flat)
  result = {
    "process": info.process_id,
    "processes": jax.process_count(),
    "devices": jax.device_count(),
  }
  jobs.say_result("checkpoint " + json.dumps(result))


def _resave_damaged_step(directory, trainer, state, process_id) -> None:
  """Restore falls back past a damaged step 4, which is then saved again.

  Process 1 lags behind process 0, which has already removed the damaged
  directory by the time process 1 looks: both must still agree to wait for
  the removal (process 0 decides).
  """
  import warnings

  from jax.experimental import multihost_utils

  from jaxcoll.train.checkpoint import COMMIT_SUCCESS_FILE, Checkpointer

  with Checkpointer(directory, keep=None) as ckpt:
    ckpt.save(3, trainer, state, data_position=3)
    ckpt.save(4, trainer, state, data_position=4)
    ckpt.wait()
    multihost_utils.sync_global_devices("saved")
    if process_id == 0:
      os.remove(os.path.join(directory, "4", COMMIT_SUCCESS_FILE))
    multihost_utils.sync_global_devices("damaged")
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      restored, position, _ = ckpt.restore(trainer)
      assert position == 3
      if process_id == 1:
        time.sleep(0.5)
      ckpt.save(4, trainer, restored, data_position=4)
    ckpt.wait()
    assert ckpt.all_steps() == [3, 4], ckpt.all_steps()


if __name__ == "__main__":
  mode, where = sys.argv[1], sys.argv[2]
  if mode == "kill":
    import jaxcoll  # noqa: F401  (JAXCOLL_CPU_DEVICES before JAX starts)

    _kill_worker(where)


@pytest.mark.parametrize("name", ["sweep?", "lr*"])
def test_a_directory_whose_glob_matches_other_directories_is_refused(tmp_path, name):
  """orbax merges a save's per-process files by a glob of its path: from `runs/sweep?`
  it also took in `runs/sweep1`'s files when both saved the same step at once (two runs of
  a sweep started together), and the save failed with NotImplementedError: CopyRange not
  supported, ending the run. Refused in one line before anything is written."""
  from jaxcoll.train.checkpoint import Checkpointer  # noqa: PLC0415

  (tmp_path / "sweep1" / "checkpoints").mkdir(parents=True)
  (tmp_path / "lr_3e-3" / "checkpoints").mkdir(parents=True)
  where = tmp_path / name / "checkpoints"
  for read_only in (False, True):
    with pytest.raises(ValueError, match=re.escape(f"contains {name[-1]!r}: orbax finds the "
                       "files") + r".* also matches other directories .* without '\*' or '\?'"):
      Checkpointer(where, read_only=read_only)
  assert not (tmp_path / name).exists()
