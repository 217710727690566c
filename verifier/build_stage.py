"""The build stage: candidates' extensions compiled on CPU, candidate code and compilers in separate workers.

A build worker executes the candidate (module import, then ``ModelNew.__init__``) with the build cache
read-only; each ``load_inline`` call the cache misses comes here as ``CompileNeeded`` and is built and
published by a one-shot compile worker that runs no candidate code (``build_main``), whose event goes back
to the build worker and into this stage's outcome (what a build worker reports about its own builds is
not trusted). A build holds one compile slot while the candidate module imports (under
``build_timeout_s``); once the worker says the module imported (``BuildProgress``) the slot goes to the next
build and instantiating ``ModelNew`` (which may build lazily too) runs under the request's own
``timeout_s``. Identical candidates share one build (``SingleFlight``); compile errors are kept, timeouts
and crashes are not (a retry builds again).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import time

from verifier import build_cache
from verifier.channel import ChannelClosed, ProtocolError
from verifier.contract import FailureKind, VerifyRequest
from verifier.pool import Slots, WorkerPool
from verifier.records import BuildJob, BuildProgress, BuildReport, CompileNeeded, CompileResult
from verifier.sandbox import WorkerStartError, describe_exit
from verifier.single_flight import SingleFlight


@dataclasses.dataclass(frozen=True)
class BuildOutcome:
  kind: FailureKind
  reason: str = ""
  events: tuple[dict, ...] = ()
  cached: bool = False  # no compiler ran for this request: its extensions were in the cache already
  logs: str = ""
  seconds: float = 0.0
  shared: bool = False  # another request's build produced it


def build_key(candidate_source: str, arch_list: str, device: str) -> str:
  h = hashlib.sha256()
  for part in (candidate_source, arch_list, device):
    h.update(part.encode())
    h.update(b"\0")
  return h.hexdigest()


class _CompileWorkerLost(Exception):
  pass


class BuildStage:
  def __init__(
    self,
    pool: WorkerPool,
    compile_pool: WorkerPool,
    slots: int,
    build_root: str,
    *,
    arch_list: str,
    device: str,
    build_timeout_s: float,
    split_build: bool,
    use_pch: bool,
    mem_mb: int,
    max_entries: int = 20000,
  ):
    self.pool, self.compile_pool, self.slots = pool, compile_pool, Slots(slots)
    self.build_root, self.arch_list, self.device = build_root, arch_list, device
    self.build_timeout_s, self.split_build, self.use_pch, self.mem_mb = (
      build_timeout_s,
      split_build,
      use_pch,
      mem_mb,
    )
    self.flight: SingleFlight[BuildOutcome] = SingleFlight(
      lambda o: o.kind in (FailureKind.OK, FailureKind.COMPILE_ERROR), max_entries
    )
    self.in_build = 0

  async def build(self, req: VerifyRequest) -> BuildOutcome:
    key = build_key(req.candidate_source, self.arch_list, self.device)
    outcome, how = await self.flight.run(key, lambda: self._build(req))
    if (
      how == "kept"
    ):  # built (or found) by an earlier request: in the cache before this one arrived
      return dataclasses.replace(
        outcome, shared=True, cached=outcome.kind is FailureKind.OK, seconds=0.0
      )
    if how == "joined":  # waited for another request's build: cached only if that one was
      return dataclasses.replace(outcome, shared=True)
    return outcome

  async def _build(self, req: VerifyRequest) -> BuildOutcome:
    job = BuildJob(
      reference_source=req.reference_source,
      candidate_source=req.candidate_source,
      build_root=self.build_root,
      seed=req.options.seed,
      split_build=self.split_build,
      use_pch=self.use_pch,
    )
    self.in_build += 1
    try:
      return await self.run_job(job, req.options.timeout_s, slotted=True)
    finally:
      self.in_build -= 1

  async def run_job(self, job: BuildJob, timeout_s: float, slotted: bool) -> BuildOutcome:
    """One build worker for ``job``; the compile slot (when ``slotted``) is held until the module imported."""
    t0 = time.monotonic()
    holding = slotted
    if slotted:
      await self.slots.acquire(1)
    worker = None
    try:
      try:
        worker = await self.pool.take()
        await worker.wait_ready(120)
      except WorkerStartError as e:
        return BuildOutcome(FailureKind.INTERNAL_ERROR, f"build stage: no build worker: {e}")
      await worker.chan.send(job)
      loop = asyncio.get_running_loop()
      deadline = loop.time() + self.build_timeout_s
      phase = "compiling the module"
      report = None
      trusted: list[dict] = []  # the compile workers' events
      while report is None:
        try:
          msg = await asyncio.wait_for(
            worker.chan.recv(BuildProgress, BuildReport, CompileNeeded),
            max(0.0, deadline - loop.time()),
          )
          if isinstance(msg, CompileNeeded):
            event = await self.compile(msg.params, max(0.0, deadline - loop.time()))
            trusted.append(event)
            await worker.chan.send(CompileResult(event))
            continue
        except asyncio.TimeoutError:
          worker.kill("timeout")
          limit = self.build_timeout_s if phase == "compiling the module" else timeout_s
          return BuildOutcome(
            FailureKind.TIMEOUT,
            f"build stage: {phase} took longer than {limit:.0f} s; the worker was killed",
            logs=worker.read_log(),
            seconds=time.monotonic() - t0,
          )
        except _CompileWorkerLost as e:
          return BuildOutcome(
            FailureKind.INTERNAL_ERROR, f"build stage: {e}", seconds=time.monotonic() - t0
          )
        except (ChannelClosed, ProtocolError) as e:
          rc = await worker.ended(grace_s=2.0)
          how = describe_exit(rc)
          return BuildOutcome(
            FailureKind.CRASH,
            f"build stage: the worker ended while {phase} ({how}; {type(e).__name__})",
            logs=worker.read_log(),
            seconds=time.monotonic() - t0,
          )
        if isinstance(msg, BuildProgress):
          if holding:
            await self.slots.release(1)
            holding = False
          phase = "instantiating ModelNew"
          deadline = loop.time() + timeout_s
        else:
          report = msg
      # cache hits as the build worker saw them (harmless: name, key), the builds as compiled
      hits = [
        {k: v for k, v in ev.items() if k != "pch_request"}
        for ev in report.build_events
        if ev.get("cached") and not any(t.get("key") == ev.get("key") for t in trusted)
      ]
      for (
        ev
      ) in hits:  # the build worker cannot mark its hits as used (the cache is read-only to it)
        if build_cache.is_entry_name(str(ev.get("key", ""))):
          build_cache.touch(os.path.join(self.build_root, ev["key"]))
      events = tuple(trusted) + tuple(hits)
      return BuildOutcome(
        report.kind,
        report.reason,
        events,
        bool(events) and all(ev.get("cached") for ev in events),
        logs=worker.read_log() if report.kind is not FailureKind.OK else "",
        seconds=time.monotonic() - t0,
      )
    finally:
      if holding:
        await self.slots.release(1)
      if worker is not None:
        worker.discard()

  async def compile(self, params: dict, timeout_s: float) -> dict:
    """One load_inline call built and published by a compile worker; its event (``error`` set when the
    compiler failed or the arguments were refused)."""
    try:
      worker = await self.compile_pool.take()
    except WorkerStartError as e:
      raise _CompileWorkerLost(f"no compile worker: {e}") from e
    try:
      await worker.wait_ready(120)
      job = BuildJob("", "", self.build_root, 0, self.split_build, self.use_pch)
      await worker.chan.send(dataclasses.replace(job, compile_request=params))
      report = await asyncio.wait_for(worker.chan.recv(BuildReport), timeout_s)
    except asyncio.TimeoutError:
      worker.kill("timeout")
      raise
    except (ChannelClosed, ProtocolError, WorkerStartError) as e:
      rc = await worker.ended(grace_s=2.0)
      raise _CompileWorkerLost(f"the compile worker ended ({describe_exit(rc)})") from e
    finally:
      worker.discard()
    event = dict(report.build_events[0]) if report.build_events else {}
    event.setdefault("cached", False)
    event.setdefault("seconds", 0.0)
    if report.kind is not FailureKind.OK and not event.get("error"):
      event["error"] = report.reason or report.kind.value
    event.setdefault("error", "")
    return event

  async def run_pch(self, request: dict) -> BuildReport | None:
    """A precompiled-header build outside the slots (it must not queue behind a burst of candidates), by a
    compile worker (it writes into the cache)."""
    worker = await self.compile_pool.take()
    try:
      await worker.wait_ready(120)
      await worker.chan.send(
        BuildJob("", "", self.build_root, 0, self.split_build, self.use_pch, pch_request=request)
      )
      return await asyncio.wait_for(worker.chan.recv(BuildReport), self.build_timeout_s)
    except (ChannelClosed, ProtocolError, asyncio.TimeoutError, WorkerStartError):
      return None
    finally:
      worker.discard()
