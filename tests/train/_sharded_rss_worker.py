"""Peak RSS of ZeRO-3's init, init_from, eval, digest and save, phase by phase (VmHWM reset
through /proc/self/clear_refs), for tests/train/test_sharded.py; prints one JSON line.

A scanned MLP whose stacked hidden layers are one 67 MB leaf (4 layers of 2048 x 2048
float32, each a jaxcoll.fsdp_unit) on 8 emulated devices: broadcasting that leaf to every
device, as init did before, costs 8 x 67 MB, far more than any bound checked here."""

import ctypes
import json
import os
import sys
import tempfile

os.environ.setdefault("JAXCOLL_CPU_DEVICES", "8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxcoll  # noqa: E402
from jaxcoll.observe import rss  # noqa: E402
from jaxcoll.run import evaluate, loop  # noqa: E402
from jaxcoll.train import checkpoint  # noqa: E402

import jobs  # noqa: E402


def main():
  width, depth = (int(a) for a in sys.argv[1:3])
  workload = jaxcoll.models.make_workload("mlp", depth=depth + 1, width=width, scan_layers=True)
  mesh = jaxcoll.devices.flat_mesh(8)
  trainer = jaxcoll.Trainer(workload.loss_fn, optax.adam(1e-3), mesh, jaxcoll.ZeRO(stage=3),
                            has_aux=True)
  out = {"leaves": [int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(workload.param_shapes)]}

  libc = ctypes.CDLL("libc.so.6")

  def phase(name, fn, trim=False):
    jax.block_until_ready(fn())  # compiled here once: the second run is measured
    if trim:  # freed memory back to the system: what the phase allocates shows in full
      libc.malloc_trim(0)
    start = rss.current_bytes()
    assert rss.reset_peak()
    result = fn()
    jax.block_until_ready(result)
    out[name] = rss.peak_bytes() - start
    return result

  source = jax.jit(workload.init_params)(jax.random.key(0))  # on one device
  jax.block_until_ready(source)
  state = phase("init", lambda: trainer.init(source))
  out["state_bytes"] = trainer.state_bytes_per_device(state) * 8
  del source
  state = phase("init_from", lambda: trainer.init_from(lambda: workload.init_params(0)))
  examples = workload.dataset.examples(np.arange(64), split="eval")
  ev = evaluate.Evaluator(workload, mesh, "data", lambda rows: {k: v[rows] for k, v in
                                                                examples.items()},
                          num_examples=64, global_batch_size=16)
  phase("eval", lambda: ev.run(trainer=trainer, state=state)["eval_loss"])
  phase("digest", lambda: loop._state_digest(trainer, state, 0)[0])  # noqa: SLF001
  with tempfile.TemporaryDirectory() as directory:
    saves = iter(range(1, 100))
    ckpt = checkpoint.Checkpointer(directory, keep=1)

    def save():
      ckpt.save(next(saves), trainer, state, data_position=0)
      ckpt.wait()
      return state.step

    phase("save", save, trim=True)  # async save + wait: no second copy of the state
    if "--copying_save" in sys.argv:  # the export before: a device copy of the whole state
      export, checkpoint._export = checkpoint._export, lambda t, s: t.export_state(s)  # noqa: SLF001
      phase("save_copying", save, trim=True)
      checkpoint._export = export  # noqa: SLF001
    ckpt.close()
  out["largest_canonical_leaf"] = max(
      int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(trainer.export_shapes()))
  out["bytes_in_flight"] = checkpoint.DEFAULT_BYTES_IN_FLIGHT
  out["unit_bytes"] = trainer.fsdp_unit_bytes(workload.param_shapes)
  jobs.say_result(json.dumps(out))


if __name__ == "__main__":
  main()
