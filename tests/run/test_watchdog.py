"""The step watchdog ends a stalled process with a clear message."""

import sys
import textwrap
import time

import jobs
import pytest

from jaxcoll.run.watchdog import EXIT_WATCHDOG, StepWatchdog

STALL = """
import time
from jaxcoll.run.watchdog import StepWatchdog
dog = StepWatchdog(1.0, poll_s=0.1)
for step in range(1, 3):
  dog.beat(step)
  time.sleep(0.05)
print("last beat at", time.monotonic(), flush=True)  # CLOCK_MONOTONIC: every process's clock
dog.beat(3)
time.sleep(60)  # stalled: the watchdog must end this
"""


def _clock(stdout: str, label: str) -> float:
  """The child's ``time.monotonic()`` printed after ``label`` (CLOCK_MONOTONIC:
  the same clock in every process of the machine)."""
  return float(next(line for line in stdout.splitlines() if line.startswith(label)).split()[-1])


def test_stalled_process_exits_naming_last_step():
  # Timed from the last beat, not from the start (the import of JAX takes
  # seconds, and many more on a loaded machine): at least the 1 s limit, then the exit.
  out = jobs.timed([sys.executable, "-c", STALL], timeout=120)
  assert out.returncode == EXIT_WATCHDOG, out.stderr
  assert "last finished step: 3" in out.stderr
  assert 1.0 <= out.ended - _clock(out.stdout, "last beat at") < 1.0 + 20


def test_beating_keeps_it_quiet_and_pause_suspends():
  dog = StepWatchdog(0.5, poll_s=0.05)
  for step in range(8):
    dog.beat(step)
    time.sleep(0.1)
  dog.pause()
  time.sleep(0.8)  # paused: no exit
  dog.stop()


def test_bad_timeout():
  with pytest.raises(ValueError, match="`timeout_s` must be > 0"):
    StepWatchdog(0)


STALLED_SAVE = """
import time
from jaxcoll.run.watchdog import StepWatchdog
dog = StepWatchdog(0.5, save_timeout_s=2.0, poll_s=0.05)
dog.beat(3)
with dog.saving(3):
  time.sleep(1.0)  # longer than a step may take, shorter than a save may
dog.beat(4)
print("save of step 4 begins at", time.monotonic(), flush=True)
with dog.saving(4):
  time.sleep(60)  # a save stuck in a barrier: the watchdog must end this
"""


def test_save_has_its_own_limit_and_is_watched():
  """Issue 12.7: saves were not watched at all (paused)."""
  out = jobs.timed([sys.executable, "-c", STALLED_SAVE], timeout=120)
  assert out.returncode == EXIT_WATCHDOG, out.stderr
  assert "the checkpoint save of step 4 did not finish within 2 s (last finished step: 4)" in (
      out.stderr)
  # The save's own limit (2 s), not the step limit (0.5 s), timed from the
  # start of the stuck save, not from the start-up.
  assert 2.0 <= out.ended - _clock(out.stdout, "save of step 4 begins at") < 2.0 + 20


def test_on_fire_hears_the_line_before_the_exit():
  """The training loop records its attempt's end there ("failed", exit 86 and the line)."""
  code = ("import time\nfrom jaxcoll.run.watchdog import StepWatchdog\n"
          "dog = StepWatchdog(0.3, poll_s=0.05, on_fire=lambda line: print('heard', line[:40], "
          "flush=True))\ndog.beat(7)\ntime.sleep(60)\n")
  out = jobs.forked([sys.executable, "-c", code], devices=1, timeout=60)
  assert out.returncode == EXIT_WATCHDOG, out.stderr
  assert out.stdout == "heard watchdog: no training step finished for \n", out.stdout
  assert "(last finished step: 7)" in out.stderr


def test_in_a_job_the_watchdog_tells_the_others_it_failed():
  """Process 1 of 2 fires: its connection to process 0 closed without a word, and process 0
  said "process 1 of 2 is gone (... killed, e.g. by SIGKILL ...)". It now ends through the
  liveness channel's end, as fail_now does: the others hear "failed" (F); the on_end
  callbacks (the attempt's record) hear (86, its line), once."""
  code = textwrap.dedent("""
  import os, socket, time
  from jaxcoll.run.watchdog import StepWatchdog
  from jaxcoll.runtime import liveness
  saved = os.dup(1)  # this test's own output (the process's is silenced after its line)
  ours, zero = socket.socketpair()
  channel = liveness._Channel(1, 2)
  channel.add(ours, 0)
  liveness._channel = channel
  liveness.on_end(lambda status, line: os.write(saved, f"{status}: {line[:30]}\\n".encode()))
  dog = StepWatchdog(0.3, poll_s=0.05, on_fire=lambda line: os.write(saved, b"on_fire\\n"))
  dog.beat(7)
  zero.settimeout(20)
  os.write(saved, b"process 0 got " + zero.recv(64) + b"\\n")
  time.sleep(30)
  """)
  out = jobs.forked([sys.executable, "-c", code], devices=1, timeout=60)
  assert out.returncode == EXIT_WATCHDOG, out.stderr
  assert sorted(out.stdout.splitlines()) == [
      "86: watchdog: no training step fin", "on_fire", "process 0 got F"], out.stdout
  assert out.stderr.startswith("watchdog: no training step finished for 0.3 s (last finished "
                               "step: 7)") and out.stderr.count("\n") == 1, out.stderr
