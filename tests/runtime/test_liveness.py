"""jaxcoll.runtime.liveness: how a process of a job ends when a peer ends.

The channel's connections are socket pairs in one forked Python here (jobs.forked: no
second process to start); the real jobs are in test_distributed.py and test_launch.py.
"""

import sys
import textwrap

import jobs
import pytest

# Process 1 of 2, its connection to process 0 one end of a socket pair; process 0 "dies"
# (the other end closes) 0.3 s after this process's collective failed.
_CHANNEL = """
import socket, sys, threading
import jax
from jaxcoll.runtime import liveness
jax.process_count = lambda: 2  # this process as one of a job of 2
ours, theirs = socket.socketpair()
channel = liveness._Channel(1, 2)
channel.add(ours, 0)
liveness._channel = channel
threading.Timer(0.3, theirs.close).start()
lost = jax.errors.JaxRuntimeError(
    "UNKNOWN: Gloo all-reduce failed: [pair.cc:538] Read error: Connection reset by peer")
"""
_GONE = ("jaxcoll.distributed: process 1 of 2: process 0 (it serves the coordinator) is gone "
         "(its connection closed without a goodbye")


@pytest.mark.parametrize("how", ["caught", "uncaught"])
def test_a_collective_failed_by_a_lost_peer_ends_with_the_watch_line_not_its_own(how):
  """Process 1 of 2 killed mid-eval: process 0's all-reduce failed at once (connection
  reset), EvalError wrapped it, and the run ended in its traceback, exit 1 (the launcher's
  SIGKILL named process 1; by hand, nothing did); a failed save of the same kind ended in
  "train: error: saving checkpoint 10 ... failed", then JAX's abort with a stack dump. The
  failing collective now waits for the liveness watch, which names the peer: exit 76."""
  if how == "caught":  # experiments.train: the collective's error found under an EvalError
    tail = """
from jaxcoll.runtime import distributed
try:
  try:
    raise lost
  except Exception as e:
    raise RuntimeError("the evaluation after step 4 failed") from e
except RuntimeError as e:
  assert distributed.lost_peer_error(e) is lost
  liveness.end_after_lost_peer("train: error: a collective failed because a peer is gone", 1)
"""
  else:  # any other program: its uncaught error
    tail = """
from jaxcoll.runtime import distributed
liveness._install_excepthook(channel, distributed.peer_gone)
raise lost
"""
  out = jobs.forked([sys.executable, "-c", textwrap.dedent(_CHANNEL + tail)], devices=1,
                    timeout=60)
  assert out.returncode == 76, out.stderr[-3000:]
  assert out.stderr.startswith(_GONE) and out.stderr.count("\n") == 1, out.stderr[-3000:]


def test_a_collective_failed_without_a_lost_peer_keeps_its_own_line():
  """No peer's end within 3 s (the connection stays open): the process's own line, status 1."""
  code = _CHANNEL.replace("threading.Timer(0.3, theirs.close).start()", "") + textwrap.dedent("""
  liveness.end_after_lost_peer("train: error: a collective failed because a peer is gone", 1)
  """)
  out = jobs.forked([sys.executable, "-c", code], devices=1, timeout=60)
  assert out.returncode == 1, out.stderr[-3000:]
  assert out.stderr == "train: error: a collective failed because a peer is gone\n"


def test_nothing_is_printed_after_the_line():
  """Process 0 of 3: process 1 gone, process 2 not yet (process 0 waits up to 3 s for it).
  What the process's other threads printed meanwhile came after its one line: when process 0
  dies, the survivor's JAX client prints "Terminating process because the JAX distributed
  service detected fatal errors" and a C++ stack trace, and gloo "terminate called ..."."""
  code = textwrap.dedent("""
  import os, socket, threading, time
  from jaxcoll.runtime import liveness
  channel = liveness._Channel(0, 3)
  ones, one = socket.socketpair()
  twos, two = socket.socketpair()  # process 2: connected, never ends
  channel.add(ones, 1)
  channel.add(twos, 2)

  def chatter():  # another thread of this process (JAX's client, gloo), on the same news
    channel.ending.wait()
    time.sleep(0.2)  # the line is out
    while True:
      os.write(2, b"F1207 client.h:80] Terminating process because ...\\n")
      time.sleep(0.05)

  threading.Thread(target=chatter, daemon=True).start()
  one.close()  # process 1 is gone
  time.sleep(30)
  """)
  out = jobs.forked([sys.executable, "-c", code], devices=1, timeout=60)
  assert out.returncode == 76, out.stderr[-3000:]
  assert out.stderr.startswith("jaxcoll.distributed: process 0 of 3: process 1 of 3 is gone")
  assert out.stderr.count("\n") == 1, out.stderr[-3000:]


def test_a_peers_end_that_began_is_not_taken_over_by_an_uncaught_error():
  """The watch, on process 0's end, decided to end this process (exit 76) and released its
  lock before it claimed the end; an uncaught exception's hook ending the process in
  between (status 1) became the ender: exit 1, and the one line naming process 0 never
  printed. Who ends, with which status, is now claimed under one lock."""
  code = _CHANNEL.replace("threading.Timer(0.3, theirs.close).start()", "") + textwrap.dedent("""
  import time

  class Lock:  # the channel's lock; the hook's end comes the moment the watch lets it go
    def __init__(self):
      self.lock, self.raced = threading.Lock(), False

    def __enter__(self):
      self.lock.acquire()

    def __exit__(self, *exc):
      self.lock.release()
      if getattr(channel, "_lost", None) is not None and not self.raced:
        self.raced = True
        threading.Thread(target=channel._end, args=(None, 1), daemon=True).start()
        channel.ending.wait(2.0)  # the hook's end claimed, or found the watch's

  channel.lock = Lock()
  theirs.close()  # process 0 is gone
  time.sleep(30)
  """)
  out = jobs.forked([sys.executable, "-c", code], devices=1, timeout=60)
  assert out.returncode == 76, out.stderr[-3000:]
  assert out.stderr.startswith(_GONE) and out.stderr.count("\n") == 1, out.stderr[-3000:]


def test_a_thread_that_finds_the_end_begun_outwaits_the_ending_thread(monkeypatch):
  """A thread that finds this process's end begun (an uncaught error's hook, a second
  ender) waited _DRAIN_S + 10 = 13 s, the ending thread's own bound (the on_end callbacks'
  10 s, the 3 s drain), then exited itself: it could cut the drain or the attempt's record
  short. It waits past that bound; the ending thread exits the process first."""
  from jaxcoll.runtime import liveness  # noqa: PLC0415

  channel = liveness._Channel(1, 2)
  channel.ending.set()  # another thread is ending this process
  channel.status = 76
  waited = []
  monkeypatch.setattr(liveness.time, "sleep", waited.append)
  monkeypatch.setattr(liveness.os, "_exit", lambda status: waited.append(("exit", status)))
  channel.await_verdict(0.0)
  bound = getattr(liveness, "ON_END_LIMIT_S", 10.0) + liveness._DRAIN_S
  assert len(waited) == 2 and waited[0] > bound and waited[1] == ("exit", 76), waited


def test_process_0_names_the_process_that_ended_to_the_others():
  """3 processes, process 1 killed: process 0 said "process 1 of 3 is gone", but process 2
  "process 0 (it serves the coordinator) failed (an uncaught exception, or a peer of its own
  ended ...)", naming no dead process. Process 0 passes the name on (``L1g;``)."""
  zero = textwrap.dedent("""
  import os, socket, threading, time
  from jaxcoll.runtime import liveness
  saved = os.dup(1)  # this test's own output, apart from the process's (silenced at its end)
  channel = liveness._Channel(0, 3)
  ones, one = socket.socketpair()
  twos, two = socket.socketpair()
  channel.add(ones, 1)
  channel.add(twos, 2)

  def process_2():  # reads process 0's word, then ends (as process 2 would)
    word = two.recv(64)
    os.write(saved, b"process 2 got " + word + b"\\n")
    two.close()

  threading.Thread(target=process_2).start()
  one.close()  # process 1 is gone
  time.sleep(30)
  """)
  out = jobs.forked([sys.executable, "-c", zero], devices=1, timeout=60)
  assert out.returncode == 76, out.stderr[-3000:]
  assert out.stdout == "process 2 got L1g;\n", out.stdout
  two = textwrap.dedent("""
  import socket
  from jaxcoll.runtime import liveness
  channel = liveness._Channel(2, 3)
  ours, zero = socket.socketpair()
  channel.add(ours, 0)
  zero.sendall(b"L1g;")
  zero.close()  # process 0 ends
  import time; time.sleep(30)
  """)
  out = jobs.forked([sys.executable, "-c", two], devices=1, timeout=60)
  assert out.returncode == 76, out.stderr[-3000:]
  assert out.stderr.startswith(
      "jaxcoll.distributed: process 2 of 3: process 1 of 3 is gone (process 0 saw its "
      "connection close without a goodbye: killed"), out.stderr


def test_on_end_callbacks_hear_the_status_and_line_before_the_exit():
  """The training loop records its attempt's end there (exit 76 and the line): the attempt
  of process 0 ended by process 1's death stayed "running", and experiments.report said it
  ended "without a word (killed, or its host lost)"."""
  code = textwrap.dedent("""
  import os, socket, time
  from jaxcoll.runtime import liveness
  saved = os.dup(1)
  channel = liveness._Channel(0, 2)
  ones, one = socket.socketpair()
  channel.add(ones, 1)
  liveness.on_end(lambda status, line: os.write(saved, f"{status}: {line[:40]}\\n".encode()))
  liveness.on_end(lambda status, line: 1 / 0)  # one that fails costs nothing
  liveness.on_end(lambda status, line: os.write(saved, b"removed\\n"))()
  one.close()
  time.sleep(30)
  """)
  out = jobs.forked([sys.executable, "-c", code], devices=1, timeout=60)
  assert out.returncode == 76, out.stderr[-3000:]
  assert out.stdout == "76: jaxcoll.distributed: process 0 of 2: pro\n", out.stdout
