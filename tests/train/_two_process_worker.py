"""The worker of test_two_processes.py (run by the launcher, 2 processes x 4 devices):
test_trainer's init check, then test_checkpoint's save from two processes into
``sys.argv[1]``; each prints its own ``RESULT <part>`` line."""

import sys

import test_checkpoint  # (both import jaxcoll, which applies JAXCOLL_CPU_DEVICES)
import test_trainer

if __name__ == "__main__":
  test_trainer._mp_init_worker()
  test_checkpoint._mp_worker(sys.argv[1])
