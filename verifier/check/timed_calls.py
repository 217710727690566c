"""The timed half of a check: the reference's baseline, the exchange's calibration and the timed calls
(``TimedCalls``, mixed into ``checker.Check``, whose staging, round trips and comparisons it uses).

Timed calls are forwards like the trials: fresh inputs written into the same kind of buffer for each, in
bursts of up to ``MAX_BURST`` a round trip, the duration taken on the checker's clock around the round trip
(on the CPU backend, the candidate's CPU time as the kernel counts it) less the calibrated exchange cost, no
time at all at or under what that resolves, and a secret random subset of them (``checked_calls``)
compared like the trials, staged like the others. On a GPU the device records' spans of each forward time
it, floored by the host clock's estimate less that clock's known error (``timing.choose``).
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time

import torch

from verifier.check import timing
from verifier.check.verdict import Verdict
from verifier.ipc import exchange, tensors
from verifier.ipc.records import CalibrationModel, CalibrationReady, TimingCalibration

# pairs of round trips (the reference, then no model) before the load; the later half counts
CALIBRATION_CALLS = 16
CHECKED_TIMED_FRACTION = 0.1  # of the timed calls, compared like the trials (at least one)
# During the timing, a round trip with no model after each timed burst that brings the timed calls since
# the last one to RECALIBRATE_CALLS (every 4th burst of 8; every 32nd of 1, where the null round trips of
# level-1's 4 GB outputs cost 8 ms each and were a ninth of such a task's timing), and at least 3
# of them when there are 3 timed bursts
RECALIBRATE_CALLS = 32
# Timed calls go in bursts: up to MAX_BURST forwards per round trip, each on its own fresh inputs, so the
# exchange's cost and its jitter are shared by the burst's forwards; at most BURST_BYTES (on a GPU, a
# sixteenth of its memory where that is more) of inputs and outputs staged per burst (level-1 tensors
# reach gigabytes: those go one at a time).
MAX_BURST = 8
BURST_BYTES = 2 << 30


def _low_quartile(xs: list[float]) -> float:
  """The lower quartile: an excess estimated low only ever counts against the candidate (on the H200
  the median credited a pass-through candidate of a 4096^2 matmul with 5-11 %, session 13)."""
  xs = sorted(xs)
  return xs[(len(xs) - 1) // 4]


def _share_quantiles(name: str, round_trips_s, k: int) -> dict[str, float]:
  """Diagnostics of a timing's spread: the 10th, 50th and 90th percentiles and the largest of the round
  trips' shares per forward, ms (``{name}_p10_ms``, ...); none for fewer than two round trips."""
  ms = sorted(t * 1e3 / k for t in round_trips_s)
  if len(ms) < 2:
    return {}
  q = statistics.quantiles(ms, n=10, method="inclusive")
  return {
    f"{name}_p10_ms": q[0],
    f"{name}_p50_ms": q[4],
    f"{name}_p90_ms": q[8],
    f"{name}_max_ms": ms[-1],
  }


def burst_calls(nbytes: int, nbuffers: int, budget: int = BURST_BYTES) -> int:
  """Forwards per timed round trip for a call with ``nbytes`` of tensor inputs and outputs in
  ``nbuffers`` buffers: as many as ``budget`` bytes and one message's descriptors allow, 1 to
  MAX_BURST."""
  by_bytes = budget // max(nbytes, 1)
  by_fds = exchange.FDS_PER_MESSAGE // max(nbuffers, 1)
  return max(1, min(MAX_BURST, by_bytes, by_fds))


def warmup_bursts(num_warmup: int, k: int) -> list[int]:
  """The warm-up's burst sizes: ``num_warmup`` calls in bursts of up to ``k`` (3 calls cost 3
  forwards, not a whole burst of 8; they are not timed, and the compared calls are drawn among them as
  among the timed ones)."""
  return [min(k, num_warmup - i) for i in range(0, num_warmup, k)]


def checked_calls(n: int, rng) -> set[int]:
  """Which of ``n`` timed calls are compared: each independently with probability
  ``CHECKED_TIMED_FRACTION`` (one drawn at random if none was), so what the candidate saw of earlier
  calls says nothing about the next ones (a fixed count would tell it when the compared ones are
  used up)."""
  checked = {j for j in range(n) if rng.random() < CHECKED_TIMED_FRACTION}
  return checked or {rng.randrange(n)}


class TimedCalls:
  """``Check``'s timing methods (a mixin: they use its ``_stage``, ``_forward``, ``_judge``, ``report``,
  ``trials`` and clocks)."""

  def _baseline(self) -> None:
    """The reference timed before any candidate code exists (nothing of the candidate can run now but its
    idle process, which runs only the verifier's code), unless the service passed one it measured so."""
    if self.job.baseline is not None:
      self.report["baseline"] = self.job.baseline
      return
    self.stage("baseline")
    opts = self.opts
    inputs0, _ = self.trials.trial(0)
    model = self.task.fresh_model()
    if opts.compile_baseline:
      model = torch.compile(model)
    self.report["baseline"] = timing.time_forward(
      model, inputs0, self.device, opts.num_perf_trials, opts.num_warmup, self.clock, self.head
    )
    self.report["baseline_measured"] = True
    self.report["phases"]["baseline_head_start_us"] = self.head.us if self.head.cycles else 0.0

  def _burst_size(self) -> int:
    """Forwards per timed round trip for this task (``burst_calls`` of trial 0's tensors)."""
    inputs, golden = self.trials.trial(0)
    leaves = [t for t in tensors.flatten(inputs) + tensors.flatten(golden) if torch.is_tensor(t)]
    budget = max(BURST_BYTES, self.report["gpu_total_bytes"] // 16)
    return burst_calls(sum(exchange.nbytes_of(t) for t in leaves), len(leaves), budget)

  def _calibrate(self, keep: set[int]) -> None:
    """What a timed round trip costs beside the forwards, measured before any candidate code exists
    (only the verifier's and the reference's code run in the candidate's process then, so the
    candidate cannot inflate it), unless the service passed the one measured with the baseline.

    Pairs of round trips shaped like the timing's bursts, on fresh inputs, caches flushed before each:
    the reference (built in the candidate's process) timed like a timed burst, then one with no model on
    the same buffers (the host's part: messages, wake-ups, publishing and copying out outputs), as the
    timing's own null round trips follow a timed one. The reference's excess over its pair's null, per
    forward, less the reference timed in process, is what a real forward adds beside its own time
    (switching the GPU to the candidate's context, first touches of the buffers; negative where back to
    back forwards run faster than the in-process baseline's flushed ones, which then counts against the
    candidate); pairing cancels the host's drift."""
    self.flush = timing.CacheFlush(self.device)
    self.burst = self._burst_size()
    cached = self.job.calibration
    if cached is not None and cached.burst_calls == self.burst and cached.clock == self.clock:
      self.calibration = self.report["calibration"] = cached
      return
    self.stage("calibration")
    why = "cpu"  # the CPU clock counts no waiting and no GPU switch: null round trips alone
    if self.cpu_clock is None:
      init, used = self.init
      self._send(CalibrationModel(self.job.reference_source, self.task.seed, init), used)
      why = self._recv(CalibrationReady).error[:300]
    rng = random.SystemRandom()
    template = self.trials.trial(0)[1]
    k = self.burst
    nulls, refs, spans = [], [], []
    for j in range(max(CALIBRATION_CALLS // k, 8) if k > 1 else CALIBRATION_CALLS):
      calls = []
      for i in range(k):
        seed = rng.randrange(2**31 - 1)
        calls.append((self._fresh(seed, template, keep, release=i == 0), seed))
      if not why:
        self.flush(j)
        try:
          self._forward(calls, calibrate=True, compared=frozenset())
          refs.append(self.round_trip_s)
          spans.append(self.spans_ns)
        except Verdict as v:  # the reference's failure there is no verdict on the candidate
          why, refs = f"its forward there ended {v.kind.value}: {v.reason[:200]}", []
      self.flush(j)
      self._forward(calls, null=True, compared=frozenset())
      nulls.append(self.round_trip_s)
    null_ms = timing.exchange_cost_s(nulls) * 1e3
    spread_ms = timing.spread_s(nulls[len(nulls) // 2 :]) * 1e3
    if refs:
      in_process_ms = self._reference_in_process_ms()
      half = len(refs) // 2
      ref_ms = statistics.median(refs[half:]) * 1e3 / k
      excess_ms = _low_quartile([r - n for r, n in zip(refs[half:], nulls[half:])]) * 1e3 / k
      if all(s is not None for s in spans[half:]):  # a diagnostic of the device clock
        device = [n * 1e-6 for s in spans[half:] for n in s]
        self.report["phases"]["calibration_reference_device_ms"] = statistics.fmean(device)
      self.calibration = TimingCalibration(
        null_ms=null_ms,
        excess_ms=max(excess_ms - in_process_ms, -null_ms / k),
        source="reference",
        reference_exchange_ms=ref_ms,
        reference_in_process_ms=in_process_ms,
        calls=len(refs) - half,
        burst_calls=k,
        null_spread_ms=spread_ms,
      )
    else:
      if why != "cpu":
        self.report["warnings"].append(
          "the exchange was calibrated with no model: the reference could not run in the "
          f"candidate's process ({why})"
        )
      self.calibration = TimingCalibration(
        null_ms=null_ms,
        excess_ms=0.0,
        source="null",
        burst_calls=k,
        clock=self.clock,
        null_spread_ms=spread_ms,
      )
    self.report["calibration"] = self.calibration
    self.report["calibration_measured"] = True

  def _reference_in_process_ms(self) -> float:
    """The reference's median call timed in this process by the baseline's method, eager (the
    baseline itself unless it was compiled)."""
    if not self.opts.compile_baseline:
      return self.report["baseline"].median_ms
    inputs0, _ = self.trials.trial(0)
    return timing.time_forward(
      self.task.fresh_model(), inputs0, self.device, CALIBRATION_CALLS, 3, self.clock, self.head
    ).median_ms

  def _timing(self) -> None:
    """Every timed call a forward like the trials, on fresh inputs, in bursts timed here; a secret
    random subset of them compared; then trial 0 re-checked, all in lock-step with the reference. The
    timed calls are whole bursts (``num_perf_trials`` rounded up), the warm-up ``num_warmup`` calls
    (``warmup_bursts``)."""
    self.stage("timing")
    self.report["phases"]["timing_drawn_into_buffers"] = float(self.draws_into_buffers)
    opts = self.opts
    k = self.burst
    sizes = warmup_bursts(opts.num_warmup, k)
    warm, timed = len(sizes), math.ceil(opts.num_perf_trials / k)
    sizes += [k] * timed
    rng = random.SystemRandom()
    checked = checked_calls(sum(sizes), rng)
    lockstep = self.trials.lockstep_model()
    template = self.trials.trial(0)[1]
    times, nulls, spans, kernel_ns, head_ns, lead_ns, tail_ns = [], [], [], 0, 0, 0, 0
    every = max(1, min(RECALIBRATE_CALLS // k, timed // 3))  # timed bursts a null; 3 nulls at least
    first = 0
    for b, size in enumerate(sizes):
      calls = range(first, first + size)
      first += size
      times.append(self._timed_burst(b, calls, checked, rng, lockstep, template))
      spans.append(self.spans_ns)
      kernel_ns += self.kernel_ns if b >= warm else 0
      head_ns += self.head_ns if b >= warm else 0
      lead_ns += self.edges_ns[0] if b >= warm else 0
      tail_ns += self.edges_ns[1] if b >= warm else 0
      if b >= warm and (b - warm + 1) % every == 0:  # on a timed burst's buffers
        nulls.append(self._null_round_trip(b))
    overhead_ms = self._overhead_ms(nulls)
    host = timing.candidate_runtime(times[warm:], overhead_ms / 1e3, k)
    resolution = timing.resolution_ms(times[warm:], k, nulls, self.calibration.null_spread_ms)
    if self.clock == "cpu":
      resolution = max(resolution, timing.CPU_OVERHEAD_RESOLUTION * overhead_ms)
    choice = self._choose_clock(host, resolution, spans[warm:])
    candidate, resolution = choice.runtime, choice.resolution_ms
    phases = self.report["phases"]
    phases["timed_calls_checked"] = float(len(checked))
    phases["timing_burst_calls"] = float(k)
    phases["timing_resolution_ms"] = resolution
    phases["timing_cpu_clock"] = float(self.clock == "cpu")
    phases["timing_unmeasurable"] = 0.0
    if self.evidence.records_on:
      phases["timing_device_kernel_ms"] = kernel_ns * 1e-6 / (timed * k)
      phases["timing_head_start_device_us"] = head_ns * 1e-3 / (timed * k)  # the spins' own time
      # the spans' idle edges a call: the host's path to the first launch the head start did not
      # cover, and the last work to the post marker (``device_records.span_edges``)
      phases["timing_device_lead_us"] = lead_ns * 1e-3 / (timed * k)
      phases["timing_device_tail_us"] = tail_ns * 1e-3 / (timed * k)
    phases.update(_share_quantiles("timing_share", times[warm:], k))
    phases.update(_share_quantiles("timing_null_share", nulls, k))
    self.report["candidate"] = dataclasses.replace(
      candidate, median_ms=max(candidate.median_ms, 0.0), mean_ms=max(candidate.mean_ms, 0.0)
    )
    # Re-check trial 0 after the timing loop (state- or cache-based cheats), in lock-step.
    self.stage("recheck")
    inputs0, golden0 = self.trials.trial(0)
    expected = self.task.forward(lockstep, inputs0, 0) if self.task.stateful else golden0
    staged = self._stage(inputs0, expected)
    done = self._forward([(staged, self.task.seeds[0])])
    self._judge(staged, done.outputs, self.copied[0], "trial 0 re-checked after timing")
    if timing.measured(candidate, resolution) is None:
      phases["timing_unmeasurable"] = 1.0
      clock = self.clock if choice.clock == "host" else "device"
      self.report["warnings"].append(
        f"timing: the candidate's {candidate.mean_ms:.4f} ms a call ({clock} clock) is at or "
        f"under what this measurement resolves ({resolution:.4f} ms): no speedup reported"
      )
      self.report["speedup"] = 0.0
      # what its mean time would give, for the shaped reward's cap (``reward.shaped_reward``)
      base = self.report["baseline"].mean_ms
      phases["timing_mean_speedup"] = base / candidate.mean_ms if candidate.mean_ms > 0 else 1e9
      return
    speedup = self.report["baseline"].mean_ms / candidate.mean_ms
    self.report["speedup"] = speedup if math.isfinite(speedup) else 0.0

  def _choose_clock(self, host, host_resolution: float, spans: list) -> timing.ClockChoice:
    """The clock that times the candidate (``timing.choose``): the device clock where every timed
    round trip brought its forwards' spans, floored by the host clock's estimate less the
    calibration's allowance; else the host clock. The phases give both clocks' estimates."""
    cal = self.calibration
    allowance = timing.device_allowance_ms(
      cal.null_ms, cal.excess_ms, cal.null_spread_ms, cal.burst_calls
    )
    every = bool(spans) and all(s is not None for s in spans)
    choice = timing.choose(
      host, host_resolution, [n for s in spans for n in s] if every else None, allowance
    )
    phases = self.report["phases"]
    phases["timing_host_mean_ms"] = host.mean_ms
    phases["timing_host_median_ms"] = host.median_ms
    phases["timing_host_resolution_ms"] = host_resolution
    phases["timing_device_clock"] = float(choice.clock == "device")
    phases["timing_device_floored"] = float(choice.clock == "floor")
    if choice.device is not None:
      phases["timing_device_mean_ms"] = choice.device.mean_ms
      phases["timing_device_median_ms"] = choice.device.median_ms
      phases["timing_device_floor_ms"] = choice.floor_ms
      phases["timing_device_allowance_ms"] = allowance
      # how much of the allowance this run's device clock used (host estimate less device mean, over
      # the allowance): the data a tighter allowance needs (docs/verifier-security.md, "the floor")
      used_ms = min(host.mean_ms, host.median_ms) - choice.device.mean_ms
      phases["timing_device_allowance_used"] = used_ms / max(allowance, 1e-9)
      spans_s = [n * 1e-9 for s in spans for n in s]
      phases.update(_share_quantiles("timing_device_span", spans_s, 1))
    if choice.clock == "floor":
      self.report["warnings"].append(
        f"timing: the device clock's {choice.device.mean_ms:.4f} ms a call is under the host clock's "
        f"estimate less its allowance ({host.mean_ms:.4f} / {host.median_ms:.4f} ms mean / median "
        f"less {allowance:.4f} ms): {choice.floor_ms:.4f} ms counts"
      )
    return choice

  def _null_round_trip(self, b: int) -> float:
    """A round trip with no model on the last timed burst's buffers, in the timing's conditions
    (caches flushed, like the calibration's: on a CPU host the flush also evicts the processes' own code
    and data, and an unflushed null round trip there was about half as long)."""
    t0 = time.monotonic()
    self.flush(b)
    self._forward(self.last_burst, null=True, compared=frozenset())
    self._acc("timing_null", time.monotonic() - t0)
    return self.round_trip_s

  def _overhead_ms(self, nulls: list[float]) -> float:
    """What is subtracted from each timed forward's share of its round trip: the host's part, the
    lower of the calibration's null round trip and those during the timing (the candidate's process
    answers the latter, so they can only lower what is subtracted; they correct a calibration that host
    noise made too high) shared by the burst's forwards, plus the calibration's excess of a real forward
    over a null one. The phases give the null round trips per forward."""
    cal = self.calibration
    k = cal.burst_calls
    phases = self.report["phases"]
    phases["exchange_call_before_ms"] = cal.null_ms / k
    null_ms = cal.null_ms
    if nulls:
      during = statistics.median(nulls) * 1e3
      phases["exchange_call_during_ms"] = during / k
      null_ms = min(null_ms, during)
    phases["exchange_call_ms"] = null_ms / k
    phases["exchange_excess_ms"] = cal.excess_ms
    phases["reference_exchange_ms"] = cal.reference_exchange_ms
    phases["reference_in_process_ms"] = cal.reference_in_process_ms
    overhead_ms = phases["exchange_overhead_ms"] = null_ms / k + cal.excess_ms
    return max(overhead_ms, 0.0)

  def _fresh(self, seed: int, template, keep: set[int] = frozenset(), release: bool = True):
    """One timed (or calibration) call's fresh inputs under ``seed``, staged: drawn straight into
    the buffers where ``draws_into_buffers``, else drawn privately and copied (the flush
    synchronises). Returns the staged call with its pairs for the mutation check: (private input,
    view) when drawn privately, (view, view) when drawn into the buffers."""
    if self.draws_into_buffers:
      return self._stage(
        None, template, keep=keep, release=release, sync=False, seed=seed, sparse_poison=True
      )
    t = time.monotonic()
    inputs = self.task.inputs_for(seed)
    self.draw_s += time.monotonic() - t
    return self._stage(inputs, template, keep=keep, release=release, sync=False, sparse_poison=True)

  def _timed_burst(self, b: int, calls, checked: set[int], rng, lockstep, template) -> float:
    """Timed burst ``b``: ``calls`` forwards, each on fresh inputs, in one round trip (returned, in
    seconds); those in ``checked`` compared with the reference (which steps on every call, before the
    burst, when it keeps state). Before the round trip every call is staged alike, compared or not
    (``_fresh``: drawn straight into its buffers where the reference allows, nothing of it kept
    privately): a compared call's private inputs are re-drawn from its seed after the round trip,
    and its golden output computed from them then (a stateful reference's before the burst, on every
    call: its inputs are drawn privately and copied, and a compared call keeps them), so the host's
    schedule the candidate can observe before a burst (its gaps, order and buffers) does not depend
    on which of its calls are compared."""
    t0 = time.monotonic()
    stage_s = 0.0
    stateful, direct = self.task.stateful, self.draws_into_buffers
    burst, kept = [], {}
    for i, j in enumerate(calls):
      seed = rng.randrange(2**31 - 1)
      if direct:
        t, draw0 = time.monotonic(), self.draw_s
        s = self._stage(None, template, release=i == 0, sync=False, seed=seed, sparse_poison=True)
        stage_s += time.monotonic() - t - (self.draw_s - draw0)
      else:
        inputs = self.task.inputs_for(seed)
        golden = self.task.forward_seeded(lockstep, inputs, seed) if stateful else template
        t = time.monotonic()
        # the flush synchronises
        s = self._stage(inputs, golden, release=i == 0, sync=False, sparse_poison=True)
        stage_s += time.monotonic() - t
        if j in checked:
          kept[i] = inputs  # the private inputs: the golden output and the mutation check
        else:
          s.pairs = []
        del inputs, golden
      burst.append((s, seed))
    self.last_burst = burst
    t2 = time.monotonic()
    self.flush(b)
    t3 = time.monotonic()
    # every timed call alike (ForwardRequest.poison); only the compared ones' outputs copied out
    compared = frozenset(i for i, j in enumerate(calls) if j in checked)
    done = self._forward(burst, poison=False, compared=compared)
    t4 = time.monotonic()
    specs = (done.outputs,) + done.burst_outputs
    for i, j in enumerate(calls):
      if j in checked:
        staged, seed = burst[i]
        if direct:  # the private inputs, re-drawn from the seed
          private = self.task.inputs_for(seed)
          leaves = [t for t in tensors.flatten(private) if isinstance(t, torch.Tensor)]
          staged.pairs = [(p, v) for p, (_, v) in zip(leaves, staged.pairs, strict=True)]
        else:
          private = kept.pop(i)
        if not stateful:
          staged.golden = self.task.forward_seeded(lockstep, private, seed)
        del private
        self._judge(staged, specs[i], self.copied[i], f"timed call {j}")
    self._acc("timing_inputs", t2 - t0 - stage_s)
    self._acc("timing_stage", stage_s)
    self._acc("timing_flush", t3 - t2)
    self._acc("timing_call", t4 - t3)
    self._acc("timing_judge", time.monotonic() - t4)
    return self.round_trip_s
