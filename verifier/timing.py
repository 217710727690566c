"""Timing of a model's forward.

GPU: CUDA events around each call, with ``torch.cuda.synchronize()`` (all streams of the device) before
the end event is recorded, so work hidden on other streams is counted; a 256 MB write flushes L2 before
every call (KernelBench main's ``clear_l2_cache``); warm-up calls first (timed too, so the checker can
account for all of the wall time it saw); fresh input clones each call (defeats caches keyed on
``data_ptr``; reference doc section 2.6). CPU: ``perf_counter`` with a 64 MB write to flush caches.

A candidate is timed in its own process; the checker, which never runs candidate code, bounds what it
reports with the wall time it measures from outside (``plausible``).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from verifier.contract import Runtime
from verifier.correctness import clone_args

L2_FLUSH_BYTES = {"cuda": 256 << 20, "cpu": 64 << 20}
# A real kernel launch takes a few microseconds; a claimed call below this is not a measurement.
MIN_CALL_MS = 1e-3


@dataclasses.dataclass(frozen=True)
class TimedCalls:
  warmup_ms: tuple[float, ...]
  trial_ms: tuple[float, ...]

  @property
  def runtime(self) -> Runtime:
    return summarize(self.trial_ms)


def summarize(trial_ms) -> Runtime:
  return Runtime(
    median_ms=float(statistics.median(trial_ms)),
    mean_ms=float(statistics.fmean(trial_ms)),
    num_trials=len(trial_ms),
  )


def time_calls(model, inputs: list, device: torch.device, trials: int, warmup: int) -> TimedCalls:
  flush = torch.empty(L2_FLUSH_BYTES[device.type] // 4, dtype=torch.int32, device=device)
  times: list[float] = []
  with torch.no_grad():
    for i in range(warmup + trials):
      args = clone_args(inputs)
      flush.fill_(i)
      if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        model(*args)
        torch.cuda.synchronize()  # every stream of the device
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
      else:
        t0 = time.perf_counter()
        model(*args)
        times.append((time.perf_counter() - t0) * 1e3)
      del args
  return TimedCalls(tuple(times[:warmup]), tuple(times[warmup:]))


def time_forward(model, inputs: list, device: torch.device, trials: int, warmup: int) -> Runtime:
  return time_calls(model, inputs, device, trials, warmup).runtime


def harness_overhead_ms(inputs: list, device: torch.device, calls: int = 5) -> float:
  """Wall time per call of ``time_calls`` around a forward that does nothing (clones, L2 flush, syncs)."""
  t0 = time.perf_counter()
  time_calls(lambda *a: None, inputs, device, calls, 0)
  return (time.perf_counter() - t0) * 1e3 / calls


@dataclasses.dataclass(frozen=True)
class Plausibility:
  ok: bool
  reason: str = ""


def plausible(
  calls: TimedCalls,
  outside_wall_s: float,
  overhead_ms: float,
  expected_trials: int,
  expected_warmup: int,
) -> Plausibility:
  """Whether times a candidate reported agree with the wall time the checker saw around them.

  The candidate's process times itself, so native code could report anything. The checker bounds it:
  the reported calls must be as many as asked, each at least ``MIN_CALL_MS``, their sum at most the wall
  time, and the wall time not explained by them plus the harness overhead (measured by the checker on the
  same inputs) must stay below half the claimed time plus 0.2 ms per call and 20 ms of slack. A claim of
  much faster calls than the wall time allows is TIMING_MISMATCH.
  """
  if len(calls.trial_ms) != expected_trials or len(calls.warmup_ms) != expected_warmup:
    return Plausibility(
      False, f"reported {len(calls.trial_ms)} timed calls, expected {expected_trials}"
    )
  all_ms = calls.warmup_ms + calls.trial_ms
  if any(not (t == t) or t < MIN_CALL_MS for t in all_ms):
    return Plausibility(False, f"a reported call time is below {MIN_CALL_MS} ms or not a number")
  claimed = sum(all_ms)
  wall_ms = outside_wall_s * 1e3
  n = len(all_ms)
  if claimed > wall_ms + 5.0:
    return Plausibility(
      False, f"reported {claimed:.1f} ms of calls within {wall_ms:.1f} ms of wall time"
    )
  unexplained = wall_ms - claimed - n * overhead_ms
  allowed = 0.5 * claimed + 0.2 * n + 20.0
  if unexplained > allowed:
    return Plausibility(
      False,
      f"{n} calls reported {claimed:.2f} ms in all, but took {wall_ms:.1f} ms of wall time seen from "
      f"outside ({n * overhead_ms:.1f} ms of it harness overhead): {unexplained:.1f} ms unexplained, "
      f"allowed {allowed:.1f} ms",
    )
  return Plausibility(True)
