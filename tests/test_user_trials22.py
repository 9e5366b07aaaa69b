"""Cases a user brought that no other test had tried (engineer trial22): resumes with
something changed (the device count, the strategy, the mesh shape, a hand-edited checkpoint
directory). Each test of a fix fails without it."""

import os
import shutil

import flax.linen as nn
import jax
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


def test_a_remote_directory_s_steps_are_not_taken_for_damaged(tmp_path, monkeypatch):
  """The item-directory check asked os.path, which sees no `gs://` directory (check_writable
  passes such paths to orbax): every step of a remote checkpoint directory read as "its
  state/ directory is gone", skipped as damaged, and no resume could go on (a damaged step
  is deleted when that step is saved again). Here the directory's name is a remote one,
  its files local: the step restores."""
  trainer = jaxcoll.Trainer(mse, optax.sgd(0.1), jaxcoll.devices.flat_mesh(8),
                            jaxcoll.DataParallel())
  state = trainer.init(init_mlp())
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, trainer, state, data_position=1)
    ckpt.directory = "gs://bucket/run/checkpoints"  # the name os.path cannot see
    monkeypatch.setattr(ckpt, "_step_dirs", lambda: [(1, True)])  # as orbax lists it there
    _, position, _ = ckpt.restore(trainer)
  assert position == 1


class _ConvBN(nn.Module):
  """A small conv net whose BatchNorm averages over the axis `"data"`, as README's models."""

  @nn.compact
  def __call__(self, x, train=True):
    x = nn.Conv(4, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=not train, axis_name="data")(x)
    return nn.Dense(3)(nn.relu(x).mean((1, 2)))


def _ce(logits, batch):
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


@pytest.mark.parametrize("strategy", ["dp", "hybrid-zero3"])
def test_a_loss_over_an_axis_the_mesh_lacks_is_one_line_at_the_step(strategy):
  """The conv net of a flat-mesh run moved onto a `node, local` mesh (hybrid ZeRO-3 on 2x4)
  from Python: the step was JAX's `NameError` traceback, "Found an unbound axis name: data.
  To fix this, please call psum under `jax.shard_map`" (the trainer's step already is one).
  Now it is one ValueError line naming the axis, the mesh's axes and the fix, as the
  runner's set-up says it."""
  w = jaxcoll.models.from_flax(_ConvBN(), _ce, inputs=("image",),
                               sample_batch={"image": np.zeros((1, 6, 6, 2), np.float32)})
  mesh = jaxcoll.devices.node_local_mesh(2, 4)
  chosen = (jaxcoll.DataParallel(axis=("node", "local")) if strategy == "dp"
            else jaxcoll.ZeRO(stage=3, axis="local", replica_axis="node"))
  trainer = jaxcoll.Trainer(w.loss_fn, optax.sgd(0.1), mesh, chosen, has_aux=True,
                            merge_aux=w.merge_aux)
  state = trainer.init(w.init_params(jax.random.key(0)))
  rng = np.random.default_rng(0)
  batch = {"image": rng.normal(size=(16, 6, 6, 2)).astype(np.float32),
           "label": rng.integers(0, 3, 16).astype(np.int32)}
  with pytest.raises(ValueError) as info:
    trainer.step(state, batch)
  assert str(info.value) == (
    "`loss_fn` reduces over axis 'data' (e.g. nn.BatchNorm(axis_name='data')), which the "
    "trainer's mesh does not have: its axes are ('node', 'local'). Name the data axes, "
    "axis_name=('node', 'local'), for statistics over the whole global batch.")


def test_a_file_named_as_a_step_is_refused_not_replaced_by_that_steps_save(tmp_path):
  """A file of the user's named `2` in the checkpoints directory (not a directory): the
  run's save of step 2 replaced it, silently (a directory so named is refused already).
  Now opening the directory to save is one ValueError line naming it; the file is kept."""
  (tmp_path / "2").write_text("my notes\n")
  with pytest.raises(ValueError) as info:
    Checkpointer(tmp_path)
  assert str(info.value) == (
    f"`directory` {tmp_path} holds the file {tmp_path}/2, which jaxcoll did not write; a save "
    f"of step 2 would replace it. Move it out of {tmp_path} (or rename it, e.g. to 002-mine: "
    "only names like 2 are steps) and run again.")
  assert (tmp_path / "2").read_text() == "my notes\n"
  (tmp_path / "2").rename(tmp_path / "002-mine")
  trainer = jaxcoll.Trainer(mse, optax.sgd(0.1), jaxcoll.devices.flat_mesh(8),
                            jaxcoll.DataParallel())
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(2, trainer, trainer.init(init_mlp()), data_position=2)
  assert (tmp_path / "002-mine").read_text() == "my notes\n"


def test_a_file_named_with_a_non_ascii_digit_is_not_a_step(tmp_path):
  """A file named `²` (a digit to str.isdigit, not to int()) in the checkpoints directory:
  the new file-named-as-a-step check raised int()'s "invalid literal" ValueError. It is no
  step name: the directory opens and saves as with any other file of the user's."""
  (tmp_path / "\u00b2").write_text("my notes\n")
  trainer = jaxcoll.Trainer(mse, optax.sgd(0.1), jaxcoll.devices.flat_mesh(8),
                            jaxcoll.DataParallel())
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(2, trainer, trainer.init(init_mlp()), data_position=2)
    assert ckpt.all_steps() == [2]
  assert (tmp_path / "\u00b2").read_text() == "my notes\n"


def test_a_checkpoint_of_a_model_with_a_layer_fewer_is_one_line_naming_the_params_first(
    tmp_path):
  """A layer added to the model (layer3) and the run resumed: the refusal was a ValueError
  of one line per differing leaf (each of the layer's leaves and their adam moments: dozens
  of lines for a transformer block, one line of kilobytes at the command line). Now it is
  one line: the parameters first, at most four leaves, and how many differ in all."""
  trainer = jaxcoll.Trainer(mse, optax.adam(1e-2), jaxcoll.devices.flat_mesh(8),
                            jaxcoll.ZeRO(stage=3))
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, trainer, trainer.init(init_mlp()), data_position=1)
  before = sorted(p for p in tmp_path.rglob("*"))
  deeper = jaxcoll.Trainer(mse, optax.adam(1e-2), jaxcoll.devices.flat_mesh(4),
                           jaxcoll.DataParallel())
  deeper.init(init_mlp(widths=(4, 5, 7, 3, 3)))
  with Checkpointer(tmp_path) as ckpt, pytest.raises(ValueError) as info:
    ckpt.restore(deeper)
  assert str(info.value) == (
    f"Checkpoint {tmp_path}/1 does not match the trainer's model (checkpoint leaf vs "
    "trainer.export_shapes()): ['params']['layer3']['b']: missing (expected shape (3,), "
    "float32); ['params']['layer3']['w']: missing (expected shape (3, 3), float32); "
    "['opt_state'][0].mu['layer3']['b']: missing (expected shape (3,), float32); "
    "['opt_state'][0].mu['layer3']['w']: missing (expected shape (3, 3), float32); and 2 "
    "more (6 leaves differ). Restore into a trainer built for the same model and optimizer, "
    "or use another `directory`. The checkpoint is left as it is.")
  assert sorted(p for p in tmp_path.rglob("*")) == before
  with Checkpointer(tmp_path) as ckpt:  # the model it was saved from still restores it
    assert ckpt.restore(trainer)[1] == 1


def test_a_resume_with_model_overrides_that_keep_every_leaf_goes_on_and_is_named():
  """configs/resnet_dp8.py (`bn_axis_name='data'`) resumed on a `node, local` mesh: without
  `--config.model_overrides.bn_axis_name='*'` the model cannot run there, and with it the
  resume was refused ("the checkpoints ... were written with model_overrides=...; pass
  --config.model_overrides=... to resume them"): no way on. Overrides that leave every
  leaf of the state as saved now resume, named in the config-changed line; ones that change
  a leaf (another width) are refused as before."""
  from jaxcoll.run import config as run_config  # noqa: PLC0415
  from jaxcoll.run import loop  # noqa: PLC0415

  saved_overrides = {"width": 4, "bn_axis_name": "data"}
  leaves = {"['params']['conv']['kernel']": (3, 3, 3, 4), "['step']": ()}

  class Saved:  # a Checkpointer's newest checkpoint, as _check_checkpoints_fit reads it
    directory = "/w/checkpoints"

    def latest_step(self):
      return 6

    def metadata(self, step):
      config = {**run_config.RunConfig(model="resnet").to_dict(),
                "model_overrides": saved_overrides}
      return {"extra": {"config": config},
              "leaves": [{"path": p, "shape": list(s), "dtype": "float32"}
                         for p, s in leaves.items()]}

  moved = run_config.parse({"model": "resnet",
                            "model_overrides": {"width": 4, "bn_axis_name": "*"}})
  specs = {path: (shape, "float32") for path, shape in leaves.items()}
  loop._check_checkpoints_fit(Saved(), moved, specs)  # no refusal
  assert loop.config_changes(Saved().metadata(6)["extra"]["config"], moved) == [
    "model_overrides.bn_axis_name 'data' -> '*'"]
  wider = run_config.parse({"model": "resnet", "model_overrides": {"width": 8}})
  with pytest.raises(run_config.ConfigError, match="were written with model_overrides="):
    loop._check_checkpoints_fit(
      Saved(), wider, {**specs, "['params']['conv']['kernel']": ((3, 3, 3, 8), "float32")})
  # Same shapes, another dtype (a user model's param_dtype='bfloat16'): the restore would
  # cast the saved float32 state, so it is refused as before, not resumed.
  with pytest.raises(run_config.ConfigError, match="were written with model_overrides="):
    loop._check_checkpoints_fit(
      Saved(), moved, {**specs, "['params']['conv']['kernel']": ((3, 3, 3, 4), "bfloat16")})


def test_the_shipped_resnet_on_a_node_local_mesh_is_one_line_before_anything_is_written(
    tmp_path):
  """`--config=configs/resnet_dp8.py --config.mesh_shape=2,4` (a resume moved onto two nodes,
  a hybrid layout): the model's own `bn_axis_name='data'` check was a traceback at the first
  step (exit 1), after summary.json and checkpoints/ were written; README says such a model
  is one line before anything is written (the check caught JAX's NameError, not the shipped
  ResNet's ValueError). Now it is that line, with the flag that fixes it."""
  from configs import resnet_dp8  # noqa: PLC0415

  from jaxcoll.run import config as run_config  # noqa: PLC0415
  from jaxcoll.run import loop  # noqa: PLC0415

  config = resnet_dp8.get_config("smoke")
  config.mesh_shape = "2,4"
  with pytest.raises(run_config.ConfigError) as info:
    loop.train_and_evaluate(config, str(tmp_path / "run"))
  assert str(info.value) == (
    "`config.model_overrides` of model 'resnet': `bn_axis_name`='data': axis 'data' is not "
    "bound here; the mesh axes bound by shard_map / pmap are ('node', 'local'). Pass "
    "bn_axis_name=('node', 'local') (or '*', every bound axis) to average BatchNorm "
    "statistics over the whole batch, or None for per-device statistics. (at the command "
    "line: --config.model_overrides.bn_axis_name='*')")
  assert not (tmp_path / "run").exists()


def test_non_ascii_digit_names_are_no_step_for_the_report_and_eval(tmp_path):
  """`checkpoints/²` passed as --workdir, and a directory `².orbax-checkpoint-tmp` in
  checkpoints/: metrics.inside_run and disk.unfinished_saves read '²' as a step (isdigit) and
  crashed in int(). They are the user's names, not orbax's: no step."""
  from jaxcoll import disk
  from jaxcoll.observe import metrics
  ckpts = tmp_path / "checkpoints"
  (ckpts / "\u00b2.orbax-checkpoint-tmp").mkdir(parents=True)
  (ckpts / "3.orbax-checkpoint-tmp-1234").mkdir()
  assert disk.unfinished_saves(ckpts) == [3]
  assert metrics.inside_run(str(ckpts / "\u00b2")) is None
  assert metrics.inside_run(str(ckpts / "4")) == (str(tmp_path), 4)
