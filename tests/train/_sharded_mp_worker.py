"""One process of tests/train/test_sharded.py's two-process ZeRO-3 init: prints one
RESULT JSON line (the state's digest and init's peak RSS above the start, per process).

The model is a scanned MLP whose stacked hidden layers are one 33.5 MB leaf (8 layers of
1024 x 1024 float32) on 2 processes x 4 emulated devices. Both processes pass the same
parameters: process-local jax arrays from ``jax.jit(init_params)`` (how flax users make
them), then numpy, then one global (replicated) jax array."""

import ctypes
import hashlib
import json
import sys

import jax
import numpy as np
import optax

import jaxcoll
from jaxcoll.observe import rss
from jaxcoll.runtime import distributed

import jobs


def main():
  info = distributed.initialize()
  width, depth = (int(a) for a in sys.argv[1:3])
  workload = jaxcoll.models.make_workload("mlp", depth=depth + 1, width=width, scan_layers=True)
  mesh = jaxcoll.devices.flat_mesh(jax.device_count())
  trainer = jaxcoll.Trainer(workload.loss_fn, optax.adam(1e-3), mesh, jaxcoll.ZeRO(stage=3),
                            has_aux=True)
  libc = ctypes.CDLL("libc.so.6")
  source = jax.jit(workload.init_params)(jax.random.key(0))  # on one local device
  host = jax.tree.map(np.asarray, source)
  sha = hashlib.sha256()
  for leaf in jax.tree.leaves(host):
    sha.update(np.ascontiguousarray(leaf, np.float32).tobytes())
  out = {"process": info.process_id, "expected_sha256": sha.hexdigest(), "sha256": {},
         "leaf": max(x.nbytes for x in jax.tree.leaves(host))}
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  sources = {
    "jax": source,
    "numpy": host,
    "global": jax.tree.map(
        lambda x: jax.make_array_from_callback(x.shape, replicated, lambda i, x=x: x[i]), host),
  }
  for name, params in sources.items():
    state = trainer.init(params)
    out["sha256"][name] = trainer.params_digest(state)[1]
    if name == "jax":  # compiled by the call above: this one is measured
      del state
      libc.malloc_trim(0)
      start = rss.current_bytes()
      assert rss.reset_peak()
      state = trainer.init(params)
      jax.block_until_ready(state)
      out["init_rss"] = rss.peak_bytes() - start
      out["state_bytes_here"] = sum(s.data.nbytes for x in jax.tree.leaves(state)
                                    for s in x.addressable_shards)
    del state
  jobs.say_result(json.dumps(out))


if __name__ == "__main__":
  main()
