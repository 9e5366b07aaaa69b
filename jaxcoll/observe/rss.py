"""The process's resident memory (RSS), phase by phase, beside XLA's figures.

Linux only (``/proc/self/status``): ``VmRSS`` is the resident set now,
``VmHWM`` its high-water mark, which writing ``5`` to ``/proc/self/clear_refs``
resets to the current RSS, so each phase's peak is measured on its own.
Elsewhere every figure is None.

XLA's ``memory_analysis()`` counts the buffers of one compiled program on one
device. On the CPU backend the emulated devices share the process's memory,
so the step's share of RSS is at most its per-device peak times the local
devices; :func:`attribution` says what the rest of the peak RSS is.

Example:
  >>> phases = PhasePeaks()
  >>> phases.start("init")
  >>> phases.start("train")
  >>> sorted(phases.peaks()) == ["init", "train"] or not available()
  True
"""

from __future__ import annotations

import os

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def available() -> bool:
  """Whether ``/proc/self/status`` can be read (Linux)."""
  return os.path.exists(_STATUS)


def _status(field: str) -> int | None:
  try:
    with open(_STATUS) as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1]) * 1024  # kB
  except OSError:
    return None
  return None


def current_bytes() -> int | None:
  """The resident set now (``VmRSS``), bytes."""
  return _status("VmRSS")


def peak_bytes() -> int | None:
  """The resident set's high-water mark since the last :func:`reset_peak` (``VmHWM``)."""
  return _status("VmHWM")


def reset_peak() -> bool:
  """Resets ``VmHWM`` to the current RSS; False where the kernel does not allow it."""
  try:
    with open(_CLEAR_REFS, "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


class PhasePeaks:
  """Peak RSS of consecutive phases: :meth:`start` ends the previous phase (reading
  its peak) and resets the high-water mark for the next one."""

  def __init__(self):
    self.baseline = current_bytes()  # before the first phase: Python, imports, JAX runtime
    self._before = peak_bytes()
    self._peaks: dict[str, int] = {}
    self._current: str | None = None
    self.resettable = True

  def start(self, name: str) -> None:
    self._close()
    self.resettable = reset_peak() and self.resettable
    self._current = name

  def _close(self) -> None:
    if self._current is not None:
      peak = peak_bytes()
      if peak is not None:
        self._peaks[self._current] = max(peak, self._peaks.get(self._current, 0))
      self._current = None

  def peaks(self) -> dict[str, int]:
    """Each phase's peak RSS so far (the open phase's up to now), bytes."""
    current = self._current
    self._close()
    peaks = dict(self._peaks)
    if current is not None:  # keep measuring it (no reset: the mark stays)
      self._current = current
    return peaks

  def figures(self, xla_peak_per_device: int | None, local_devices: int,
              state_bytes_per_device: int | None = None) -> dict:
    """summary.json's memory figures: peak RSS, per phase, XLA's peak x local devices,
    and :func:`attribution`'s line. Empty where RSS cannot be read."""
    peaks = self.peaks()
    if self.baseline is None or not peaks:
      return {}
    overall = max([*peaks.values(), self._before or 0])
    phase = max(peaks, key=peaks.get)
    xla = None if xla_peak_per_device is None else int(xla_peak_per_device) * local_devices
    out = {
        "rss_peak_bytes": overall,
        "rss_baseline_bytes": self.baseline,
        **{f"rss_{name}_peak_bytes": v for name, v in peaks.items()},
        "xla_peak_bytes_x_local_devices": xla,
        "memory_note": attribution(overall, phase, self.baseline, xla_peak_per_device,
                                   local_devices, state_bytes_per_device,
                                   exact_phases=self.resettable),
    }
    return out


def attribution(rss_peak: int, phase: str, baseline: int, xla_peak_per_device: int | None,
                local_devices: int, state_bytes_per_device: int | None = None, *,
                exact_phases: bool = True) -> str:
  """One line: what the process's peak RSS is made of, as far as it can be told."""
  gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
  parts = [f"peak RSS {gb(rss_peak)} (in {phase}"
           + ("" if exact_phases else "; VmHWM could not be reset, phases overlap") + ")",
           f"{gb(baseline)} before init (Python, imports, JAX runtime)"]
  rest = rss_peak - baseline
  if xla_peak_per_device is not None:
    xla = xla_peak_per_device * local_devices
    state = ""
    if state_bytes_per_device is not None:
      state = f", of which model state {gb(state_bytes_per_device * local_devices)}"
    parts.append(f"{gb(xla)} XLA step peak ({xla_peak_per_device / 1e6:.1f} MB/device x "
                 f"{local_devices} local devices{state})")
    rest -= xla
  if rest >= 0:
    parts.append(f"{gb(rest)} other: host copies (numpy batches, eval rows, checkpoint and "
                 "digest buffers), compiled programs, buffers of other programs in flight "
                 "and allocator memory not returned to the OS")
  else:
    parts.append(f"{gb(-rest)} less than that sum: XLA's peak buffers are not all resident "
                 "at once (untouched pages, donated state reused in place)")
  return parts[0] + " = " + " + ".join(parts[1:])
