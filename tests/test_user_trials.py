"""Cases a user brought that no other test had tried (engineer "trial").

Each test guards one fix; each is fast (seconds) and reuses tiny models.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxcoll


def _tiny_loss(p, b):
  return jnp.mean((b["x"] @ p["w"]) ** 2) + jnp.sum(p["b"] ** 2)


def test_a_zero_size_parameter_leaf_is_checkpointed_and_restored(tmp_path):
  # orbax refuses to save an array of zero size ("Cannot save arrays with zero
  # size"): a model with a (0, 4) leaf trained, then failed at its first
  # checkpoint. The empty leaf is left out of the orbax item and made again on
  # restore, with its shape, dtype and the restoring trainer's sharding.
  params = {"w": np.ones((16, 4), np.float32), "b": np.zeros(3, np.float32),
            "empty": np.zeros((0, 4), np.float32)}
  batch = {"x": np.ones((8, 16), np.float32)}
  trainer = jaxcoll.Trainer(_tiny_loss, optax.adam(1e-2), jaxcoll.devices.flat_mesh(8),
                            jaxcoll.ZeRO(stage=3))
  state, _ = trainer.step(trainer.init(params), batch)
  saved = jax.tree.map(np.asarray, trainer.params(state))
  with jaxcoll.checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, trainer, state, data_position=1)
  other = jaxcoll.Trainer(_tiny_loss, optax.adam(1e-2), jaxcoll.devices.flat_mesh(4),
                          jaxcoll.DataParallel())
  other.init(params)
  with jaxcoll.checkpoint.Checkpointer(tmp_path) as ckpt:
    state, position, _ = ckpt.restore(other)
  restored = jax.tree.map(np.asarray, other.params(state))
  assert position == 1
  assert restored["empty"].shape == (0, 4) and restored["empty"].dtype == np.float32
  np.testing.assert_array_equal(restored["w"], saved["w"])
  np.testing.assert_array_equal(restored["b"], saved["b"])
  state, metrics = other.step(state, batch)  # and it trains on
  assert np.isfinite(float(metrics["loss"]))
