"""The head start (issue 37 item 9): a short spin on the device, enqueued on the current stream after a
synchronise and before a timed call's clock starts, so that the call's first launches are queued while
the device spins and the clock starts on device work, not on the host's dispatch. Both sides alike: the
candidate's worker before each forward's pre marker copy (``candidate_main.CandidateRuntime.forward``,
the device clock's start), the checker before the start event of its in-process CUDA-event timing
(``timing.time_calls``: the baseline, the calibration's reference in process).

Why: on an idle device a CUDA event (or a marker copy) recorded before the call times the host's path to
the call's first launch as well: 36 us of the worker's (Python, the module call, the extension's
dispatch, CUPTI's callbacks) on a 0.094 ms ReLU on the H200, 20-30 us more than aten's relu there
(docs/performance.md, "H200, issue 37 item 9, session 21"): a fifth of the call, charged to the candidate.

Cost (the allowance it grants, both sides alike): host work of at most the head start before a call's
first launch is not counted (KernelBench's events count it); work after that launch, and any work on the
device, still is. And ``HEAD_START_US`` of device time per spanned forward (every request of a worker
with device records: trials, timed calls, calibration and null round trips alike, so the host clock
subtracts it too), per timed call of the checker's baseline.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch

# The spin's length: over the worker's 36 us path to a ReLU's launch on the H200 with room for a loaded
# host, and well under the device clock's floor allowance (0.4-0.8 ms a call there, ``timing``), which
# bounds what a forged span gains anyway.
HEAD_START_US = 100.0
# Cycles of the one-off calibration's timed spin (~1 ms at 2 GHz): long against the events' resolution.
CALIBRATION_CYCLES = 1 << 21


@dataclasses.dataclass(frozen=True)
class HeadStart:
  """A calibrated spin (``cycles`` of the device's clock for about ``us``), or none (``cycles`` 0, ``why``
  says why). Calling it enqueues the spin on the current stream."""

  cycles: int = 0
  us: float = 0.0
  why: str = ""
  sleep: Callable[[int], None] | None = dataclasses.field(default=None, compare=False, repr=False)

  def __call__(self) -> None:
    if self.cycles and self.sleep is not None:
      self.sleep(self.cycles)


NONE = HeadStart(why="no head start asked for")


def cycles_for(us: float, cycles: int, elapsed_ms: float) -> int:
  """The spin's cycles for ``us`` microseconds, from a spin of ``cycles`` that took ``elapsed_ms``."""
  if not (elapsed_ms > 0 and cycles > 0 and us > 0):
    raise ValueError(f"head start: cannot scale {cycles} cycles in {elapsed_ms} ms to {us} us")
  return max(1, round(us * cycles / (elapsed_ms * 1e3)))


def calibrate(us: float = HEAD_START_US) -> HeadStart:
  """A head start of about ``us`` on the current CUDA device: ``torch.cuda._sleep`` (ATen's
  ``spin_kernel``, counting ``clock64`` cycles) timed once by CUDA events, queued behind a first spin so
  the timed one starts on a busy device (a few ms, once per process). None (with why) without CUDA,
  without ``_sleep``, or where it fails."""
  sleep = getattr(torch.cuda, "_sleep", None)
  if sleep is None:
    return HeadStart(why="torch.cuda._sleep is unavailable in this torch")
  if not torch.cuda.is_available():
    return HeadStart(why="no CUDA device")
  try:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sleep(1)  # loads the kernel's module (lazy loading), outside the timed part
    torch.cuda.synchronize()
    sleep(CALIBRATION_CYCLES // 8)
    start.record()
    sleep(CALIBRATION_CYCLES)
    end.record()
    end.synchronize()
    return HeadStart(cycles_for(us, CALIBRATION_CYCLES, start.elapsed_time(end)), us, "", sleep)
  except Exception as e:  # noqa: BLE001 - timed without a head start instead, and the report says so
    return HeadStart(why=f"calibrating torch.cuda._sleep failed: {type(e).__name__}: {e}"[:300])


@functools.cache
def calibrated() -> HeadStart:
  """This process's head start, calibrated on first use."""
  return calibrate()
