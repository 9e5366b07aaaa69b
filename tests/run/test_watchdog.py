"""The step watchdog ends a stalled process with a clear message."""

import subprocess
import sys
import time

import pytest

from jaxcoll.run.watchdog import EXIT_WATCHDOG, StepWatchdog

STALL = """
import time
from jaxcoll.run.watchdog import StepWatchdog
dog = StepWatchdog(1.0, poll_s=0.1)
for step in range(1, 4):
  dog.beat(step)
  time.sleep(0.05)
time.sleep(60)  # stalled: the watchdog must end this
"""


def test_stalled_process_exits_naming_last_step():
  t0 = time.monotonic()
  out = subprocess.run([sys.executable, "-c", STALL], capture_output=True, text=True,
                       timeout=30, check=False)
  assert out.returncode == EXIT_WATCHDOG
  assert "last finished step: 3" in out.stderr
  assert time.monotonic() - t0 < 20


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
with dog.saving(4):
  time.sleep(60)  # a save stuck in a barrier: the watchdog must end this
"""


def test_save_has_its_own_limit_and_is_watched():
  """Issue 12.7: saves were not watched at all (paused)."""
  t0 = time.monotonic()
  out = subprocess.run([sys.executable, "-c", STALLED_SAVE], capture_output=True, text=True,
                       timeout=30, check=False)
  assert out.returncode == EXIT_WATCHDOG, out.stderr
  assert "the checkpoint save of step 4 did not finish within 2 s (last finished step: 4)" in (
      out.stderr)
  assert time.monotonic() - t0 < 20
