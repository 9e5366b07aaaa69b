"""jaxcoll.runtime.distributed: telling a peer's exit from this process's own error."""

import jax
import pytest

from jaxcoll.runtime import distributed

_GLOO = ("INTERNAL: Error dispatching computation: Gloo context initialization failed: "
         "[external/gloo/gloo/transport/tcp/pair.cc:152] timed out connecting: SO_ERROR: "
         "Connection refused, remote=[127.0.0.1]:10635$24")


@pytest.mark.parametrize("message,processes,gone", [
    (_GLOO, 2, True),  # the peer exited before the first collective connected (seen in CI)
    ("INTERNAL: Connection reset by peer", 4, True),  # ... or during one
    ("INTERNAL: Read error: Connection closed by peer", 2, True),
    (_GLOO, 1, False),  # one process: no peer to blame
    ("RESOURCE_EXHAUSTED: Out of memory allocating 123 bytes", 2, False),  # its own fault
])
def test_peer_gone_is_only_a_collective_losing_its_peer(monkeypatch, message, processes, gone):
  monkeypatch.setattr(jax, "process_count", lambda: processes)
  assert distributed.peer_gone(jax.errors.JaxRuntimeError(message)) is gone
  assert not distributed.peer_gone(RuntimeError(message))  # a user's own exception
