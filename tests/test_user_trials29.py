"""Cases found by the lead's review of stop 41's change (reviewer helper): each test of a fix
fails without it."""

import numpy as np
import pytest
from mlp_task import init_mlp, mse

import jaxcoll
from jaxcoll.errors import StopRequested
from jaxcoll.run import loop


def _trainer_and_state():
  import optax

  trainer = jaxcoll.Trainer(mse, optax.adam(1e-2), jaxcoll.devices.flat_mesh(8),
                            jaxcoll.DataParallel())
  return trainer, trainer.init(init_mlp())


def test_a_stop_names_its_params_unless_the_digest_fails_or_the_state_is_too_large(
    monkeypatch):
  """A stop (SIGTERM, preemption) now digests the parameters for its attempt's entry. A
  digest that raised (a runtime error, a peer gone) replaced the StopRequested, so the
  attempt was recorded as failed with the wrong exit status (a requeue reads it); a large
  state was hashed on the host before anything was recorded, which can outlast a
  preemption's grace period. The stop comes first."""
  trainer, state = _trainer_and_state()
  stop = loop._with_digest(StopRequested(3, saved=True), trainer, state)  # noqa: SLF001
  assert set(stop.attempt_detail) == {"params_sha256", "params_global_norm"}
  assert stop.attempt_detail["params_sha256"] == trainer.params_digest(state)[1]

  monkeypatch.setattr(loop, "STOP_DIGEST_MAX_BYTES", 1000)
  stop = loop._with_digest(StopRequested(3, saved=True), trainer, state)  # noqa: SLF001
  assert not hasattr(stop, "attempt_detail") and stop.status == 143
  monkeypatch.undo()

  def broken(_state):
    raise RuntimeError("a peer is gone")

  monkeypatch.setattr(trainer, "params_digest", broken)
  stop = StopRequested(3, saved=True)
  assert loop._with_digest(stop, trainer, state) is stop  # noqa: SLF001
  assert stop.status == 143 and not hasattr(stop, "attempt_detail")


def test_a_model_named_by_its_file_without_a_function_says_the_module_colon_function_form():
  """`--config.model=/src/my_model.py` (a file, no `:function`) was split at its last dot:
  "did you mean '/src/my_model:py'?", a name that cannot work. It now names the module form
  and the PYTHONPATH that finds it."""
  from jaxcoll.run import config as run_config

  with pytest.raises(run_config.ConfigError) as e:
    run_config.RunConfig(model="/src/my_model.py")
  assert str(e.value).endswith(
      "a file is named by its module, e.g. PYTHONPATH=/src --config.model=my_model:make (the "
      "function that builds the model).")
  assert ":py" not in str(e.value)
  with pytest.raises(run_config.ConfigError, match=r"e\.g\. --config\.model=my_model:make "):
    run_config.RunConfig(model="my_model.py")


def test_the_trainers_init_broadcast_runs_leaf_by_leaf(monkeypatch):
  """Tensor fusion packs a pytree broadcast into 25 MiB buffers, which XLA may keep alive at
  once: one more copy of the model at init, where memory is tightest. The trainers' init
  broadcast of the parameters keeps to leaf by leaf (bucket_bytes=0), as before fusion."""
  import optax

  from jaxcoll import collectives

  seen = []
  real = collectives.broadcast

  def spy(x, *args, **kwargs):
    seen.append(kwargs.get("bucket_bytes", collectives.DEFAULT_BUCKET_BYTES))
    return real(x, *args, **kwargs)

  monkeypatch.setattr(collectives, "broadcast", spy)
  for strategy in (jaxcoll.DataParallel(), jaxcoll.ZeRO(stage=1), jaxcoll.ZeRO(stage=3)):
    trainer = jaxcoll.Trainer(mse, optax.adam(1e-2), jaxcoll.devices.flat_mesh(8), strategy)
    trainer.init(init_mlp())
  assert seen and set(seen) == {0}, seen
