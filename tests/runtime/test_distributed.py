"""jaxcoll.runtime.distributed: telling a peer's exit from this process's own error; a
multi-process job's collectives as its survivors need them."""

import sys

import jax
import jobs
import pytest

from jaxcoll.runtime import distributed

_GLOO = ("INTERNAL: Error dispatching computation: Gloo context initialization failed: "
         "[external/gloo/gloo/transport/tcp/pair.cc:152] timed out connecting: SO_ERROR: "
         "Connection refused, remote=[127.0.0.1]:10635$24")
_GLOO_TIMEOUT = ("DEADLINE_EXCEEDED: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/"
                 "unbound_buffer.cc:81] Timed out waiting 30000ms for recv operation to complete")


@pytest.mark.parametrize("message,processes,gone", [
    (_GLOO, 2, True),  # the peer exited before the first collective connected (seen in CI)
    ("INTERNAL: Connection reset by peer", 4, True),  # ... or during one
    ("INTERNAL: Read error: Connection closed by peer", 2, True),
    (_GLOO, 1, False),  # one process: no peer to blame
    ("RESOURCE_EXHAUSTED: Out of memory allocating 123 bytes", 2, False),  # its own fault
    # Any gloo error matched: a timeout waited 3 s and said "a peer process is gone".
    (_GLOO_TIMEOUT, 2, False),
])
def test_peer_gone_is_only_a_collective_losing_its_peer(monkeypatch, message, processes, gone):
  monkeypatch.setattr(jax, "process_count", lambda: processes)
  assert distributed.peer_gone(jax.errors.JaxRuntimeError(message)) is gone
  assert not distributed.peer_gone(RuntimeError(message))  # a user's own exception


def test_without_pass_adds_to_the_flag_xla_reads():
  name = distributed.CPU_ALL_REDUCE_COMBINER
  assert distributed.without_pass("", name) == f"--xla_disable_hlo_passes={name}"
  assert distributed.without_pass(f"--xla_disable_hlo_passes=a --x=1 --xla_disable_hlo_passes="
                                  f"b,{name}", name) == (
      f"--xla_disable_hlo_passes=a --x=1 --xla_disable_hlo_passes=b,{name}")  # once, the last
  assert distributed.without_pass("--xla_disable_hlo_passes=a,b", name) == (
      f"--xla_disable_hlo_passes=a,b,{name}")


# A training step's shape: a gradient vector and two scalars (loss, norm), each psum'd. Process
# `victim` ends abruptly between two steps, as fail_at_step does (and the OOM killer may).
_STEPS = """if True:
  import os, sys
  import jaxcoll
  info = jaxcoll.distributed.initialize()
  import jax, jax.numpy as jnp, numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((jax.device_count(),), ("d",), devices=jax.devices())

  def body(w, x):
    h = jnp.tanh(x @ w)
    return (jax.lax.psum((h.T @ x).reshape(-1), "d"), jax.lax.psum(h.mean(), "d"),
            jax.lax.psum(h.max(), "d"))

  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d")),
                               out_specs=(P(), P(), P())))
  w = jnp.full((96, 96), 0.01, jnp.float32)
  x = jax.make_array_from_callback((jax.device_count() * 16, 96), NamedSharding(mesh, P("d")),
                                   lambda i: np.ones((16, 96), np.float32))
  print("all-reduces:", step.lower(w, x).compile().as_text().count(" all-reduce("), flush=True)
  for i in range(30):
    if i == 5 and info.process_id == int(sys.argv[1]):
      os._exit(17)
    jax.block_until_ready(step(w, x))
  print("still running", flush=True)
"""


@pytest.mark.parametrize("victim", [0, 1])
def test_the_survivor_of_a_process_gone_between_two_steps_ends_with_one_line(victim):
  """`fail_at_step=5` kills process 0 (the coordinator's): its survivor crashed every time,
  `gloo::EnforceNotMet ... Received data size doesn't match expected size`, SIGABRT and a
  Python thread dump, instead of the one line and exit 76. XLA:CPU had combined the step's
  three all-reduces into one; when a peer dies during it, XLA goes on to its next operand
  while the neighbours are still in the first, and gloo aborts on the mismatch from its own
  thread. Kept apart (one collective each), a lost peer fails the collective as a whole."""
  runs = jobs.by_hand([sys.executable, "-c", _STEPS, str(victim)], [(2, {}, [])] * 2)
  survivor = 1 - victim
  status, out, err, _ = runs[survivor]
  assert runs[victim][0] == 17
  assert "all-reduces: 3" in out, out  # one each, not one combined of three operands
  assert status == 76, err[-3000:]
  gone = ("process 0 (it serves the coordinator) is gone" if victim == 0
          else "process 1 of 2 is gone")
  lines = err.strip().splitlines()
  assert lines[-1].startswith(f"jaxcoll.distributed: process {survivor} of 2: {gone} "), err
  for crash in ("EnforceNotMet", "terminate called", "Fatal Python error", "Check failure"):
    assert crash not in err, err[-3000:]
  assert "still running" not in out
