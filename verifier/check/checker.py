"""One check, run by the checker process: the reference and the verdict on this side, the candidate in its
own process behind a channel.

Protocol with the candidate (``records``): a probe (can it map device buffers? else host staging); when
timed, the reference's baseline and the exchange's calibration (round trips with no model), both before
any candidate code exists; the load, then one forward per correctness trial (inputs copied from the
checker's private tensors into buffers, expected outputs as poisoned buffers; the last trial profiled for
the runtime check), then the timed calls and a re-check of trial 0 in lock-step with the reference.

The timed half (baseline, calibration, timed calls) is ``timed_calls.TimedCalls``. Every message from the
candidate is untrusted: outputs are copied out of the shared buffers into this process before they are
compared with the golden outputs here; the candidate's self-reported failures are limited to kinds that
can only hurt it, and no duration it reports counts but its device records' spans of each forward (the
device clock, on a GPU), and those only above this process's clock's estimate less that clock's known
error (``timing.choose``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import time

import torch

from verifier.api.contract import FailureKind, candidate_text
from verifier.check import correctness, runtime_check
from verifier.check.call_evidence import CallEvidence
from verifier.check.cpu_clock import CpuClock
from verifier.check.reference import ReferenceTask, TrialStream, same_values
from verifier.check.timed_calls import TimedCalls
from verifier.check.verdict import CandidateGone, Verdict
from verifier.ipc import channel, cuda_driver, exchange, head_start, tensors
from verifier.ipc.channel import Channel, ChannelClosed, ChannelTimeout, ProtocolError
from verifier.ipc.records import (
  CANDIDATE_EXCHANGE_PARTS,
  BurstCall,
  CalibrationModel,
  SELF_REPORTED_KINDS,
  CandidateFailure,
  CandidateJob,
  CandidateStarting,
  CheckReport,
  DeviceRecords,
  ForwardDone,
  ForwardRequest,
  Loaded,
  ProbeReply,
  ProbeRequest,
  RecordsQuery,
  RecordsStatus,
  RunJob,
  Shutdown,
  TensorRef,
)

GRACE_S = (
  5.0  # the checker waits a little past the request's limit; the service kills the candidate
)
# round trips with no model before the load, on the first trial's buffers, when the host is sampled:
# what the verifier's own exchange work costs there (host_evidence); the first only warms up
NULL_CALLS = 8
# Correctness trials a request gets at least when its forwards are judged and nothing is timed: the first
# forward only warms up (lazy initialisation is not judged as host compute) and the last is profiled (the
# profiler's own CPU time is not judged either), so a third is the one the host evidence judges.
JUDGED_TRIALS = 3
# the secret offsets of timed calls' sparse output poison (``exchange.output_buffer``)
_POISON_RNG = random.SystemRandom()
# elements of each output an uncompared timed call reads before the clock stops (``_touch``)
TOUCH_SAMPLES = 1024


@functools.cache
def pageable_host_memory() -> bool:
  """Whether this process's GPU lets kernels reach pageable host memory (``cuda_driver``); False where
  the driver cannot say."""
  try:
    return cuda_driver.pageable_memory_access()
  except Exception:  # noqa: BLE001 - a diagnostic: no driver, no CUDA device
    return False


def correctness_trials(opts) -> int:
  """The trials a request runs: ``num_correct_trials``, raised to ``JUDGED_TRIALS`` when its forwards are
  judged (runtime check on) and no timed call is (was: an RL request's single trial was its warm-up, judged
  with none of a first call's allowance, so an honest CPU kernel got HOST_COMPUTE)."""
  n = opts.num_correct_trials
  if opts.strict.runtime_check and not opts.measure_performance:
    return max(n, JUDGED_TRIALS)
  return n


@dataclasses.dataclass
class _Staged:
  """One forward's filled buffers: argument and output descriptions, (private, view) input pairs for the
  mutation check, the buffer ids and the expected outputs."""

  args: tuple
  outs: tuple
  pairs: list
  used: list[int]
  golden: object


def _reported(seconds: float, at_most: float) -> float:
  """A duration the candidate reported, clamped to what it can have been."""
  return min(max(seconds, 0.0), at_most)


def _fits(*id_lists) -> bool:
  """Whether these buffers' descriptors fit in one message to the candidate."""
  return len({i for ids in id_lists for i in ids}) <= exchange.FDS_PER_MESSAGE


class Check(TimedCalls):
  def __init__(
    self,
    job: RunJob,
    task: ReferenceTask,
    cand: Channel,
    stage,
    use_device_buffers: bool,
    keep_bytes: int = 0,
  ):
    self.job, self.task, self.cand, self.stage_cb = job, task, cand, stage
    self.trials = TrialStream(task, keep_bytes)
    self.opts = job.options
    self.device = task.device
    self.buffers = exchange.BufferSet(
      self.device, use_device_buffers and self.device.type == "cuda"
    )
    self.deadline = time.monotonic() + self.opts.timeout_s + GRACE_S
    self.calls = 0
    self.report: dict = {
      "job_id": job.job_id,
      "reference_stateful": task.stateful,
      "device_name": torch.cuda.get_device_name(0) if self.device.type == "cuda" else "cpu",
      "gpu_total_bytes": (
        int(torch.cuda.get_device_properties(0).total_memory) if self.device.type == "cuda" else 0
      ),
      "phases": {},
      "warnings": [],
    }
    self.stage_name = ""
    self.t_last = time.monotonic()
    self.evidence = CallEvidence(
      self.device.type, job.build_root, self.opts.strict, job.kernel_names
    )
    self.in_bytes: int | None = None
    self.cpu_clock = self._cpu_clock()
    self.cpu_last: int | None = None  # the candidate's CPU time (ns) when its last round trip ended
    self.draw_s = 0.0  # get_inputs() drawn into buffers by _stage (part of its time)
    self.draws_into_buffers = False  # timed calls' inputs drawn into their buffers (_decide_draw)
    self.head = head_start.NONE  # the in-process timing's head start, where the worker spins too
    self.head_ns = 0  # the worker's head starts' device time in the last round trip (a diagnostic)
    self.edges_ns = (0, 0)  # its spans' idle edges, lead and tail (a diagnostic too)

  def _cpu_clock(self) -> CpuClock | None:
    """On the CPU backend the candidate's calls are timed by its CPU time (``cpu_clock``); the wall
    clock where the service asks for it, or (a warning) where that CPU time cannot be read."""
    if self.device.type != "cpu" or not self.opts.measure_performance or not self.job.cpu_clock:
      return None  # a GPU, untimed, or a service that times by the wall clock
    try:
      return CpuClock(self.job.cpu_clock)
    except (OSError, ValueError) as e:
      self.report["warnings"].append(
        f"timed on the wall clock: the candidate's CPU time cannot be read ({e})"
      )
      return None

  @property
  def clock(self) -> str:
    return "cpu" if self.cpu_clock is not None else "wall"

  # ---- plumbing ---------------------------------------------------------------------------------
  def stage(self, name: str) -> None:
    now = time.monotonic()
    if self.stage_name:
      phases = self.report["phases"]
      phases[self.stage_name] = phases.get(self.stage_name, 0.0) + now - self.t_last
    self.stage_name, self.t_last = name, now
    self.stage_cb(name)

  def _send(self, rec, ids=(), prefetch=()) -> None:
    refs, fds = self.buffers.new_refs(ids)
    if isinstance(rec, CalibrationModel):
      rec = dataclasses.replace(rec, buffers=tuple(refs))
    elif isinstance(rec, CandidateJob):
      more, more_fds = self.buffers.new_refs(prefetch)
      rec = dataclasses.replace(rec, buffers=tuple(refs), prefetch=tuple(more))
      fds = fds + more_fds
    elif isinstance(rec, ProbeRequest):
      rec = dataclasses.replace(rec, probe=refs[0])
    try:
      self.cand.send(rec, fds)
    except ChannelClosed:
      raise CandidateGone() from None
    finally:
      for fd in fds:
        os.close(fd)

  def _recv(self, *expected):
    try:
      msg, _ = self.cand.recv(*expected, CandidateFailure, timeout=self.deadline - time.monotonic())
    except ChannelClosed:
      raise CandidateGone() from None
    except ChannelTimeout:
      raise Verdict(
        FailureKind.TIMEOUT, f"no answer within the limit of {self.opts.timeout_s:.0f} s"
      ) from None
    except ProtocolError as e:
      raise Verdict(FailureKind.CRASH, f"the candidate's process broke the protocol: {e}") from None
    if isinstance(msg, CandidateFailure):
      if msg.kind not in SELF_REPORTED_KINDS:
        raise Verdict(
          FailureKind.CRASH, f"the candidate's process reported {msg.kind.value} about itself"
        )
      raise Verdict(msg.kind, candidate_text(msg.reason))
    return msg

  # ---- the check --------------------------------------------------------------------------------
  def run(self) -> CheckReport:
    try:
      self._run()
      kind, reason = FailureKind.OK, ""
    except Verdict as v:
      kind, reason = v.kind, v.reason
    except CandidateGone:
      kind, reason = FailureKind.CRASH, f"the candidate's process ended during {self.stage_name}"
      self.report["candidate_gone"] = True
    except exchange.ExchangeError as e:  # the reference's inputs or outputs cannot be exchanged
      kind, reason = FailureKind.REFERENCE_ERROR, f"reference values cannot be sent: {e}"
    finally:
      self.report["stage"] = self.stage_name
      self.stage("")
      self.buffers.close()
      t0 = time.monotonic()
      self.evidence.close()
      self._acc("evidence_close", time.monotonic() - t0)
      self.report["phases"].update(self.report.pop("costs", {}))
      self.report["phases"].update(self.evidence.phases())
      self.report["warnings"] += self.evidence.warnings
    try:
      self.cand.send(Shutdown())
    except (ChannelClosed, OSError):
      pass
    return CheckReport(kind=kind, reason=reason, **self.report)

  def _run(self) -> None:
    self.stage("candidate_load")
    t0 = time.monotonic()
    self.evidence.attach(self.job.worker_pid)  # before any candidate code
    self._acc("evidence_attach", time.monotonic() - t0)
    self._probe()
    self.report["transport"] = self.buffers.transport
    self.evidence.device_buffers = self.buffers.use_device_memory
    self._records_query()
    self._pageable_memory_warning()
    used: list[int] = []
    init = tuple(exchange.send_value(a, self.buffers, used) for a in self.task.init_args)
    self.init = (init, used)
    # The first trial is staged before the job goes out, so the candidate maps its buffers while it
    # loads (the reference also runs before any candidate code then).
    trials = correctness_trials(self.opts)
    first = self._stage(*self.trials.trial(0), keep=set(used)) if trials else None
    if self.opts.measure_performance:
      self.draws_into_buffers = self._decide_draw()
      self._baseline()
      self._calibrate(set(used) | set(first.used if first else ()))
      self.stage("candidate_load")
    if first is not None and self.evidence.host_on:
      for _ in range(NULL_CALLS):
        self._forward([(first, self.task.seeds[0])], null=True)
    self._send(
      CandidateJob(
        candidate_source=self.job.candidate_source,
        build_root=self.job.build_root,
        device=self.device.type,
        seed=self.task.seed,
        init_args=init,
        buffers=(),
        kernel_names=self.job.kernel_names,
        split_build=self.job.split_build,
        use_pch=self.job.use_pch,
        gpu_memory_fraction=self.job.gpu_memory_fraction,
      ),
      used,
      prefetch=first.used if first and _fits(used, first.used) else (),
    )
    self._recv(CandidateStarting)  # the runtime's work is done; the candidate's code runs next
    self.report["candidate_started"] = True
    loaded = self._recv(Loaded)
    if self.evidence.records_on:
      t0 = time.monotonic()
      self.evidence.load = self._recv(DeviceRecords)
      self._acc("evidence_records", time.monotonic() - t0)
    self.report.update(compiled=True, build_cached=loaded.build_cached)
    self.report["phases"]["candidate_build_load"] = loaded.load_s
    self._acc("exchange_load_map_wait", _reported(loaded.map_wait_s, self.opts.timeout_s))

    self.stage("trials")
    strictness = self.opts.strict
    max_abs, strict_ok = 0.0, True
    runtime = None
    for i in range(trials):
      profile = strictness.runtime_check and i == trials - 1
      staged = first if i == 0 else self._stage(*self.trials.trial(i))
      c, runtime = self._trial(i, staged, profile, strictness)
      del staged
      first = None
      max_abs, strict_ok = max(max_abs, c.max_abs_diff), strict_ok and c.strict_ok
    self.report.update(correct=True, strict_correct=strict_ok, max_abs_diff=max_abs)
    if runtime is not None and runtime.kind is not FailureKind.OK:
      raise Verdict(runtime.kind, runtime.reason)
    self._judge_evidence()
    if self.opts.measure_performance:
      self._timing()
      self._judge_evidence()

  def _judge_evidence(self) -> None:
    """Every call so far judged from the evidence below the dispatcher (``call_evidence``)."""
    t0 = time.monotonic()
    v = self.evidence.verdict()
    self._acc("evidence_judge", time.monotonic() - t0)  # the host samples drained and attributed
    if v.kind is not FailureKind.OK:
      raise Verdict(v.kind, v.reason)

  def _records_query(self) -> None:
    """On a GPU, before any candidate code: does the candidate's process collect device records? If not
    (no CUPTI there), its last trial is profiled in process as before, with a warning. Where they are
    and its worker spins before each forward's span (``head_start``), this process's in-process timing
    (the baseline, the calibration's reference) spins alike before its start events."""
    if self.device.type != "cuda":
      return
    self._send(RecordsQuery())
    status = self._recv(RecordsStatus)
    why = status.error
    self.evidence.records_on = not why
    if why:
      self.report["warnings"].append(
        f"device records unavailable ({why[:300]}): the last trial was profiled in process instead"
      )
      return
    phases = self.report["phases"]
    phases["timing_head_start_us"] = status.head_start_us  # reported before any candidate code
    if status.head_start_us <= 0:
      self.report["warnings"].append(
        f"timing: no head start in the candidate's process ({status.head_start_error[:300]}): "
        "its host path to each forward's first launch is timed, and the baseline's too"
      )
      return
    self.head = head_start.calibrated()
    if not self.head.cycles:
      self.report["warnings"].append(
        f"timing: no head start in the checker ({self.head.why}): the baseline's host path to its "
        "first launch is timed, the candidate's is not"
      )

  def _pageable_memory_warning(self) -> None:
    """Where the device records judge a strict run on a GPU whose kernels read pageable host memory
    (HMM), the report says what they cannot see (phase ``device_pageable_memory_access``)."""
    if not (self.evidence.records_on and self.opts.strict.runtime_check and pageable_host_memory()):
      return
    self.report["phases"]["device_pageable_memory_access"] = 1.0
    self.report["warnings"].append(
      "this GPU's kernels read pageable host memory (HMM): a candidate's own kernels can hand its "
      "inputs to the host with no CUDA call, which no device record shows; host compute that way is "
      "the host samples' to catch (above ~2 ms a forward)"
    )

  def _probe(self) -> None:
    """Before any candidate code runs: a tiny device buffer must map in the candidate's process."""
    if not self.buffers.use_device_memory:
      return
    try:
      b = self.buffers.take(4)
      ref = TensorRef(b.id, "float32", (1,), (1,))
      b.view(ref).fill_(exchange.PROBE_VALUE)
      torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - this process cannot export device memory
      self._host_staging(f"device buffers unavailable here ({type(e).__name__}: {e})")
      return
    self._send(ProbeRequest(b.ref(), ref), [b.id])
    reply = self._recv(ProbeReply)
    if reply.error or reply.value != exchange.PROBE_VALUE:
      self._host_staging(f"the candidate cannot map device buffers ({reply.error or reply.value})")
    else:
      self.buffers.release_all()

  def _host_staging(self, why: str) -> None:
    self.buffers.close()
    self.buffers = exchange.BufferSet(self.device, False)
    self.report["warnings"].append(why + "; tensors staged through host shared memory")

  def _decide_draw(self) -> bool:
    """Whether a timed call's inputs are drawn straight into its buffers (``exchange.DrawInto``; its
    private inputs, for a compared call, re-drawn from the seed after the round trip): where the
    reference keeps no state (a stateful reference's golden outputs are computed from the inputs
    before the round trip, so those stay private), the buffers live where it draws (not host buffers
    for a GPU), and, tried once per task before any candidate code, trial 0 drawn again into buffers
    is trial 0's private inputs bit for bit (``get_inputs()`` repeats under a seed: not where it draws
    from Python's ``random`` or numpy; and the buffers hold what a private draw gives)."""
    task = self.task
    where = (self.device.type == "cuda") == self.buffers.use_device_memory
    if task.stateful or not where:
      return False
    if task.draws_into_buffers is None:
      drawn = exchange.DrawInto(self.buffers)
      why = "differ from a private draw"
      try:
        again = task.inputs_for(task.seeds[0], drawn)
        task.draws_into_buffers = same_values(self.trials.trial(0)[0], again)
        del again
      except Exception as e:  # noqa: BLE001 - a factory's out= form failing on a buffer view
        task.draws_into_buffers, why = False, f"failed ({type(e).__name__}: {str(e)[:200]})"
      drawn.give_back()
      if not task.draws_into_buffers:
        self.report["warnings"].append(
          f"timing: inputs drawn into the exchange buffers {why}; drawn privately and copied"
        )
    return task.draws_into_buffers

  def _stage(
    self,
    call_args: list | None,
    golden,
    keep: set[int] = frozenset(),
    release: bool = True,
    sync: bool = True,
    seed: int | None = None,
    sparse_poison: bool = False,
  ) -> "_Staged":
    """Fill buffers for one forward: the inputs (copied from the checker's private tensors) and poisoned
    output buffers shaped like ``golden``'s tensors (in buffers other than those staged since the last
    ``release``: a burst's forwards each have their own). ``sync=False``: the caller synchronises (a
    burst's cache flush does, once for all its forwards). With ``seed`` instead of ``call_args``:
    ``get_inputs()`` under it drawn straight into the buffers, what it returns from elsewhere copied
    (its pairs are then (buffer view, buffer view): the caller re-draws the private side).
    ``sparse_poison``: large float outputs poisoned sparsely (``exchange.output_buffer``; timed and
    calibration calls, whose inputs are fresh every call)."""
    t0 = time.monotonic()
    alloc0 = self.buffers.alloc_s
    if release:
      self.buffers.release_all(keep)
    used: list[int] = []
    pairs: list = []
    drawn, draw_s = None, 0.0
    if seed is not None:
      drawn = exchange.DrawInto(self.buffers)
      t = time.monotonic()
      call_args = self.task.inputs_for(seed, drawn)
      drawn.settle(call_args)
      draw_s = time.monotonic() - t
      self.draw_s += draw_s
    args = tuple(exchange.send_value(a, self.buffers, used, pairs, drawn) for a in call_args)
    outs = tuple(
      exchange.output_buffer(g, self.buffers, used, _POISON_RNG if sparse_poison else None)
      if isinstance(g, torch.Tensor)
      else None
      for g in tensors.flatten(golden)
    )
    if sync and self.device.type == "cuda":
      torch.cuda.synchronize()
    self._acc("exchange_stage", time.monotonic() - t0 - draw_s)
    self._acc("exchange_stage_alloc", self.buffers.alloc_s - alloc0)
    return _Staged(args, outs, pairs, used, golden)

  def _forward(
    self,
    calls: list[tuple["_Staged", int]],
    profile: bool = False,
    calibrate: bool = False,
    null: bool = False,
    poison: bool | None = None,
    compared: frozenset[int] | None = None,
  ) -> ForwardDone:
    """Forwards in the candidate on staged buffers, one per (staged, seed) of ``calls``, in one round
    trip (more than one: a timed burst); ``self.round_trip_s`` is the round trip on this process's clock
    (the only duration of a candidate call that counts), ``self.copied[k]`` call ``k``'s outputs copied
    out in it where ``k`` is in ``compared`` (default: every call), else None (``_copy_outputs``). The
    round trip is a window of evidence (``call_evidence``): host samples in it and, after the clock, the
    device records the candidate's process sends. ``poison`` (``ForwardRequest``): by default on for
    forwards of the model, off for calibration and null round trips."""
    call = self.calls
    (staged, seed), burst = calls[0], calls[1:]
    self.calls += 0 if calibrate or null else len(calls)
    marker, span_markers = self.evidence.markers()
    refs, fds = self.buffers.new_refs([i for s, _ in calls for i in s.used])
    req = ForwardRequest(
      call,
      seed,
      staged.args,
      staged.outs,
      new_buffers=tuple(refs),
      profile=profile,
      calibrate=calibrate or null,
      null=null,
      burst=tuple(BurstCall(call + 1 + k, sd, s.args, s.outs) for k, (s, sd) in enumerate(burst)),
      marker=marker,
      span_markers=span_markers,
      poison=not (calibrate or null) if poison is None else poison,
    )
    data = channel.frame(req, len(fds))  # encoded before the clock starts
    c0 = self.cpu_clock.ns() if self.cpu_clock is not None and self.cpu_last is None else 0
    t1 = time.monotonic()
    w0 = time.monotonic_ns()
    try:
      p0 = time.perf_counter()
      try:
        self.cand.send_frame(data, fds)
      except ChannelClosed:
        raise CandidateGone() from None
      done = self._recv(ForwardDone)
      self.copied = self._copy_outputs([s.outs for s, _ in calls], compared)
      p1 = time.perf_counter()
    finally:
      for fd in fds:
        os.close(fd)
    w1 = time.monotonic_ns()
    t_done = time.monotonic()
    self.round_trip_s = self.wall_round_trip_s = p1 - p0
    if self.cpu_clock is not None:
      # Everything the candidate's tasks ran since its previous round trip ended, the gap before this
      # one included: work it did between calls (on inputs it saw staged) counts like work inside.
      now = self.cpu_clock.ns()
      self.round_trip_s = (now - (self.cpu_last if self.cpu_last is not None else c0)) * 1e-9
      self.cpu_last = now
    t0 = time.monotonic()
    records = self._recv(DeviceRecords) if self.evidence.records_on else None
    self._acc("evidence_records", time.monotonic() - t0)  # the collector's flush and marker wait
    # each forward's span on the device clock, where every one of them came back (``timing.choose``)
    spans = records.forward_ns if records is not None else ()
    self.spans_ns = spans if len(spans) == len(calls) else None
    # the kernels' own device time in it (a diagnostic: a span less this is launch gaps and dispatch)
    self.kernel_ns = sum(r.ns for r in records.kernels) if records is not None else 0
    self.head_ns = records.head_ns if records is not None else 0
    self.edges_ns = (records.lead_ns, records.tail_ns) if records is not None else (0, 0)
    # the in-process profiler's own work is no evidence (with device records it does not run)
    kind = "profiled" if profile and not self.evidence.records_on else "call"
    if calibrate or null:
      kind = "null_after" if self.report.get("candidate_started") else "null"
      kind = "reference" if calibrate and not null else kind
    self.evidence.window(
      kind,
      len(calls),
      w0,
      w1,
      f"{self.stage_name} call {call}" + (f"-{call + len(burst)}" if burst else ""),
      records,
      marker,
      self._input_bytes(),
    )
    # Diagnostics: the wake-ups on either side (the candidate's stamps, on the host's one monotonic
    # clock, clamped to the round trip; never part of a verdict or a time).
    self._acc("exchange_rt_wake_in", _reported(done.received_at - p0, self.wall_round_trip_s))
    self._acc("exchange_rt_wake_out", _reported(p1 - done.replying_at, self.wall_round_trip_s))
    if done.call != call or len(done.burst_outputs) != len(burst):
      raise Verdict(
        FailureKind.CRASH,
        f"the candidate answered call {done.call} with {len(done.burst_outputs)} more, expected "
        f"{call} with {len(burst)}",
      )
    # What the separation costs: staging buffers (``_stage``), and everything around the candidate's
    # forward in its process (mapping, staging, publishing outputs, messages) beyond the forward itself.
    # The candidate's own split of that (``parts_s``) is only a diagnostic: clamped, known names only.
    round_trip = t_done - t1
    forward = _reported(done.wall_s, round_trip)
    self._acc("exchange_round_trip", round_trip - forward)
    self._acc("candidate_forward", forward)
    for part in CANDIDATE_EXCHANGE_PARTS:
      self._acc(f"exchange_rt_{part}", _reported(done.parts_s.get(part, 0.0), round_trip))
    return done

  def _input_bytes(self) -> int:
    """Bytes of one forward's tensor inputs (trial 0's: every call has the same shapes)."""
    if self.in_bytes is None:
      inputs, _ = self.trials.trial(0)
      self.in_bytes = sum(
        exchange.nbytes_of(t) for t in tensors.flatten(inputs) if torch.is_tensor(t)
      )
    return self.in_bytes

  def _copy_outputs(self, outs_per_call, compared: frozenset[int] | None = None) -> list:
    """Every expected output of every call in ``compared`` (None: every call) copied out of its buffer
    into this process, and every other call's outputs read sparsely (``_touch``), before the clock stops.
    The candidate's process saying it is done proves nothing (native code can skip its synchronisation
    and finish its kernels after answering): this read either runs after the candidate's kernels, and
    the clock counts them, or before they finished, and a compared call reads an unfinished output
    (which it judges; the candidate cannot tell which calls are compared until after it answered). An
    uncompared call's full copy was never judged: beyond the read's ordering it gave the clock only its
    own length, ~4 ms of a 4 GB output's ~17 ms round trip (performance.md, session 34)."""
    copied = []
    for k, outs in enumerate(outs_per_call):
      views = [None if r is None else self.buffers.buffers[r.buffer].view(r) for r in outs]
      if compared is None or k in compared:
        copied.append([None if v is None else self._local(v) for v in views])
      else:
        copied.append(None)
        for v in views:
          if v is not None:
            _touch(v)
    if self.device.type == "cuda":
      torch.cuda.synchronize()
    return copied

  def _acc(self, name: str, seconds: float) -> None:
    cost = self.report.setdefault("costs", {})
    cost[name] = cost.get(name, 0.0) + seconds

  def _trial(
    self, i: int, staged: "_Staged", profile: bool, strictness
  ) -> tuple[correctness.Comparison, runtime_check.RuntimeVerdict | None]:
    done = self._forward([(staged, self.task.seeds[i])], profile)
    where = f"trial {i}"
    t0 = time.monotonic()
    pairs = staged.pairs
    which = correctness.mutated([p for p, _ in pairs], [self._readable(v) for _, v in pairs])
    if which:
      raise Verdict(FailureKind.INPUT_MUTATION, f"{where}: the candidate modified {which}")
    c = self._compare(staged.golden, done.outputs, staged.outs, self.copied[0], where)
    self._acc("compare", time.monotonic() - t0)
    if c.kind is not FailureKind.OK:
      self.report["max_abs_diff"] = c.max_abs_diff
      raise Verdict(c.kind, c.reason)
    runtime = None
    if profile:
      if done.evidence is None:
        runtime = runtime_check.RuntimeVerdict(
          FailureKind.KERNEL_NOT_LAUNCHED, f"{where}: no profile of the forward came back"
        )
      else:
        runtime = runtime_check.judge(
          done.evidence,
          self.device.type,
          self.job.kernel_names,
          strictness,
          device_records=self.evidence.records_on,
        )
    return c, runtime

  def _local(self, view: torch.Tensor) -> torch.Tensor:
    """A buffer view copied into this process's memory on its device, out of the candidate's reach (it
    still maps the buffer and may write it while the checker compares)."""
    return view.to(self.device, copy=True)

  def _readable(self, view: torch.Tensor) -> torch.Tensor:
    """A buffer view as the mutation check reads it: the view itself where it lives on this process's
    device (``correctness.mutated`` reads each value once, as a copy would: a write racing it has the
    same chance either way, and an input of gigabytes is not copied again), else a copy here."""
    return view if view.device == self.device else self._local(view)

  def _compare(self, golden, specs, outs, copied: list, where: str) -> correctness.Comparison:
    """One call's outputs (the candidate's descriptions ``specs``, the copies made in its round trip)
    against ``golden``."""
    refs = tensors.flatten(golden)
    if len(specs) != len(refs):
      return correctness.Comparison(
        FailureKind.SHAPE_MISMATCH, f"{where}: {len(specs)} outputs, expected {len(refs)}"
      )
    leaves = []
    for k, (ref, spec, out) in enumerate(zip(refs, specs, outs)):
      label = where if len(refs) == 1 else f"{where}, output {k}"
      if spec.kind == "tensor":
        if not isinstance(ref, torch.Tensor):
          return correctness.Comparison(
            FailureKind.SHAPE_MISMATCH, f"{label}: expected {type(ref).__name__}, got a tensor"
          )
        if not spec.plain:
          return correctness.Comparison(
            FailureKind.LAZY_OUTPUT, f"{label}: output is a {spec.type_name}, not a plain tensor"
          )
        if spec.device != str(ref.device):
          return correctness.Comparison(
            FailureKind.DTYPE_MISMATCH, f"{label}: output on {spec.device}, expected {ref.device}"
          )
        if tuple(spec.shape) != tuple(ref.shape):
          return correctness.Comparison(
            FailureKind.SHAPE_MISMATCH,
            f"{label}: shape {tuple(spec.shape)}, expected {tuple(ref.shape)}",
          )
        if spec.dtype != str(ref.dtype).removeprefix("torch."):
          return correctness.Comparison(
            FailureKind.DTYPE_MISMATCH, f"{label}: dtype {spec.dtype}, expected {ref.dtype}"
          )
        if out is None or not spec.copied:
          return correctness.Comparison(
            FailureKind.WRONG_OUTPUT, f"{label}: the output was not handed over"
          )
        leaves.append(copied[k])
      elif spec.kind == "data":
        leaves.append(spec.data)
      else:
        return correctness.Comparison(
          FailureKind.SHAPE_MISMATCH, f"{label}: output of type {spec.type_name} cannot be compared"
        )
    return correctness.compare_outputs(
      refs, leaves, self.opts.atol, self.opts.rtol, where, self.task.norm_rule
    )

  # ---- timing -----------------------------------------------------------------------------------
  def _judge(self, staged: "_Staged", specs, copied: list, where: str) -> None:
    """Compare one forward's outputs (and its inputs, for mutation) like a correctness trial."""
    which = correctness.mutated(
      [p for p, _ in staged.pairs], [self._readable(v) for _, v in staged.pairs]
    )
    if which:
      self.report["correct"] = False
      raise Verdict(FailureKind.INPUT_MUTATION, f"{where}: the candidate modified {which}")
    c = self._compare(staged.golden, specs, staged.outs, copied, where)
    if c.kind is not FailureKind.OK:
      self.report["correct"] = False
      raise Verdict(c.kind, c.reason)


def _touch(view: torch.Tensor, samples: int = TOUCH_SAMPLES) -> None:
  """A sparse read of an output buffer: about ``samples`` elements at a stride from a secret offset,
  copied on its device (queued on this process's stream like a full copy, at a small part of its
  bytes)."""
  flat = view.reshape(-1)
  n = flat.numel()
  if n == 0:
    return
  stride = max(1, n // samples)
  flat[_POISON_RNG.randrange(stride) :: stride].clone()


def check(
  job: RunJob,
  task: ReferenceTask,
  cand: Channel,
  stage,
  use_device_buffers: bool,
  keep_bytes: int = 0,
) -> CheckReport:
  return Check(job, task, cand, stage, use_device_buffers, keep_bytes).run()
