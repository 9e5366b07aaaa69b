r"""nccl-tests for jaxcoll: time and check every collective and algorithm.

    python -m experiments.bench_collectives --collective=all_reduce \
        --algorithms=all --min_bytes=4K --max_bytes=16M --step_factor=4
    python -m experiments.bench_collectives -b 8 -e 128M -f 2 -n 20 -w 5 -c 1 -d float -o sum
    python -m experiments.bench_collectives --collective=all --mesh_shape=2,4 \
        --mesh_axes=node,local --dtype=bfloat16 --json=/tmp/bench.json --plot=/tmp/bench.png
    python -m experiments.bench_collectives --algorithms=native,auto \
        --tuning_table=/tmp/tuning.json   # the table `jaxcoll tune --out=...` measured
    python -m jaxcoll.launch --num_processes=2 --devices_per_process=4 -- \
        python -m experiments.bench_collectives --mesh_shape=2,4 --mesh_axes=node,local

nccl-tests' short flags are aliases of the long ones: -b/-e/-f (min_bytes,
max_bytes, step_factor), -n/-w (iters, warmup_iters), -c (check; -c 0 / -c 1
as nccl-tests), -d (dtype, nccl-tests' names too: float, half, double, int, char;
-d all or a comma-separated list), -o (op; avg = mean; -o all), -r (root), -i
(step_bytes), -t 1 -g N (N: the devices of each process), -h, and its long names
(--minbytes, --datatype, ...); a value attached as getopt takes it (-b8 -e128M) too.
Its options jaxcoll has no equivalent of (-a, -z, -G, -J, ...) are one line each.

Prints nccl-tests' table (size, count, type, redop, root, algorithm, then
out-of-place and in-place time, algbw, busbw, #wrong; --noin_place for the
out-of-place columns only) and a footer with the wrong-values verdict and the
average bus bandwidth of each algorithm. Exit status: 0 when every value is
right, 1 when some are wrong, 2 on bad input (one line on stderr). Without
accelerators it emulates ``JAXCOLL_CPU_DEVICES`` CPU devices (default 8).
Sizes round down as nccl-tests rounds them (bench.element_count). The harness:
jaxcoll/observe/bench.py.
"""

from __future__ import annotations

import os

# Before jax starts: jaxcoll applies it to the CPU platform only.
os.environ.setdefault("JAXCOLL_CPU_DEVICES", "8")

import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from experiments import _cli  # noqa: E402
from jaxcoll import collectives  # noqa: E402
from jaxcoll.comm_model import tuning  # noqa: E402
from jaxcoll.observe import bench  # noqa: E402
from jaxcoll.runtime import devices, distributed  # noqa: E402
from jaxcoll.sizes import human_bytes  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("collective", "all_reduce", f"One of {', '.join(bench.SPECS)}, or all.")
flags.DEFINE_string(
    "algorithms", "all", "Comma-separated algorithm names (auto allowed), or all."
)
flags.DEFINE_string("min_bytes", "4K", "Smallest size (largest buffer; K/M/G = powers of 1024).",
                    short_name="b")
flags.DEFINE_string("max_bytes", "16M", "Largest size.", short_name="e")
flags.DEFINE_integer("step_factor", 4, "Each size is the previous one times this (>= 2).",
                     short_name="f")
flags.DEFINE_string("step_bytes", None, "Each size is the previous one plus this (nccl-tests' "
                    "-i), instead of --step_factor.", short_name="i")
flags.DEFINE_string(
    "dtype", "float32",
    f"One of {', '.join(bench.DTYPES)} (or nccl-tests' names: "
    f"{', '.join(f'{k}={v}' for k, v in bench.NCCL_DTYPES.items())}), a comma-separated "
    "list, or all (nccl-tests' -d all).", short_name="d")
flags.DEFINE_string(
    "op", "sum", f"Reduction op: {', '.join(bench.OPS)} (nccl-tests' avg = mean), a "
    "comma-separated list, or all (mean for the floating dtypes only).", short_name="o")
flags.DEFINE_integer("root", 0, "Root rank of broadcast and reduce.", short_name="r")
flags.DEFINE_integer("iters", 20, "Timed calls per (algorithm, size); time is their median.",
                     short_name="n")
flags.DEFINE_integer("warmup_iters", 5, "Untimed calls before the timed ones.", short_name="w")
flags.DEFINE_bool(
    "check", True, "Count the values that differ from the numpy reference (nccl-tests' "
    "-c 0 / -c 1 work too).", short_name="c")
flags.DEFINE_bool(
    "in_place", True, "Also measure nccl-tests' in-place columns (the input buffer donated, "
    "the result written into it); --noin_place for the out-of-place columns only.")
flags.DEFINE_string("mesh_shape", None, "Mesh shape, e.g. 2,4 (-1 fills); default all devices.")
flags.DEFINE_string(
    "mesh_axes", None, "Mesh axis names, e.g. node,local; default data (1 axis), node,local (2)."
)
flags.DEFINE_string(
    "json", None, "Write the rows to this JSON file (each row with the run's metadata: devices, "
    "platform, versions, timing mode, date)."
)
flags.DEFINE_string("csv", None, "Write the rows to this CSV file.")
flags.DEFINE_string(
    "plot", None, "Write a PNG of busbw vs size, one panel per collective, 3 per row "
    "(needs matplotlib)."
)
flags.DEFINE_string(
    "tuning_table", None, "The tuning table algorithm auto reads: a JSON file `jaxcoll tune "
    "--out=PATH` wrote (default: the one shipped for this device kind, else the cost model); "
    "needs auto in --algorithms.")
flags.DEFINE_integer(
    "ngpus", None, "nccl-tests' -g: the devices of each process, which the benchmark runs on "
    "all of (with -t 1, nccl-tests' one thread driving them); checked against this process's.",
    short_name="g")
flags.DEFINE_bool("progress", False, "Show progress on stderr (always on a terminal).")

_PROG = "bench_collectives"


def _mesh():
  return devices.mesh_from_text(FLAGS.mesh_shape, FLAGS.mesh_axes,
                                shape_name="--mesh_shape", axes_name="--mesh_axes")


def _plans(mesh, sizes: list[int], requested_pairs: list[tuple[str, str]]
           ) -> list[tuple[str, tuple[str, ...], str, str]]:
  """(collective, algorithms, dtype, op) to run for the sweep's ``sizes`` and the (dtype,
  op) pairs of -d / -o (:func:`_dtype_ops`); checks every flag before anything runs."""
  names = list(bench.SPECS) if FLAGS.collective == "all" else [FLAGS.collective]
  n, num_axes = mesh.devices.size, len(mesh.axis_names)
  requested = FLAGS.algorithms
  plans = []
  for collective in names:
    algos = requested
    if FLAGS.collective == "all" and requested != "all":
      # Each named algorithm runs where it exists; a name no collective has is an error.
      valid = bench.applicable_algorithms(collective, num_axes) + ("auto",)
      algos = [a for a in requested.split(",") if a in valid]
      if not algos:
        continue
    # A collective without a reduction runs once per dtype (its redop is none); --op is
    # checked all the same (-o prod is an error whatever the collective, as it was).
    pairs = requested_pairs
    if collective in bench.SPECS and not bench.SPECS[collective].reduces:  # else cases() says
      pairs = [(d, "sum") for d in dict.fromkeys(d for d, _ in pairs)]
    for dtype, op in pairs:
      # --collective=all: one whose every size holds no element (reduce_scatter below 16 B
      # per rank) is left out and named above the table, as its too-small sizes are; the
      # others run. Its flags are checked all the same, at the smallest size it takes.
      runs = sizes
      if FLAGS.collective == "all" and _runs_none(collective, sizes, n, dtype):
        runs = [bench.smallest_size(collective, n, dtype)]
      algos, _ = bench.cases(
          collective, algos, runs, n=n, num_axes=num_axes, dtype=dtype, op=op,
          root=FLAGS.root, iters=FLAGS.iters, warmup_iters=FLAGS.warmup_iters,
      )
      plans.append((collective, algos, dtype, op))
  if plans and all(_runs_none(c, sizes, n, d) for c, _, d, _ in plans):
    c, algos, d, op = plans[0]  # says which size each collective needs
    bench.cases(c, algos, sizes, n=n, num_axes=num_axes, dtype=d, op=op, root=FLAGS.root)
  if FLAGS.collective == "all" and requested != "all":
    known = {a for _, algos, _, _ in plans for a in algos}
    unknown = [a for a in requested.split(",") if a not in known]
    if "hierarchical" in unknown and num_axes < 2:  # a name that exists, on a 1-axis mesh
      bench.resolve_algorithms("all_reduce", "hierarchical", num_axes)  # says what it needs
    if unknown:
      every = sorted({a for c in bench.SPECS for a in bench.applicable_algorithms(c, num_axes)})
      raise ValueError(
          f"Unknown `--algorithms` {', '.join(unknown)} for this mesh; valid choices: "
          f"{', '.join(every)}, auto, or all."
      )
  return plans


def _runs_none(collective: str, sizes: list[int], n: int, dtype: str) -> bool:
  """Whether no size of the sweep holds an element of ``collective`` on ``n`` ranks."""
  return len(bench.left_out_sizes(collective, sizes, n, dtype)) == len(sizes)


class _AutoPicks:
  """`auto`'s default chooser (the tuning table, else the cost model) that remembers what
  it chose for each (collective, dtype, size) of the benchmark's group, for the table."""

  def __init__(self, n: int):
    self.n = n
    self.picks: dict[tuple[str, str], dict[int, str]] = {}

  def __call__(self, collective, nbytes, group, dtype) -> str:
    name, from_table = tuning.pick(collective, nbytes, group, dtype)
    if group.size == self.n:  # not a level of a hierarchical algorithm
      # a table without an entry for this group / dtype leaves the pick to the cost model:
      # said, else the line read as the table's choice
      self.picks.setdefault((collective, np.dtype(dtype).name), {})[int(nbytes)] = (
          name if from_table else f"{name} (cost model)")
    return name

  def line(self) -> str | None:
    """``auto chose: all_reduce float32 1K..4K ring, 16K native; ...`` (None if no auto ran)."""
    parts = []
    for (collective, dtype), by_size in self.picks.items():
      runs: list[list] = []  # [first size, last size, name], sizes ascending
      for size, name in sorted(by_size.items()):
        if runs and runs[-1][2] == name:
          runs[-1][1] = size
        else:
          runs.append([size, size, name])
      spans = ", ".join(
          f"{human_bytes(a)}{'' if a == b else '..' + human_bytes(b)} B {name}"
          for a, b, name in runs)
      parts.append(f"{collective} {dtype} {spans}")
    return f"auto chose: {'; '.join(parts)}" if parts else None


def _check_ngpus(mesh) -> None:
  """nccl-tests' ``-g N`` names the devices of each process: ours are the mesh's."""
  if FLAGS.ngpus is None:
    return
  here = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
  if FLAGS.ngpus != here:
    raise ValueError(
        f"`-g/--ngpus` {FLAGS.ngpus}: this process runs the benchmark on {here} devices of "
        f"the mesh; drop -g, or choose the devices with --mesh_shape (JAXCOLL_CPU_DEVICES on "
        f"CPU; `jaxcoll launch --devices_per_process=N` for several processes).")


def _sizes() -> list[int]:
  """The sweep of -b / -e with -f or -i (nccl-tests uses -i where -f is 1, its default)."""
  if FLAGS.step_bytes is None:
    return bench.size_sweep(FLAGS.min_bytes, FLAGS.max_bytes, FLAGS.step_factor)
  if FLAGS["step_factor"].present and FLAGS.step_factor != 1:
    raise ValueError(
        f"`--step_bytes` (-i {FLAGS.step_bytes}) and `--step_factor` (-f {FLAGS.step_factor}) "
        "both set the step; give one (nccl-tests takes -i with -f 1).")
  return bench.size_sweep(FLAGS.min_bytes, FLAGS.max_bytes, step_bytes=FLAGS.step_bytes)


def _use_tuning_table(path: str, plans) -> None:
  """Makes ``--tuning_table`` the table `auto` reads, or says in one line why it cannot."""
  fix = "give the JSON file `jaxcoll tune --out=PATH` wrote"
  if not path:
    raise ValueError(f"`--tuning_table` is empty; {fix}, or leave --tuning_table out.")
  if not any("auto" in algos for _, algos, _, _ in plans):
    raise ValueError(
        f"`--tuning_table` is read by algorithm auto only, and --algorithms={FLAGS.algorithms} "
        "runs no auto; add it, e.g. --algorithms=auto or --algorithms=native,ring,auto.")
  tuning.use(tuning.load_agreed(path, "--tuning_table"))  # the same on every process


def _left_out(plans, sizes: list[int], n: int) -> str | None:
  """The line naming the sizes of each collective and dtype that hold no element
  (nccl-tests rounds them down to size 0 and prints them so) and the size that runs."""
  by_collective: dict[tuple, list[str]] = {}  # (collective, sizes, smallest) -> dtypes
  for collective, dtype in dict.fromkeys((c, d) for c, _, d, _ in plans):
    if left := bench.left_out_sizes(collective, sizes, n, dtype):
      span = f"{left[0]}" if len(left) == 1 else f"{left[0]}..{left[-1]}"
      key = (collective, span, bench.smallest_size(collective, n, dtype))
      by_collective.setdefault(key, []).append(dtype)
  together: dict[tuple, list[str]] = {}  # (dtypes, sizes, smallest) -> collectives
  for (collective, span, smallest), dtypes in by_collective.items():
    together.setdefault((tuple(dtypes), span, smallest), []).append(collective)
  if not together:
    return None
  every = {d for _, _, d, _ in plans}
  parts = []
  for (ds, span, smallest), cs in together.items():
    types = "every type" if len(every) > 1 and set(ds) == every else ", ".join(ds)
    parts.append(f"{', '.join(cs)} ({types}) {span} B, runs from {smallest} B")
  return (f"left out on {n} ranks, too small once rounded down as nccl-tests rounds (it "
          f"prints them as size 0): {'; '.join(parts)}")


def _names(flag: str, every, aliases: dict[str, str]) -> list[str]:
  """``--dtype`` / ``--op``: one name, a comma-separated list, or all (nccl-tests' -d all /
  -o all), nccl-tests' names mapped to ours."""
  names = [aliases.get(t.strip(), t.strip()) for t in FLAGS[flag].value.split(",") if t.strip()]
  if not names:
    raise ValueError(f"`--{flag}` is empty; name one (e.g. --{flag}={every[0]}), or all.")
  return list(every) if names == ["all"] else list(dict.fromkeys(names))


def _requested() -> tuple[list[str], list[str]]:
  """The dtypes of ``--dtype`` and the ops of ``--op`` (our names)."""
  return (_names("dtype", tuple(bench.DTYPES), bench.NCCL_DTYPES),
          _names("op", bench.OPS, bench.NCCL_OPS))


def _dtype_ops(dtypes: list[str], ops: list[str]) -> list[tuple[str, str]]:
  """The (dtype, op) pairs to run: every pair of ``dtypes`` x ``ops`` that exists, a pair
  that does not (mean of an integer type) left out where either flag names several."""
  for op in ops:
    bench.check_op(op, "float32")  # an unknown op
  pairs = [(d, o) for d in dtypes for o in ops if o in bench.ops_for(d)]
  if not pairs or len(dtypes) == len(ops) == 1:
    bench.check_op(ops[0], dtypes[0])  # why the one pair cannot run
  return pairs


def _skipped(dtypes: list[str], ops: list[str]) -> str | None:
  """The line that says which (dtype, op) pairs of -d / -o were left out, if any."""
  left = [d for d in dtypes if any(o not in bench.ops_for(d) for o in ops)]
  if not left:
    return None
  missing = sorted({o for d in left for o in ops if o not in bench.ops_for(d)},
                   key=bench.OPS.index)
  return (f"op {', '.join(missing)} left out for {', '.join(left)} "
          "(mean needs a floating dtype)")


def _progress(stream):
  """One progress callback over the whole run, or None."""
  if not (FLAGS.progress or stream.isatty()):
    return None
  return bench.ProgressLine(stream)


def main(argv: list[str]) -> int:
  if not FLAGS["verbosity"].present:
    # absl's default (INFO) would print JAX's backend probing to stderr.
    logging.set_verbosity(logging.WARNING)
  distributed.initialize()
  try:
    if len(argv) > 1:
      raise ValueError(f"Unexpected arguments {argv[1:]}; every option is a --flag.")
    mesh = _mesh()
    _check_ngpus(mesh)
    sizes, (dtypes, ops) = _sizes(), _requested()
    plans = _plans(mesh, sizes, _dtype_ops(dtypes, ops))
    if FLAGS.tuning_table is not None:
      _use_tuning_table(FLAGS.tuning_table, plans)
    if FLAGS.plot:
      bench.require_matplotlib()
    for flag, example in (("json", "bench.json"), ("csv", "bench.csv"), ("plot", "busbw.png")):
      # before measuring: a path that cannot be written lost the rows, an empty one wrote none
      if FLAGS[flag].value is not None:
        _cli.writable_file(flag, FLAGS[flag].value, example)
  except (ValueError, ImportError) as e:
    print(f"{_PROG}: error: {e}", file=sys.stderr)
    return 2
  lead = jax.process_index() == 0
  progress = _progress(sys.stderr) if lead else None
  picks = _AutoPicks(mesh.devices.size)
  if any("auto" in algos for _, algos, _, _ in plans):
    collectives.set_auto_chooser(picks)  # the default chooser, which it calls, plus a note
  rows = []
  for collective, algos, dtype, op in plans:
    if _runs_none(collective, sizes, mesh.devices.size, dtype):
      continue  # --collective=all: named on the left-out line
    rows += bench.run_benchmark(
        collective, algos, sizes, dtype=dtype, op=op, root=FLAGS.root,
        iters=FLAGS.iters, warmup_iters=FLAGS.warmup_iters, check=FLAGS.check, mesh=mesh,
        progress=progress, in_place=FLAGS.in_place,
    )
  if lead:
    shape = " x ".join(f"{a}={s}" for a, s in mesh.shape.items())
    title = (
        f"jaxcoll bench: {mesh.devices.size} {jax.devices()[0].platform} devices "
        f"({shape}, {jax.process_count()} process(es)), iters {FLAGS.iters}, "
        f"warm-up {FLAGS.warmup_iters}, time = "
        f"{'median' if bench.timing_mode() == 'one_in_flight' else 'mean'}"
    )
    if FLAGS.tuning_table:
      title += f"\n# auto reads the tuning table {FLAGS.tuning_table}"
    if chose := picks.line():
      title += f"\n# {chose}"
    if skipped := _skipped(dtypes, ops):
      title += f"\n# {skipped}"
    if left_out := _left_out(plans, sizes, mesh.devices.size):
      title += f"\n# {left_out}"
    print(bench.format_table(rows, title=title), flush=True)
    if FLAGS.json:
      bench.write_json(rows, FLAGS.json, metadata=bench.run_metadata(mesh))
    if FLAGS.csv:
      bench.write_csv(rows, FLAGS.csv)
    if FLAGS.plot:
      bench.plot(rows, FLAGS.plot, title=title.replace("\n# ", "\n"))
  return 1 if bench.total_wrong(rows) else 0


def _parser():
  parse = _cli.flags_parser(_PROG)

  def nccl_then_absl(argv):
    try:
      argv = bench.nccl_argv(argv)
    except ValueError as e:
      _cli.fail(_PROG, str(e))
    return parse(argv)

  return nccl_then_absl


if __name__ == "__main__":
  app.run(main, flags_parser=_parser())
