"""Start-up: a process id given to two processes is named at once, by every process.

Two processes of a job started by hand with the same ``JAXCOLL_PROCESS_ID``
(a copied command line) used to meet inside JAX's coordination service: the
one that registered first was aborted by JAX (``ALREADY_EXISTS: Aborted
connect attempt as there is a request from a newer incarnation``, a C++ stack
dump), and the others waited out the start-up timeout (300 s by default, exit
75) saying only that not every process connected. In a job of 2 with two
processes given id 1, the job even started with one of them and the other
timed out.

Here every process states its id to process 0 before it joins JAX's job: one
UDP datagram to the coordinator's ``host:port`` (UDP, so the port is the one
already configured: JAX's coordinator serves it over TCP only). Process 0
answers each id it has not heard from another process with ``ok``; a second
process claiming an id (0 included: its own) is a duplicate, and process 0
tells every process it has heard from, which each say the same one line
naming the id and both processes (pid and host), and exit 2 (bad input). A
process waits for process 0's answer before joining JAX's job, so the
duplicate never reaches JAX; once process 0's TCP port answers, it waits at
most ``_GRACE_S`` more (a network that drops UDP, a process 0 that is not
jaxcoll's) and goes on without. Anything that goes wrong here only costs the
early, named end, never the job. Used for the explicit ``JAXCOLL_*``
settings only (a scheduler's ids are distinct).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time

from jaxcoll.errors import EXIT_USAGE

_TAG = "jaxcoll-claim"
_RESEND_S = 0.2  # a claim is sent again this often until answered
_GRACE_S = 2.0  # after process 0's TCP port answers, how long to wait for its UDP answer
_LINGER_S = 0.3  # process 0, ending on a duplicate: time for its word to arrive


def _who() -> str:
  return f"pid {os.getpid()} on {socket.gethostname()}"


def _udp_socket(host: str) -> socket.socket:
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  return socket.socket(family, socket.SOCK_DGRAM)


def _end(process_id: int, num_processes: int, message: str) -> None:
  with contextlib.suppress(OSError, ValueError):
    sys.stdout.flush()
  with contextlib.suppress(OSError, ValueError):
    sys.stderr.write(f"jaxcoll.distributed: process {process_id} of {num_processes} "
                     f"({_who()}): {message}\n")
    sys.stderr.flush()
  os._exit(EXIT_USAGE)


def duplicate_message(process_id: int, first: str, second: str, coordinator: str,
                      num_processes: int) -> str:
  return (f"JAXCOLL_PROCESS_ID={process_id} was given to two processes of the job at "
          f"{coordinator} ({first}, and {second}); give each process its own "
          f"JAXCOLL_PROCESS_ID in 0..{num_processes - 1} (python -m jaxcoll.launch does).")


class Registry:
  """Process 0's side: answers the claims for the life of the process. Once the job has
  started (:attr:`started` set), a duplicate claim ends only the process that made it
  (a stray copy started late): the running job goes on."""

  def __init__(self, sock: socket.socket, *, coordinator: str, num_processes: int):
    self.sock = sock
    self.coordinator = coordinator
    self.num_processes = num_processes
    # id: (nonce, who, address) of the process that claimed it first
    self.claims: dict[int, tuple[str, str, object]] = {0: ("", _who(), None)}
    self.closed = threading.Event()
    self.started = threading.Event()  # the job has started: a late duplicate ends alone
    threading.Thread(target=self._serve, daemon=True, name="jaxcoll-claims").start()

  def _serve(self) -> None:
    while not self.closed.is_set():
      try:
        data, addr = self.sock.recvfrom(4096)
        claim = json.loads(data)
        if claim.get("j") != _TAG:
          continue
        pid, nonce, who = int(claim["id"]), str(claim["nonce"]), str(claim["who"])
      except (OSError, ValueError, KeyError, TypeError):
        if self.closed.is_set():
          return
        continue
      known = self.claims.get(pid)
      if known is None or known[0] == nonce:
        self.claims[pid] = (nonce, who, addr)
        with contextlib.suppress(OSError):
          self.sock.sendto(json.dumps({"j": _TAG, "ok": True}).encode(), addr)
        continue
      message = duplicate_message(pid, known[1], who, self.coordinator, self.num_processes)
      if self.started.is_set():  # a stray process, late: it alone ends; the job goes on
        message = message.replace(
            "; give each", f"; {known[1]} has it in the running job; give each", 1)
        with contextlib.suppress(OSError):
          self.sock.sendto(json.dumps({"j": _TAG, "duplicate": message}).encode(), addr)
        continue
      word = json.dumps({"j": _TAG, "duplicate": message}).encode()
      targets = [a for _, _, a in self.claims.values() if a is not None] + [addr]
      for _ in range(3):  # UDP: said more than once
        for target in targets:
          with contextlib.suppress(OSError):
            self.sock.sendto(word, target)
      time.sleep(_LINGER_S)
      _end(0, self.num_processes, message)

  def close(self) -> None:
    self.closed.set()
    with contextlib.suppress(OSError):
      self.sock.close()


def serve(*, bind_host: str, port: int, coordinator: str, num_processes: int) -> Registry | None:
  """Process 0: answers the claims on UDP ``bind_host:port`` (None when it cannot bind)."""
  sock = _udp_socket(bind_host)
  try:
    sock.bind((bind_host, port))
  except OSError:
    sock.close()
    return None
  sock.settimeout(0.5)
  return Registry(sock, coordinator=coordinator, num_processes=num_processes)


class Claim:
  """A process other than 0: its claim, answered before it joins JAX's job, and a
  watch for a later ``duplicate`` word until :meth:`close`."""

  def __init__(self, sock: socket.socket, address, *, process_id: int, num_processes: int):
    self.sock = sock
    self.address = address
    self.process_id = process_id
    self.num_processes = num_processes
    self.payload = json.dumps({"j": _TAG, "id": process_id, "who": _who(),
                               "nonce": os.urandom(8).hex()}).encode()
    self.answered = threading.Event()
    self.duplicate: str | None = None
    self.closed = threading.Event()
    threading.Thread(target=self._listen, daemon=True, name="jaxcoll-claim").start()

  def _listen(self) -> None:
    while not self.closed.is_set():
      try:
        data, _ = self.sock.recvfrom(4096)
        answer = json.loads(data)
      except (OSError, ValueError):
        if self.closed.is_set():
          return
        continue
      if not isinstance(answer, dict) or answer.get("j") != _TAG:
        continue
      if "duplicate" in answer:
        self.duplicate = str(answer["duplicate"])
        if self.on_duplicate is not None:
          self.on_duplicate(self.duplicate)
        self.answered.set()
        return
      self.answered.set()

  on_duplicate = None  # called with the message (in the listening thread)

  def send(self) -> None:
    with contextlib.suppress(OSError):
      self.sock.sendto(self.payload, self.address)

  def close(self) -> None:
    self.closed.set()
    with contextlib.suppress(OSError):
      self.sock.close()


def _tcp_answers(host: str, port: int) -> bool:
  try:
    with socket.create_connection((host, port), timeout=0.2):
      return True
  except OSError:
    return False


def claim(*, host: str, port: int, process_id: int, num_processes: int,
          wait: bool = True) -> Claim | None:
  """Claims ``process_id`` at process 0 (``host:port`` over UDP). With ``wait``, returns
  once process 0 answered ``ok`` (or cannot be heard: see the module docstring); a
  ``duplicate`` answer, then or later, ends this process with its one line (exit 2).
  Without ``wait`` (a process 0 whose coordinator port is taken), waits up to
  ``_GRACE_S / 2`` and returns the claim, whose ``duplicate`` says whether it is one.
  None when no socket could be made."""
  host = host.strip("[]")
  try:
    info = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    sock = socket.socket(info[0], socket.SOCK_DGRAM)
  except OSError:
    return None
  sock.settimeout(0.5)
  c = Claim(sock, info[4], process_id=process_id, num_processes=num_processes)
  if wait:
    c.on_duplicate = lambda message: _end(process_id, num_processes, message)
  tcp_up_since = None
  deadline = None if wait else time.monotonic() + _GRACE_S / 2
  while not c.answered.is_set():
    c.send()
    if c.answered.wait(_RESEND_S):
      break
    now = time.monotonic()
    if deadline is not None and now > deadline:
      break
    if wait:
      if tcp_up_since is None and _tcp_answers(host, port):
        tcp_up_since = now
      if tcp_up_since is not None and now - tcp_up_since > _GRACE_S:
        break  # process 0 is up but not heard over UDP: go on without
  return c
