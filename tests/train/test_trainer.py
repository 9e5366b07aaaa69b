"""Trainer, DataParallel and ZeRO on 8 emulated CPU devices.

The reference of every strategy is a plain optax loop on one device with the
same global batch: one step of any strategy must compute the same update.
_mp_init_worker is one part of tests/train's launched 2-process job (test_two_processes.py).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from mlp_task import GLOBAL_BATCH, WIDTHS, init_mlp, mlp, mse

import jaxcoll
from jaxcoll.train import DataParallel, Trainer, ZeRO, compression
from jaxcoll.train.buckets import ShardLayout, plan_buckets

STEPS = 10


def batches(steps=STEPS, size=GLOBAL_BATCH, widths=WIDTHS, seed=1):
  rng = np.random.default_rng(seed)
  teacher = init_mlp(seed + 100, widths)
  out = []
  for _ in range(steps):
    x = rng.normal(size=(size, widths[0])).astype(np.float32)
    y = np.asarray(mlp(teacher, x)) + 0.1 * rng.normal(size=(size, widths[-1]))
    out.append({"x": x, "y": y.astype(np.float32)})
  return out


def single_device(optimizer, params, data, loss_fn=mse):
  """The reference: a plain optax loop on one device, whole global batch."""
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  for batch in data:
    params, opt_state = step(params, opt_state, batch)
  return params


def assert_trees_close(actual, expected, rtol=1e-4, atol=1e-6):
  jax.tree.map(
    lambda a, e: np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol),
    actual,
    expected,
  )


def train(trainer, params, data):
  state = trainer.init(params)
  metrics = None
  for batch in data:
    state, metrics = trainer.step(state, batch)
  return state, metrics


@pytest.fixture(scope="module")
def reference():
  params, data = init_mlp(), batches()
  return params, data, single_device(optax.adam(1e-2), params, data)


STRATEGIES = {
  "dp-native": (None, DataParallel(algorithm="native")),
  "dp-ring-small-buckets": (None, DataParallel(algorithm="ring", bucket_bytes=64)),
  "dp-halving_doubling": (None, DataParallel(algorithm="halving_doubling")),
  "dp-hierarchical": ("node_local", DataParallel(axis=("node", "local"), algorithm="hierarchical")),
  "zero1": (None, ZeRO(stage=1)),
  "zero2-small-buckets": (None, ZeRO(stage=2, bucket_bytes=128)),
  "zero3": (None, ZeRO(stage=3)),
  "zero3-hierarchical": (
    "node_local",
    ZeRO(stage=3, axis=("node", "local"), algorithm="hierarchical"),
  ),
}


def make_mesh(kind):
  if kind == "node_local":
    return jaxcoll.devices.node_local_mesh(2, 4)
  return jaxcoll.devices.flat_mesh(8)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_matches_single_device(name, reference):
  params, data, expected = reference
  mesh_kind, strategy = STRATEGIES[name]
  trainer = Trainer(mse, optax.adam(1e-2), make_mesh(mesh_kind), strategy)
  state, metrics = train(trainer, params, data)

  assert_trees_close(trainer.params(state), expected)
  assert trainer.trace_count == 1  # one compile for all STEPS steps
  assert int(state.step) == STEPS
  # Metrics are global: the loss of the last step's params on its batch.
  assert metrics["grad_norm"] > 0
  eval_loss = trainer.eval(state, data[0])["loss"]
  np.testing.assert_allclose(eval_loss, mse(expected, data[0]), rtol=1e-4)
  trainer.check_replicas(state)


@pytest.mark.parametrize(
  "strategy", [DataParallel(algorithm="native"), ZeRO(stage=3)], ids=["dp", "zero3"]
)
def test_grad_accumulation_matches_single_device(strategy, reference):
  params, data, expected = reference
  mesh = jaxcoll.devices.flat_mesh(8)
  trainer = Trainer(mse, optax.adam(1e-2), mesh, strategy, grad_accum_steps=4)  # 4 x 8 = 32
  state, _ = train(trainer, params, data)
  assert_trees_close(trainer.params(state), expected)


@pytest.mark.parametrize("strategy", [DataParallel(), ZeRO(stage=2)], ids=["dp", "zero2"])
def test_clip_global_norm_matches_optax(strategy):
  params, data = init_mlp(), batches(steps=3)
  expected = single_device(
    optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)), params, data
  )
  mesh = jaxcoll.devices.flat_mesh(8)
  trainer = Trainer(mse, optax.adam(1e-2), mesh, strategy, clip_global_norm=0.05)
  state, metrics = train(trainer, params, data)
  assert metrics["grad_norm"] > 0.05  # clipping was active
  assert_trees_close(trainer.params(state), expected)


def test_clip_global_norm_takes_numpy_and_jax_scalars():
  # A jnp scalar (jnp.float32(0.05), what a jnp expression gives) was refused when the
  # check became isinstance(x, (int, float, np.number)); True passed it (a clip of 1).
  params, data = init_mlp(), batches(steps=1)
  expected = single_device(optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(1.0)),
                           params, data)
  mesh = jaxcoll.devices.flat_mesh(8)
  for clip in (np.float32(0.05), jnp.float32(0.05)):
    trainer = Trainer(mse, optax.sgd(1.0), mesh, DataParallel(), clip_global_norm=clip)
    state, metrics = train(trainer, params, data)
    assert metrics["grad_norm"] > 0.05  # clipping was active
    assert_trees_close(trainer.params(state), expected)


def test_batch_not_divisible_raises():
  trainer = Trainer(mse, optax.sgd(0.1), jaxcoll.devices.flat_mesh(8), DataParallel())
  state = trainer.init(init_mlp())
  batch = batches(steps=1, size=30)[0]
  with pytest.raises(ValueError, match=r"Global batch size 30 .* data-parallel size 8"):
    trainer.step(state, batch)

  accum = Trainer(
    mse, optax.sgd(0.1), jaxcoll.devices.flat_mesh(8), DataParallel(), grad_accum_steps=4
  )
  state = accum.init(init_mlp())
  with pytest.raises(ValueError, match=r"Global batch size 16 .* 8 x grad_accum_steps 4 = 32"):
    accum.step(state, batches(steps=1, size=16)[0])


@pytest.mark.parametrize("call", ["step", "eval"])
def test_a_batch_of_no_rows_is_one_line(call):
  # 0 divides by every device count: a step on an empty last batch ran, logged a NaN loss
  # and still stepped the optimizer (adam's count, weight decay); eval returned NaN.
  trainer = Trainer(mse, optax.adamw(0.1, weight_decay=0.5), jaxcoll.devices.flat_mesh(8),
                    ZeRO(stage=3))
  state = trainer.init(init_mlp())
  empty = jax.tree.map(lambda x: x[:0], batches(steps=1, size=8)[0])
  with pytest.raises(ValueError, match=r"^Global batch size 0: `batch` has no rows; pass at "
                     r"least 8 \(8 data-parallel devices x grad_accum_steps 1\)"):
    getattr(trainer, call)(state, empty)
  assert int(state.step) == 0  # not donated: the state is still usable


def test_aux_is_averaged_over_devices_and_microbatches():
  def loss_with_aux(params, batch):
    # BatchNorm-like statistics of the local batch, and a count.
    stats = {"mean": jnp.mean(batch["x"], axis=0), "var": jnp.var(batch["x"], axis=0)}
    return mse(params, batch), {"stats": stats, "count": jnp.int32(batch["x"].shape[0])}

  data = batches(steps=1)
  trainer = Trainer(
    loss_with_aux,
    optax.sgd(0.1),
    jaxcoll.devices.flat_mesh(8),
    ZeRO(stage=1),
    has_aux=True,
    grad_accum_steps=2,
  )
  state = trainer.init(init_mlp())
  x = data[0]["x"]
  _, metrics = trainer.step(state, data[0])
  aux = metrics["aux"]
  np.testing.assert_allclose(aux["stats"]["mean"], x.mean(0), rtol=1e-5, atol=1e-6)
  # The average of the 16 local variances (8 devices x 2 microbatches of 2).
  local_vars = x.reshape(16, 2, -1).var(axis=1).mean(0)
  np.testing.assert_allclose(aux["stats"]["var"], local_vars, rtol=1e-5)
  assert int(aux["count"]) == GLOBAL_BATCH
  np.testing.assert_allclose(metrics["loss"], mse(init_mlp(), data[0]), rtol=1e-5)


def test_check_replicas_catches_divergence():
  trainer = Trainer(mse, optax.sgd(0.1), jaxcoll.devices.flat_mesh(8), DataParallel())
  params = init_mlp()
  state = trainer.init(params)
  assert trainer.check_replicas(state) == []
  assert trainer.check_replicas(trainer.params(state)) == []  # any pytree, not only a state

  # Device 3's copy of one weight differs in one element.
  leaf = state.params["layer1"]["w"]
  copies = [np.asarray(s.data) for s in leaf.addressable_shards]
  copies[3] = copies[3].copy()
  copies[3][0, 0] += 1e-3
  bad = jax.make_array_from_single_device_arrays(
    leaf.shape,
    leaf.sharding,
    [jax.device_put(c, s.device) for c, s in zip(copies, leaf.addressable_shards)],
  )
  diverged = state._replace(params={**state.params, "layer1": {**state.params["layer1"], "w": bad}})
  problems = trainer.check_replicas(diverged, raise_on_mismatch=False)
  assert len(problems) == 1 and "layer1" in problems[0] and "'w'" in problems[0]
  assert "[3]" in problems[0]
  with pytest.raises(RuntimeError, match="layer1"):
    trainer.check_replicas(diverged)

  # init broadcasts device 0's values, repairing diverged replicas.
  repaired = trainer.init(diverged.params)
  assert trainer.check_replicas(repaired) == []
  np.testing.assert_array_equal(repaired.params["layer1"]["w"], params["layer1"]["w"])


def test_int8_error_feedback_reaches_uncompressed_loss():
  widths = (8, 32, 4)
  params, data = init_mlp(0, widths), batches(steps=60, widths=widths)
  mesh = jaxcoll.devices.flat_mesh(8)
  losses = {}
  for name, strategy in {
    "f32": DataParallel(),
    "int8": DataParallel(compression="int8", error_feedback=True),
  }.items():
    trainer = Trainer(mse, optax.adam(3e-3), mesh, strategy)
    state, _ = train(trainer, params, data)
    losses[name] = float(trainer.eval(state, data[0])["loss"])
  assert losses["f32"] < 0.5 * float(mse(params, data[0]))  # it learned
  assert abs(losses["int8"] - losses["f32"]) <= 0.02 * losses["f32"]


def test_bf16_compute_keeps_float32_master_params(reference):
  params, data, expected = reference
  trainer = Trainer(
    mse,
    optax.adam(1e-2),
    jaxcoll.devices.flat_mesh(8),
    ZeRO(stage=3),
    compute_dtype=jnp.bfloat16,
  )
  state, _ = train(trainer, params, data[:3])
  out = trainer.params(state)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(out))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.opt_state) if x.ndim > 1)
  ref3 = single_device(optax.adam(1e-2), params, data[:3])
  assert_trees_close(out, ref3, rtol=0, atol=3e-2)


# -- communication volume (jaxcoll.analysis) -----------------------------------


def _comm_bytes(strategy, widths=(64, 128, 64)):
  """Bytes one device sends per step, read from the lowered step's HLO.

  The lowered HLO is what the trainer asks for; the CPU backend later
  upcasts bf16 all-reduces and merges ZeRO-3's re-gather with the first one.
  """
  analysis = pytest.importorskip("jaxcoll.observe.analysis")
  params = init_mlp(0, widths)
  trainer = Trainer(mse, optax.adam(1e-3), jaxcoll.devices.flat_mesh(8), strategy)
  state = trainer.init(params)
  hlo = trainer.lower_step(state, batches(1, 32, widths)[0]).as_text(dialect="hlo")
  report = analysis.report_from_hlo(hlo)
  return report.total_bytes_sent_per_device, sum(x.size for x in jax.tree.leaves(params))


def test_comm_volume_dp_zero3_bf16():
  n = 8
  dp, psi = _comm_bytes(DataParallel(algorithm="native"))
  assert dp == pytest.approx(2 * (n - 1) / n * psi * 4, rel=0.01)
  zero3, _ = _comm_bytes(ZeRO(stage=3, algorithm="native"))
  assert zero3 == pytest.approx(1.5 * dp, rel=0.01)
  bf16, _ = _comm_bytes(DataParallel(algorithm="native", compression="bf16"))
  assert bf16 == pytest.approx(0.5 * dp, rel=0.01)
  int8, _ = _comm_bytes(DataParallel(compression="int8"))
  assert int8 < 0.3 * dp


# -- building blocks and argument checks ---------------------------------------


def test_plan_buckets_reverse_order_and_cap():
  assert plan_buckets([40, 40, 40, 100], bucket_bytes=80) == ((3,), (2, 1), (0,))
  assert plan_buckets([4, 0, 4], bucket_bytes=100) == ((2, 0),)
  layout = ShardLayout.build([np.zeros((5, 7)), np.zeros(3)], n=8, bucket_bytes=10**6)
  assert layout.chunks == (5, 1) and layout.buckets == ((1, 0),)


def test_buckets_never_mix_dtypes():
  assert plan_buckets([40] * 4, bucket_bytes=80, groups="abab") == ((3, 1), (2, 0))
  assert plan_buckets([40] * 3, bucket_bytes=80, groups="aaa") == ((2, 1), (0,))
  leaves = [np.zeros((5, 7), np.float32), np.zeros(3, jnp.bfloat16), np.zeros(2, np.float32)]
  layout = ShardLayout.build(leaves, n=8, bucket_bytes=10**6)
  assert layout.buckets == ((2, 0), (1,))


def test_zero_rows_keep_the_leaf_rank():
  layout = ShardLayout.build([np.zeros((5, 7)), np.zeros(3), np.float32(2), np.zeros((2, 3, 4))],
                             n=8, bucket_bytes=10**6)
  assert [layout.row_shape(i) for i in range(4)] == [(1, 5), (1,), (), (1, 1, 3)]
  x = jnp.arange(35.0).reshape(5, 7)
  rows = layout.rows(x, 0)
  assert rows.shape == (8, 1, 5)
  np.testing.assert_array_equal(layout.unrows(rows, 0), x)
  np.testing.assert_array_equal(layout.own_shard(x, 0, 6), [[30, 31, 32, 33, 34]])
  assert layout.rows(jnp.float32(2), 2).shape == (8,)


def _scaled_mse(params, batch):
  """mse of the MLP times a trained scalar (a scalar parameter leaf)."""
  return params["scale"] * mse({k: v for k, v in params.items() if k != "scale"}, batch)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_ndim_mask_matches_single_device(stage):
  """adamw without decay on biases and scalars (a mask by ndim) sees rows as leaves."""
  no_decay_on_vectors = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731
  optimizer = optax.adamw(1e-2, weight_decay=0.5, mask=no_decay_on_vectors)
  params, data = {**init_mlp(), "scale": jnp.float32(1.5)}, batches(steps=3)
  trainer = Trainer(_scaled_mse, optimizer, jaxcoll.devices.flat_mesh(8), ZeRO(stage=stage))
  state, _ = train(trainer, params, data)
  expected = single_device(optimizer, params, data, loss_fn=_scaled_mse)
  assert_trees_close(trainer.params(state), expected, rtol=1e-4)
  if stage == 3:
    assert state.params["layer0"]["w"].shape == (8, 3)  # rows (1, c) concatenated over N
    assert state.params["scale"].shape == (8,)
  # The canonical state is single-device optax's, scalar's state included.
  opt_state = optimizer.init(params)
  for batch in data:
    grads = jax.grad(_scaled_mse)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  assert_trees_close(trainer.export_state(state)["opt_state"], opt_state, rtol=1e-4)


@pytest.mark.parametrize("strategy", [DataParallel(), ZeRO(stage=1), ZeRO(stage=2), ZeRO(stage=3)],
                         ids=["dp", "zero1", "zero2", "zero3"])
def test_mixed_float32_bfloat16_params_match_single_device(strategy):
  params = init_mlp()
  params["layer0"]["b"] = params["layer0"]["b"].astype(jnp.bfloat16)
  params["layer1"]["w"] = params["layer1"]["w"].astype(jnp.bfloat16)

  def loss_fn(p, batch):
    return mse(jax.tree.map(lambda x: x.astype(jnp.float32), p), batch)

  data = batches(steps=2)
  trainer = Trainer(loss_fn, optax.sgd(0.1), jaxcoll.devices.flat_mesh(8), strategy)
  state, _ = train(trainer, params, data)
  out = trainer.params(state)
  expected = single_device(optax.sgd(0.1), params, data, loss_fn=loss_fn)
  assert jax.tree.map(lambda x: x.dtype, out) == jax.tree.map(lambda x: x.dtype, expected)
  for a, e in zip(jax.tree.leaves(out), jax.tree.leaves(expected)):
    tol = 1e-2 if a.dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32),
                               rtol=tol, atol=tol)


def _complex_loss(p, b):
  return jnp.mean(jnp.abs(b["x"] @ p["w"] + p["b"]) ** 2)


@pytest.mark.parametrize("strategy", [DataParallel(), ZeRO(stage=1), ZeRO(stage=3)],
                         ids=["dp", "zero1", "zero3"])
def test_complex_params_clip_by_their_whole_norm_like_one_device(strategy):
  # The gradient norm took float32 of each complex gradient, its real part only: 5.37
  # where optax's is 6.00, so clip_global_norm scaled complex models' steps wrongly.
  params = {"w": np.full((6, 2), 1 + 0.5j, np.complex64), "b": np.zeros(2, np.float32)}
  batch = {"x": np.random.default_rng(0).normal(size=(8, 6)).astype(np.float32)}
  trainer = Trainer(_complex_loss, optax.sgd(0.1), jaxcoll.devices.flat_mesh(4), strategy,
                    clip_global_norm=0.5)
  state, metrics = trainer.step(trainer.init(params), batch)
  grads = jax.grad(_complex_loss)(params, batch)
  np.testing.assert_allclose(float(metrics["grad_norm"]), float(optax.tree.norm(grads)),
                             rtol=1e-6)
  tx = optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1))
  expected = optax.apply_updates(params, tx.update(grads, tx.init(params), params)[0])
  for got, want in zip(jax.tree.leaves(trainer.params(state)), jax.tree.leaves(expected)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("compression", ["bf16", "int8"])
def test_compression_of_complex_params_is_one_line(compression):
  # The float32 bucket took each complex gradient's real part: the imaginary parts never
  # trained (params 0.046 off one device's after one Adam step), silently.
  params = {"w": np.full((6, 2), 1 + 0.5j, np.complex64), "b": np.zeros(2, np.float32)}
  trainer = Trainer(_complex_loss, optax.sgd(0.1), jaxcoll.devices.flat_mesh(4),
                    DataParallel(compression=compression))
  with pytest.raises(ValueError, match=rf"^DataParallel: `compression` '{compression}' sends "
                     r"real numbers, but `params` leaf w is complex64: the imaginary part"):
    trainer.init(params)


def test_integer_param_leaf_raises_naming_the_leaf():
  trainer = Trainer(mse, optax.sgd(0.1), jaxcoll.devices.flat_mesh(8), ZeRO(stage=1))
  params = {**init_mlp(), "count": jnp.int32(3)}
  with pytest.raises(ValueError, match=r"`params` leaf \['count'\] has dtype int32"):
    trainer.init(params)


@pytest.mark.parametrize("accum", [1, 2])
def test_bool_aux_leaves_are_counted(accum):
  def loss_fn(params, batch):
    return mse(params, batch), {"finite": jnp.all(jnp.isfinite(batch["x"])),
                                "positive": batch["x"][0, 0] > 0}

  batch = batches(steps=1)[0]
  trainer = Trainer(loss_fn, optax.sgd(0.1), jaxcoll.devices.flat_mesh(8), DataParallel(),
                    has_aux=True, grad_accum_steps=accum)
  _, metrics = trainer.step(trainer.init(init_mlp()), batch)
  aux = metrics["aux"]
  assert aux["finite"].dtype == jnp.int32 and int(aux["finite"]) == 8 * accum
  # The first example of each (device, microbatch) slice of 32 / (8 * accum).
  firsts = batch["x"][:: GLOBAL_BATCH // (8 * accum), 0]
  assert int(aux["positive"]) == int(np.sum(firsts > 0))


@pytest.mark.parametrize("strategy", [DataParallel(), ZeRO(stage=1)], ids=["dp", "zero1"])
def test_params_outlive_the_next_step(strategy):
  trainer = Trainer(mse, optax.sgd(0.1), jaxcoll.devices.flat_mesh(8), strategy)
  state = trainer.init(init_mlp())
  before = trainer.params(state)
  state, _ = trainer.step(state, batches(steps=1)[0])  # donates state's buffers
  np.testing.assert_array_equal(before["layer0"]["b"], init_mlp()["layer0"]["b"])
  assert before["layer0"]["b"].sharding.is_fully_replicated


def test_int8_quantization_roundtrip():
  x = jnp.linspace(-3.0, 5.0, 512).reshape(2, 256)
  q, scale = compression.quantize_int8(x, block=128)
  assert q.dtype == jnp.int8 and scale.shape == (2, 2)
  back = compression.dequantize_int8(q, scale, block=128)
  assert float(jnp.max(jnp.abs(back - x))) <= float(jnp.max(scale)) / 2 + 1e-6


@pytest.mark.parametrize(
  "make, match",
  [
    (lambda: ZeRO(stage=4), "`stage` must be 1, 2 or 3"),
    (lambda: DataParallel(algorithm="bogus"), "`algorithm` must be"),
    (lambda: ZeRO(algorithm="halving_doubling"), "`algorithm` must be"),
    (lambda: DataParallel(compression="fp8"), "`compression` must be"),
    (lambda: DataParallel(bucket_bytes=0), "`bucket_bytes` must be"),
    (
      lambda: Trainer(
        mse, optax.sgd(1.0), jaxcoll.devices.flat_mesh(8), DataParallel(axis="model")
      ),
      "`axis`",
    ),
    (
      lambda: Trainer(
        mse, optax.sgd(1.0), jaxcoll.devices.flat_mesh(8), DataParallel(), grad_accum_steps=0
      ),
      "`grad_accum_steps`",
    ),
    (  # the class itself: TypeError "data_axes() missing 1 required positional argument"
      lambda: Trainer(mse, optax.sgd(1.0), jaxcoll.devices.flat_mesh(8), DataParallel),
      r"^`strategy` must be an instance, e\.g\. jaxcoll\.DataParallel\(\); got the class",
    ),
    (  # a TypeError at the first step: 'NoneType' object is not callable
      lambda: Trainer(None, optax.sgd(1.0), jaxcoll.devices.flat_mesh(8), DataParallel()),
      r"^`loss_fn` must be callable, loss_fn\(params, batch\) -> loss; got None\.",
    ),
    (  # TypeError: '>' not supported between instances of 'str' and 'int'
      lambda: Trainer(mse, optax.sgd(1.0), jaxcoll.devices.flat_mesh(8), DataParallel(),
                      clip_global_norm="1.0"),
      r"^`clip_global_norm` must be a positive number or None; got '1.0'\.",
    ),
    (  # True is an int: it was taken for a clip of 1
      lambda: Trainer(mse, optax.sgd(1.0), jaxcoll.devices.flat_mesh(8), DataParallel(),
                      clip_global_norm=True),
      r"^`clip_global_norm` must be a positive number or None; got True\.",
    ),
    (  # a TypeError at the first step: loss_fn() takes 2 positional arguments but 3 were given
      lambda: Trainer(mse, optax.sgd(1.0), jaxcoll.devices.flat_mesh(8), DataParallel(), rng=0),
      r"^`rng` was given, so `loss_fn` is called as loss_fn\(params, batch, rng\), but mse "
      r"takes \(params, batch\) only: add a third parameter",
    ),
    # A traceback from inside shard_map at the first step ("needs a tuple of >= 2 axes").
    *[(lambda s=s: Trainer(mse, optax.sgd(1.0), jaxcoll.devices.flat_mesh(8), s),
       r"^(DataParallel|ZeRO): `algorithm` 'hierarchical' reduces inside nodes, then across "
       r"them: it needs a tuple of >= 2 mesh axes .* got axis='data'\.")
      for s in (DataParallel(algorithm="hierarchical"),
                ZeRO(stage=3, algorithm=jaxcoll.Hierarchical()))],
  ],
  ids=["stage", "dp-algorithm", "zero-algorithm", "compression", "bucket-bytes", "axis", "accum",
       "strategy-class", "loss-fn-none", "clip-text", "clip-bool", "rng-without-its-parameter",
       "dp-hierarchical-on-one-axis", "zero-hierarchical-on-one-axis"],
)
def test_bad_arguments_raise(make, match):
  with pytest.raises(ValueError, match=match):
    make()


@pytest.mark.parametrize("strategy", [DataParallel(), ZeRO(stage=3)], ids=["dp", "zero3"])
def test_merge_aux_writes_model_state_back(strategy):
  """BatchNorm-style running statistics: from aux back into the params."""

  def loss_fn(params, batch):
    stats = jnp.mean(batch["x"], axis=0)  # this device's batch statistics
    return mse({k: v for k, v in params.items() if k != "stats"}, batch), {"stats": stats}

  def merge(params, aux):
    return {**params, "stats": 0.5 * params["stats"] + 0.5 * aux["stats"]}

  params = {**init_mlp(), "stats": jnp.zeros((WIDTHS[0] + 1,))[:WIDTHS[0]]}
  trainer = Trainer(loss_fn, optax.sgd(0.1), jaxcoll.devices.flat_mesh(8), strategy,
                    has_aux=True, merge_aux=merge)
  state = trainer.init(params)
  data = batches(steps=2)
  want = np.zeros(WIDTHS[0])
  for batch in data:
    state, _ = trainer.step(state, batch)
    want = 0.5 * want + 0.5 * batch["x"].mean(0)  # the global batch mean
  np.testing.assert_allclose(trainer.params(state)["stats"], want, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="`merge_aux` needs `has_aux=True`"):
    Trainer(mse, optax.sgd(0.1), jaxcoll.devices.flat_mesh(8), strategy, merge_aux=merge)


@pytest.mark.parametrize("mesh,strategy", [
    ((4,), ZeRO(stage=3)), ((2, 2), ZeRO(stage=3, axis="local", replica_axis="node")),
], ids=["zero3", "hybrid3"])
def test_merge_aux_reads_the_full_params_under_zero3(mesh, strategy):
  # merge_aux was given ZeRO-3's rows: an EMA of statistics, 0.9 * p + 0.1 * aux, added a
  # (2,) row to an (8,) aux (TypeError: incompatible shapes for broadcasting); it worked
  # only where a row was one element. It gets the full params now, as under DP and ZeRO-1/2.
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(5, 8)).astype(np.float32),
            "ema": np.zeros(8, np.float32), "ema2": np.zeros((3, 8), np.float32)}

  def loss_fn(p, b):
    h = b["x"] @ p["w"]
    return jnp.mean((h - p["ema"]) ** 2), {"mean": h.mean(0)}

  def merge(p, aux):
    return {**p, "ema": 0.9 * p["ema"] + 0.1 * aux["mean"],
            "ema2": 0.9 * p["ema2"] + 0.1 * jnp.stack([aux["mean"]] * 3)}

  data = [{"x": rng.normal(size=(8, 5)).astype(np.float32)} for _ in range(2)]
  want, tx = params, optax.sgd(0.1)
  for batch in data:  # one device
    (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(want, batch)
    want = merge(optax.apply_updates(want, tx.update(grads, tx.init(want))[0]), aux)
  grid = jaxcoll.devices.make_mesh(mesh, ("data",) if len(mesh) == 1 else ("node", "local"),
                                   jax.devices()[:4])
  trainer = Trainer(loss_fn, tx, grid, strategy, has_aux=True, merge_aux=merge)
  state = trainer.init(params)
  for batch in data:
    state, _ = trainer.step(state, batch)
  assert_trees_close(trainer.params(state), want)


def _mp_init_worker():
  from jaxcoll.runtime import distributed  # noqa: PLC0415

  info = distributed.initialize()
  mesh = jaxcoll.devices.flat_mesh(jax.device_count())
  params = init_mlp(seed=info.process_id)  # jax arrays, different on each process
  b0, problems = {}, []
  for strategy in (DataParallel(), ZeRO(stage=3)):
    trainer = Trainer(mse, optax.sgd(0.1), mesh, strategy)
    state = trainer.init(params)
    problems += trainer.check_replicas(state, raise_on_mismatch=False)
    full = trainer.params(state)
    problems += trainer.check_replicas(full, raise_on_mismatch=False)
    b0[strategy.name] = float(np.asarray(full["layer0"]["b"].addressable_data(0))[0])
  result = {"process": info.process_id, "b0": b0, "replica_problems": problems}
  import jobs  # noqa: PLC0415

  jobs.say_result("init " + json.dumps(result))
