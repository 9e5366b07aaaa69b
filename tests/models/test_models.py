"""Model workloads: registry, parameter counts, learning, synchronised BatchNorm."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import SWEEP_COMPILER_OPTIONS
from jax.sharding import PartitionSpec as P

from jaxcoll.runtime import devices
from jaxcoll import models

# Small sizes so that each compiles and trains in a few seconds on a CPU.
SMALL = {
    "mlp": dict(widths=(32,)),
    "resnet": dict(width=4, image_size=8),
    "transformer": dict(num_layers=1, d_model=32, num_heads=2),
    "recommender": dict(),
}
# (learning rate, steps, batch size) of Adam that lower each loss clearly.
TRAINING = {"mlp": (3e-3, 25, 32), "resnet": (3e-3, 25, 32), "transformer": (3e-3, 25, 32),
            "recommender": (1e-2, 150, 64)}


def fast_key(seed=0):
  # XLA:CPU compiles threefry initialisation of ResNet-18 several times slower
  # than the training step; the RngBitGenerator key keeps the tests fast.
  return jax.random.key(seed, impl="unsafe_rbg")


def tree_max_rel_err(x, y):
  errs = jax.tree.map(
      lambda a, b: float(jnp.abs(a - b).max() / (jnp.abs(b).max() + 1e-12)), x, y
  )
  return max(jax.tree.leaves(errs))


def test_names_and_get():
  assert models.names() == ("mlp", "resnet", "transformer", "recommender")
  assert models.get("resnet") is models.resnet.make_workload


def test_unknown_name_raises_value_error_listing_models():
  with pytest.raises(ValueError, match=r"`name` must be one of \('mlp', 'resnet'.*'vgg'"):
    models.get("vgg")
  with pytest.raises(ValueError, match="`name`"):
    models.make_workload("vgg")


def test_unknown_override_raises_value_error_listing_valid_ones():
  with pytest.raises(ValueError, match=r"\['depth'\].*'resnet'.*'width'"):
    models.make_workload("resnet", depth=50)


@pytest.mark.parametrize(
    "name, overrides, expected",
    [
        ("mlp", {}, 6_922),
        ("resnet", {}, 176_402),
        ("transformer", {}, 114_752),
        ("recommender", {}, 12_337),
        # The standard CIFAR ResNet-18 (e.g. kuangliu/pytorch-cifar): 11,173,962.
        ("resnet", dict(width=64), 11_173_962),
        # BERT-base's MLM model without the segment embeddings and pooler.
        ("transformer", dict(num_layers=12, d_model=768, num_heads=12, vocab_size=30522,
                             seq_len=512), 109_512_762),
    ],
    ids=["mlp", "resnet", "transformer", "recommender", "resnet18_width64", "bert_base"],
)
def test_num_params(name, overrides, expected):
  assert models.make_workload(name, **overrides).num_params == expected


def test_resnet_params_carry_batch_stats():
  w = models.make_workload("resnet", **SMALL["resnet"])
  shapes = w.param_shapes
  assert sorted(shapes) == ["batch_stats", "params"]
  assert w.state_collections == ("batch_stats",)
  assert models.count_params(shapes["batch_stats"]) == 2 * (4 + 4 * 4 + 5 * 8 + 5 * 16 + 5 * 32)


def _compiled(fn, *args):
  """``jax.jit(fn)`` compiled for ``args`` as the collectives sweep compiles (backend level
  0, elemental emitters: SWEEP_COMPILER_OPTIONS, tests/conftest.py): the same program and
  HLO, ~half the compile CPU of ResNet-18's train step at level 0 alone, and this file
  39 -> 30 CPU-s with the emitters (the test is compile-bound: 25 steps on 8x8 images run
  in 0.1 s, the step compiles in ~7 s at the default level)."""
  return jax.jit(fn).lower(*args).compile(SWEEP_COMPILER_OPTIONS)


@pytest.mark.parametrize("name", models.names())
def test_adam_lowers_the_loss(name):
  w = models.make_workload(name, **SMALL[name])
  # Jitted: ResNet's init run op by op compiles dozens of small programs (4.6 s).
  params = _compiled(w.init_params, fast_key())(fast_key())
  assert models.count_params(params["params"]) == w.num_params
  lr, steps, batch_size = TRAINING[name]
  tx = optax.adam(lr)

  def step_fn(params, opt_state, batch):
    (loss, aux), grads = jax.value_and_grad(w.loss_fn, has_aux=w.has_aux)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return w.merge_aux(optax.apply_updates(params, updates), aux), opt_state, loss

  held_out = w.make_batch(0, 256, split="eval")
  loss_fn = _compiled(w.loss_fn, params, held_out)
  before, aux = loss_fn(params, held_out)
  assert np.isfinite(before)
  assert 0.0 <= float(aux["accuracy"]) <= 1.0
  opt_state = tx.init(params)
  train_step = _compiled(step_fn, params, opt_state, w.make_batch(0, batch_size))
  for step in range(steps):
    params, opt_state, loss = train_step(params, opt_state, w.make_batch(step, batch_size))
    assert np.isfinite(loss)
  after, _ = loss_fn(params, held_out)
  assert after < before - 0.05, (float(before), float(after))
  metrics = _compiled(w.eval_fn, params, held_out)(params, held_out)
  assert np.isfinite(metrics["loss"]) and 0.0 <= float(metrics["accuracy"]) <= 1.0


def test_int_seed_initialises_deterministically():
  w = models.make_workload("mlp", widths=(8,))
  a, b = w.init_params(3), w.init_params(jax.random.key(3))
  assert tree_max_rel_err(a, b) == 0.0
  assert tree_max_rel_err(a, w.init_params(4)) > 0.1


def test_mlp_regression_and_bfloat16():
  w = models.make_workload("mlp", widths=(8,), task="regression", dtype=jnp.bfloat16)
  batch = w.make_batch(0, 8)
  assert batch["labels"].shape == (8, 10)
  loss, aux = w.loss_fn(w.init_params(0), batch)
  assert loss.dtype == jnp.float32 and np.isfinite(loss) and aux["mse"] == loss


def test_transformer_heads_must_divide_d_model():
  with pytest.raises(ValueError, match=r"`num_heads` \(3\) must divide `d_model` \(64\)"):
    models.make_workload("transformer", num_heads=3)


def test_merge_aux_replaces_only_state():
  params = {"params": {"w": 1.0}, "batch_stats": {"mean": 0.0}}
  merged = models.merge_aux(params, {"batch_stats": {"mean": 2.0}, "accuracy": 0.5})
  assert merged == {"params": {"w": 1.0}, "batch_stats": {"mean": 2.0}}
  assert params["batch_stats"] == {"mean": 0.0}  # not modified in place
  assert models.merge_aux({"params": 1}, {"params": 2}) == {"params": 1}


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
def test_resnet_sync_batchnorm_in_shard_map_matches_one_device(check_vma):
  # Two stages: the second one's strided block has a BatchNorm on its shortcut.
  w = models.make_workload("resnet", width=4, image_size=8, stage_sizes=(1, 1))
  params = jax.jit(w.init_params)(fast_key())  # op by op: dozens of small compiles
  batch = w.make_batch(0, 16)
  value_and_grad = jax.value_and_grad(w.loss_fn, has_aux=True)
  # All four programs compiled at backend level 0 (_compiled): the same HLO on 1 and 8 devices.
  (loss_1, aux_1), grads_1 = _compiled(value_and_grad, params, batch)(params, batch)

  def per_device(params, batch):
    if check_vma:  # local gradients, then an explicit mean, as a trainer does
      params = jax.lax.pcast(params, "data", to="varying")
    (loss, aux), grads = value_and_grad(params, batch)
    return jax.lax.pmean((loss, aux, grads), "data")

  mesh = devices.flat_mesh()
  sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
                          check_vma=check_vma)
  loss_8, aux_8, grads_8 = _compiled(sharded, params, batch)(params, batch)
  np.testing.assert_allclose(loss_8, loss_1, rtol=1e-5)
  assert tree_max_rel_err(aux_8["batch_stats"], aux_1["batch_stats"]) < 1e-5
  assert tree_max_rel_err(grads_8, grads_1) < 1e-4

  # The same statistics, checked layer by layer on the normalised outputs.
  def stem_stats(params, images):
    _, state = w.model.apply(params, images, mutable=["batch_stats", "intermediates"],
                             capture_intermediates=lambda mdl, _: mdl.name == "BatchNorm_0")
    return state["intermediates"]["BatchNorm_0"]["__call__"][0]

  images = batch["images"]
  out_8 = _compiled(jax.shard_map(stem_stats, mesh=mesh, in_specs=(P(), P("data")),
                                  out_specs=P("data"), check_vma=check_vma),
                    params, images)(params, images)
  out_1 = _compiled(stem_stats, params, images)(params, images)
  np.testing.assert_allclose(out_8, out_1, atol=1e-5)
  np.testing.assert_allclose(np.mean(out_8, axis=(0, 1, 2)), 0.0, atol=1e-5)


def test_resnet_without_axis_name_keeps_per_device_statistics():
  w = models.make_workload("resnet", width=4, image_size=8, stage_sizes=(1,), bn_axis_name=None)
  params = jax.jit(w.init_params)(fast_key())  # op by op: dozens of small compiles
  batch = w.make_batch(0, 16)

  def per_device(params, batch):
    stats = w.loss_fn(params, batch)[1]["batch_stats"]
    return jax.tree.map(lambda x: x[None], stats)

  mesh = devices.flat_mesh()
  local = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data")),
                                out_specs=P("data"), check_vma=False))(
      params, batch)
  whole = jax.jit(per_device)(params, batch)
  assert tree_max_rel_err(local, jax.tree.map(lambda x: x.repeat(8, axis=0), whole)) > 1e-3


def test_resnet_eval_uses_running_statistics():
  w = models.make_workload("resnet", width=4, image_size=8, stage_sizes=(1,))
  params = jax.jit(w.init_params)(fast_key())  # op by op: dozens of small compiles
  batch = w.make_batch(0, 16)
  _, aux = jax.jit(w.loss_fn)(params, batch)  # jitted: op by op compiles dozens of programs
  updated = w.merge_aux(params, aux)
  eval_fn = jax.jit(w.eval_fn)
  before = eval_fn(params, batch)["loss"]
  after = eval_fn(updated, batch)["loss"]
  assert abs(float(before) - float(after)) > 1e-4
  # momentum 0.9: the running mean moves a tenth of the way to the batch mean.
  mean_0 = params["batch_stats"]["BatchNorm_0"]["mean"]
  mean_1 = updated["batch_stats"]["BatchNorm_0"]["mean"]
  assert np.all(mean_0 == 0.0) and np.any(mean_1 != 0.0)


def _restack(unrolled, names, layer_prefix):
  """An unrolled params dict re-arranged as the scanned model's: the layers
  ``layer_prefix``0.. stacked under "layers", the others renamed by ``names``."""
  p = unrolled["params"]
  layer_keys = sorted((k for k in p if k.startswith(layer_prefix)),
                      key=lambda k: int(k.rsplit("_", 1)[1]))
  out = {new: p[old] for old, new in names.items()}
  out["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *(p[k] for k in layer_keys))
  return {"params": out}


# The transformer with -m slow: tests/train/test_fsdp.py's scanned units match one device.
@pytest.mark.parametrize("name", ["mlp", pytest.param("transformer", marks=pytest.mark.slow)])
def test_scanned_model_gives_the_unrolled_loss_and_grads(name):
  if name == "mlp":
    kw = dict(depth=4, width=16)
    # Unrolled Dense_0 (input), Dense_1..3 (the stacked blocks), Dense_4 (output).
    unrolled_w = models.make_workload("mlp", **kw, scan_layers=False)
    params = unrolled_w.init_params(fast_key())
    p = params["params"]
    restacked = {"params": {
        "Dense_0": p["Dense_0"], "Dense_1": p["Dense_4"],
        "layers": {"Dense_0": jax.tree.map(lambda *xs: jnp.stack(xs),
                                           p["Dense_1"], p["Dense_2"], p["Dense_3"])},
    }}
  else:
    kw = dict(num_layers=3, d_model=32, num_heads=2, seq_len=16)
    unrolled_w = models.make_workload("transformer", **kw, scan_layers=False)
    params = unrolled_w.init_params(fast_key())
    others = {k: k for k in params["params"] if not k.startswith("EncoderLayer_")}
    restacked = _restack(params, others, "EncoderLayer_")
  scanned_w = models.make_workload(name, **kw, scan_layers=True)
  # Same tree as the scanned model's own init, same parameter count.
  assert jax.tree.structure(restacked) == jax.tree.structure(scanned_w.param_shapes)
  assert jax.tree.map(jnp.shape, restacked) == jax.tree.map(lambda s: s.shape,
                                                             scanned_w.param_shapes)
  assert scanned_w.num_params == unrolled_w.num_params
  batch = unrolled_w.make_batch(0, 8)
  grad = jax.jit(jax.value_and_grad(lambda w, p, b: w.loss_fn(p, b)[0], argnums=1),
                 static_argnums=0)
  loss_u, grads_u = grad(unrolled_w, params, batch)
  loss_s, grads_s = grad(scanned_w, restacked, batch)
  np.testing.assert_allclose(loss_s, loss_u, rtol=1e-5)
  if name == "mlp":
    g = grads_u["params"]
    np.testing.assert_allclose(grads_s["params"]["layers"]["Dense_0"]["kernel"][1],
                               g["Dense_2"]["kernel"], rtol=1e-4, atol=1e-7)
  else:
    g = _restack(grads_u, {k: k for k in others}, "EncoderLayer_")
    assert tree_max_rel_err(grads_s, g) < 1e-4


def test_scan_layers_defaults_and_bad_input():
  # Defaults keep their unrolled trees; deep stacks of equal blocks scan.
  assert "layers" not in models.make_workload("transformer").param_shapes["params"]
  assert "layers" not in models.make_workload("mlp").param_shapes["params"]
  deep = models.make_workload("transformer", num_layers=8, d_model=32, num_heads=2)
  assert deep.param_shapes["params"]["layers"]["Dense_0"]["kernel"].shape == (8, 32, 128)
  assert models.make_workload("mlp", depth=8, width=16).config["scan_layers"] is True
  with pytest.raises(ValueError, match=r"`scan_layers`=True needs .* widths=\(16, 32\)"):
    models.make_workload("mlp", widths=(16, 32), scan_layers=True)
  with pytest.raises(ValueError, match="`depth`.*`width`"):
    models.make_workload("mlp", depth=4)
  with pytest.raises(TypeError, match="`scan_layers`"):
    models.make_workload("transformer", scan_layers="yes")
