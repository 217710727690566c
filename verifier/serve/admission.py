"""Memory-aware admission to a shared GPU: how many of its slots a run of a given reference holds.

The first run of a reference reports the checker's GPU peak over the job (reference instances, the trial
being judged, trial 0 kept, input clones); the candidate's process holds about one more copy of the
inputs and outputs, so a run needs about ``CHECKER_PEAK_FACTOR`` times that peak plus a CUDA context
per process. Runs of the same reference that arrive meanwhile wait for that first run; later ones hold
slots in proportion (``admission_units``). A larger peak seen later (an OOM retry) raises the estimate.
"""

from __future__ import annotations

import asyncio
import math

GiB = 1 << 30
CHECKER_PEAK_FACTOR = 2.0


def admission_units(
  ref_peak_bytes: int,
  gpu_total_bytes: int,
  slots: int,
  factor: float = 3.0,
  overhead_bytes: int = 1 << 30,
) -> int:
  """GPU slots a run of this reference should hold: a run keeps the reference's inputs, outputs and model,
  the candidate's own and input clones alive at once, so it needs about ``factor`` times the reference's
  peak plus a CUDA context; a slot is 1/``slots`` of the device memory."""
  if ref_peak_bytes <= 0 or gpu_total_bytes <= 0 or slots <= 1:
    return 1
  need = factor * ref_peak_bytes + overhead_bytes
  return max(1, min(slots, math.ceil(need / (gpu_total_bytes / slots))))


class MemoryAdmission:
  """Slot units per (reference, device), learned from the first run's peak."""

  def __init__(self):
    self.known: dict[str, asyncio.Future] = {}

  async def units(self, key: str) -> tuple[int, bool]:
    """(units to hold, whether this caller is the one that measures)."""
    probe = self.known.get(key)
    if probe is None:
      self.known[key] = asyncio.get_running_loop().create_future()
      return 1, True
    await asyncio.shield(probe)
    return probe.result(), False

  def learned(self, key: str, peak_bytes: int, total_bytes: int, slots: int) -> None:
    """A run's measured peak. The measuring run's result settles the waiters (without a peak, the next
    run measures again); a later, larger one raises the estimate."""
    probe = self.known.get(key)
    units = (
      admission_units(peak_bytes, total_bytes, slots, factor=CHECKER_PEAK_FACTOR)
      if peak_bytes
      else 0
    )
    if probe is None or probe.done():
      if units and (probe is None or units > probe.result()):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(units)
        self.known[key] = fut
      return
    if not units:
      del self.known[key]
      units = 1
    probe.set_result(units)
