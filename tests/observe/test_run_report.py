"""The one writer (JSONL + TensorBoard run info), the run report, the bench plot grid and
the bench JSON metadata.

TensorBoard's own reader is not installed here: the event files are read as TensorBoard
reads a run directory, every ``events.out.tfevents.*`` file of it in name order, each a
sequence of TFRecord records of ``Event`` protos (tensorboardX's own proto classes).
"""

import glob
import importlib.util
import json
import os
import statistics
import struct
import sys

import jobs
import numpy as np
import pytest
from tensorboardX.proto import event_pb2, plugin_hparams_pb2

from configs import minimal
from jaxcoll.observe import bench, metrics, run_report
from jaxcoll.run import loop

needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="the report and the bench plot need matplotlib")

CONFIG = {"model": "mlp", "steps": 40, "learning_rate": 1e-3, "tensorboard": True,
          "data": {"train": "", "eval_examples": 1024}, "model_overrides": {"widths": (32, 16)}}
FIGURES = {"comm_bytes_per_step": 1835008, "memory_bytes_per_device": 123456,
           "param_count": 4321, "process_ids": [0, 1]}


def read_run(logdir):
  """``(file, event)`` of every event of the run in ``logdir``, files in name order."""
  events = []
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    i = 0
    while i < len(data):
      (length,) = struct.unpack("<Q", data[i:i + 8])
      event = event_pb2.Event()
      event.ParseFromString(data[i + 12:i + 12 + length])
      events.append((os.path.basename(path), event))
      i += 12 + length + 4
  return events


def values(events, tag):
  """``(step, value)`` of every summary value named ``tag``."""
  return [(e.step, v) for _, e in events for v in e.summary.value if v.tag == tag]


def scalars(events, tag):
  return [(step, v.simple_value) for step, v in values(events, tag)]


def texts(events, tag):
  return [(step, v.tensor.string_val[0].decode())
          for step, v in values(events, f"{tag}/text_summary")]


def test_write_run_info_writes_config_hparams_and_figures_once(tmp_path):
  w = metrics.MetricsWriter(str(tmp_path), start_step=0)
  w.write_run_info(CONFIG, FIGURES)
  w.write(10, {"loss": 0.5, "step_time_s": 0.01, "process_time_s": [0.01, 0.02]})
  w.close()
  events = read_run(tmp_path / "tensorboard")

  (step, config_text), = texts(events, "config")
  assert step == 0
  assert "| learning_rate | 0.001 |" in config_text
  assert "| data.eval_examples | 1024 |" in config_text
  assert "| model_overrides.widths | [32, 16] |" in config_text
  (_, figures_text), = texts(events, "run_figures")
  assert "| comm_bytes_per_step | 1835008 |" in figures_text
  assert "| process_ids | [0, 1] |" in figures_text  # a list: in the text only

  (_, start), = values(events, "_hparams_/session_start_info")
  data = plugin_hparams_pb2.HParamsPluginData()
  data.ParseFromString(start.metadata.plugin_data.content)
  hp = data.session_start_info.hparams
  assert hp["learning_rate"].number_value == pytest.approx(1e-3)
  assert hp["model"].string_value == "mlp"
  assert hp["tensorboard"].bool_value is True
  assert hp["model_overrides.widths"].string_value == "[32, 16]"
  (_, experiment), = values(events, "_hparams_/experiment")
  data.ParseFromString(experiment.metadata.plugin_data.content)
  assert [m.name.tag for m in data.experiment.metric_infos] == [
      "loss", "comm_bytes_per_step", "memory_bytes_per_device", "param_count"]
  assert len(values(events, "_hparams_/session_end_info")) == 1

  for name in ("comm_bytes_per_step", "memory_bytes_per_device", "param_count"):
    assert scalars(events, name) == [(0, FIGURES[name])]
  assert values(events, "process_ids") == []
  assert scalars(events, "loss") == [(10, 0.5)]
  assert values(events, "process_time_s") == []  # lists go to the JSONL only
  assert metrics.read_metrics(str(tmp_path)) == [
      {"step": 10, "loss": 0.5, "step_time_s": 0.01, "process_time_s": [0.01, 0.02]}]
  assert len(glob.glob(str(tmp_path / "tensorboard" / "*"))) == 1  # one event file, no run dirs


def test_a_figure_known_later_is_written_once_at_its_step(tmp_path):
  w = metrics.MetricsWriter(str(tmp_path), start_step=4)
  w.write_run_info(CONFIG, FIGURES)
  w.write(5, {"loss": 0.5})
  w.write_figures({"comm_share_measured": 0.25}, step=6)
  w.close()
  events = read_run(tmp_path / "tensorboard")
  assert scalars(events, "comm_share_measured") == [(6, 0.25)]
  assert scalars(events, "param_count") == [(4, 4321)]
  assert [(step, "comm_share_measured" in text) for step, text in texts(events, "run_figures")
          ] == [(4, False), (6, True)]
  assert metrics.read_metrics(str(tmp_path)) == [{"step": 5, "loss": 0.5}]


@pytest.mark.parametrize("tensorboard", [True, False], ids=["tensorboard", "jsonl_only"])
def test_a_writer_that_writes_nothing_leaves_no_event_file(tmp_path, tensorboard):
  metrics.MetricsWriter(str(tmp_path), tensorboard=tensorboard).close()
  assert not (tmp_path / "tensorboard").exists()
  w = metrics.MetricsWriter(str(tmp_path), tensorboard=tensorboard)
  w.write(1, {"process_time_s": [0.1, 0.2]})  # no number for TensorBoard
  w.close()
  assert not (tmp_path / "tensorboard").exists()
  assert metrics.read_metrics(str(tmp_path)) == [{"step": 1, "process_time_s": [0.1, 0.2]}]


def test_a_resumed_writer_adds_to_the_same_run(tmp_path):
  first = metrics.MetricsWriter(str(tmp_path))
  first.write_run_info(CONFIG, FIGURES)
  for step in (1, 2, 3):  # step 3 logged after the last checkpoint (2), then a crash
    first.write(step, {"loss": step / 8})  # exact in float32, as TensorBoard stores it
  first.close()
  before = read_run(tmp_path / "tensorboard")
  # Same second, same process: the resumed attempt gets a file of its own anyway.
  second = metrics.MetricsWriter(str(tmp_path), start_step=2)
  second.write_run_info(CONFIG, FIGURES)
  second.write(3, {"loss": 0.25})
  second.close()

  files = sorted(os.listdir(tmp_path / "tensorboard"))
  assert len(files) == 2
  events = read_run(tmp_path / "tensorboard")
  assert events[:len(before)] == before  # the first attempt's file is intact, and read first
  assert {name for name, _ in events[len(before):]} == {files[1]}
  # The resumed file purges the steps after its start (TensorBoard's purge: a START
  # session log at step start + 1), as metrics.jsonl drops the rows after it.
  purge = [e.step for _, e in events[len(before):]
           if e.HasField("session_log") and e.session_log.status == e.session_log.START]
  assert purge == [3]
  assert scalars(events, "loss") == [(1, 0.125), (2, 0.25), (3, 0.375), (3, 0.25)]
  assert [step for step, _ in texts(events, "config")] == [0, 2]  # once per attempt
  assert scalars(events, "param_count") == [(0, 4321), (2, 4321)]
  assert [r["loss"] for r in metrics.read_metrics(str(tmp_path))] == [0.125, 0.25, 0.25]


# ------------------------------------------------------------------ the run report

def write_run(workdir, *, slow_process=1, loss_scale=1.0, steps=40, restart=20):
  """A resumed two-process run with evals, checkpoints and a restart, in the row schema of
  metrics.jsonl (train, eval and checkpoint rows) and summary.json (attempts)."""
  os.makedirs(workdir, exist_ok=True)
  rng = np.random.default_rng(0)
  rows = []
  for step in range(2, steps + 1, 2):
    times = [0.010 + 0.001 * rng.random(), 0.010 + 0.001 * rng.random()]
    times[slow_process] *= 2.5
    slowest = int(np.argmax(times))
    rows.append({
        "step": step, "loss": loss_scale * 2.0 / step, "grad_norm": 1.0 / step,
        "learning_rate": 1e-3, "step_time_s": times[0], "data_time_s": 0.002,
        "examples_per_s": 64 / max(times), "skipped_steps": max(0, (step - 30) // 2),
        "process_time_s": times, "slowest_process": slowest,
        "process_step_time_s": [0.05 + 0.001 * step, 0.05 + 0.001 * step],
        "slowest_process_time_s": times[slowest], "fastest_process": 1 - slowest,
        "fastest_process_time_s": times[1 - slowest],
    })
    if step % 10 == 0:
      rows.append({"step": step, "eval_loss": loss_scale * 2.5 / step, "eval_accuracy": step / 50,
                   "eval_examples": 256, "eval_time_s": 0.3})
      rows.append({"step": step, "checkpoint_time_s": 0.05 + step / 1000})
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  attempts = [
      {"start_step": 0, "end_step": restart + 3, "wall_time_s": 5.0, "started_at": 1.7e9,
       "status": "interrupted"},
      {"start_step": restart, "end_step": steps, "wall_time_s": 4.0, "started_at": 1.7e9 + 60,
       "status": "completed"},
  ]
  summary = {"steps": steps, "start_step": restart, "final_loss": rows[-3]["loss"],
             "num_devices": 8, "num_processes": 2, "attempts": attempts,
             "comm_share_estimate": 0.125, "skipped_steps": 5,
             "config": {"model": "mlp", "strategy": "dp", "algorithm": "ring"}}
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f)
  return rows


def pixels(path):
  from PIL import Image  # noqa: PLC0415  (matplotlib's own dependency)

  with Image.open(path) as image:
    return np.asarray(image.convert("RGB"))


@needs_matplotlib
def test_report_of_a_resumed_run_is_drawn_from_its_metrics(tmp_path):
  rows = write_run(tmp_path / "a")
  text = run_report.write_report(str(tmp_path / "a"))
  png = pixels(tmp_path / "a" / "report.png")
  assert png.shape == (1000, 1600, 3)
  assert (tmp_path / "a" / "report.txt").read_text() == text + "\n"

  write_run(tmp_path / "b", loss_scale=3.0)  # other losses, same everything else
  run_report.write_report(str(tmp_path / "b"))
  write_run(tmp_path / "c", restart=30)  # the restart line moves
  run_report.write_report(str(tmp_path / "c"))
  other_loss, other_restart = pixels(tmp_path / "b" / "report.png"), pixels(
      tmp_path / "c" / "report.png")
  assert (png != other_loss).any(axis=2).sum() > 500
  assert (png != other_restart).any(axis=2).sum() > 100
  # The same metrics draw the same picture: the differences above come from the metrics.
  run_report.draw(run_report.load_run(str(tmp_path / "a")), str(tmp_path / "again.png"))
  assert np.array_equal(png, pixels(tmp_path / "again.png"))

  train = [r for r in rows if "loss" in r]
  lines = text.splitlines()
  assert lines[1] == "steps: 40 (20 train rows, 4 eval rows, 4 checkpoint rows)"
  assert lines[2] == "attempts: 2 (interrupted, completed); restarts at step: 20"
  assert lines[3] == f"final loss: {train[-1]['loss']:.4g} at step 40"
  assert lines[4] == "final eval: eval_loss=0.0625, eval_accuracy=0.8 at step 40"
  median = statistics.median(r["step_time_s"] for r in train)
  rate = statistics.median(r["examples_per_s"] for r in train)
  assert lines[5] == (f"step time: median {median:.4g} s over 20 rows; "
                      f"examples/s: median {rate:.4g}")
  true = statistics.median(r["process_step_time_s"][0] for r in train)
  assert lines[6] == (f"median step time per process (dispatch to ready): 0: {true:.4g} s, "
                      f"1: {true:.4g} s")
  per = [statistics.median(r["process_time_s"][p] for r in train) for p in (0, 1)]
  assert lines[7] == (f"slowest process (most host time before dispatch): 1 in 20 of 20 rows; "
                      f"median host time before dispatch (data + dispatch) per process: "
                      f"0: {per[0]:.4g} s, 1: {per[1]:.4g} s")
  saves = statistics.median([0.06, 0.07, 0.08, 0.09])
  assert lines[8] == (f"data time: median 0.002 s per step; checkpoints: 4 (median save "
                      f"{saves:.4g} s); evals: 4 (median 0.3 s)")
  assert "skipped steps: 5" in lines
  assert "comm share (cost-model estimate): 12.5% of the step" in lines

  write_run(tmp_path / "e", slow_process=0)
  slow0 = run_report.summarize(run_report.load_run(str(tmp_path / "e")))
  assert "slowest process (most host time before dispatch): 0 in 20 of 20 rows" in slow0


@needs_matplotlib
def test_report_of_many_processes_names_the_extremes(tmp_path):
  rng = np.random.default_rng(1)
  rows = []
  for step in range(1, 11):
    times = list(0.010 + 0.001 * rng.random(16))
    times[5] *= 2
    rows.append({"step": step, "loss": 1 / step, "step_time_s": times[0],
                 "process_time_s": times, "slowest_process": int(np.argmax(times))})
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  text = run_report.write_report(str(tmp_path))
  per = [statistics.median(r["process_time_s"][p] for r in rows) for p in range(16)]
  fastest = int(np.argmin(per))
  assert (f"slowest process (most host time before dispatch): 5 in 10 of 10 rows; median host "
          f"time before dispatch (data + dispatch) per process: fastest {fastest}: "
          f"{per[fastest]:.4g} s, median {statistics.median(per):.4g} s, slowest 5: "
          f"{per[5]:.4g} s") in text.splitlines()
  assert pixels(tmp_path / "report.png").shape == (1000, 1600, 3)


@needs_matplotlib
def test_report_command_line(tmp_path):
  write_run(tmp_path / "run")
  out = jobs.run([sys.executable, "-m", "experiments.report", f"--workdir={tmp_path}/run"],
                 timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.splitlines()[0] == f"run report: {tmp_path}/run"
  assert out.stdout == (tmp_path / "run" / "report.txt").read_text()
  assert pixels(tmp_path / "run" / "report.png").shape == (1000, 1600, 3)

  out = jobs.forked([sys.executable, "-m", "experiments.report", f"--workdir={tmp_path}/missing"],
                    timeout=120)  # the first one started a real Python
  assert out.returncode == 2
  assert out.stderr.count("\n") == 1 and out.stderr.startswith("report: error: `--workdir`")
  assert "is not a directory" in out.stderr and "Traceback" not in out.stderr
  assert not (tmp_path / "missing").exists()


def test_report_of_a_workdir_without_rows_is_an_error(tmp_path):
  with pytest.raises(ValueError, match="has no metrics.jsonl"):
    run_report.write_report(str(tmp_path))
  (tmp_path / "metrics.jsonl").write_text("")
  with pytest.raises(ValueError, match="has no rows"):
    run_report.write_report(str(tmp_path))
  assert os.listdir(tmp_path) == ["metrics.jsonl"]  # nothing written


def test_report_without_matplotlib_says_how_to_install_it(tmp_path, monkeypatch):
  write_run(tmp_path)
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
  with pytest.raises(ImportError, match=r"needs matplotlib.*pip install 'jaxcoll\[plot\]'"):
    run_report.write_report(str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl", "summary.json"]


@needs_matplotlib
def test_report_and_tensorboard_of_a_real_run(tmp_path):
  config = minimal.get_config("smoke")
  config.update(steps=3, log_every=1)
  summary = loop.train_and_evaluate(config, str(tmp_path))
  events = read_run(tmp_path / "tensorboard")
  assert len(os.listdir(tmp_path / "tensorboard")) == 1
  (step, config_text), = texts(events, "config")
  assert step == 0 and "| global_batch_size | 16 |" in config_text
  assert (0, float(summary["comm_bytes_per_step"])) in scalars(events, "comm_bytes_per_step")
  assert len(values(events, "_hparams_/session_start_info")) == 1

  text = run_report.write_report(str(tmp_path))
  train = [r for r in metrics.read_metrics(str(tmp_path)) if "loss" in r]
  assert [r["step"] for r in train] == [1, 2, 3]
  assert f"final loss: {train[-1]['loss']:.4g} at step 3" in text
  assert pixels(tmp_path / "report.png").shape == (1000, 1600, 3)



@needs_matplotlib
def test_report_command_of_a_run_with_checkpoints_prints_no_orbax_log(tmp_path):
  """The report reads the newest checkpoints back to check them (a damaged one is no resume
  point): each Checkpointer it opened printed orbax's INFO lines, 27 lines of
  'I1207 ... checkpoint_manager.py ...' on stderr for a run of two checkpoints. The command
  logs at WARNING, as train and eval do, unless --verbosity is given."""
  config = minimal.get_config("smoke")
  config.update(steps=2, log_every=1, checkpoint_every=1)
  loop.train_and_evaluate(config, str(tmp_path))
  out = jobs.forked([sys.executable, "-m", "experiments.report", f"--workdir={tmp_path}"],
                    timeout=120)
  assert out.returncode == 0, out.stderr
  assert "checkpoints on disk: 1, 2 (newest 2: a resume starts there)" in out.stdout
  assert out.stderr.splitlines() == [f"wrote {tmp_path}/report.png and report.txt"], out.stderr

# ------------------------------------------------------------------ the benchmark's outputs

def bench_rows(collectives):
  return [bench.Row(c, algo, size, size // 4, "float32", "sum", -1, 10.0 + i, size / 1e4,
                    size / 8e3, 0)
          for c in collectives for i, algo in enumerate(("native", "ring"))
          for size in (1024, 4096)]


@needs_matplotlib
@pytest.mark.parametrize("count, size", [(2, (1200, 450)), (6, (1800, 900))])
def test_bench_plot_is_a_grid(tmp_path, count, size):
  rows = bench_rows(list(bench.SPECS)[:count])
  bench.plot(rows, str(tmp_path / "busbw.png"), title=f"{count} collectives, 8 cpu devices")
  assert pixels(tmp_path / "busbw.png").shape == (size[1], size[0], 3)


def test_bench_json_rows_carry_the_run_metadata(tmp_path, devices):
  import jax  # noqa: PLC0415

  from jaxcoll.runtime import devices as devices_lib  # noqa: PLC0415

  mesh = devices_lib.mesh_from_text("2,4", "node,local")
  rows = bench_rows(["all_reduce"])
  bench.write_json(rows, str(tmp_path / "rows.json"), metadata=bench.run_metadata(mesh))
  loaded = json.loads((tmp_path / "rows.json").read_text())
  assert [{k: r[k] for k in bench.FIELDS} for r in loaded] == bench.to_dicts(rows)
  meta = loaded[0]
  assert meta["devices"] == 8
  assert meta["platform"] == "cpu" and meta["device_kind"] == jax.devices()[0].device_kind
  assert meta["process_count"] == 1
  assert meta["mesh"] == {"node": 2, "local": 4}
  assert meta["jax_version"] == jax.__version__
  assert meta["jaxlib_version"] and meta["jaxcoll_version"]
  assert meta["timing_mode"] == "one_in_flight"
  assert meta["date"][:2] == "20" and meta["date"].endswith("+00:00")
  assert all(r["date"] == meta["date"] for r in loaded)


# ------------------------------------------------------------ honest axes and titles (issue 23)

def _captured_axes(monkeypatch):
  """The figures :func:`run_report.draw` / :func:`bench.plot` make, kept open."""
  import matplotlib.pyplot as plt  # noqa: PLC0415

  figures = []
  monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
  return figures


@needs_matplotlib
def test_report_axes_start_at_zero_and_print_the_span(tmp_path, monkeypatch):
  """An eval accuracy of 0.690-0.697 is drawn from 0 (not as a collapse), with its span;
  the step time panel plots every process's dispatch-to-ready time."""
  rows = [r for r in write_run(tmp_path) if "eval_accuracy" not in r]
  rows += [{"step": step, "eval_accuracy": acc, "eval_loss": 0.5}
           for step, acc in ((20, 0.697), (40, 0.690))]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  figures = _captured_axes(monkeypatch)
  run_report.draw(run_report.load_run(str(tmp_path)), str(tmp_path / "r.png"))
  (fig,) = figures
  loss, evals, steps = fig.axes[:3]
  assert evals.get_ylim()[0] == 0 and loss.get_ylim()[0] == 0
  texts = [t.get_text() for t in evals.texts]
  assert "span 0.69 to 0.697" in texts
  assert "dispatch to ready" in steps.get_title()
  plotted = {tuple(line.get_ydata()) for line in steps.get_lines()}
  train = [r for r in rows if "loss" in r]
  assert tuple(r["process_step_time_s"][1] for r in train) in plotted
  assert tuple(r["process_time_s"][1] for r in train) in plotted  # dashed, named in the title


@needs_matplotlib
def test_long_titles_are_wrapped_to_the_figure(tmp_path, monkeypatch):
  long = str(tmp_path / ("a-very-long-workdir-name-" * 8))
  os.makedirs(long)
  write_run(long)
  figures = _captured_axes(monkeypatch)
  run_report.draw(run_report.load_run(long), os.path.join(long, "r.png"))
  row = bench.Row("all_reduce", "ring", 1024, 256, "float32", "sum", -1, 10.0, 0.1, 0.2, 0)
  bench.plot([row], str(tmp_path / "b.png"), title="jaxcoll bench: " + "x=1, " * 40)
  report_title, bench_title = (fig._suptitle.get_text() for fig in figures)
  assert max(map(len, report_title.split("\n"))) <= 120 < len(report_title)
  assert max(map(len, bench_title.split("\n"))) <= 80 < len(bench_title)


@needs_matplotlib
def test_eval_only_rows_are_reported_apart(tmp_path):
  """evals.jsonl (python -m experiments.eval) of the workdir and of another directory: one
  line for them, crosses on the panels; a torn line is skipped; the in-training evals and
  metrics.jsonl stay as they are."""
  rows = [{"step": s, "loss": 2.0 / s, "step_time_s": 0.01} for s in (2, 4, 6)]
  rows.append({"step": 6, "eval_loss": 1.5, "eval_accuracy": 0.5, "eval_examples": 10,
               "eval_time_s": 0.1})
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  base = {"eval_examples": 10, "eval_data": "synthetic", "strategy": "ZeRO-3",
          "num_devices": 4, "eval_time_s": 0.2}
  metrics.append_eval_row({"step": 4, "eval_loss": 1.75, "eval_accuracy": 0.25,
                           "evaluated_at": 1.0, **base}, str(tmp_path))
  with open(tmp_path / metrics.EVALS_NAME, "a") as f:
    f.write('{"step": 5, "eval_lo')  # torn by a kill mid-write
    f.write("\n")
  other = tmp_path / "elsewhere"
  metrics.append_eval_row({"step": 6, "eval_loss": 1.5, "eval_accuracy": 0.5,
                           "evaluated_at": 2.0, **base}, str(other))
  run = run_report.load_run(str(tmp_path), eval_dirs=[str(other), str(tmp_path)])
  assert [r["step"] for r in run.eval_only] == [4, 6] and [r["step"] for r in run.evals] == [6]
  text = run_report.summarize(run)
  assert "evals: 1 (" in text and "final eval: eval_loss=1.5, eval_accuracy=0.5 at step 6" in text
  assert ("eval-only (experiments.eval): 2 rows; latest: eval_loss=1.5, eval_accuracy=0.5 at "
          "checkpoint 6 (10 examples: synthetic, ZeRO-3 on 4 devices)") in text
  run_report.draw(run, str(tmp_path / "report.png"))
  assert os.path.getsize(tmp_path / "report.png") > 0
  assert len(metrics.read_metrics(str(tmp_path))) == 4


def test_one_row_is_counted_in_the_singular(tmp_path):
  # A 1-step run's report said "1 train rows, 1 eval rows" and "over 1 rows".
  (tmp_path / "metrics.jsonl").write_text(
      json.dumps({"step": 1, "loss": 0.5, "step_time_s": 0.01}) + "\n"
      + json.dumps({"step": 1, "eval_loss": 0.4}) + "\n")
  lines = run_report.summarize(run_report.load_run(str(tmp_path))).splitlines()
  assert lines[1] == "steps: 1 (1 train row, 1 eval row, 0 checkpoint rows)"
  assert any(line.startswith("step time: median 0.01 s over 1 row; ") for line in lines), lines


def test_a_stopped_run_reports_the_step_it_stopped_at_not_its_last_logged_row(tmp_path):
  """SIGTERM after step 55 of a run logged every 50 (or an incident's stop at an odd step of
  one logged every 2): the final checkpoint is 55, summary.json's attempt ends at 55 and has
  no result, and the report said "steps: 50", the last train row's."""
  (tmp_path / "metrics.jsonl").write_text(
      json.dumps({"step": 50, "loss": 1.5, "step_time_s": 0.01}) + "\n"
      + json.dumps({"step": 55, "checkpoint_time_s": 0.2}) + "\n")
  (tmp_path / "summary.json").write_text(json.dumps({"attempts": [
      {"start_step": 0, "end_step": 55, "status": "stopped"}]}))
  lines = run_report.summarize(run_report.load_run(str(tmp_path))).splitlines()
  assert lines[1] == "steps: 55 (1 train row, 0 eval rows, 1 checkpoint row)", lines
  assert "final loss: 1.5 at step 50" in lines
  # A job killed mid-attempt ("running", no end step yet): its last row, as before.
  (tmp_path / "summary.json").write_text(json.dumps({"attempts": [
      {"start_step": 0, "end_step": None, "status": "running"}]}))
  lines = run_report.summarize(run_report.load_run(str(tmp_path))).splitlines()
  assert lines[1].startswith("steps: 50 ("), lines
