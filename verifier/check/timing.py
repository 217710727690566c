"""Timing of a model's forward.

The reference (in the checker, which never runs candidate code): CUDA events around each call on the
current stream, the end event recorded right after the call as KernelBench main's
``time_execution_with_cuda_event`` does (the reference is trusted PyTorch code, whose side streams join the
current one; an end event recorded after a ``synchronize()`` timed the host's wake-up as well, and a host
stall there, e.g. under parallel builds, as the call's), as the candidate's post marker is enqueued right
after its call; the head start (``head_start``) before the start event, where the candidate's worker
spins before each forward's device span; a 256 MB write flushes L2 before every call
(KernelBench main's ``clear_l2_cache``); warm-up calls first; fresh input clones each call (defeats caches keyed on
``data_ptr``; KernelBench v0.1's timing notes). CPU: the process's CPU time (``process_time``), like the
candidate's (``cpu_clock``; ``perf_counter`` where the candidate is timed by the wall clock), with a 64 MB
write to flush caches.

A candidate is never timed by its own process alone: the checker times each of its calls on the checker's
clock around the round trip through the exchange and subtracts the exchange's own cost, measured before
any candidate code ran; a time within the measurement's resolution is no time (``measured``). On a GPU
with device records, each forward's span between two marker copies on the device clock (CUPTI, in the
candidate's process) decides instead, floored by that host clock's estimate less its known error
(``choose``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import torch

from verifier.api.contract import Runtime
from verifier.ipc import head_start
from verifier.ipc.head_start import HeadStart
from verifier.ipc.tensors import clone_args

L2_FLUSH_BYTES = {"cuda": 256 << 20, "cpu": 64 << 20}
# The finest time a clock here resolves (perf_counter and the kernel's CPU time count in ns, cgroup v2
# in us): no call is timed below it, whatever the statistics say.
CLOCK_TICK_MS = 1e-3
# A candidate's time counts only above this many standard errors of its estimate (``resolution_ms``).
RESOLUTION_SIGMAS = 3.0
# On the CPU clock, and at most this fraction of the exchange's own CPU time per call (the part
# subtracted): that cost moves from run to run with the host's load like the candidate's own (0.55-0.72
# ms a call in six runs on the 2-core dev VM, an axpy's estimate 0.07-0.28 ms meanwhile), so a time
# under it cannot be told apart from that drift.
CPU_OVERHEAD_RESOLUTION = 1.0


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


def time_calls(
  model,
  inputs: list,
  device: torch.device,
  trials: int,
  warmup: int,
  clock: str = "cpu",
  head: HeadStart = head_start.NONE,
) -> TimedCalls:
  """``warmup`` then ``trials`` calls of ``model`` on fresh clones of ``inputs``, each timed (module
  docstring); on the CPU by ``clock``: "cpu" (this process's CPU time) or "wall" (``perf_counter``),
  whichever the candidate's calls are timed by. On a GPU, ``head`` (``head_start``) spins after the
  synchronise and before the start event, as the candidate's worker spins before its pre marker (the
  checker's baseline; none: KernelBench's own timing)."""
  cpu_time = time.process_time if clock == "cpu" else time.perf_counter
  flush = torch.empty(L2_FLUSH_BYTES[device.type] // 4, dtype=torch.int32, device=device)
  times: list[float] = []
  with torch.no_grad():
    for i in range(warmup + trials):
      args = clone_args(inputs)
      flush.fill_(i)
      if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        head()  # the call's launches queue while the device spins (``head_start``)
        start.record()
        model(*args)
        end.record()  # on the call's stream, right after it (module docstring)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
      else:
        t0 = cpu_time()
        model(*args)
        times.append((cpu_time() - t0) * 1e3)
      del args
  return TimedCalls(tuple(times[:warmup]), tuple(times[warmup:]))


def time_forward(
  model,
  inputs: list,
  device: torch.device,
  trials: int,
  warmup: int,
  clock: str = "cpu",
  head: HeadStart = head_start.NONE,
) -> Runtime:
  return time_calls(model, inputs, device, trials, warmup, clock, head).runtime


def candidate_runtime(round_trips_s, exchange_s: float, calls_per_trip: int = 1) -> Runtime:
  """A candidate's runtime per call from the checker's round trips of its timed bursts (``calls_per_trip``
  forwards each): the mean and median share of a call less the exchange's own cost per call (subtracted
  from the summary, not per round trip, so jitter averages out instead of being clipped). May be at or
  under zero: ``measurable`` decides whether it is a time at all."""
  ms = [t * 1e3 / calls_per_trip for t in round_trips_s]
  cost = exchange_s * 1e3
  return Runtime(
    median_ms=float(statistics.median(ms)) - cost,
    mean_ms=float(statistics.fmean(ms)) - cost,
    num_trials=len(ms) * calls_per_trip,
  )


def spread_s(values) -> float:
  """The interquartile range of ``values`` (0 for fewer than two)."""
  xs = sorted(values)
  if len(xs) < 2:
    return 0.0
  q = statistics.quantiles(xs, n=4, method="inclusive")
  return float(q[2] - q[0])


def resolution_ms(round_trips_s, calls_per_trip: int, nulls_s, null_spread_ms: float) -> float:
  """The smallest per-call time this timing resolves: ``RESOLUTION_SIGMAS`` standard errors of (the
  mean share of a timed call) less (the exchange's cost per call), each from its samples' interquartile
  range (robust to the outliers of a loaded host), and never under ``CLOCK_TICK_MS``. ``nulls_s``: the
  null round trips during the timing; ``null_spread_ms``: the calibration's."""
  k = calls_per_trip
  shares = [t * 1e3 / k for t in round_trips_s]
  se_t = spread_s(shares) / 1.349 / math.sqrt(max(len(shares), 1))
  null_spreads = [spread_s([n * 1e3 / k for n in nulls_s]), null_spread_ms / k]
  se_null = max(null_spreads) / 1.349 / math.sqrt(max(len(nulls_s), 1))
  return max(CLOCK_TICK_MS, RESOLUTION_SIGMAS * math.hypot(se_t, se_null))


def measured(candidate: Runtime, resolution: float) -> Runtime | None:
  """The candidate's runtime if it is a measurement (its mean above ``resolution``), else None: a time
  at or under what the clock resolves gives no speedup (it used to be floored at 1 us and divided into
  the baseline: 129,690x for an axpy, issue 37)."""
  return candidate if candidate.mean_ms > resolution else None


def exchange_cost_s(round_trips_s) -> float:
  """The exchange's cost per call from calibration round trips: the median of the later half (the first
  calls warm the candidate's process up and run slower, which would credit the candidate with time it did
  not save)."""
  trips = list(round_trips_s)
  return float(statistics.median(trips[len(trips) // 2 :]))


def device_allowance_ms(null_ms: float, excess_ms: float, null_spread_ms: float, k: int) -> float:
  """How far under the host clock's estimate of a call the device clock may go (``choose``): the host
  clock's known error per call, from the calibration alone (measured before any candidate code, so the
  candidate cannot widen it): the whole exchange cost per call (``null_ms`` a round trip of ``k``
  forwards; its drift after the load reached +0.16 ms of 0.36-0.56 ms a call on the H200), the excess's
  size (its estimate was off by 0.185 ms there) and ``RESOLUTION_SIGMAS`` null spreads per call. On the
  H200 (session 20) the host clock put a 0.09 ms ReLU at 0.12-0.56 ms a call by its mean (errors to
  +0.47 ms; its median, which the floor takes where lower, 0.1 ms under the mean in the spikiest run),
  with nulls of 0.36-0.56 ms a call: this allowance is 0.4-0.8 ms there."""
  k = max(k, 1)
  return null_ms / k + abs(excess_ms) + RESOLUTION_SIGMAS * null_spread_ms / k


@dataclasses.dataclass(frozen=True)
class ClockChoice:
  """The candidate's time per call and the clock that decided it: "host" (the checker's clock around
  round trips), "device" (the forwards' spans on the device clock) or "floor" (the device clock's time
  was under the host clock's estimate less the allowance: that bound counts instead)."""

  runtime: Runtime
  resolution_ms: float  # a time at or under it is no time (``measured``)
  clock: str
  device: Runtime | None = None  # the spans' mean and median
  floor_ms: float = 0.0


def choose(host: Runtime, host_resolution_ms: float, spans_ns, allowance_ms: float) -> ClockChoice:
  """The candidate's time per call: with every timed forward's device span (``spans_ns``, ns; None or
  empty where any round trip lacks them) their mean and median, what CUDA events around each call would
  say (``time_calls``); floored by the host clock's estimate (the lower of its mean and median) less
  ``allowance_ms``, since the spans come from the candidate's process and could be forged (a forgery
  gains at most the allowance). Without spans, the host clock's estimate. The device clock resolves
  ``CLOCK_TICK_MS`` (CUPTI counts ns)."""
  if not spans_ns:
    return ClockChoice(host, host_resolution_ms, "host")
  ms = [s * 1e-6 for s in spans_ns]
  device = Runtime(
    median_ms=float(statistics.median(ms)), mean_ms=float(statistics.fmean(ms)), num_trials=len(ms)
  )
  floor = min(host.mean_ms, host.median_ms) - allowance_ms
  if device.mean_ms >= floor:
    return ClockChoice(device, CLOCK_TICK_MS, "device", device, floor)
  floored = Runtime(median_ms=max(device.median_ms, floor), mean_ms=floor, num_trials=len(ms))
  return ClockChoice(floored, CLOCK_TICK_MS, "floor", device, floor)


class CacheFlush:
  """The write that evicts caches before each timed call (the device's L2, or the host's)."""

  def __init__(self, device: torch.device):
    self.device = device
    self.buf = torch.empty(L2_FLUSH_BYTES[device.type] // 4, dtype=torch.int32, device=device)

  def __call__(self, i: int) -> None:
    self.buf.fill_(i)
    if self.device.type == "cuda":
      torch.cuda.synchronize()
