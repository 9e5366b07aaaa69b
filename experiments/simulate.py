r"""Predicts collective times on clusters far larger than the one at hand.

    python -m experiments.simulate --preset=dgx-h100
    python -m experiments.simulate --preset=dgx-h100 --collective=all \
        --min_gpus=8 --max_gpus=1024 --in_network_reduction --out=/tmp/sim

Prints, for every GPU count (powers of two) and size (x4 steps), the time and
bus bandwidth that jaxcoll.cost predicts for every algorithm, then a summary:
how ring and log-step algorithms scale, where hierarchical wins across nodes,
the crossover sizes between algorithms, and what in-network reduction buys.
With --out, writes table.txt, simulate.json and PNG plots (if matplotlib is
installed). The model and its sources: jaxcoll/comm_model/cost.py, jaxcoll/comm_model/topology.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

from absl import app, flags

from experiments import _cli
from jaxcoll.comm_model import cost
from jaxcoll.collectives import COLLECTIVES
from jaxcoll.sizes import format_bytes, parse_size
from jaxcoll.comm_model.topology import PRESETS, Topology

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "dgx-h100", f"Machine preset: {', '.join(PRESETS)}.")
flags.DEFINE_string(
    "collective", "all_reduce", f"One of {', '.join(COLLECTIVES)}, or 'all'."
)
flags.DEFINE_integer("min_gpus", 8, "Smallest device count (then doubled).")
flags.DEFINE_integer("max_gpus", 16384, "Largest device count.")
flags.DEFINE_string("min_bytes", "1K", "Smallest size (K/M/G suffixes, powers of 1024).")
flags.DEFINE_string("max_bytes", "4G", "Largest size (sizes grow x4).")
flags.DEFINE_string("out", None, "Directory for table.txt, simulate.json and plots.")
flags.DEFINE_bool(
    "in_network_reduction", False, "Turn on NVLS / SHARP where the preset's hardware has it."
)

def human_time(t: float) -> str:
  for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
    if t >= scale:
      return f"{t / scale:.3g}{unit}"
  return f"{t * 1e9:.3g}ns"


def _grid(lo: int, hi: int, factor: int, what: str) -> list[int]:
  if lo > hi:
    raise ValueError(f"`--min_{what}` ({lo}) must not exceed `--max_{what}` ({hi}).")
  out = [lo]
  while out[-1] * factor <= hi:
    out.append(out[-1] * factor)
  return out


# ------------------------------------------------------------------ report


def _table(rows: list[cost.SimRow], topologies: dict[int, Topology]) -> list[str]:
  lines = []
  for (collective, n), group in _group_by(rows, lambda r: (r.collective, r.num_devices)):
    names = list(dict.fromkeys(r.algorithm for r in group))
    width = max(19, max(len(a) for a in names) + 1)
    lines += ["", f"== {collective} on {topologies[n]}  (time, busbw GB/s) =="]
    lines.append(f"{'size':>9}" + "".join(f"{a:>{width}}" for a in names) + "   best")
    for size, cells in _group_by(group, lambda r: r.nbytes):
      text = "".join(
          f"{human_time(r.time_s) + ' ' + format(r.busbw_Bps / 1e9, '.1f'):>{width}}"
          for r in cells
      )
      best = next(r.algorithm for r in cells if r.best)
      lines.append(f"{format_bytes(size):>9}{text}   {best}")
  return lines


def _group_by(items, key):
  groups: dict = {}
  for item in items:
    groups.setdefault(key(item), []).append(item)
  return list(groups.items())


def _summary(
    collective: str, preset: str, counts: list[int], sizes: list[int], inr: bool
) -> list[str]:
  topos = {n: Topology.cluster(preset, n, in_network_reduction=inr) for n in counts}
  algos = cost.modelled_algorithms(collective)
  big, out = sizes[-1], ["", f"## Summary: {collective} on {preset}"]

  def busbw(n: int, size: int, algo: str, topo: Topology | None = None) -> float:
    t = cost.estimate(collective, size, topo or topos[n], algo)
    return size / t * cost.bus_bandwidth_factor(collective, n) / 1e9

  def latency(n: int, algo: str) -> float:
    return cost.estimate(collective, 0, topos[n], algo)

  if "ring" in algos:
    out.append(
        f"ring: busbw at {format_bytes(big)} stays at the slowest link's bandwidth while "
        "the latency term is small; latency (0 bytes) grows linearly with N:"
    )
    for n in counts:
      lat = latency(n, "ring")
      out.append(
          f"  N={n:>6}  busbw {busbw(n, big, 'ring'):7.1f} GB/s   latency "
          f"{human_time(lat):>8}  = {lat / (n - 1) * 1e6:6.2f} us x (N-1)"
      )
  logs = [a for a in ("tree", "halving_doubling", "recursive_doubling", "recursive_halving",
                      "binomial_tree") if a in algos]
  if logs:
    out.append("log-step algorithms: latency (0 bytes) grows with log2 N:")
    for n in counts:
      cells = "  ".join(
          f"{a} {human_time(latency(n, a)):>8} ({latency(n, a) / math.log2(n) * 1e6:5.1f} us"
          " x log2 N)" for a in logs
      )
      out.append(f"  N={n:>6}  {cells}")
  multi = [n for n in counts if len(topos[n].levels) > 1]
  if "hierarchical" in algos and multi:
    flat = [a for a in algos if a not in ("native", "hierarchical")]
    out.append("hierarchical across nodes (vs the best flat ppermute algorithm, and native):")
    for n in multi:
      cands = flat + ["hierarchical"]
      found = cost.crossovers(collective, topos[n], sizes[0], big, candidates=cands)
      wins = [c.nbytes for c in found if c.above == "hierarchical"]
      if cost.choose(collective, sizes[0], topos[n], candidates=cands) == "hierarchical":
        wins.insert(0, sizes[0])
      where = (
          f"beats them from {format_bytes(wins[0])}" if wins else "never wins in this size range"
      )
      best_flat = cost.choose(collective, big, topos[n], candidates=flat)
      out.append(
          f"  N={n:>6}: {where}; at {format_bytes(big)} {busbw(n, big, 'hierarchical'):.1f} "
          f"GB/s vs {best_flat} {busbw(n, big, best_flat):.1f}, native "
          f"{busbw(n, big, 'native'):.1f}"
      )
  out.append("crossovers (size where the best algorithm changes; all / ppermute only):")
  ppermute = [a for a in algos if a != "native"]
  for n in counts:
    one_level = len(topos[n].levels) < 2
    flat_only = [a for a in ppermute if not (one_level and a == "hierarchical")]
    for label, cands in (("all", None), ("ppermute", flat_only)):
      found = cost.crossovers(collective, topos[n], sizes[0], big, candidates=cands)
      first = cost.choose(collective, sizes[0], topos[n], candidates=cands)
      steps = " -> ".join(
          [first] + [f"{c.above} @ {format_bytes(c.nbytes)}" for c in found]
      )
      out.append(f"  N={n:>6} {label:>8}: {steps}")
  if collective in ("all_reduce", "reduce_scatter", "reduce"):
    out.append(f"in-network reduction (native, {format_bytes(big)}):")
    for n in sorted({counts[0], counts[-1]} | set(multi[:1])):
      off = Topology.cluster(preset, n, in_network_reduction=False)
      on = Topology.cluster(preset, n, in_network_reduction=True)
      levels = [lv.name for lv in on.levels if lv.in_network_reduction] or ["none"]
      b_off, b_on = busbw(n, big, "native", off), busbw(n, big, "native", on)
      out.append(
          f"  N={n:>6}: off {b_off:7.1f} GB/s, on {b_on:7.1f} GB/s "
          f"(x{b_on / b_off:.2f}; levels reducing in network: {', '.join(levels)})"
      )
  return out


def _plots(rows: list[cost.SimRow], out_dir: str, preset: str) -> list[str]:
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return []
  written = []
  names = list(dict.fromkeys(r.algorithm for r in rows))
  # Fixed colour and marker per algorithm; ring and bidirectional_ring often overlap.
  style = {
      a: dict(color=f"C{i % 10}", marker="os^vD<>p*h"[i % 10], markersize=4,
              linestyle="-" if i % 2 == 0 else "--", label=a)
      for i, a in enumerate(names)
  }
  for collective, group in _group_by(rows, lambda r: r.collective):
    counts = sorted({r.num_devices for r in group})
    picks = sorted({counts[round(i * (len(counts) - 1) / 3)] for i in range(4)})
    fig, axes = plt.subplots(1, len(picks), figsize=(5 * len(picks), 4), squeeze=False)
    for ax, n in zip(axes[0], picks):
      at_n = [r for r in group if r.num_devices == n]
      for algo, points in _group_by(at_n, lambda r: r.algorithm):
        ax.plot([r.nbytes for r in points], [r.busbw_Bps / 1e9 for r in points], **style[algo])
      ax.set(xscale="log", xlabel="size (bytes)", ylabel="busbw (GB/s)", title=f"N={n}")
    _legend(fig, axes[0])
    fig.suptitle(f"{collective} on {preset}: predicted bus bandwidth")
    path = os.path.join(out_dir, f"busbw_{collective}.png")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    written.append(path)

    sizes = sorted({r.nbytes for r in group})
    size = min(sizes, key=lambda s: abs(math.log2(s) - 26))  # closest to 64 MiB
    fig, ax = plt.subplots(figsize=(6, 4))
    for algo, points in _group_by([r for r in group if r.nbytes == size], lambda r: r.algorithm):
      ax.plot([r.num_devices for r in points], [r.time_s for r in points], **style[algo])
    ax.set(xscale="log", yscale="log", xlabel="devices", ylabel="time (s)",
           title=f"{collective} of {format_bytes(size)} on {preset}")
    ax.legend(fontsize="small")
    path = os.path.join(out_dir, f"time_vs_n_{collective}.png")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    written.append(path)
  return written


def _legend(fig, axes) -> None:
  """One legend for all panels (some algorithms only appear across nodes)."""
  seen = {}
  for ax in axes:
    for handle, label in zip(*ax.get_legend_handles_labels()):
      seen.setdefault(label, handle)
  fig.legend(seen.values(), seen.keys(), loc="upper center", ncol=len(seen),
             bbox_to_anchor=(0.5, 0.0), fontsize="small")


# ------------------------------------------------------------------ main


def run(argv_flags=FLAGS) -> list[str]:
  """Runs the simulation described by the flags; returns the printed lines."""
  preset = argv_flags.preset
  if preset not in PRESETS:
    raise ValueError(f"Unknown `--preset` {preset!r}; valid presets: {', '.join(PRESETS)}.")
  if argv_flags.collective == "all":
    collectives = list(COLLECTIVES)
  elif argv_flags.collective in COLLECTIVES:
    collectives = [argv_flags.collective]
  else:
    raise ValueError(
        f"Unknown `--collective` {argv_flags.collective!r}; valid: "
        f"{', '.join(COLLECTIVES)}, all."
    )
  if argv_flags.min_gpus < 2:
    raise ValueError(f"`--min_gpus` must be >= 2; got {argv_flags.min_gpus}.")
  counts = _grid(argv_flags.min_gpus, argv_flags.max_gpus, 2, "gpus")
  sizes = _grid(
      parse_size(argv_flags.min_bytes, "--min_bytes"),
      parse_size(argv_flags.max_bytes, "--max_bytes"),
      4,
      "bytes",
  )
  inr = argv_flags.in_network_reduction
  per_node = Topology.preset(preset).levels[-1].size
  for n in counts:  # the sweep doubles --min_gpus: each count must be whole nodes or a part of one
    if n > per_node and n % per_node:  # (it was an error naming `num_devices`, not a flag)
      what = (f"`--min_gpus`={n} is" if n == counts[0] else
              f"`--min_gpus`={counts[0]} doubles to {n} GPUs,")
      fix = "" if n == counts[0] else f", or --max_gpus={n // 2}"
      raise ValueError(f"{what} not a whole number of {preset} nodes of {per_node} GPUs; use "
                       f"e.g. --min_gpus={per_node}{fix}.")
  if argv_flags.out is not None:  # before simulating: an --out not writable lost the tables
    _cli.writable_dir("out", argv_flags.out)
  topologies = {n: Topology.cluster(preset, n, in_network_reduction=inr) for n in counts}
  rows = cost.simulate(
      preset, collectives=collectives, device_counts=counts, sizes=sizes,
      in_network_reduction=inr,
  )
  head = topologies[counts[-1]]
  lines = [
      f"jaxcoll cost model: {preset}, in-network reduction {'on' if inr else 'off'}",
      "levels (outer to inner): " + "; ".join(
          f"{lv.name}: alpha {lv.latency_s * 1e6:g} us, {lv.bandwidth_Bps / 1e9:g} GB/s, "
          f"reduce {lv.reduce_Bps / 1e9:g} GB/s" for lv in head.levels
      ) + f"; launch {head.launch_s * 1e6:g} us per operation",
  ]
  lines += _table(rows, topologies)
  summary = []
  for collective in collectives:
    summary += _summary(collective, preset, counts, sizes, inr)
  lines += summary
  if argv_flags.out:
    os.makedirs(argv_flags.out, exist_ok=True)
    with open(os.path.join(argv_flags.out, "table.txt"), "w") as f:
      f.write("\n".join(lines) + "\n")
    record = {
        "preset": preset,
        "in_network_reduction": inr,
        "collectives": collectives,
        "device_counts": counts,
        "sizes": sizes,
        "topologies": {str(n): t.to_dict() for n, t in topologies.items()},
        "rows": [dataclasses.asdict(r) for r in rows],
        "summary": summary,
    }
    with open(os.path.join(argv_flags.out, "simulate.json"), "w") as f:
      json.dump(record, f, indent=1)
    plots = _plots(rows, argv_flags.out, preset)
    lines.append(f"wrote {argv_flags.out}: table.txt, simulate.json" +
                 "".join(f", {os.path.basename(p)}" for p in plots))
  return lines


def main(argv: list[str]) -> None:
  try:
    if len(argv) > 1:
      raise ValueError(f"Unexpected arguments {argv[1:]}; every option is a --flag.")
    lines = run()
  except ValueError as e:
    _cli.fail("simulate", str(e))
  print("\n".join(lines))


if __name__ == "__main__":
  app.run(main, flags_parser=_cli.flags_parser("simulate"))
