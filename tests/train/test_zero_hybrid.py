"""Hybrid ZeRO: sharded over `axis`, replicated over `replica_axis`."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_fsdp import Block, Net, _batch, _close

import jaxcoll


def _loss(model):
  def loss_fn(p, b):
    return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

  return loss_fn


def _run(model, params, mesh, strategy, batch, *, steps=5):
  trainer = jaxcoll.Trainer(_loss(model), optax.adam(1e-2), mesh, strategy)
  state = trainer.init(params)
  for _ in range(steps):
    state, _ = trainer.step(state, batch)
  return trainer, state


@pytest.mark.parametrize("stage, algorithm", [(1, "auto"), (2, "ring"), (3, "hierarchical")])
def test_hybrid_matches_single_device(stage, algorithm):
  batch = _batch()
  model = Net(jaxcoll.fsdp_unit(Block), scan=True)
  params = model.init(jax.random.key(3), batch["x"])["params"]
  single, s1 = _run(model, params, jaxcoll.devices.flat_mesh(1), jaxcoll.DataParallel(), batch)
  mesh = jaxcoll.devices.node_local_mesh(2, 4)
  strategy = jaxcoll.ZeRO(stage=stage, axis="local", replica_axis="node", algorithm=algorithm)
  trainer, state = _run(model, params, mesh, strategy, batch)
  assert trainer.dp_size == 8
  _close(jax.tree.map(np.asarray, trainer.params(state)),
         jax.tree.map(np.asarray, single.params(s1)))
  # The replicas over `node` hold bit-identical rows and optimizer state (2 copies
  # of a row; 8 of a replicated leaf).
  for leaf in jax.tree.leaves((state.params, state.opt_state)):
    by_index = {}
    for shard in leaf.addressable_shards:
      by_index.setdefault(str(shard.index), []).append(np.asarray(shard.data))
    for copies in by_index.values():
      assert len(copies) in (2, 8) and all(np.array_equal(copies[0], c) for c in copies)


class Wide(nn.Module):
  @nn.compact
  def __call__(self, x):
    for _ in range(3):
      x = nn.Dense(64)(x)
    return x


def test_hybrid_state_is_a_quarter_of_dp():
  model = Wide()
  batch = {"x": np.ones((8, 64), np.float32), "y": np.ones((8, 64), np.float32)}
  params = model.init(jax.random.key(0), batch["x"])["params"]
  mesh = jaxcoll.devices.node_local_mesh(2, 4)
  sizes = {}
  for name, strategy in [("dp", jaxcoll.DataParallel(axis=("node", "local"))),
                         ("hybrid", jaxcoll.ZeRO(3, axis="local", replica_axis="node"))]:
    trainer = jaxcoll.Trainer(_loss(model), optax.adam(1e-3), mesh, strategy)
    sizes[name] = trainer.state_bytes_per_device(trainer.init(params))
  # Adam's count (4 bytes) and the step are replicated in both.
  assert sizes["hybrid"] - 8 == (sizes["dp"] - 8) // 4, sizes


def test_replica_axis_bad_input():
  with pytest.raises(ValueError, match="`replica_axis`.*overlaps `axis`"):
    jaxcoll.ZeRO(3, axis="local", replica_axis="local")
  mesh = jaxcoll.devices.node_local_mesh(2, 4)
  trainer_args = (lambda p, b: 0.0, optax.adam(1e-3), mesh)
  with pytest.raises(ValueError, match="`replica_axis` 'rack' is not an axis of the mesh"):
    jaxcoll.Trainer(*trainer_args, jaxcoll.ZeRO(3, axis="local", replica_axis="rack"))


def test_hybrid_config_smoke_trains(tmp_path):
  from configs import hybrid_2x4  # noqa: PLC0415
  from jaxcoll.run import loop  # noqa: PLC0415

  config = hybrid_2x4.get_config("smoke")
  strategy = loop.build_strategy(config, ("node", "local"))
  assert (strategy.axis, strategy.replica_axis, strategy.stage) == ("local", "node", 3)
  summary = loop.train_and_evaluate(config, str(tmp_path))
  assert summary["steps"] == config.steps and np.isfinite(summary["final_loss"])


def test_dp_takes_a_replica_axis_of_the_mesh_and_refuses_one_the_mesh_lacks():
  # --config.strategy=dp ignored --config.replica_axis entirely: 'nodes' (a typo for
  # 'node') trained without a word. A mesh axis is still taken (DP replicates over every
  # axis; a command line switched back from hybrid keeps it).
  from jaxcoll.errors import ConfigError  # noqa: PLC0415
  from jaxcoll.run import loop  # noqa: PLC0415

  config = {"strategy": "dp", "mesh_shape": "2,4", "mesh_axes": "node,local"}
  assert isinstance(loop.build_strategy({**config, "replica_axis": "node"}, ("node", "local")),
                    jaxcoll.DataParallel)
  with pytest.raises(ConfigError, match=r"replica_axis.*'nodes'.*mesh axes \('node', 'local'\)"):
    loop.build_strategy({**config, "replica_axis": "nodes"}, ("node", "local"))


@pytest.mark.parametrize("strategy", [jaxcoll.ZeRO(stage=3, axis="local"),
                                      jaxcoll.DataParallel(axis="local")], ids=["zero3", "dp"])
def test_strategy_axes_that_leave_a_mesh_axis_out_warn_that_its_groups_repeat_the_step(strategy):
  # ZeRO(axis="local") on a (node, local) mesh without replica_axis ran silently: each
  # node group repeated the same step on the same batch, half the devices doing nothing new.
  mesh = jaxcoll.devices.node_local_mesh(2, 4)
  loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)  # noqa: E731
  with pytest.warns(UserWarning, match=r"over 'local' \(4 of the mesh's 8 devices\).*"
                    r"\('node',\) take no part.*axis=\('node', 'local'\).*replica_axis='node'"):
    jaxcoll.Trainer(loss_fn, optax.sgd(0.1), mesh, strategy)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # every device used: no warning
    jaxcoll.Trainer(loss_fn, optax.sgd(0.1), mesh, jaxcoll.ZeRO(3, axis="local", replica_axis="node"))
    jaxcoll.Trainer(loss_fn, optax.sgd(0.1), mesh, jaxcoll.DataParallel(axis=("node", "local")))
