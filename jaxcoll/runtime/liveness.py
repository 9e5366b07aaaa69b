"""Ends a multi-process job's survivors at once when one of its processes dies.

A process killed by a signal (SIGKILL, the OOM killer) or ended by
``os._exit`` leaves its peers waiting in a collective: gloo does not notice a
peer that is gone, and JAX's heartbeat timeout is long on purpose (the step
watchdog must report a *hung* peer first), so the survivors waited for the
watchdog, ``watchdog_s`` (600 s by default). A launcher (``python -m
jaxcoll.launch``, ``mpirun``) stops them within seconds; ``srun`` without
``--kill-on-bad-exit`` and processes started by hand did not.

Here each process other than 0 keeps one TCP connection to process 0 (its
address is published through JAX's coordination service, so no port is
configured). The kernel closes a dead process's sockets, so the other end
reads end-of-file at once. A process that ends through Python's exit (any
status: the others then learn its status from whoever started the job, as
before) says goodbye first; a connection that ends without one is a process
that died. Process 0 then names it and exits with :data:`EXIT_PEER_GONE`,
which closes its own connections, so every other process follows, naming
process 0. An uncaught exception in a process (its traceback printed as
usual, then exit 1 at once) and :func:`fail_now` say "failed" on the
connections instead of goodbye, so the others end as for a death; without
this the failing process sat in JAX's shutdown barrier, which waits for the
others, and they in their collective: both ended after 300 s in JAX's abort.
A peer that hangs (SIGSTOP, a stuck device) keeps its connection open: that
stays the watchdog's case. Anything that goes wrong in setting this up only
costs the early exit, never the job.

A peer's death also fails this process's collective in flight (gloo: connection closed or
reset), as fast as the watch sees it: an uncaught error of that kind, and
:func:`end_after_lost_peer`, wait (up to 3 s) for the watch to name the peer and end the
process (exit 76), instead of a traceback and exit 1 that named nobody.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

from jaxcoll.errors import EXIT_PEER_GONE

_KEY = "jaxcoll/liveness"  # where process 0 publishes host:port (a fresh service per job)
_BYE = b"B"  # a Python exit on purpose (any status the whole job agrees on)
_FAILED = b"F"  # this process fails on its own: the others end too
# Process 0 ends because process K ended: b"L<K>g;" (gone) or b"L<K>f;" (failed), so that the
# others name K rather than process 0.
_LOST = b"L"
_CONNECT_TIMEOUT_S = 30.0
# How long process 0, ending, waits for its peers to end on its word first: its exit takes
# down JAX's coordination service, and a peer that notices that first aborts with JAX's
# fatal-error lines ("Terminating process because the JAX distributed service detected
# fatal errors", a stack dump) before or instead of this module's one line.
_DRAIN_S = 3.0
# How long a process whose collective failed because a peer is gone waits for the watch to
# see that peer's end (it sees it as soon as gloo does: the same closed connections).
_VERDICT_S = 3.0
ON_END_LIMIT_S = 10.0  # how long the on_end callbacks may take, all together
# How long a thread that finds this process's end begun waits for the ending thread to exit
# it: that thread's steps that wait (the on_end callbacks, the drain) take ON_END_LIMIT_S +
# _DRAIN_S at most, and a waiter that exited at that bound could cut the drain or the
# attempt's record short; what else it does are writes of a few bytes (to each peer, one
# line), which block only on a reader that stopped. Past this the waiter exits (with the
# ender's status) rather than hang with it.
_AWAIT_END_S = ON_END_LIMIT_S + _DRAIN_S + 30.0


class _Channel:
  """This process's liveness connections (process 0: one per peer; others: one)."""

  def __init__(self, process_id: int, num_processes: int):
    self.process_id = process_id
    self.num_processes = num_processes
    self.conns: list[socket.socket] = []
    self.ended: list[threading.Event] = []  # per connection: it reached its end
    self.peers: list[int] = []  # per connection: the process at its other end
    self.closing = False
    self.ending = threading.Event()  # set once this process is being ended (_end)
    self.status: int | None = None  # ... with this exit status
    self._lost: tuple[int, bool] | None = None  # ... because this peer ended (failed or gone)
    self._reporter: int | None = None  # ... as this peer told (process 0 passes it on)
    self.lock = threading.Lock()

  def watch(self, conn: socket.socket, peer: int, ended: threading.Event) -> None:
    """Reads ``conn`` until it ends; an end without a goodbye is a dead peer."""
    got = b""
    try:
      while chunk := conn.recv(64):
        got += chunk
        lost = _lost_in(got)
        if lost is not None:  # process 0 ends because `lost` did: name that one
          self.peer_died(lost[0], failed=lost[1], via=peer)
        elif _FAILED in got and _BYE not in got:  # at once: the sender waits for our end
          self.peer_died(peer, failed=True)  # ends this process, unless it is ending
    except OSError:
      pass
    ended.set()
    if _BYE in got or self.closing:
      return
    self.peer_died(peer, failed=_FAILED in got)

  def peer_died(self, peer: int, *, failed: bool = False, via: int | None = None) -> None:
    """Ends this process because process ``peer`` ended (``failed``: on its own error, else
    without a word); ``via``: the process that passed the word on (process 0). Nothing
    once this process is closing (its goodbye is out, or an end began)."""
    who = ("process 0 (it serves the coordinator)" if peer == 0
           else f"process {peer} of {self.num_processes}")
    if failed:
      why = (f"{who} failed (an uncaught exception, its step watchdog, or a peer of its own "
             "ended: its output says which)")
    else:
      seen = ("its connection closed" if via is None
              else f"process {via} saw its connection close")
      why = (f"{who} is gone ({seen} without a goodbye: killed, e.g. by SIGKILL or the OOM "
             "killer, or its host lost)")
    self._end(f"jaxcoll.distributed: process {self.process_id} of {self.num_processes}: {why}; "
              "ending this process too instead of waiting in a collective (exit "
              f"{EXIT_PEER_GONE}); that process's own output, or its launcher's, says why "
              "it ended.", EXIT_PEER_GONE, lost=(peer, failed),
              reporter=peer if via is None else via)

  def _end(self, message: str | None, status: int, *, lost: tuple[int, bool] | None = None,
           reporter: int | None = None, stream=None) -> None:
    """Tells every peer this process failed, writes ``message`` (to ``stream``, default
    stderr) and exits at once:
    JAX's shutdown at a normal exit waits for every process in a barrier that the
    others, in a collective, never reach (300 s, then an abort with a stack dump).
    ``message`` is the last this process prints: what its other threads write after it is
    dropped (see :func:`_silence`). ``lost``: ``(process, failed)``, the peer whose end
    ends this one (``reporter`` told of it); returns at once when this process is closing.

    The first caller ends the process, with its status: who that is is decided under the
    lock, with ``lost`` (a peer's end the watch decided on is not taken over by an uncaught
    exception's end, status 1, that came between its decision and its claim)."""
    with self.lock:
      if lost is not None and self.closing:  # exiting on purpose, or an end began
        return
      begun = self.ending.is_set()
      if not begun:
        self.closing, self.status = True, status
        self._lost, self._reporter = lost, reporter
        self.ending.set()
      conns = list(self.conns)
    if begun:  # another thread is ending this process: it exits it
      self.await_verdict(0.0)
    lost = self._lost
    word = _FAILED if lost is None else _LOST + b"%d%s;" % (lost[0], b"f" if lost[1] else b"g")
    try:
      for conn in conns:
        with contextlib.suppress(OSError):
          conn.sendall(word)
      _write_last_line(message, stream)
      _call_on_end(status, message)
      # The others end on our word first (process 0 serves JAX's coordinator, and a process
      # gone early is an error JAX sends the rest, who abort with its fatal-error lines): one
      # that fails on its own waits for its peers, process 0 for all but the one that told it.
      reporter = self._reporter
      if reporter is None or self.process_id == 0:
        deadline = time.monotonic() + _DRAIN_S
        for i, ended in enumerate(list(self.ended)):
          if reporter is None or self.peers[i] != reporter:
            ended.wait(max(0.0, deadline - time.monotonic()))
    finally:
      os._exit(status)

  def await_verdict(self, timeout_s: float = _VERDICT_S) -> None:
    """Waits up to ``timeout_s`` for this process to be ended by another thread (the watch,
    on a peer's end); returns if it is not. Never returns once the end has begun: the
    ending thread exits the process (``_AWAIT_END_S`` is past the longest it takes)."""
    if not self.ending.wait(timeout_s):
      return
    time.sleep(_AWAIT_END_S)
    os._exit(self.status if self.status is not None else EXIT_PEER_GONE)

  def goodbye(self) -> None:
    """At a Python exit: tell every peer this end is on purpose."""
    with self.lock:
      self.closing = True
      conns = list(self.conns)
    for conn in conns:
      try:
        conn.sendall(_BYE)
        conn.shutdown(socket.SHUT_WR)
      except OSError:
        pass

  def add(self, conn: socket.socket, peer: int) -> None:
    ended = threading.Event()
    with self.lock:
      self.conns.append(conn)
      self.ended.append(ended)
      self.peers.append(peer)
    threading.Thread(target=self.watch, args=(conn, peer, ended), daemon=True,
                     name=f"jaxcoll-liveness-{peer}").start()


_ON_END: list = []  # callables(status, line) of on_end


def on_end(callback) -> Callable[[], None]:
  """Registers ``callback(status, line)``, called when this process is ended at once from
  any thread (a peer's end: exit 76 and its line; :func:`fail_now`; :func:`end_now`, as
  the step watchdog's exit 86; an uncaught exception, ``line`` None) before it exits,
  given ``ON_END_LIMIT_S`` at most: e.g. to record the attempt's end. Returns the function
  that unregisters it.

  In a job with a liveness channel the callbacks run after the process's one line, with
  its stdout and stderr already at /dev/null (:func:`_silence`: that line is its last
  output), so what they print (a warning while recording the end) is dropped; one that must
  be heard writes to a descriptor it duplicated before (``os.dup(2)``). In one process
  (:func:`end_now` without a channel) nothing is silenced."""
  _ON_END.append(callback)

  def remove() -> None:
    with contextlib.suppress(ValueError):
      _ON_END.remove(callback)

  return remove


def _call_on_end(status: int, line: str | None) -> None:
  """Each :func:`on_end` callback, in a thread of its own, waited for ``ON_END_LIMIT_S``
  at most (a hung disk may be why the process ends); their errors are dropped (the line
  is already out)."""
  callbacks = list(_ON_END)
  if not callbacks:
    return

  def call():
    for callback in callbacks:
      with contextlib.suppress(Exception):
        callback(status, line)

  thread = threading.Thread(target=call, name="jaxcoll-on-end", daemon=True)
  thread.start()
  thread.join(ON_END_LIMIT_S)


def _write_line(line: str | None, stream=None) -> None:
  """``line`` on ``stream`` (default stderr), after what stdout holds."""
  stream = sys.stderr if stream is None else stream
  with contextlib.suppress(OSError, ValueError):
    sys.stdout.flush()
  if line:
    with contextlib.suppress(OSError, ValueError):
      stream.write(line + "\n")
  for out in {id(stream): stream, id(sys.stderr): sys.stderr}.values():
    with contextlib.suppress(OSError, ValueError):
      out.flush()


def _write_last_line(line: str | None, stream=None) -> None:
  """``line`` as this process's last output: stdout and stderr point at /dev/null first
  (:func:`_silence`), then ``line`` goes to where ``stream`` (default stderr) pointed, through
  a descriptor of its own. Written before the silence, another thread's lines could still
  come after it (JAX's coordination client: "Terminating process because the JAX distributed
  service detected fatal errors", on a loaded machine). A stream without a descriptor: the
  line, then the silence."""
  stream = sys.stderr if stream is None else stream
  for out in (sys.stdout, stream):
    with contextlib.suppress(OSError, ValueError):
      out.flush()
  try:
    saved = os.dup(stream.fileno())
  except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
    _write_line(line, stream)
    _silence()
    return
  _silence()
  try:
    if line:
      with contextlib.suppress(OSError):
        os.write(saved, (line + "\n").encode(errors="replace"))
  finally:
    os.close(saved)


def _lost_in(got: bytes) -> tuple[int, bool] | None:
  """``(process, failed)`` from process 0's word that a process ended (``L<K>g;`` or
  ``L<K>f;``) once all of it arrived, else None."""
  start = got.find(_LOST)
  end = got.find(b";", start)
  if start < 0 or end < 0:
    return None
  word = got[start + 1:end]
  if len(word) < 2 or not word[:-1].isdigit() or word[-1:] not in (b"g", b"f"):
    return None
  return int(word[:-1]), word[-1:] == b"f"


def _silence() -> None:
  """Points stdout and stderr (the file descriptors) at /dev/null. The peer's end that ends
  this process reaches its other threads too, and they print after its one line until it
  is gone: JAX's coordination client on losing process 0 ("Failed to retrieve preemption
  notice ... Socket closed", "Terminating process because the JAX distributed service
  detected fatal errors" and a C++ stack trace), gloo's "terminate called after throwing
  ...", Python's thread dump of the abort that follows; process 0 waits up to 3 s more for
  the others (the drain). It comes before the :func:`on_end` callbacks too (they may take
  10 s, and the others' lines would come meanwhile): what they print is dropped as well."""
  try:
    devnull = os.open(os.devnull, os.O_WRONLY)
  except OSError:
    return
  for fd in (1, 2):
    with contextlib.suppress(OSError):
      os.dup2(devnull, fd)
  os.close(devnull)


def _serve(channel: _Channel, server: socket.socket) -> None:
  """Process 0: accepts each peer's connection (it sends its process id first)."""
  for _ in range(channel.num_processes - 1):
    try:
      conn, _ = server.accept()
      conn.settimeout(_CONNECT_TIMEOUT_S)
      got = conn.recv(4, socket.MSG_WAITALL)
      conn.settimeout(None)
    except OSError:
      continue
    if len(got) != 4:  # gone before it said who it is: JAX's own checks see to it
      conn.close()
      continue
    peer = int.from_bytes(got, "little")
    channel.add(conn, peer)
  server.close()


def start(client, *, process_id: int, num_processes: int, coordinator_host: str,
          bind_host: str, lost_peer: Callable[[BaseException], bool] = lambda error: False
          ) -> bool:
  """Starts the liveness watch of this process; True when it runs.

  Args:
    client: JAX's distributed runtime client (``key_value_set`` /
      ``blocking_key_value_get``), once every process has connected.
    process_id, num_processes: this process and the job's count.
    coordinator_host: the host the other processes reach process 0 at.
    bind_host: what process 0 listens on ("" for every interface).
    lost_peer: whether an error is a collective's because a peer is gone
      (:func:`jaxcoll.runtime.distributed.peer_gone`): uncaught, it waits for the watch.
  """
  channel = _Channel(process_id, num_processes)
  try:
    if process_id == 0:
      try:
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        server = socket.socket(family, socket.SOCK_STREAM)
        server.bind((bind_host, 0))
        server.listen(num_processes)
      except OSError:
        client.key_value_set(_KEY, "")  # the others go on without it, at once
        return False
      client.key_value_set(_KEY, f"{coordinator_host}:{server.getsockname()[1]}")
      threading.Thread(target=_serve, args=(channel, server), daemon=True,
                       name="jaxcoll-liveness-server").start()
    else:
      address = client.blocking_key_value_get(_KEY, int(_CONNECT_TIMEOUT_S * 1000))
      if not address:
        return False
      host, _, port = address.rpartition(":")
      conn = socket.create_connection((host.strip("[]"), int(port)), timeout=_CONNECT_TIMEOUT_S)
      conn.sendall(process_id.to_bytes(4, "little"))
      conn.settimeout(None)
      channel.add(conn, 0)
  except Exception:  # noqa: BLE001  (only the early exit is lost; the job goes on)
    return False
  atexit.register(channel.goodbye)
  _install_excepthook(channel, lost_peer)
  global _channel  # noqa: PLW0603  (one per process, as jax.distributed's client)
  _channel = channel
  return True


def _install_excepthook(channel: _Channel, lost_peer: Callable[[BaseException], bool]) -> None:
  """An uncaught exception prints its traceback as usual, then ends this process at once,
  telling the others; one that is a collective's error because a peer is gone
  (``lost_peer``) waits for the watch to name that peer first (exit 76, no traceback)."""
  previous = sys.excepthook

  def excepthook(kind, value, traceback):
    with contextlib.suppress(Exception):  # a predicate that fails: the traceback, as before
      if lost_peer(value):
        channel.await_verdict()
    previous(kind, value, traceback)
    # Python's own statuses: 130 for an uncaught Ctrl-C (as a SIGINT death), else 1.
    channel._end(None, 128 + signal.SIGINT if issubclass(kind, KeyboardInterrupt) else 1)

  sys.excepthook = excepthook


_channel: _Channel | None = None


def active() -> bool:
  """Whether this process of a multi-process job has its liveness channel."""
  return _channel is not None


def end_after_lost_peer(message: str, status: int = 1) -> None:
  """Ends this process after one of its collectives failed because a peer process is gone
  (:func:`jaxcoll.runtime.distributed.peer_gone`): the liveness watch sees that peer's end
  too, names it and ends this process with exit 76 (:data:`EXIT_PEER_GONE`); this waits for
  it (up to 3 s) and otherwise ends with ``message`` and ``status``, as :func:`fail_now`."""
  if _channel is not None:
    _channel.await_verdict()
  fail_now(message, status)


def end_now(status: int, line: str, *, stream=None) -> None:
  """Ends this process at once (``os._exit(status)``, from any thread) after ``line`` (on
  ``stream``, default stderr), for a reason of its own (the step watchdog: exit 86): the
  :func:`on_end` callbacks hear ``(status, line)``; in a multi-process job with a liveness
  channel the others are told it failed first, as by :func:`fail_now` (they end too, exit
  76, naming it; without the word they took it for a process killed). Never returns."""
  if _channel is not None:
    _channel._end(line, status, stream=stream)
  _write_line(line, stream)
  _call_on_end(status, line)
  os._exit(status)


def fail_now(message: str, status: int = 1) -> None:
  """Ends this process of a multi-process job at once with ``message`` (one line on
  stderr) and ``status``, telling the others it failed so that they end too; for an
  error that only this process met. Without a liveness channel (one process): the
  same as ``sys.exit(message)`` with ``status``."""
  if _channel is None:
    sys.stderr.write(message + "\n")
    sys.exit(status)
  _channel._end(message, status)
