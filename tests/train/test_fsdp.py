"""FSDP units under ZeRO-3: same training as one device, memory at one layer, bad input."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcoll
from jaxcoll.train import fsdp_params


class Block(nn.Module):
  """A residual MLP block (13 hidden units: no leaf size divides by 8 or 4)."""

  hidden: int = 13

  @nn.compact
  def __call__(self, x, _=None):
    h = jnp.tanh(nn.Dense(self.hidden)(x))
    return x + nn.Dense(x.shape[-1])(h), None


class Net(nn.Module):
  """Dense -> ``layers`` blocks (scanned or unrolled) -> Dense."""

  block: type = Block
  layers: int = 3
  scan: bool = False
  width: int = 6
  hidden: int = 13

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.width)(x)
    if self.scan:
      stack = nn.scan(self.block, variable_axes={"params": 0}, split_rngs={"params": True},
                      length=self.layers)
      x, _ = stack(self.hidden)(x, None)
    else:
      for _ in range(self.layers):
        x, _ = self.block(self.hidden)(x)
    return nn.Dense(3)(x)


def _batch(n=16, d=5, seed=0):
  rng = np.random.default_rng(seed)
  return {"x": rng.normal(size=(n, d)).astype(np.float32),
          "y": rng.normal(size=(n, 3)).astype(np.float32)}


def _train(model, params, mesh, strategy, batch, *, steps=5):
  def loss_fn(p, b):
    return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

  trainer = jaxcoll.Trainer(loss_fn, optax.adam(1e-2), mesh, strategy)
  state = trainer.init(params)
  for _ in range(steps):
    state, _ = trainer.step(state, batch)
  return trainer, state, jax.tree.map(np.asarray, trainer.params(state))


def _close(a, b, rtol=1e-4, atol=1e-6):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def test_unit_outside_zero3_changes_nothing():
  batch = _batch()
  for scan in (False, True):
    plain = Net(Block, scan=scan)
    unit = Net(jaxcoll.fsdp_unit(Block), scan=scan)
    params = unit.init(jax.random.key(0), batch["x"])["params"]
    assert jax.tree.structure(params) == jax.tree.structure(
        plain.init(jax.random.key(0), batch["x"])["params"])
    out_plain = plain.apply({"params": params}, batch["x"])
    out_unit = unit.apply({"params": params}, batch["x"])
    assert np.array_equal(np.asarray(out_plain), np.asarray(out_unit))
  # ZeRO-2 training of the marked (scanned) model is bit-identical to the plain one.
  mesh = jaxcoll.devices.flat_mesh(8)
  _, _, got = _train(unit, params, mesh, jaxcoll.ZeRO(stage=2), batch, steps=2)
  _, _, want = _train(plain, params, mesh, jaxcoll.ZeRO(stage=2), batch, steps=2)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert np.array_equal(x, y)


@pytest.mark.parametrize("scan, remat", [(False, True), (True, False)],
                         ids=["unrolled-remat", "scanned"])
def test_zero3_units_match_single_device(scan, remat):
  batch = _batch()
  unit = jaxcoll.fsdp_unit(Block)
  model = Net(nn.remat(unit) if remat else unit, scan=scan)
  params = model.init(jax.random.key(1), batch["x"])["params"]
  _, _, want = _train(model, params, jaxcoll.devices.flat_mesh(1), jaxcoll.DataParallel(), batch)
  trainer, state, got = _train(model, params, jaxcoll.devices.flat_mesh(8), jaxcoll.ZeRO(3), batch)
  layout = trainer._plan.layout
  assert len(layout.units) == (12 if not scan else 4)  # 4 leaves per layer (or stacked)
  assert [layout.layers[i] for i in sorted(layout.units)] == ([None] * 12 if not scan else [3] * 4)
  _close(got, want)
  # The canonical state is layout-free: it restores onto data parallelism.
  canonical = trainer.export_state(state)
  dp = jaxcoll.Trainer(trainer.loss_fn, trainer.optimizer, jaxcoll.devices.flat_mesh(4),
                       jaxcoll.DataParallel())
  _close(jax.tree.map(np.asarray, dp.params(dp.import_state(canonical))), got, rtol=0, atol=0)


def test_fsdp_params_without_flax_matches_single_device():
  rng = np.random.default_rng(2)
  layers = {"w": rng.normal(size=(4, 6, 6)).astype(np.float32) * 0.3,
            "b": rng.normal(size=(4, 6)).astype(np.float32) * 0.1}
  params = {"layers": layers, "out": rng.normal(size=(6, 3)).astype(np.float32)}
  batch = {"x": rng.normal(size=(16, 6)).astype(np.float32),
           "y": rng.normal(size=(16, 3)).astype(np.float32)}

  def loss_fn(p, b):
    @jax.checkpoint
    def body(x, layer):
      layer = fsdp_params(layer, ("layers",))
      return jnp.tanh(x @ layer["w"] + layer["b"]), None

    x, _ = jax.lax.scan(body, b["x"], p["layers"])
    return jnp.mean((x @ p["out"] - b["y"]) ** 2)

  jax.eval_shape(loss_fn, params, batch)  # records the unit
  results = []
  for mesh, strategy in [(jaxcoll.devices.flat_mesh(1), jaxcoll.DataParallel()),
                         (jaxcoll.devices.flat_mesh(8), jaxcoll.ZeRO(3))]:
    trainer = jaxcoll.Trainer(loss_fn, optax.adam(1e-2), mesh, strategy)
    state = trainer.init(params)
    for _ in range(5):
      state, _ = trainer.step(state, batch)
    results.append(jax.tree.map(np.asarray, trainer.params(state)))
  assert sorted(trainer._plan.layout.units) == [0, 1]
  _close(results[1], results[0])


class Outer(nn.Module):
  @nn.compact
  def __call__(self, x):
    return jaxcoll.fsdp_unit(nn.Dense)(4)(x)


def test_unit_inside_unit_is_rejected():
  with pytest.raises(ValueError, match="`module_cls`.*cannot nest"):
    jaxcoll.fsdp_unit(Outer)().init(jax.random.key(0), jnp.ones((2, 3)))


def test_layer_axis_that_is_not_leading_is_rejected():
  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      scan = nn.scan(jaxcoll.fsdp_unit(Block), variable_axes={"params": 1},
                     split_rngs={"params": True}, length=3)
      return scan()(x, None)[0]

  batch = _batch()
  model = Stack()
  params = model.init(jax.random.key(0), batch["x"][:, :5])["params"]

  def loss_fn(p, b):
    return jnp.mean(model.apply({"params": p}, b["x"]) ** 2)

  trainer = jaxcoll.Trainer(loss_fn, optax.adam(1e-2), jaxcoll.devices.flat_mesh(8),
                            jaxcoll.ZeRO(3))
  with pytest.raises(ValueError, match=r"`params` leaf .*variable_axes=\{'params': 0\}"):
    trainer.init(params)


def test_fsdp_unit_needs_a_module_class():
  with pytest.raises(TypeError, match="`module_cls`"):
    jaxcoll.fsdp_unit(Block())


class Wide(nn.Module):
  width: int = 256

  @nn.compact
  def __call__(self, x, _=None):
    return x + jnp.tanh(nn.Dense(self.width)(x)), None


def test_scanned_zero3_peak_memory_is_a_fraction_of_dp():
  """8 scanned 256x256 layers on 8 devices: peak per device from XLA's memory analysis."""
  width, layers, n = 256, 8, 8
  model = Net(jaxcoll.fsdp_unit(Wide), layers=layers, scan=True, width=width, hidden=width)
  batch = _batch(n=16, d=width)
  params = model.init(jax.random.key(0), batch["x"])["params"]
  psi = sum(x.size for x in jax.tree.leaves(params))

  def loss_fn(p, b):
    return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

  mesh = jaxcoll.devices.flat_mesh(n)
  peaks = {}
  for name, strategy in [("dp", jaxcoll.DataParallel()), ("zero3", jaxcoll.ZeRO(3))]:
    trainer = jaxcoll.Trainer(loss_fn, optax.adam(1e-3), mesh, strategy)
    state = trainer.init(params)
    m = trainer.compile_step(state, batch).memory_analysis()
    peaks[name] = (m.argument_size_in_bytes + m.output_size_in_bytes
                   - m.alias_size_in_bytes + m.temp_size_in_bytes)
  assert peaks["zero3"] <= 2.5 * 16 * psi / n, peaks
  assert peaks["zero3"] <= peaks["dp"] / 3.5, peaks


def _workload_params(w, strategy, mesh, steps=3, batch_size=16):
  trainer = jaxcoll.Trainer(w.loss_fn, optax.adam(1e-3), mesh, strategy, has_aux=True)
  state = trainer.init(w.init_params(0))
  for s in range(steps):
    state, _ = trainer.step(state, w.make_batch(s, batch_size))
  return trainer, jax.tree.map(np.asarray, trainer.params(state))


# resnet compiles for about a minute on 2 loaded cores; transformer covers the default run.
# Both with -m slow: test_zero3_units_match_single_device checks FSDP units by value by default.
@pytest.mark.parametrize("name", [pytest.param("transformer", marks=pytest.mark.slow),
                                  pytest.param("resnet", marks=pytest.mark.slow)])
def test_shipped_models_gather_their_blocks_under_zero3(name):
  from jaxcoll.models import resnet, transformer  # noqa: PLC0415

  if name == "transformer":  # scanned: 16 stacked leaves in "layers", 9 outside
    w, want_units = transformer.make_workload(num_layers=8, d_model=16, num_heads=2), 16
  else:  # 2 blocks: 2 convs + 2 BatchNorm scale/bias each, + 1x1 shortcut and its norm
    w, want_units = resnet.make_workload(width=4, stage_sizes=(1, 1), image_size=8), 15
  # Another size of the same model in this process: its records must not hide these units.
  other = (transformer.make_workload(num_layers=8, d_model=32, num_heads=2) if name ==
           "transformer" else resnet.make_workload(width=8, stage_sizes=(1, 1), image_size=8))
  other.init_params(0)
  trainer, got = _workload_params(w, jaxcoll.ZeRO(stage=3), jaxcoll.devices.flat_mesh(8))
  assert len(trainer._plan.layout.units) == want_units
  _, want = _workload_params(w, jaxcoll.DataParallel(), jaxcoll.devices.flat_mesh(1))
  _close(got, want, rtol=1e-4, atol=1e-5)


def test_model_without_units_sharing_unit_paths_is_refused_under_zero3():
  batch = _batch()
  unit = Net(jaxcoll.fsdp_unit(Block), scan=True)
  params = unit.init(jax.random.key(0), batch["x"])["params"]  # records the unit's leaves
  with pytest.raises(ValueError, match="no jaxcoll.fsdp_unit used them"):
    _train(Net(Block, scan=True), params, jaxcoll.devices.flat_mesh(8), jaxcoll.ZeRO(3), batch,
           steps=1)


def test_units_the_trainer_was_built_before_seeing_are_named_in_a_warning():
  # Params loaded from a file (here: zeros of the model's shapes) in a process that never
  # ran the model: the units were unknown to the trainer, so ZeRO-3 gathered their
  # parameters up front with the whole model (XLA temp of a scanned 8 x 256 MLP: 6.90 MB
  # instead of 1.03 MB), silently. Now a warning names the units and the fix; after it
  # the step gathers layer by layer, and both train alike.
  class LoadedBlock(Block):  # a name no other test runs, so no unit of it was recorded
    pass

  model = Net(jaxcoll.fsdp_unit(LoadedBlock), scan=True, hidden=11)
  batch = _batch()
  # The shapes a saved file holds (the same model without units: nothing recorded).
  shapes = jax.eval_shape(Net(LoadedBlock, scan=True, hidden=11).init, jax.random.key(0),
                          batch["x"])["params"]
  loaded = jax.tree.map(lambda s: np.full(s.shape, 0.1, s.dtype), shapes)
  mesh = jaxcoll.devices.flat_mesh(2)
  with pytest.warns(UserWarning, match=r"^FSDP unit\(s\) \['ScanLoadedBlock_0'\] ran under "
                    r"ZeRO-3, but the trainer was built before they were seen.*"
                    r"jax.eval_shape\(model.init, key, x\)"):
    trainer, _, before = _train(model, loaded, mesh, jaxcoll.ZeRO(3), batch, steps=1)
  assert trainer.fsdp_unit_bytes(loaded) is None
  jax.eval_shape(model.init, jax.random.key(0), batch["x"])  # the fix: records the units
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    trainer, _, after = _train(model, loaded, mesh, jaxcoll.ZeRO(3), batch, steps=1)
  assert trainer.fsdp_unit_bytes(loaded)[3]  # a scanned unit
  _close(before, after)


class BoxedBlock(nn.Module):
  """Block with MaxText-style partitioning annotations on its kernels."""

  hidden: int = 13

  @nn.compact
  def __call__(self, x, _=None):
    h = nn.Dense(self.hidden, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("embed", "mlp")))(x)
    return x + nn.Dense(x.shape[-1], kernel_init=nn.with_partitioning(
        nn.initializers.lecun_normal(), ("mlp", None)))(jnp.tanh(h)), None


def test_units_whose_params_are_boxed_by_with_partitioning_match_single_device():
  # The trainer matched a unit's leaves by paths that end in the box's 'value' key, while
  # the unit, given unboxed params, looked them up without it: "`params` leaves
  # ['ScanBoxedBlock_0/Dense_0/kernel/value', ...] have the path and shape of an FSDP unit's
  # parameters ..., but no jaxcoll.fsdp_unit used them" (and: rename the modules).
  class BoxedNet(nn.Module):
    @nn.compact
    def __call__(self, x):
      stack = nn.scan(jaxcoll.fsdp_unit(BoxedBlock), variable_axes={"params": 0},
                      split_rngs={"params": True}, length=3,
                      metadata_params={nn.PARTITION_NAME: "layers"})
      return nn.Dense(3)(stack()(nn.Dense(6)(x), None)[0])

  batch = _batch()
  model = BoxedNet()
  params = jax.jit(model.init)(jax.random.key(0), batch["x"])["params"]  # one program
  trainer, _, got = _train(model, params, jaxcoll.devices.flat_mesh(4), jaxcoll.ZeRO(3), batch,
                           steps=1)
  assert trainer.fsdp_unit_bytes(params)[3]  # a scanned unit: gathered layer by layer
  tx = optax.adam(1e-2)

  @jax.jit
  def one_device(p):
    grads = jax.grad(lambda p: jnp.mean((model.apply({"params": p}, batch["x"]) - batch["y"])
                                        ** 2))(p)
    return optax.apply_updates(p, tx.update(grads, tx.init(p), p)[0])

  _close(got, one_device(params))


class SetupBlock(nn.Module):
  """A block whose parameters are made in ``setup`` (flax's other style), scanned."""

  def setup(self):
    self.up = nn.Dense(13)
    self.down = nn.Dense(6)

  def __call__(self, x, _=None):
    return x + self.down(jnp.tanh(self.up(x))), None


class TiedLM(nn.Module):
  """A token model with tied embeddings (``attend``) and scanned ``setup`` blocks."""

  @nn.compact
  def __call__(self, tokens):
    embed = jaxcoll.fsdp_unit(nn.Embed)(11, 6, name="embed")
    stack = nn.scan(jaxcoll.fsdp_unit(SetupBlock), variable_axes={"params": 0},
                    split_rngs={"params": True}, length=3)
    x, _ = stack()(embed(tokens), None)
    return embed.attend(nn.LayerNorm()(x))


def test_units_made_in_setup_and_read_by_attend_match_single_device():
  # An nn.Embed unit (parameter made in setup) whose attend() is the tied read-out, and
  # setup-style scanned blocks: ZeRO-3 ran setup() on the device's rows outside the unit
  # (flax ScopeParamShapeError, reported as "no jaxcoll.fsdp_unit used them"), and
  # attend() would have read the rows.
  tokens = np.random.default_rng(3).integers(0, 11, size=(16, 5)).astype(np.int32)
  model = TiedLM()
  params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
  plain = jax.tree.map(np.asarray, params)

  def loss_fn(p, b):
    logits = model.apply({"params": p}, b["t"])
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], b["t"][:, 1:]).mean()

  results = []
  for mesh, strategy in [(jaxcoll.devices.flat_mesh(1), jaxcoll.DataParallel()),
                         (jaxcoll.devices.flat_mesh(8), jaxcoll.ZeRO(3))]:
    trainer = jaxcoll.Trainer(loss_fn, optax.adam(1e-2), mesh, strategy)
    state = trainer.init(plain)
    for _ in range(3):
      state, _ = trainer.step(state, {"t": tokens})
    results.append(jax.tree.map(np.asarray, trainer.params(state)))
  layout = trainer._plan.layout
  assert sorted(map(str, (layout.layers[i] for i in layout.units))) == ["3"] * 4 + ["None"]
  _close(results[1], results[0])


def test_fsdp_params_path_that_names_no_parameters_is_one_line():
  # A typo in fsdp_params' path: the step warned "the trainer was built before they were
  # seen ... (loaded from a file?)" and held the whole model; now one line naming the path.
  rng = np.random.default_rng(4)
  params = {"layers": {"w": rng.normal(size=(2, 5, 5)).astype(np.float32)},
            "out": rng.normal(size=(5, 1)).astype(np.float32)}
  batch = {"x": rng.normal(size=(8, 5)).astype(np.float32)}

  def loss_fn(p, b):
    def body(x, layer):
      return jnp.tanh(x @ fsdp_params(layer, ("stack",))["w"]), None

    return jnp.mean(jax.lax.scan(body, b["x"], p["layers"])[0] @ p["out"])

  jax.eval_shape(loss_fn, params, batch)
  trainer = jaxcoll.Trainer(loss_fn, optax.sgd(0.1), jaxcoll.devices.flat_mesh(8), jaxcoll.ZeRO(3))
  state = trainer.init(params)
  with pytest.raises(ValueError, match=r"`path` \('stack',\) names no parameters: its leaves "
                     r"\(stack/w\) .* \(e\.g\. path=\('layers',\)\)") as info:
    trainer.step(state, batch)
  assert "\n" not in str(info.value)


def test_unit_helper_method_works_on_an_unbound_module():
  # fsdp_unit wraps a unit's public methods; one that reads only attributes still runs on
  # an unbound module, as on the class itself (the wrapper asked for the module's path).
  class Sized(nn.Module):
    features: int = 3

    def out_dim(self):
      return 2 * self.features

    @nn.compact
    def __call__(self, x):
      return nn.Dense(self.out_dim())(x)

  assert jaxcoll.fsdp_unit(Sized)(4).out_dim() == 8
