"""Worker of tests/test_user_trials13.py: one process of a 2 x 4 hybrid ZeRO-3 job.

Run as ``python -m jaxcoll.launch --num_processes=2 --devices_per_process=4 --
python tests/_replica_worker.py``. Each process holds one copy of every row (the
replica axis ``node`` is the process); process 1 changes its copy of one row and
every process prints ``RESULT <json>`` of ``check_replicas`` and
``check_fingerprints`` before and after.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxcoll
from jaxcoll.runtime import distributed

import jobs

distributed.initialize()
mesh = jaxcoll.devices.node_local_mesh()  # ("node", "local") = (processes, devices each)
trainer = jaxcoll.Trainer(lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2), optax.adam(1e-2),
                          mesh, jaxcoll.ZeRO(stage=3, axis="local", replica_axis="node"))
state, _ = trainer.step(trainer.init({"w": np.ones((8, 2), np.float32)}),
                        {"x": np.ones((8, 8), np.float32)})
before = trainer.check_replicas(state, raise_on_mismatch=False)
leaf = state.params["w"]
copies = [np.asarray(s.data).copy() for s in leaf.addressable_shards]
if jax.process_index() == 1:
  copies[1].reshape(-1)[0] += 1.0  # this process's copy of rows 2:4
leaf = jax.make_array_from_single_device_arrays(
    leaf.shape, leaf.sharding,
    [jax.device_put(c, s.device) for c, s in zip(copies, leaf.addressable_shards)])
diverged = state._replace(params={"w": leaf})
after = trainer.check_replicas(diverged, raise_on_mismatch=False)
fingerprints = (trainer.check_fingerprints(state, raise_on_mismatch=False),
                trainer.check_fingerprints(diverged, raise_on_mismatch=False))
jobs.say_result(json.dumps({"before": before, "after": after, "fingerprints": fingerprints}))
