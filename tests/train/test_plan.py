"""Plans answer for their strategy kind; strategy names map to stages in one place."""

from __future__ import annotations

import jax
import ml_collections
import optax
import pytest
from mlp_task import init_mlp, mse

import jaxcoll
from jaxcoll.run import loop
from jaxcoll.train import strategies


def test_strategy_names_map_to_stages_once():
  assert strategies.STAGES == {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
  assert loop.STRATEGIES == tuple(strategies.STAGES)
  for name, stage in strategies.STAGES.items():
    config = ml_collections.ConfigDict(dict(
        strategy=name, algorithm="native", bucket_bytes=1 << 20, compression=""))
    assert loop.build_strategy(config, "data").stage == stage


@pytest.mark.parametrize("strategy, refused", [
    (jaxcoll.DataParallel(), False), (jaxcoll.ZeRO(stage=1), True), (jaxcoll.ZeRO(stage=3), True),
])
def test_the_plan_checks_its_own_optimizer_state(strategy, refused):
  # A mask by size sees another structure on ZeRO's rows (they keep the rank, not
  # the size): only a plan that keeps the state on rows refuses it.
  large = lambda p: jax.tree.map(lambda x: x.size > 4, p)  # noqa: E731
  momentum_on_large = optax.chain(optax.masked(optax.trace(0.9), large), optax.sgd(0.1))
  trainer = jaxcoll.Trainer(mse, momentum_on_large, jaxcoll.devices.flat_mesh(8), strategy)
  trainer.init(init_mlp())
  if refused:
    with pytest.raises(ValueError, match="`optimizer`: optimizer.init gives a differently"):
      trainer.export_shapes()
  else:
    assert set(trainer.export_shapes()) == {"step", "params", "opt_state"}
