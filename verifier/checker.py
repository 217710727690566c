"""One check, run by the checker process: the reference and the verdict on this side, the candidate in its
own process behind a channel.

Protocol with the candidate (``records``): a probe (can it map device buffers? else host staging), the
load, then one forward per correctness trial (inputs copied from the checker's private tensors into
buffers, expected outputs as poisoned buffers; the last trial profiled for the runtime check), then the
timing (its reported times bounded by the wall time seen here) and a re-check of trial 0 in lock-step
with the reference. Every message from the candidate is untrusted: outputs are read back into this
process and compared with the golden outputs here; the candidate's self-reported failures are limited
to kinds that can only hurt it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import torch

from verifier import correctness, exchange, runtime_check, timing
from verifier.candidate_main import SELF_REPORTED_KINDS
from verifier.channel import Channel, ChannelClosed, ChannelTimeout, ProtocolError
from verifier.contract import FailureKind
from verifier.records import (
  CANDIDATE_EXCHANGE_PARTS,
  CandidateFailure,
  CandidateJob,
  CandidateStarting,
  CheckReport,
  ForwardDone,
  ForwardRequest,
  Loaded,
  ProbeReply,
  ProbeRequest,
  RunJob,
  Shutdown,
  TensorRef,
  TimeDone,
  TimeRequest,
)
from verifier.reference import ReferenceTask, TrialStream

GRACE_S = (
  5.0  # the checker waits a little past the request's limit; the service kills the candidate
)


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


class Verdict(Exception):
  """The check ends here with this kind (raised from deep inside the protocol)."""

  def __init__(self, kind: FailureKind, reason: str = ""):
    super().__init__(reason)
    self.kind, self.reason = kind, reason


class CandidateGone(Exception):
  pass


class Check:
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
    if isinstance(rec, (ForwardRequest, TimeRequest)):
      rec = dataclasses.replace(rec, new_buffers=tuple(refs))
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
      raise Verdict(msg.kind, msg.reason)
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
      self.report["phases"].update(self.report.pop("costs", {}))
    try:
      self.cand.send(Shutdown())
    except (ChannelClosed, OSError):
      pass
    return CheckReport(kind=kind, reason=reason, **self.report)

  def _run(self) -> None:
    self.stage("candidate_load")
    self._probe()
    self.report["transport"] = self.buffers.transport
    used: list[int] = []
    init = tuple(exchange.send_value(a, self.buffers, used) for a in self.task.init_args)
    # The first trial is staged before the job goes out, so the candidate maps its buffers while it
    # loads (the reference also runs before any candidate code then).
    trials = self.opts.num_correct_trials
    first = self._stage(*self.trials.trial(0), keep=set(used)) if trials else None
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
    if self.opts.measure_performance:
      self._timing()

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

  def _stage(self, call_args: list, golden, keep: set[int] = frozenset()) -> "_Staged":
    """Fill buffers for one forward: the inputs (copied from the checker's private tensors) and poisoned
    output buffers shaped like ``golden``'s tensors."""
    t0 = time.monotonic()
    alloc0 = self.buffers.alloc_s
    self.buffers.release_all(keep)
    used: list[int] = []
    pairs: list = []
    args = tuple(exchange.send_value(a, self.buffers, used, pairs) for a in call_args)
    outs = tuple(
      exchange.output_buffer(g, self.buffers, used) if isinstance(g, torch.Tensor) else None
      for g in correctness.flatten(golden)
    )
    if self.device.type == "cuda":
      torch.cuda.synchronize()
    self._acc("exchange_stage", time.monotonic() - t0)
    self._acc("exchange_stage_alloc", self.buffers.alloc_s - alloc0)
    return _Staged(args, outs, pairs, used, golden)

  def _forward(self, staged: "_Staged", seed: int, profile: bool) -> ForwardDone:
    """One forward in the candidate on staged buffers."""
    call = self.calls
    self.calls += 1
    t1 = time.monotonic()
    self._send(ForwardRequest(call, seed, staged.args, staged.outs, profile=profile), staged.used)
    done = self._recv(ForwardDone)
    if done.call != call:
      raise Verdict(FailureKind.CRASH, f"the candidate answered call {done.call}, expected {call}")
    # What the separation costs: staging buffers (``_stage``), and everything around the candidate's
    # forward in its process (mapping, staging, publishing outputs, messages) beyond the forward itself.
    # The candidate's own split of that (``parts_s``) is only a diagnostic: clamped, known names only.
    round_trip = time.monotonic() - t1
    forward = _reported(done.wall_s, round_trip)
    self._acc("exchange_round_trip", round_trip - forward)
    self._acc("candidate_forward", forward)
    for part in CANDIDATE_EXCHANGE_PARTS:
      self._acc(f"exchange_rt_{part}", _reported(done.parts_s.get(part, 0.0), round_trip))
    return done

  def _acc(self, name: str, seconds: float) -> None:
    cost = self.report.setdefault("costs", {})
    cost[name] = cost.get(name, 0.0) + seconds

  def _trial(
    self, i: int, staged: "_Staged", profile: bool, strictness
  ) -> tuple[correctness.Comparison, runtime_check.RuntimeVerdict | None]:
    done = self._forward(staged, self.task.seeds[i], profile)
    where = f"trial {i}"
    t0 = time.monotonic()
    pairs = staged.pairs
    which = correctness.mutated([p for p, _ in pairs], [self._local(v) for _, v in pairs])
    if which:
      raise Verdict(FailureKind.INPUT_MUTATION, f"{where}: the candidate modified {which}")
    c = self._compare(staged.golden, done, staged.outs, where)
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
          done.evidence, self.device.type, self.job.kernel_names, strictness
        )
    return c, runtime

  def _local(self, view: torch.Tensor) -> torch.Tensor:
    """A buffer view as a tensor on the checker's device (host staging: copied over)."""
    return view if view.device == self.device else view.to(self.device)

  def _compare(self, golden, done: ForwardDone, outs, where: str) -> correctness.Comparison:
    refs = correctness.flatten(golden)
    if len(done.outputs) != len(refs):
      return correctness.Comparison(
        FailureKind.SHAPE_MISMATCH, f"{where}: {len(done.outputs)} outputs, expected {len(refs)}"
      )
    leaves = []
    for k, (ref, spec, out) in enumerate(zip(refs, done.outputs, outs)):
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
        leaves.append(self._local(self.buffers.buffers[out.buffer].view(out)))
      elif spec.kind == "data":
        leaves.append(spec.data)
      else:
        return correctness.Comparison(
          FailureKind.SHAPE_MISMATCH, f"{label}: output of type {spec.type_name} cannot be compared"
        )
    return correctness.compare_outputs(refs, leaves, self.opts.atol, self.opts.rtol, where)

  # ---- timing -----------------------------------------------------------------------------------
  def _timing(self) -> None:
    self.stage("timing")
    opts = self.opts
    self.buffers.release_all()
    used: list[int] = []
    inputs0, _ = self.trials.trial(0)
    args = tuple(exchange.send_value(a, self.buffers, used) for a in inputs0)
    if self.device.type == "cuda":
      torch.cuda.synchronize()
    overhead = self.task.harness_overhead_ms(inputs0)
    # A claim the outside wall time cannot explain is measured once more before it is rejected:
    # other processes on a loaded host can stretch one wall-clock window (a false TIMING_MISMATCH
    # was seen on a 2-core CI box), while a forged claim fails both times.
    for attempt in (1, 2):
      request = TimeRequest(args, opts.num_warmup, opts.num_perf_trials, self.task.seeds[0])
      self._send(request, used)
      t0 = time.monotonic()
      done = self._recv(TimeDone)
      wall = time.monotonic() - t0
      self.calls += opts.num_warmup + opts.num_perf_trials  # the candidate stepped either way
      calls = timing.TimedCalls(done.warmup_ms, done.trial_ms)
      p = timing.plausible(calls, wall, overhead, opts.num_perf_trials, opts.num_warmup)
      if p.ok:
        break
      if attempt == 2:
        raise Verdict(FailureKind.TIMING_MISMATCH, f"{p.reason} (measured twice)")
      self.report["warnings"].append(f"timing re-measured: {p.reason}")
    candidate = calls.runtime
    self.report["candidate"] = candidate
    baseline = self.job.baseline
    if baseline is None:
      self.stage("baseline")
      model = self.task.fresh_model()
      if opts.compile_baseline:
        model = torch.compile(model)
      baseline = timing.time_forward(
        model, inputs0, self.device, opts.num_perf_trials, opts.num_warmup
      )
      del model
      self.report["baseline_measured"] = True
    self.report["baseline"] = baseline
    # Re-check trial 0 after the timing loop (state- or cache-based cheats), in lock-step.
    self.stage("recheck")
    expected = self.trials.expected_after(self.calls - self.opts.num_correct_trials)
    staged = self._stage(inputs0, expected)
    done = self._forward(staged, self.task.seeds[0], False)
    c = self._compare(expected, done, staged.outs, "trial 0 re-checked after timing")
    if c.kind is not FailureKind.OK:
      self.report["correct"] = False
      raise Verdict(c.kind, c.reason)
    mean = candidate.mean_ms
    self.report["speedup"] = baseline.mean_ms / mean if mean > 0 else 0.0
    if not math.isfinite(self.report["speedup"]):
      self.report["speedup"] = 0.0


def check(
  job: RunJob,
  task: ReferenceTask,
  cand: Channel,
  stage,
  use_device_buffers: bool,
  keep_bytes: int = 0,
) -> CheckReport:
  return Check(job, task, cand, stage, use_device_buffers, keep_bytes).run()
