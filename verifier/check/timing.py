"""Timing of a model's forward.

The reference (in the checker, which never runs candidate code): CUDA events around each call, with
``torch.cuda.synchronize()`` (all streams of the device) before the end event is recorded, so work hidden
on other streams is counted; a 256 MB write flushes L2 before every call (KernelBench main's
``clear_l2_cache``); warm-up calls first; fresh input clones each call (defeats caches keyed on
``data_ptr``; KernelBench v0.1's timing notes). CPU: ``perf_counter`` with a 64 MB write to flush caches.

A candidate is never timed by its own process: the checker times each of its calls on the checker's
clock around the round trip through the exchange and subtracts the exchange's own cost, measured before
any candidate code ran (``call_ms``).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from verifier.api.contract import Runtime
from verifier.ipc.tensors import clone_args

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


def candidate_runtime(round_trips_s, exchange_s: float, calls_per_trip: int = 1) -> Runtime:
  """A candidate's runtime per call from the checker's round trips of its timed bursts (``calls_per_trip``
  forwards each): the mean and median share of a call less the exchange's own cost per call (subtracted
  from the summary, not per round trip, so jitter averages out instead of being clipped; never below
  ``MIN_CALL_MS``)."""
  ms = [t * 1e3 / calls_per_trip for t in round_trips_s]
  cost = exchange_s * 1e3
  return Runtime(
    median_ms=max(float(statistics.median(ms)) - cost, MIN_CALL_MS),
    mean_ms=max(float(statistics.fmean(ms)) - cost, MIN_CALL_MS),
    num_trials=len(ms) * calls_per_trip,
  )


def exchange_cost_s(round_trips_s) -> float:
  """The exchange's cost per call from calibration round trips: the median of the later half (the first
  calls warm the candidate's process up and run slower, which would credit the candidate with time it did
  not save)."""
  trips = list(round_trips_s)
  return float(statistics.median(trips[len(trips) // 2 :]))


class CacheFlush:
  """The write that evicts caches before each timed call (the device's L2, or the host's)."""

  def __init__(self, device: torch.device):
    self.device = device
    self.buf = torch.empty(L2_FLUSH_BYTES[device.type] // 4, dtype=torch.int32, device=device)

  def __call__(self, i: int) -> None:
    self.buf.fill_(i)
    if self.device.type == "cuda":
      torch.cuda.synchronize()
