"""tests/train's one launched job, 2 processes x 4 devices over gloo, run once per
pytest process for every test that reads it (a launch costs two JAX start-ups and a
rendezvous): test_trainer's init from processes with different params, then
test_checkpoint's ZeRO-3 save from two processes (_two_process_worker.py). Each
part prints ``RESULT <part> {json}``; a test asserts on its own part's lines."""

import functools
import json
import os
import sys

import jobs

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_two_process_worker.py")


@functools.cache
def _run(directory: str):
  return jobs.launch(sys.executable, WORKER, directory, processes=2, devices=4,
                     launcher_flags=("--init_timeout_s=60", "--timeout_s=200", "--grace_s=2"),
                     timeout=240)


def run(tmp_path_factory):
  """(the finished launch, the directory its checkpoint part wrote, under this pytest
  process's base temporary directory): launched on the first call, the same after."""
  directory = tmp_path_factory.getbasetemp() / "two_process_job"
  directory.mkdir(exist_ok=True)
  return _run(str(directory)), str(directory)


def results(out, part: str) -> list[dict]:
  """The ``RESULT <part>`` lines of ``out``'s stdout, parsed."""
  needle = f"RESULT {part} "
  return [json.loads(line.split(needle, 1)[1]) for line in out.stdout.splitlines()
          if needle in line]
