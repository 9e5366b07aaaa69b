"""flax.nnx models in the trainers: a split model's ``nnx.State`` as params, and
``jaxcoll.models.from_nnx`` for models with state (BatchNorm) and dropout.

DP and ZeRO-1/2/3 on 8 devices match one device by value, BatchNorm statistics
are carried like linen's ``batch_stats``, a checkpoint resumes bit-identically
(and reshards), and the mistakes an nnx user makes are one line each."""

import os
import tempfile

import jax
import jax.numpy as jnp
import jobs
import numpy as np
import optax
import pytest
from flax import nnx

import jaxcoll
from jaxcoll.scale.step_model import WorkloadSpec

STRATEGIES = {
    "dp": jaxcoll.DataParallel(algorithm="ring"),
    "zero1": jaxcoll.ZeRO(stage=1, algorithm="ring"),
    "zero2": jaxcoll.ZeRO(stage=2, algorithm="ring"),
    "zero3": jaxcoll.ZeRO(stage=3, algorithm="ring"),
}


class Net(nnx.Module):
  """Linear -> BatchNorm (over the data axis) -> Dropout -> Linear."""

  def __init__(self, rngs: nnx.Rngs, dropout: float = 0.0):
    # No bias before BatchNorm: its true gradient is 0, and Adam turns rounding noise into
    # full-size steps that differ with the order of additions.
    self.l1 = nnx.Linear(4, 8, use_bias=False, rngs=rngs)
    self.bn = nnx.BatchNorm(8, axis_name="data", momentum=0.5, rngs=rngs)
    self.drop = nnx.Dropout(dropout, rngs=rngs)
    self.l2 = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.drop(jax.nn.relu(self.bn(self.l1(x)))))


class TiedStack(nnx.Module):
  """Tied input/output embedding (one shared nnx.Embed) around an nnx.vmap'd,
  nnx.scan'ned stack of 3 layers."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(11, 6, rngs=rngs)

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def layers(rngs):
      return nnx.Linear(6, 6, rngs=rngs)

    self.layers = layers(rngs)

  def __call__(self, tokens):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, layer):
      return x + jnp.tanh(layer(x))

    return self.embed.attend(body(self.embed(tokens), self.layers))


class UnitStack(nnx.Module):
  """An nnx.vmap'd stack of 4 layers, each an FSDP unit (jaxcoll.train.fsdp_params of the
  layer module inside an nnx.remat'ed nnx.scan body)."""

  def __init__(self, rngs: nnx.Rngs):
    self.inp = nnx.Linear(4, 16, rngs=rngs)

    @nnx.split_rngs(splits=4)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def layers(rngs):
      return nnx.Linear(16, 16, rngs=rngs)

    self.layers = layers(rngs)
    self.out = nnx.Linear(16, 2, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def body(x, layer):
      layer = jaxcoll.train.fsdp_params(layer, ("params", "layers"))
      return x + jnp.tanh(layer(x))

    return self.out(body(self.inp(x), self.layers))


def _mse(y, batch):
  return jnp.mean((y - batch["y"]) ** 2)


def _batch(n=16):
  rng = np.random.default_rng(0)
  return {"inputs": rng.normal(size=(n, 4)).astype(np.float32),
          "y": rng.normal(size=(n, 2)).astype(np.float32)}


def _trainer(workload, n, strategy, **kwargs):
  return jaxcoll.Trainer(workload.loss_fn, optax.adam(1e-2), jaxcoll.devices.flat_mesh(n),
                         strategy, has_aux=True, merge_aux=workload.merge_aux, **kwargs)


def _train(trainer, params, steps=3, batch=None):
  state = trainer.init(params)
  for _ in range(steps):
    state, _ = trainer.step(state, _batch() if batch is None else batch)
  return state


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _close(a, b, tol=1e-5):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(_leaves(a), _leaves(b)):
    np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


def test_from_nnx_dp_and_zero_match_one_device_with_batchnorm_stats_carried():
  w = jaxcoll.models.from_nnx(Net, _mse)  # make(rngs): init_params builds it
  assert w.state_collections == ("batch_stats",) and w.num_params == 4 * 8 + 16 + 8 * 2 + 2
  init = w.init_params(jax.random.key(0))
  # rng=0: training mode (BatchNorm on batch statistics, its running averages updated).
  ref = _trainer(w, 1, jaxcoll.DataParallel(), rng=0)
  want = ref.params(_train(ref, init))
  moved = np.abs(np.asarray(want["batch_stats"]["bn"]["mean"][...])).max()
  assert moved > 1e-3  # the statistics travelled back through aux (merge_aux)
  for strategy in STRATEGIES.values():
    trainer = _trainer(w, 8, strategy, rng=0)
    got = trainer.params(_train(trainer, init))
    _close(got, want)
    assert isinstance(got["params"], nnx.State)


def test_split_model_state_is_params_and_comes_back_as_state():
  """The plain nnx pattern: nnx.split(model, nnx.Param, ...), a loss that merges."""
  model = TiedStack(nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = np.random.default_rng(1).integers(0, 11, size=(16, 5)).astype(np.int32)
  batch = {"tokens": tokens, "y": np.ones((16, 5, 11), np.float32) / 11}

  def loss_fn(p, b):
    return jnp.mean((nnx.merge(graphdef, p, rest)(b["tokens"]) - b["y"]) ** 2)

  def train(n, strategy):
    trainer = jaxcoll.Trainer(loss_fn, optax.adam(1e-2), jaxcoll.devices.flat_mesh(n), strategy,
                              clip_global_norm=0.5)
    state = trainer.init(params)
    for _ in range(2):
      state, metrics = trainer.step(state, batch)
    return trainer.params(state), trainer.eval(state, batch)["loss"]

  want, want_eval = train(1, jaxcoll.DataParallel())
  assert want["layers"]["kernel"].shape == (3, 6, 6)  # the stacked layers, one leaf
  assert "embed" in want and len(jax.tree.leaves(want)) == 3  # tied: one embedding
  for strategy in (STRATEGIES["dp"], STRATEGIES["zero3"]):
    got, got_eval = train(8, strategy)
    _close(got, want)
    np.testing.assert_allclose(float(got_eval), float(want_eval), rtol=1e-5)
  nnx.update(model, got)  # the trained State goes straight back into the model
  np.testing.assert_array_equal(np.asarray(model.embed.embedding[...]),
                                np.asarray(got["embed"]["embedding"][...]))


def test_a_module_without_rng_state_is_itself_the_params():
  """An nnx Module is a pytree: with only float variables, trainer.init(model) and a
  loss_fn(model, batch) train it, and params() is the Module again."""
  model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
  batch = {"x": _batch()["inputs"], "y": _batch()["y"]}

  def loss_fn(net, b):
    return jnp.mean((net(b["x"]) - b["y"]) ** 2)

  got = {}
  for n, strategy in ((1, jaxcoll.DataParallel()), (8, STRATEGIES["zero3"])):
    trainer = jaxcoll.Trainer(loss_fn, optax.sgd(0.1), jaxcoll.devices.flat_mesh(n), strategy)
    state, _ = trainer.step(trainer.init(model), batch)
    got[n] = trainer.params(state)
  assert isinstance(got[8], nnx.Linear)
  _close(got[8], got[1])


def test_dropout_masks_follow_the_trainer_rng_and_eval_is_deterministic():
  w = jaxcoll.models.from_nnx(Net(nnx.Rngs(0), dropout=0.5), _mse)  # an instance
  init = w.init_params(0)  # the instance's own values
  np.testing.assert_array_equal(np.asarray(init["params"]["l1"]["kernel"][...]),
                                np.asarray(w.model.l1.kernel[...]))
  runs = {}
  for name in ("dp", "zero3"):
    trainer = _trainer(w, 8, STRATEGIES[name], rng=0)
    state = trainer.init(init)
    losses = []
    for _ in range(3):
      state, metrics = trainer.step(state, _batch())
      losses.append(float(metrics["loss"]))
    runs[name] = (losses, trainer.params(state))
    first, again = trainer.eval(state, _batch()), trainer.eval(state, _batch())
    assert float(first["loss"]) == float(again["loss"])  # no dropout in eval
  assert runs["dp"][0] == runs["zero3"][0] and len(set(runs["dp"][0])) == 3
  _close(runs["dp"][1], runs["zero3"][1])
  # Another seed draws other masks.
  other = _trainer(w, 8, STRATEGIES["dp"], rng=1)
  _, metrics = other.step(other.init(init), _batch())
  assert float(metrics["loss"]) != runs["dp"][0][0]


def test_checkpoint_resumes_bit_identically_and_reshards():
  w = jaxcoll.models.from_nnx(lambda rngs: Net(rngs, dropout=0.25), _mse)
  init = w.init_params(jax.random.key(0))
  trainer = _trainer(w, 8, STRATEGIES["zero2"], rng=0)
  state = _train(trainer, init, steps=2)
  directory = tempfile.mkdtemp()
  with jaxcoll.checkpoint.Checkpointer(directory) as ckpt:
    ckpt.save(2, trainer, state, data_position=2)
    ckpt.wait()
  at_save = trainer.params(state)
  for _ in range(2):
    state, _ = trainer.step(state, _batch())
  uninterrupted = trainer.params(state)

  resumed = _trainer(w, 8, STRATEGIES["zero2"], rng=0)
  resumed.init(init)
  with jaxcoll.checkpoint.Checkpointer(directory, read_only=True) as ckpt:
    state2, position, _ = ckpt.restore(resumed)
  assert position == 2
  for _ in range(2):
    state2, _ = resumed.step(state2, _batch())
  got = resumed.params(state2)
  assert jax.tree.structure(got) == jax.tree.structure(uninterrupted)
  for x, y in zip(_leaves(got), _leaves(uninterrupted)):
    np.testing.assert_array_equal(x, y)  # bit for bit, batch_stats included

  other = _trainer(w, 4, STRATEGIES["zero3"], rng=0)  # another device count and stage
  other.init(init)
  with jaxcoll.checkpoint.Checkpointer(directory, read_only=True) as ckpt:
    state3, _, _ = ckpt.restore(other)
  resharded = other.params(state3)
  assert jax.tree.structure(resharded) == jax.tree.structure(at_save)
  for x, y in zip(_leaves(resharded), _leaves(at_save)):
    np.testing.assert_array_equal(x, y)


def test_init_from_a_factory_equals_init():
  w = jaxcoll.models.from_nnx(Net, _mse)
  trainer = _trainer(w, 8, STRATEGIES["zero3"], rng=0)
  key = jax.random.key(3)
  sharded = trainer.init_from(w.init_params, key)
  for x, y in zip(_leaves(trainer.params(sharded)), _leaves(w.init_params(key))):
    np.testing.assert_array_equal(x, y)


def test_fsdp_units_of_an_nnx_scanned_stack_match_one_device():
  w = jaxcoll.models.from_nnx(UnitStack, _mse)
  init = w.init_params(jax.random.key(0))
  jax.eval_shape(w.loss_fn, init, _batch(), jax.random.key(0))  # running the units records them
  ref = _trainer(w, 1, jaxcoll.DataParallel())
  want = ref.params(_train(ref, init, steps=2))
  trainer = _trainer(w, 8, STRATEGIES["zero3"])
  outside, rows, largest, scanned = trainer.fsdp_unit_bytes(init)
  assert scanned and largest == (16 * 16 + 16) * 4  # one layer of the stack
  assert rows == largest * 4 // 8  # the 4 layers' rows on each of 8 devices
  _close(trainer.params(_train(trainer, init, steps=2)), want)


def test_workload_spec_from_an_nnx_module():
  model = Net(nnx.Rngs(0))
  spec = WorkloadSpec.from_flax(model, np.zeros((8, 4), np.float32), achieved_flops=1e12)
  # One layer per top-level entry of the Param state, in its (sorted) order: bn, l1, l2.
  assert spec.layer_params == (16.0, 32.0, 18.0)
  assert spec.seconds_per_example > 0 and spec.param_bytes == 4


def test_nnx_mistakes_are_one_line():
  model = Net(nnx.Rngs(0), dropout=0.5)
  mesh = jaxcoll.devices.flat_mesh(8)
  with pytest.raises(ValueError, match=r"^`optimizer` .* got flax.nnx.Optimizer\. Pass the "
                     r"optax transformation") as e:
    jaxcoll.Trainer(_mse, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param), mesh,
                    jaxcoll.DataParallel())
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match=r"got Foo\(x x [^\n]*x \.\.\. \(Foo\)\.$"):
    jaxcoll.Trainer(_mse, type("Foo", (), {"__repr__": lambda s: "Foo(" + "x\n" * 200})(),
                    mesh, jaxcoll.DataParallel())
  trainer = jaxcoll.Trainer(lambda p, b: 0.0, optax.sgd(0.1), mesh, jaxcoll.DataParallel())
  # The whole state: its rng count is uint32.
  with pytest.raises(ValueError, match=r"dtype uint32.*It is an nnx RngCount: train only the "
                     r"model's nnx.Param state"):
    trainer.init(nnx.state(model))
  # BatchNorm's statistics closed over and mutated in training mode.
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  closure = jaxcoll.Trainer(
      lambda p, b: _mse(nnx.merge(graphdef, p, rest)(b["inputs"]), b), optax.sgd(0.1), mesh,
      jaxcoll.DataParallel())
  with pytest.raises(ValueError, match=r"^`loss_fn` mutates nnx state it closes over \(Cannot "
                     r"mutate BatchStat from a different trace level\)") as e:
    closure.step(closure.init(params), _batch())
  assert "\n" not in str(e.value)
  import flax.linen as nn  # noqa: PLC0415

  with pytest.raises(ValueError, match="is a flax.linen Module; use jaxcoll.models.from_flax"):
    jaxcoll.models.from_nnx(nn.Dense(2), _mse)

  class Counter(nnx.Module):
    def __init__(self, rngs):
      self.l = nnx.Linear(2, 2, rngs=rngs)
      self.seen = nnx.Variable(jnp.zeros((), jnp.int32))

  with pytest.raises(ValueError, match=r"variable seen \(Variable\) has dtype int32"):
    jaxcoll.models.from_nnx(Counter, _mse)
  with pytest.raises(ValueError, match="must be an nnx.Module or a function"):
    jaxcoll.models.from_nnx(3, _mse)


def test_runner_trains_an_nnx_model_and_resumes_bit_identically(tmp_path):
  """``--config.model=nnx_task:make`` (tests/nnx_task.py: from_nnx, BatchNorm, Dropout),
  ZeRO-3: stopped at step 2 and resumed, the params of the uninterrupted run."""
  flags = (f"--config={os.path.join(jobs.REPO, 'configs', 'minimal.py')}:smoke",
           "--config.model=nnx_task:make", "--config.strategy=zero3", "--config.algorithm=ring",
           "--config.checkpoint_every=2", "--config.eval_every=4")
  shas = []
  for workdir, steps in ((tmp_path / "whole", (4,)), (tmp_path / "resumed", (2, 4))):
    for n in steps:
      out = jobs.train_forked(*flags, f"--config.steps={n}", f"--workdir={workdir}")
      assert out.returncode == 0, out.stderr[-3000:]
    summary = jobs.summary(workdir)
    assert summary["steps"] == 4 and "eval_loss" in summary
    shas.append(summary["params_sha256"])
  assert jobs.summary(tmp_path / "resumed")["start_step"] == 2
  assert shas[0] == shas[1]
