"""What a person sees: the start / resume / nothing-to-do lines of
``experiments.train`` (default verbosity, in a subprocess), summary.json's
history of attempts, and the launcher's output (whole lines, gloo's chatter
as one line per process)."""

import io
import json
import os
import re
import sys
import textwrap
import time

import jobs
import pytest

from jaxcoll.runtime import launch
from jaxcoll.run import attempts, hooks, loop

SMOKE = "--config=configs/default.py:smoke"
GLOO = ("[Gloo] Rank {r} is connected to {n} peer ranks. Expected number of connected peer ranks "
        "is : {n}")


def _files(path):
  """(relative path, size, mtime_ns, bytes) of every file and directory under ``path``."""
  seen = []
  for root, dirs, files in os.walk(path):
    dirs.sort()
    for name in sorted(dirs) + sorted(files):
      full = os.path.join(root, name)
      st = os.stat(full)
      data = open(full, "rb").read() if os.path.isfile(full) else b""
      seen.append((os.path.relpath(full, path), st.st_size, st.st_mtime_ns, data))
  return seen


def _lines(stderr: str, word: str) -> list[str]:
  return [line for line in stderr.splitlines() if word in line]


# ------------------------------------------------------------ the trainer's lines


def test_start_interrupt_resume_and_nothing_to_do(tmp_path):
  """One workdir through four attempts, as a user would run them: a first
  run killed before its last step, a resume with more steps onto ZeRO-3, and
  two runs already at their final step."""
  workdir = str(tmp_path / "run")
  flags = [SMOKE, f"--workdir={workdir}", "--config.checkpoint_every=1", "--config.log_every=2"]

  # Process 0 dies before step 4 (os._exit: no clean-up, its entry stays "running").
  # The first two forked from a warm Python (~2.5 CPU-s less each); the two that check the
  # whole of stderr are real starts (an import's warning would show there).
  killed = jobs.train_forked(*flags, "--config.steps=4", "--config.fail_at_step=4")
  assert killed.returncode == hooks.EXIT_INJECTED_FAULT, killed.stderr[-2000:]
  started = _lines(killed.stderr, "Starting:")
  assert len(started) == 1 and "strategy DP(" in started[0], killed.stderr[-2000:]
  assert "on 8 devices in 1 process, 4 steps, workdir " + workdir in started[0]
  history = attempts.read_summary(workdir)["attempts"]
  assert [(a["status"], a["start_step"], a["end_step"]) for a in history] == [
      ("running", 0, None)]

  again = jobs.train_forked(*flags, "--config.steps=5", "--config.strategy=zero3")
  assert again.returncode == 0, again.stderr[-2000:]
  summary = jobs.summary(workdir)
  start = summary["start_step"]
  assert start in (2, 3)  # step 3's save may have died with the process
  resumed = _lines(again.stderr, "Resuming from step")
  assert len(resumed) == 1, again.stderr[-2000:]
  assert re.search(rf"Resuming from step {start} of 5 in {re.escape(workdir)}: strategy "
                   r"ZeRO-3\S* on 8 devices in 1 process, resharded from 8 devices / strategy "
                   r"DP\(", resumed[0]), resumed[0]
  assert [(a["status"], a["start_step"], a["end_step"]) for a in summary["attempts"]] == [
      ("interrupted", 0, None), ("completed", start, 5)]
  assert summary["steps"] == 5 and summary["params_sha256"]  # the top level: this attempt
  assert summary["attempts"][0]["started_at"] < summary["attempts"][1]["started_at"]
  assert summary["attempts"][1]["wall_time_s"] == pytest.approx(summary["wall_time_s"], abs=1.0)

  before = _files(workdir)
  quiet = jobs.train(*flags, "--config.steps=4", "--verbosity=-1")  # WARNING and up only
  assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout == "", quiet.stderr
  done = jobs.train(*flags, "--config.steps=5", "--config.keep_checkpoints=1")
  assert done.returncode == 0, done.stderr[-2000:]
  assert [line for line in done.stderr.splitlines() if line.strip()] == _lines(
      done.stderr, "nothing to do: already at step 5 (steps=5)"), done.stderr
  assert len(_lines(done.stderr, "nothing to do")) == 1 and done.stdout == ""
  # Nothing in the workdir changed: the checkpoints (bytes and mtimes, the
  # directories' too; keep=1 pruned nothing), metrics.jsonl, TensorBoard, summary.json.
  assert _files(workdir) == before
  assert len(before) > 10 and any(name == "metrics.jsonl" for name, *_ in before)

  # The run report of this real resumed run marks its restart and counts its checkpoints.
  image = pytest.importorskip("matplotlib.image")
  from jaxcoll.observe import run_report  # noqa: PLC0415

  run = run_report.load_run(workdir)
  # One row per checkpoint: the first attempt's up to `start`, the second's after it.
  assert run.restarts == [start] and [r["step"] for r in run.checkpoints] == [1, 2, 3, 4, 5]
  text = run_report.write_report(workdir)
  assert f"restarts at step: {start}" in text, text
  assert image.imread(os.path.join(workdir, "report.png")).shape[:2] == (1000, 1600)


def test_bad_configuration_after_the_attempt_began_leaves_summary_as_it_was(tmp_path):
  """An exit-2 error leaves the workdir as it was: the entry is withdrawn."""
  attempts.write_summary(tmp_path, {"steps": 3, "attempts": []})
  before = (tmp_path / "summary.json").read_bytes()
  attempt = attempts.Attempt(tmp_path, start_step=3, is_chief=True)
  attempt.begin()
  assert [a["status"] for a in attempts.read_summary(tmp_path)["attempts"]] == ["running"]
  error = loop.ConfigError("`data.train` matches no files")
  assert attempt.on_exit(type(error), error, None) is False
  assert (tmp_path / "summary.json").read_bytes() == before


def test_stopped_and_failed_attempts_keep_the_last_completed_summary(tmp_path):
  first = attempts.Attempt(tmp_path, start_step=0, is_chief=True)
  first.begin()
  first.end("completed", end_step=4, summary={"steps": 4, "params_sha256": "ab"})
  stopped = attempts.Attempt(tmp_path, start_step=4, is_chief=True)
  stopped.begin()
  stopped.hook.before_step(7, None, None)
  stop = loop.watchdog.StopRequested(6, saved=True)
  stopped.on_exit(type(stop), stop, None)
  failed = attempts.Attempt(tmp_path, start_step=6, is_chief=True)
  failed.begin()
  failed.hook.before_save(8)
  error = FloatingPointError("nan")
  failed.on_exit(type(error), error, None)
  summary = attempts.read_summary(tmp_path)
  assert (summary["steps"], summary["params_sha256"]) == (4, "ab")
  assert [(a["status"], a["start_step"], a["end_step"]) for a in summary["attempts"]] == [
      ("completed", 0, 4), ("stopped", 4, 6), ("failed", 6, 8)]
  assert all(a["wall_time_s"] >= 0 for a in summary["attempts"])


def test_torn_summary_is_kept_aside_and_history_restarts(tmp_path):
  (tmp_path / "summary.json").write_text('{"steps": 6, "attempts": [{"sta')
  attempt = attempts.Attempt(tmp_path, start_step=6, is_chief=True)
  attempt.begin()
  aside = [p for p in os.listdir(tmp_path) if p.startswith("summary.json.unreadable-")]
  assert len(aside) == 1
  assert (tmp_path / aside[0]).read_text() == '{"steps": 6, "attempts": [{"sta'
  assert [a["start_step"] for a in attempts.read_summary(tmp_path)["attempts"]] == [6]
  assert sorted(os.listdir(tmp_path)) == sorted(["summary.json", aside[0]])  # no temporaries


def test_summary_without_attempts_counts_as_one_completed_attempt(tmp_path):
  (tmp_path / "summary.json").write_text(json.dumps(
      {"steps": 200, "start_step": 0, "wall_time_s": 12.5}))
  attempts.Attempt(tmp_path, start_step=200, is_chief=True).begin()
  history = attempts.read_summary(tmp_path)["attempts"]
  assert [(a["start_step"], a["end_step"], a["wall_time_s"], a["status"]) for a in history] == [
      (0, 200, 12.5, "completed"), (200, None, None, "running")]


def test_only_process_0_writes(tmp_path):
  attempt = attempts.Attempt(tmp_path, start_step=0, is_chief=False)
  attempt.begin()
  attempt.end("completed", end_step=2, summary={"steps": 2})
  assert os.listdir(tmp_path) == []
  with pytest.raises(ValueError, match="`status` must be one of"):
    attempt.end("done", end_step=2)


# ------------------------------------------------------------ the launcher's lines


class _ChunkStream:
  """A child's pipe: ``read1`` returns the chunks one by one, slowly."""

  def __init__(self, chunks, pause_s=0.001):
    self._chunks, self._pause_s = list(chunks), pause_s

  def read1(self, n):
    del n
    time.sleep(self._pause_s)
    return self._chunks.pop(0) if self._chunks else b""

  def close(self):
    pass


def _chatter(process: int) -> list[bytes]:
  """Gloo's lines as it writes them: in pieces, two threads' pieces mixed."""
  ranks = [4 * process + r for r in range(4)]
  chunks = []
  for r in ranks:
    chunks += [b"[Gloo] Rank ", str(r).encode(), b" is connected to 7 peer ranks. ",
               b"Expected number of connected peer ranks is : 7\n"]
  head = b"[Gloo] Rank "  # the garbled pair seen in the recommender's output
  chunks += [head, (GLOO.format(r=process, n=1) + "\n").encode(),
             f"{process} is connected to 1 peer ranks. Expected number of connected peer ranks is :"
             " 1\n".encode()]
  return chunks


def test_line_pump_keeps_lines_whole_and_collapses_gloo_chatter():
  """Two processes' streams written at once in small pieces: every line
  comes out whole with its prefix, gloo's chatter is one line per process."""
  long_line = b"x" * 300_000
  sink = io.BytesIO()
  outputs = []
  for p in (0, 1):
    gloo = launch.GlooChatter()
    out = [b"step 1 lo", b"ss=0.5", b"\nstep 2 ", b"loss=0.4\n", *_chatter(p),
           *(long_line[i:i + 4096] for i in range(0, len(long_line), 4096)), b"\n",
           b"no newline at the end"]
    err = [b"W1201 warn", b"ing from p%d\n" % p, *_chatter(p)[:4], b"[Gloo] Rank ",
           b"9 is connected to 3 peer ranks. Expected number of connected peer ranks is : 7\n"]
    prefix = b"[p%d] " % p
    outputs += [launch._Output(_ChunkStream(out), sink, prefix, gloo),
                launch._Output(_ChunkStream(err), sink, prefix, gloo)]
  for out in outputs:
    out.join(timeout=30)
  lines = sink.getvalue().decode().split("\n")
  assert lines[-1] == ""  # the text ends with a newline
  lines = lines[:-1]
  for p in (0, 1):
    mine = [line for line in lines if line.startswith(f"[p{p}] ")]
    gloo_lines = [line for line in mine if "gloo" in line.lower()]
    # one collapsed line, and the short connection (3 of 7 peers), which is news
    assert len(gloo_lines) == 2, gloo_lines
    assert gloo_lines.count(f"[p{p}] gloo: connected to 7 peer rank(s) (further gloo connection "
                            "lines hidden)") == 1
    assert f"[p{p}] [Gloo] Rank 9 is connected to 3 peer ranks. Expected number of connected " \
           "peer ranks is : 7" in gloo_lines
    assert f"[p{p}] step 1 loss=0.5" in mine and f"[p{p}] step 2 loss=0.4" in mine
    assert f"[p{p}] W1201 warning from p{p}" in mine
    assert f"[p{p}] " + "x" * 300_000 in mine
    assert f"[p{p}] no newline at the end" in mine
  assert len(lines) == 2 * 7


def test_line_buffer_cuts_a_runaway_line_and_flushes_the_tail():
  buffer = launch.LineBuffer(limit=8)
  assert buffer.feed(b"abc") == []
  assert buffer.feed(b"def\ngh") == [b"abcdef\n"]
  assert buffer.feed(b"ijklmnopq") == [b"ghijklmn\n"]
  assert buffer.flush() == b"opq\n" and buffer.flush() is None


def test_gloo_chatter_passes_other_lines_unchanged():
  gloo = launch.GlooChatter()
  first = (GLOO.format(r=0, n=1) + "\n").encode()
  assert gloo.filter(first) == b"gloo: connected to 1 peer rank(s) (further gloo connection " \
      b"lines hidden)\n"
  assert gloo.filter(first) is None
  mixed = b"[Gloo] Rank step 3 loss=0.1\n"  # not only gloo's pieces: shown as is
  assert gloo.filter(mixed) == mixed
  assert gloo.filter(b"Rank 12 of the table\n") == b"Rank 12 of the table\n"


def test_launcher_output_of_two_children_writing_pieces(tmp_path):
  """Real child processes (no JAX) writing gloo's chatter and partial lines
  unflushed-then-flushed, at the same time: one gloo line per process,
  every other line whole."""
  code = textwrap.dedent("""
      import os, sys, time
      p = int(os.environ["JAXCOLL_PROCESS_ID"])
      out = sys.stdout
      for r in range(4):
        for piece in ["[Gloo] Rank ", str(4 * p + r), " is connected to 7 peer ranks. ",
                      "Expected number of connected peer ranks is : 7\\n"]:
          out.write(piece); out.flush(); time.sleep(0.002)
      for i in range(20):
        out.write(f"line {i} of p{p} "); out.flush(); time.sleep(0.002)
        out.write("x" * 5000 + "\\n"); out.flush()
      out.write("last words"); out.flush()
  """)
  r = jobs.run([sys.executable, "-m", "jaxcoll.launch", "--num_processes=2",
                "--devices_per_process=1", "--", sys.executable, "-c", code], timeout=60)
  assert r.returncode == 0, r.stderr
  lines = r.stdout.splitlines()
  for p in (0, 1):
    mine = [line for line in lines if line.startswith(f"[p{p}] ")]
    assert [line for line in mine if "gloo" in line.lower()] == [
        f"[p{p}] gloo: connected to 7 peer rank(s) (further gloo connection lines hidden)"]
    body = [line for line in mine if " line " in line]
    assert body == [f"[p{p}] line {i} of p{p} " + "x" * 5000 for i in range(20)]
    assert mine[-1] == f"[p{p}] last words"
  assert len(lines) == 2 * 22


def test_announce_lines_name_layout_and_resharding(caplog):
  caplog.set_level("INFO", logger="jaxcoll")
  attempts.announce_resume(start=6, steps=9, strategy="DP(auto)", devices=4, processes=2,
                           workdir="/w", saved_by={"strategy": "DP(auto)", "device_count": 4,
                                                   "process_count": 2})
  attempts.announce_resume(start=6, steps=9, strategy="DP(auto)", devices=4, processes=1,
                           workdir="/w", saved_by={"strategy": "ZeRO-3", "device_count": 8,
                                                   "process_count": 1})
  auto = attempts.auto_note("DP(auto)")  # issue 23: auto is not layout-free, said on the line
  assert auto.startswith("; algorithm auto picks per topology")
  assert caplog.messages == [
      "Resuming from step 6 of 9 in /w: strategy DP(auto) on 4 devices in 2 processes" + auto,
      "Resuming from step 6 of 9 in /w: strategy DP(auto) on 4 devices in 1 process, resharded "
      "from 8 devices / strategy ZeRO-3 in 1 process" + auto,
  ]


def test_threads_share_one_sink_without_mixing():
  """Many pumps at once onto one sink: each line arrives whole."""
  sink = io.BytesIO()
  pieces = [b"a" * 7, b"b" * 5 + b"\n"] * 50
  outs = [launch._Output(_ChunkStream(list(pieces), pause_s=0), sink, b"[p%d] " % i)
          for i in range(6)]
  for out in outs:
    out.join(timeout=30)
  lines = sink.getvalue().decode().splitlines()
  assert len(lines) == 300
  assert all(re.fullmatch(r"\[p\d\] a{7}b{5}", line) for line in lines)
