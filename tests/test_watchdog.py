"""The step watchdog ends a stalled process with a clear message."""

import subprocess
import sys
import time

import pytest

from jaxcoll.train.watchdog import EXIT_WATCHDOG, StepWatchdog

STALL = """
import time
from jaxcoll.train.watchdog import StepWatchdog
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
