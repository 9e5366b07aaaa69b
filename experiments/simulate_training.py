r"""Predicts training step time and scaling efficiency on clusters we do not have.

    python -m experiments.simulate_training
    python -m experiments.simulate_training --preset=dgx-h100 --workloads= \
        --params=7e9 --flops_per_example=8.6e13 --per_device_batch=4 --out=/tmp/simtrain
    python -m experiments.simulate_training --validate --workloads=
    python -m experiments.simulate_training --cluster=4,4,25,2,200,1600 --min_gpus=4

For each workload and each strategy (DP, ZeRO-1/2/3, hybrid ZeRO-3), prints
the predicted step time split into compute, exposed communication,
optimizer and synchronization, the weak-scaling efficiency against one device
with the model's held-out error band beside it (its median error on the
published rows it was not fitted to), and the model-state memory per device
(and whether it fits), for 8..16,384 GPUs; then the knee where efficiency
falls below --threshold and what would move it. The default workloads are
real models at published per-GPU speeds on A100 (ResNet-50, BERT-large, a
1.3B and a 7B decoder: jaxcoll.scale.published.DEFAULT_WORKLOADS; scale their
speed with --compute_scale for another GPU); the shipped models (mlp,
transformer, resnet, recommender) are measured on this machine instead.
--cluster describes your own cluster by its links instead of a --preset.
--validate prints the fitted and held-out published rows against the model.
With --out, writes table.txt, simulate_training.json and efficiency.png. The
model: jaxcoll/scale/step_model.py; published figures: jaxcoll/scale/published.py.
"""

from __future__ import annotations

import dataclasses
import json
import os

from absl import app, flags

from experiments import _cli

_PROG = "simulate_training"
# jaxcoll.train.kinds.STAGES_WITH_HYBRID (hybrid: ZeRO-3 sharded in a node); a test checks.
_STRATEGIES = ("dp", "zero1", "zero2", "zero3", "hybrid")
_SHIPPED = ("mlp", "transformer", "resnet", "recommender")
_PUBLISHED = ("resnet50", "bert_large", "decoder_1.3b", "decoder_7b")
# Per-GPU batch of each published workload when --per_device_batch is not given: ResNet-50
# 256 (DeepLearningExamples A100 AMP), BERT-large 64 sequences of 128, decoders 8 / 4 sequences.
_DEFAULT_BATCH = {"resnet50": 256, "bert_large": 64, "decoder_1.3b": 8, "decoder_7b": 4}

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "dgx-a100", "Cluster preset (jaxcoll.topology.PRESETS).")
flags.DEFINE_string(
    "cluster", None,
    "Your own cluster instead of --preset: GPUS_PER_NODE,INTRA_LINKS,INTRA_GBps,INTER_LINKS,"
    "INTER_Gbps[,HBM_GBps] (per GPU: its links inside the node and their GB/s each; per "
    "node: its NICs and their Gb/s each), e.g. 4,4,25,2,200,1600 for 4 GPUs on 4 x 25 GB/s "
    "links and 2 x 200 Gb/s NICs per node (Topology.from_hardware); 2,1,15.75,0,0 for one "
    "machine of 2 GPUs on PCIe without NICs.")
flags.DEFINE_list("workloads", list(_PUBLISHED),
                  f"Workloads: {', '.join(_PUBLISHED)} (published A100 speeds), or shipped ones "
                  f"measured on this machine: {', '.join(_SHIPPED)}.")
flags.DEFINE_float("compute_scale", 1.0,
                   "Per-GPU speed of the published workloads relative to the A100 figures they "
                   "come with (e.g. 2.5 for an H100; an input, not a fit).")
flags.DEFINE_float("params", None, "A workload given by numbers: its parameter count.")
flags.DEFINE_float("flops_per_example", None,
                   "Training FLOPs per example of --params' workload (6 x params x tokens).")
flags.DEFINE_float("achieved_tflops", 400.0,
                   "FLOP/s one device sustains for --params' workload, in TFLOP/s (400: about "
                   "40% of an H100's dense bf16 peak; an assumption, set yours).")
flags.DEFINE_integer("layers", 32, "Equal layers of --params' workload (buckets, ZeRO-3 units).")
flags.DEFINE_integer("per_device_batch", None,
                     "Examples per device per step (weak scaling); default: 32, or the published "
                     "workload's own (ResNet-50 256, BERT-large 64, decoders 8 and 4).")
flags.DEFINE_list("strategies", list(_STRATEGIES), f"Of: {', '.join(_STRATEGIES)}.")
flags.DEFINE_integer("bucket_mb", 25, "Gradient bucket size in MiB (DDP's default 25).")
flags.DEFINE_string("algorithm", "native", "Collective algorithm (a jaxcoll.cost name).")
flags.DEFINE_integer("min_gpus", 8, "Smallest device count (then doubled).")
flags.DEFINE_integer("max_gpus", 16384, "Largest device count.")
flags.DEFINE_float("threshold", 0.8, "Efficiency below which scaling has stopped (the knee).")
flags.DEFINE_integer("input_workers", None,
                     "Host data-loader workers per GPU decoding on the CPU (e.g. PyTorch "
                     "DataLoader num_workers; DeepLearningExamples ResNet-50 uses 16 on DGX "
                     "A100): caps each GPU at input_workers x the fitted loader rate when GPUs "
                     "share a node. Default: input not modelled (synthetic / GPU decoding).")
flags.DEFINE_float("interference", None, "Overlap interference kappa (default: the fitted one).")
flags.DEFINE_float("device_memory_gb", None,
                   "Device memory for 'fits?' (default: the preset's device, if known).")
flags.DEFINE_bool("validate", False, "Print the validation table against published results.")
flags.DEFINE_string("out", None, "Directory for table.txt, simulate_training.json, PNG.")
flags.DEFINE_string("record_cpu_calibration", None,
                    "Measure bench_trainer medians and the cpu-sim calibration on this machine "
                    "and write them to this JSON file (e.g. tests/data/cpu_sim_calibration.json).")

# Memory of one device of each preset, GB (datasheets: H100 SXM5 80 GB, A100
# 80 GB, TPU v5e 16 GB HBM, P100 16 GB, V100 SXM2 16 GB (32 GB variant exists)).
DEVICE_MEMORY_GB = {
    "dgx-h100": 80, "dgx-a100": 80, "tpu-v5e": 16, "pascal-pcie-25gbe-roce": 16,
    "pascal-pcie-25gbe-tcp": 16, "pascal-nvlink-50gbe": 16, "volta-nvlink-100gb-ib": 16,
}


def _strategy(name: str, bucket_bytes: int, algorithm):
  from jaxcoll.scale.step_model import StepStrategy  # noqa: PLC0415
  from jaxcoll.train.kinds import STAGES_WITH_HYBRID  # noqa: PLC0415

  return StepStrategy(stage=STAGES_WITH_HYBRID[name], bucket_bytes=bucket_bytes,
                      algorithm=algorithm, hybrid=name == "hybrid")


_CLUSTER_FIELDS = ("GPUS_PER_NODE", "INTRA_LINKS", "INTRA_GBps", "INTER_LINKS", "INTER_Gbps",
                   "HBM_GBps")


def _machine(f):
  """The cluster to simulate: ``--cluster`` built from its links, else the ``--preset`` name."""
  if f.cluster is None:
    return f.preset
  from jaxcoll.comm_model.topology import Topology  # noqa: PLC0415

  example = "e.g. --cluster=4,4,25,2,200,1600"
  parts = [p.strip() for p in f.cluster.split(",")]
  if len(parts) not in (5, 6):
    raise ValueError(f"`--cluster`={f.cluster!r} needs 5 or 6 comma-separated numbers "
                     f"({','.join(_CLUSTER_FIELDS)}), {example}.")
  try:
    values = [float(p) for p in parts]
  except ValueError:
    raise ValueError(f"`--cluster`={f.cluster!r}: every field must be a number "
                     f"({','.join(_CLUSTER_FIELDS)}), {example}.") from None
  for name, value in zip(_CLUSTER_FIELDS, values):
    whole = name in ("GPUS_PER_NODE", "INTRA_LINKS", "INTER_LINKS")
    if values[0] == 1 and values[1] == values[2] == 0 and name in ("INTRA_LINKS", "INTRA_GBps"):
      continue  # nodes of one GPU: no links inside them (Topology.from_hardware)
    if values[3] == values[4] == 0 and name in ("INTER_LINKS", "INTER_Gbps"):
      continue  # one machine without NICs (a workstation): the sweep must stay inside it
    if not value > 0 or value == float("inf") or (whole and value != int(value)):
      kind = "a whole number >= 1" if whole else "a number > 0"
      raise ValueError(f"`--cluster` field {name} must be {kind}; got {value:g} "
                       f"({example}).")
  per_node, intra, intra_gbps, inter, inter_gbps = values[:5]
  hbm = values[5] * 1e9 if len(values) == 6 else float("inf")
  return Topology.from_hardware(
      nodes=1, gpus_per_node=int(per_node), intra_links=int(intra), intra_link_GBps=intra_gbps,
      inter_links=int(inter), inter_link_Gbps=inter_gbps, hbm_Bps=hbm,
      name=f"cluster {f.cluster}")


def _check_flags(f) -> None:
  from jaxcoll.comm_model.topology import PRESETS  # noqa: PLC0415

  if f.cluster is not None and f is FLAGS and FLAGS["preset"].present:
    raise ValueError(f"`--preset`={f.preset!r} and `--cluster`={f.cluster!r} name two clusters; "
                     "pass one of them.")
  machine = _machine(f)
  if f.preset not in PRESETS:
    raise ValueError(f"Unknown `--preset` {f.preset!r}; valid presets: {', '.join(PRESETS)}.")
  bad = [s for s in f.strategies if s not in _STRATEGIES]
  if bad or not f.strategies:
    raise ValueError(f"`--strategies` {bad or '(empty)'}; valid: {', '.join(_STRATEGIES)}.")
  bad = [w for w in f.workloads if w not in _SHIPPED + _PUBLISHED]
  if bad:
    raise ValueError(f"Unknown `--workloads` {bad}; valid: {', '.join(_PUBLISHED + _SHIPPED)} "
                     "(or empty).")
  if not f.compute_scale > 0:
    raise ValueError(f"`--compute_scale` must be > 0; got {f.compute_scale}.")
  if (f.params is None) != (f.flops_per_example is None):
    raise ValueError("Give `--params` and `--flops_per_example` together (e.g. --params=7e9 "
                     "--flops_per_example=8.6e13).")
  for name in ("params", "flops_per_example", "achieved_tflops", "device_memory_gb"):
    value = getattr(f, name)
    if value is not None and not value > 0:
      raise ValueError(f"`--{name}` must be > 0; got {value}.")
  for name in ("layers", "per_device_batch", "bucket_mb", "min_gpus", "max_gpus",
               "input_workers"):
    if getattr(f, name) is not None and getattr(f, name) < 1:
      raise ValueError(f"`--{name}` must be >= 1; got {getattr(f, name)}.")
  if f.min_gpus > f.max_gpus:
    raise ValueError(f"`--min_gpus` ({f.min_gpus}) must not exceed `--max_gpus` ({f.max_gpus}).")
  if f.cluster is not None:  # after the counts are known >= 1 (--min_gpus=0 doubled forever)
    per_node = machine.levels[-1].size
    if f.min_gpus > per_node and f.min_gpus % per_node:
      raise ValueError(f"`--min_gpus`={f.min_gpus} is not a whole number of the --cluster's "
                       f"nodes of {per_node} GPUs; use e.g. --min_gpus={per_node}.")
    # the sweep's last count: --min_gpus doubled while it stays within --max_gpus
    largest = f.min_gpus * 2 ** ((f.max_gpus // f.min_gpus).bit_length() - 1)
    if machine.node_link is None and largest > per_node:
      raise ValueError(
          f"`--cluster`={f.cluster!r} has no links between nodes (INTER_LINKS=0): it is one "
          f"machine of {per_node} GPUs, but the sweep reaches {largest}; use --min_gpus=1 "
          f"--max_gpus={per_node}, or give its NICs (INTER_LINKS,INTER_Gbps, e.g. 2,200).")
    # The sweep doubles --min_gpus: every count up to --max_gpus must fit the nodes too
    # (3 on nodes of 4 doubled to 6, which failed mid-run naming `num_devices`).
    n = f.min_gpus
    while n * 2 <= f.max_gpus:
      n *= 2
      if n > per_node and n % per_node:
        raise ValueError(
            f"`--min_gpus`={f.min_gpus} doubles to {n} GPUs, not a whole number of the "
            f"--cluster's nodes of {per_node} GPUs; use e.g. --min_gpus={per_node}, or "
            f"--max_gpus={n // 2}.")
  from jaxcoll.comm_model import cost  # noqa: PLC0415

  valid = [a for a in cost.modelled_algorithms("all_reduce")]
  if f.algorithm not in valid:
    raise ValueError(f"Unknown `--algorithm` {f.algorithm!r}; valid: {', '.join(valid)}.")
  # ZeRO's lines run reduce-scatter and all-gather: an all-reduce-only algorithm failed them
  # half-way with "Unknown all_gather `algorithm` 'tree'", a flag the user never gave.
  both = [a for a in valid if all(a in cost.modelled_algorithms(c)
                                  for c in ("reduce_scatter", "all_gather"))]
  zero = [s for s in f.strategies if s != "dp"]
  if f.algorithm not in both and zero:
    raise ValueError(
        f"`--algorithm`={f.algorithm} is all-reduce only, and `--strategies` {zero} run "
        f"reduce-scatter and all-gather (the default --strategies has them); pass "
        f"--strategies=dp, or an --algorithm of all three (valid choices: {', '.join(both)}).")
  if not 0 < f.threshold <= 1:
    raise ValueError(f"`--threshold` must be in (0, 1]; got {f.threshold}.")
  if f.interference is not None and not 0 <= f.interference <= 1:
    raise ValueError(f"`--interference` must be in [0, 1]; got {f.interference}.")
  # Flags that would change nothing were silently ignored (the table as without them).
  if f.compute_scale != 1.0 and not any(w in _PUBLISHED for w in f.workloads):
    raise ValueError(
        f"`--compute_scale`={f.compute_scale:g} scales the published workloads "
        f"({', '.join(_PUBLISHED)}), and `--workloads` has none of them; for --params' "
        "workload set its speed with --achieved_tflops (the shipped ones are measured here).")
  if f.params is None and f is FLAGS:
    given = [n for n in ("achieved_tflops", "layers") if FLAGS[n].present]
    if given:
      raise ValueError(
          f"`--{given[0]}`={getattr(f, given[0]):g} describes the --params workload, and no "
          "--params is given; add --params=... --flops_per_example=..., or drop it.")
  if not f.workloads and f.params is None and not f.validate:
    raise ValueError("Nothing to simulate: give `--workloads`, or `--params` and "
                     "`--flops_per_example`, or `--validate`.")
  if f.out is not None:
    _cli.writable_dir("out", f.out)


def _workloads(f) -> list:
  """(workload, per-device batch) pairs."""
  from jaxcoll.scale import published  # noqa: PLC0415
  from jaxcoll.scale.step_model import WorkloadSpec  # noqa: PLC0415

  out = []
  for name in f.workloads:
    if name in _PUBLISHED:
      w = published.DEFAULT_WORKLOADS[name]
      if f.compute_scale != 1.0:
        w = dataclasses.replace(w, seconds_per_example=w.seconds_per_example / f.compute_scale,
                                source=f"{w.source}, x{f.compute_scale:g} (--compute_scale)")
      out.append((w, f.per_device_batch or _DEFAULT_BATCH[name]))
    else:
      import jaxcoll  # noqa: PLC0415

      out.append((WorkloadSpec.from_model(jaxcoll.models.make_workload(name)),
                  f.per_device_batch or 32))
  if f.params is not None:
    out.append((WorkloadSpec.from_numbers(
        f"{f.params:.3g} params", num_params=f.params, flops_per_example=f.flops_per_example,
        achieved_flops=f.achieved_tflops * 1e12, layers=f.layers,
        source=f"given: {f.flops_per_example:.3g} FLOPs/example at {f.achieved_tflops:g} TFLOP/s",
    ), f.per_device_batch or 32))
  return out


def _band(bands, num_devices, machine) -> tuple[str | None, float | None]:
  """``(regime, held-out median error)`` of a prediction on ``num_devices`` of ``machine`` (a
  preset name or a Topology); ``(None, None)`` beyond the largest published device count (an
  extrapolation)."""
  from jaxcoll.comm_model.topology import Topology  # noqa: PLC0415
  from jaxcoll.scale import published  # noqa: PLC0415

  topo = (machine.resized(num_devices) if isinstance(machine, Topology)
          else Topology.cluster(machine, num_devices))
  name = published.regime(num_devices, topo.levels[-1].size)
  return name, None if name is None else bands[name].median_pp


def _table(workload, batch, rows, memory_limit, bands, *, machine) -> list[str]:
  lines = [
      "", f"== {workload.name} ({workload.num_params:,.0f} params; {batch} per GPU; "
          f"{workload.source}) ==",
      f"{'strategy':<18}{'GPUs':>7}{'step':>11}{'compute':>10}{'exposed':>10}{'optim':>9}"
      f"{'sync':>9}{'eff':>7}{'±held-out':>11}{'mem GB':>9}  fits?",
  ]
  for r in rows:
    s = r.step
    fits = "-" if memory_limit is None else ("yes" if s.memory_bytes <= memory_limit else "NO")
    lines.append(
        f"{r.strategy:<18}{r.num_devices:>7}{s.step_s * 1e3:>9.2f}ms{s.compute_s * 1e3:>8.2f}ms"
        f"{s.exposed_comm_s * 1e3:>8.2f}ms{s.optimizer_s * 1e3:>7.2f}ms{s.sync_s * 1e3:>7.2f}ms"
        f"{r.efficiency:>7.1%}{_shown_band(bands, r.num_devices, machine):>11}"
        f"{s.memory_bytes / 1e9:>9.3f}  {fits}"
        + (f"  host-bound (input {s.input_s * 1e3:.2f}ms)" if s.host_bound else "")
    )
  return lines


def _shown_band(bands, num_devices, machine) -> str:
  if num_devices == 1:
    return "-"  # the baseline itself: 100% by definition
  median = _band(bands, num_devices, machine)[1]
  return "extrap." if median is None else f"±{median:.1f} pts"


def _knees(workload, batch, f, counts, kappa) -> list[str]:
  from jaxcoll.collectives import Hierarchical  # noqa: PLC0415
  from jaxcoll.scale.step_model import StepStrategy, knee, scaling  # noqa: PLC0415

  bucket_bytes, algorithm = f.bucket_mb << 20, f.algorithm
  variants = {
      "DP": StepStrategy(bucket_bytes=bucket_bytes, algorithm=algorithm),
      "DP, 4x bigger buckets": StepStrategy(bucket_bytes=4 * bucket_bytes, algorithm=algorithm),
      "DP, hierarchical all-reduce": StepStrategy(bucket_bytes=bucket_bytes,
                                              algorithm=Hierarchical()),
      "DP, bf16 compression": StepStrategy(bucket_bytes=bucket_bytes, algorithm=algorithm,
                                       compression="bf16"),
      "DP, int8 compression": StepStrategy(bucket_bytes=bucket_bytes, algorithm=algorithm,
                                       compression="int8"),
      "ZeRO-3": StepStrategy(stage=3, bucket_bytes=bucket_bytes, algorithm=algorithm),
      "hybrid ZeRO-3 (shard in node)": StepStrategy(stage=3, bucket_bytes=bucket_bytes,
                                                algorithm=algorithm, hybrid=True),
  }
  from jaxcoll.comm_model import cost  # noqa: PLC0415

  # A ZeRO-3 line runs reduce-scatter and all-gather: an all-reduce algorithm they do not
  # have (tree, halving_doubling, ...) leaves those lines out (it failed a --strategies=dp run).
  zero3 = all(algorithm in cost.modelled_algorithms(c) for c in ("reduce_scatter", "all_gather"))
  variants = {k: v for k, v in variants.items() if zero3 or v.stage != 3}
  lines = [f"knee (first GPU count with efficiency < {f.threshold:.0%}) and what moves it:"]
  for label, strategy in variants.items():
    rows = scaling(workload, [strategy], _machine(f), counts, per_device_batch=batch,
                   interference=kappa, input_workers=f.input_workers)
    at = knee(rows, strategy.name, f.threshold)
    last = rows[-1]
    where = f"N={at}" if at else f"none up to {counts[-1]}"
    lines.append(f"  {label:<31} {where:<22} (efficiency at {last.num_devices}: "
                 f"{last.efficiency:.1%})")
  return lines


def _plot(results, path, preset, threshold) -> bool:
  try:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    return False
  fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
  for ax, (workload, rows) in zip(axes[0], results):
    for i, name in enumerate(dict.fromkeys(r.strategy for r in rows)):
      points = [r for r in rows if r.strategy == name]
      ax.plot([r.num_devices for r in points], [r.efficiency for r in points],
              marker="os^vD<>"[i % 7], markersize=4, label=name)
    ax.axhline(threshold, color="grey", linestyle=":", linewidth=1)
    ax.set(xscale="log", ylim=(0, 1.05), xlabel="GPUs", ylabel="scaling efficiency",
           title=workload.name)
    ax.legend(fontsize="small")
  fig.suptitle(f"Predicted weak-scaling efficiency on {preset}")
  fig.savefig(path, dpi=100, bbox_inches="tight")
  plt.close(fig)
  return True


def run(f=FLAGS) -> list[str]:
  """Runs what the flags describe; returns the printed lines."""
  _check_flags(f)
  from jaxcoll.scale import published  # noqa: PLC0415
  from jaxcoll.scale.step_model import DEFAULT_INTERFERENCE, scaling  # noqa: PLC0415

  kappa = DEFAULT_INTERFERENCE if f.interference is None else f.interference
  validated = published.validate()
  band = published.summary(validated)["held_out"]
  bands = published.held_out_bands(validated)
  lines = []
  if f.validate:
    lines += ["Published data-parallel scaling results vs the step model (its three parameters "
              "fitted on the 'Fitted rows' only):", published.validation_table(validated)]
  bucket_bytes = f.bucket_mb << 20
  counts = [f.min_gpus]
  while counts[-1] * 2 <= f.max_gpus:
    counts.append(counts[-1] * 2)
  strategies = [_strategy(s, bucket_bytes, f.algorithm) for s in f.strategies]
  machine = _machine(f)
  where = f.preset if f.cluster is None else machine.name
  memory_gb = f.device_memory_gb or (DEVICE_MEMORY_GB.get(f.preset) if f.cluster is None
                                     else None)
  limit = None if memory_gb is None else memory_gb * 1e9
  results = []
  workloads = _workloads(f)
  feed = ("not modelled" if f.input_workers is None
          else f"{f.input_workers} CPU loader workers per GPU")
  if workloads:
    lines.insert(0, f"jaxcoll step model on {where}: buckets {f.bucket_mb} MiB, "
                    f"{f.algorithm}, interference {kappa:g}; memory = model state (ZeRO paper "
                    f"formula), device {'?' if memory_gb is None else f'{memory_gb:g} GB'}; "
                    f"input: {feed}; "
                    f"±held-out: the model's median error on published rows it was not fitted "
                    f"to, where the prediction falls: "
                    + "; ".join(f"{name} ±{b.median_pp:.1f} pts ({b.within_5} of {b.rows} "
                                f"within 5)" for name, b in bands.items())
                    + f"; all {band.rows}: ±{band.median_pp:.1f} pts, max {band.max_pp:.0f}; "
                    f"'extrap.': beyond {published.MAX_PUBLISHED_DEVICES} GPUs, the largest "
                    f"published count (python -m experiments.simulate_training --validate)")
  for workload, batch in workloads:
    rows = scaling(workload, strategies, machine, counts, per_device_batch=batch,
                   interference=kappa, input_workers=f.input_workers)
    results.append((workload, rows))
    lines += _table(workload, batch, rows, limit, bands, machine=machine)
    lines += _knees(workload, batch, f, counts, kappa)
  if f.out:
    os.makedirs(f.out, exist_ok=True)
    with open(os.path.join(f.out, "table.txt"), "w") as fh:
      fh.write("\n".join(lines) + "\n")
    record = {
        "preset": f.preset if f.cluster is None else None,
        "cluster": f.cluster, "interference": kappa, "input_workers": f.input_workers,
        "held_out_error_pp": {"median": band.median_pp, "max": band.max_pp,
                              "within_5": band.within_5, "rows": band.rows},
        "held_out_error_pp_by_regime": {
            name: {"median": b.median_pp, "max": b.max_pp, "within_5": b.within_5,
                   "rows": b.rows} for name, b in bands.items()},
        "max_published_devices": published.MAX_PUBLISHED_DEVICES,
        "workloads": [
            {"name": w.name, "num_params": w.num_params, "per_device_batch": batch,
             "seconds_per_example": w.seconds_per_example, "source": w.source,
             "rows": [{**dataclasses.asdict(r.step), "efficiency": r.efficiency,
                       **dict(zip(("held_out_regime", "held_out_median_pp"),
                                  _band(bands, r.num_devices, machine)))}
                      for r in rows]}
            for (w, rows), (_, batch) in zip(results, workloads)
        ],
    }
    with open(os.path.join(f.out, "simulate_training.json"), "w") as fh:
      json.dump(record, fh, indent=1)
    written = ["table.txt", "simulate_training.json"]
    if results and _plot(results, os.path.join(f.out, "efficiency.png"), where, f.threshold):
      written.append("efficiency.png")
    lines.append(f"wrote {f.out}: {', '.join(written)}")
  return lines


# -------------------------------------------------------------- cpu-sim calibration

_CALIBRATION_MODELS = {"mlp": {"widths": (512, 512)}, "transformer": {}}
_BATCH, _DEVICES = 256, 8  # bench_trainer's defaults: global batch 256 on 8 devices
_ROUNDS = 15  # the machine is shared: every figure is a median over interleaved rounds


def _calibration_items(model: str, overrides: dict) -> tuple[dict, dict]:
  """Callables that run one step of each measured thing, and the model's sizes."""
  import concurrent.futures  # noqa: PLC0415

  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  import optax  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  import jaxcoll  # noqa: PLC0415
  from jaxcoll.train import baselines  # noqa: PLC0415

  per_device = _BATCH // _DEVICES
  w = jaxcoll.models.make_workload(model, **overrides)
  params = w.init_params(0)
  pool = concurrent.futures.ThreadPoolExecutor(_DEVICES)
  strategies = {"DP (native)": lambda: jaxcoll.DataParallel(algorithm="native"),
                "ZeRO-3": lambda: jaxcoll.ZeRO(stage=3, algorithm="native")}

  def stepper(trainer, mesh, batch_size, seed):
    state = {"s": trainer.init(params)}
    batch = baselines.data_sharded([w.make_batch(seed, batch_size)], mesh, "data")[0]

    def step():
      state["s"], metrics = trainer.step(state["s"], batch)
      jax.block_until_ready((state["s"], metrics))

    return step

  items = {}
  mesh8 = jaxcoll.devices.flat_mesh(_DEVICES)
  for name, make in strategies.items():
    # bench_trainer's measurement: the trainer on 8 devices, global batch 256
    trainer = jaxcoll.Trainer(w.loss_fn, optax.adam(1e-3), mesh8, make(), has_aux=True)
    items[f"bench {name}"] = stepper(trainer, mesh8, _BATCH, 0)
    # The same strategy with no communication: 8 one-device steps at once, on
    # one emulated device (measured: as contended as 8 devices, which share
    # the same cores; and one compile instead of 8). Each step blocks itself,
    # so the trainer's in-flight bound is not needed across threads.
    mesh1 = jaxcoll.devices.flat_mesh(1)
    t1 = jaxcoll.Trainer(w.loss_fn, optax.adam(1e-3), mesh1, make(), has_aux=True,
                         max_steps_in_flight=1 << 30)
    ones = [stepper(t1, mesh1, per_device, i) for i in range(_DEVICES)]

    def concurrent_steps(ones=ones):
      for future in [pool.submit(step) for step in ones]:
        future.result()

    items[f"no_comm {name}"] = concurrent_steps

  # The gradient alone (forward + backward, no optimizer), 8 at once: under
  # ZeRO the rest of a one-device step (optimizer, layout) is per shard.
  grad = jax.jit(jax.grad(lambda p, b: w.loss_fn(p, b)[0]))
  local = [jax.device_put(w.make_batch(i, per_device)) for i in range(_DEVICES)]

  def grad_steps():
    for future in [pool.submit(lambda b=b: jax.block_until_ready(grad(params, b)))
                   for b in local]:
      future.result()

  items["no_comm gradient only"] = grad_steps
  grad_bytes = 4 * sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(params))

  def all_reduce(x):
    return jaxcoll.all_reduce(x, "data", algorithm="native")

  f = jax.jit(jax.shard_map(all_reduce, mesh=mesh8, in_specs=P("data"), out_specs=P("data")))
  for label, nbytes in (("all_reduce_tiny", 1024), ("all_reduce_grad", grad_bytes)):
    x = jnp.ones((_DEVICES * max(nbytes // 4, 1),), jnp.float32)
    items[label] = lambda f=f, x=x: jax.block_until_ready(f(x))
  return items, {"num_params": w.num_params, "grad_bytes": grad_bytes}


def record_cpu_calibration(path: str) -> list[str]:
  """Measures what tests/scale/test_step_model.py checks the model against; writes ``path``.

  Per model (the MLP (512, 512) and the transformer), interleaved round by
  round so that every figure sees the same mix of load (the machine is
  shared; one figure alone varies 2-3x), median seconds of:

  * ``bench``: bench_trainer's measurement (the same Trainer, mesh, batch and
    optimizer: DP native and ZeRO-3 on 8 devices, global batch 256): what the
    model must predict;
  * ``no_comm``: the same strategy's one-device step (batch 32), 8 of them
    at once: the devices' compute, optimizer and the strategy's own work,
    contended as on the 8-device mesh, without communication;
  * ``no_comm gradient only``: ``jax.grad`` of the loss alone, 8 at once
    (under ZeRO, the rest of the one-device step is per shard: 1/8 of it);
  * native all-reduces of 1 KiB and of the gradient on 8 devices: cpu-sim's
    launch cost and bandwidth (:func:`jaxcoll.step_model.fit_native_level`).
  """
  import datetime  # noqa: PLC0415
  import statistics  # noqa: PLC0415
  import time  # noqa: PLC0415

  record = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": f"python -m experiments.simulate_training --record_cpu_calibration={path}",
            "devices": _DEVICES, "global_batch": _BATCH, "rounds": _ROUNDS, "models": {}}
  for model, overrides in _CALIBRATION_MODELS.items():
    items, sizes = _calibration_items(model, overrides)
    for run in items.values():  # compile and warm up
      for _ in range(3):
        run()
    times = {k: [] for k in items}
    for _ in range(_ROUNDS):
      for label, run in items.items():
        for _ in range(2):
          start = time.perf_counter()
          run()
          times[label].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    record["models"][model] = {
        "overrides": {k: list(v) for k, v in overrides.items()},
        **sizes,
        "bench_trainer_median_s": {k[6:]: v for k, v in med.items() if k.startswith("bench ")},
        "no_comm_step_s": {k[8:]: v for k, v in med.items() if k.startswith("no_comm ")},
        "all_reduce_tiny_s": med["all_reduce_tiny"],
        "all_reduce_grad_s": med["all_reduce_grad"],
    }
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as fh:
    json.dump(record, fh, indent=1)
  return [json.dumps(record, indent=1), f"wrote {path}"]


def main(argv: list[str]) -> None:
  os.environ.setdefault("JAXCOLL_CPU_DEVICES", str(_DEVICES))
  try:
    if len(argv) > 1:
      raise ValueError(f"Unexpected arguments {argv[1:]}; every option is a --flag.")
    if FLAGS.record_cpu_calibration:
      _cli.writable_file("record_cpu_calibration", FLAGS.record_cpu_calibration,
                         "cpu_sim_calibration.json")
      lines = record_cpu_calibration(FLAGS.record_cpu_calibration)
    else:
      lines = run()
  except (ValueError, TypeError) as e:
    _cli.fail(_PROG, str(e))
  print("\n".join(lines))


if __name__ == "__main__":
  app.run(main, flags_parser=_cli.flags_parser(_PROG))
