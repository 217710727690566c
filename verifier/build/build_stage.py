"""The build stage: candidates' extensions compiled on CPU, candidate code and compilers in separate workers.

A build worker executes the candidate (module import, then ``ModelNew.__init__``) with the build cache
read-only; each ``load_inline`` call the cache misses comes here as ``CompileNeeded`` and is built and
published by a one-shot compile worker that runs no candidate code (``build_main``), whose event goes back
to the build worker and into this stage's outcome (what a build worker reports about its own builds is
not trusted). One deadline per build, the request's ``timeout_s`` (at most ``build_timeout_s``) from the
moment it holds a compile slot, bounds everything the candidate causes: the compiles (the compile worker
is killed at the deadline), the module's import with its extensions' static initialisers, and
``ModelNew``'s instantiation. The slot goes to the next build once the worker says the module imported
(``BuildProgress``), or at the deadline. Identical candidates share one build (``SingleFlight``); compile errors are kept, timeouts
and crashes are not (a retry builds again).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import signal
import time
import uuid

from verifier.api.contract import FailureKind, VerifyRequest, candidate_text
from verifier.build import build_cache
from verifier.build.fair_slots import QUANTUM_S, TICK_S, Budget, FairSlots, Turn
from verifier.build.single_flight import SingleFlight
from verifier.ipc.channel import ChannelClosed, ProtocolError
from verifier.ipc.records import BuildJob, BuildProgress, BuildReport, CompileNeeded, CompileResult
from verifier.sandbox.pool import WorkerPool
from verifier.sandbox.sandbox import WorkerStartError, describe_exit, watch_resources
from verifier.sandbox.task_limits import JobTasks, tasks_verdict


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


class _LimitHit(Exception):
  """The watchdog killed the build worker on a limit (memory, processes)."""


async def _receive(worker, watch: asyncio.Future, budget: Budget, *kinds):
  """The worker's next message of ``kinds``; TimeoutError once ``budget`` is spent (looked at again every
  ``TICK_S``: a suspended build's budget stands still), _LimitHit once ``watch`` killed the worker."""
  recv = asyncio.ensure_future(worker.chan.recv(*kinds))
  try:
    while budget.left() > 0:
      done, _ = await asyncio.wait(
        {recv, watch}, timeout=min(budget.left(), TICK_S), return_when=asyncio.FIRST_COMPLETED
      )
      if watch in done:
        raise _LimitHit(watch.result())
      if recv in done:
        return recv.result()
    raise asyncio.TimeoutError
  finally:
    if not recv.done():
      recv.cancel()
      await asyncio.gather(recv, return_exceptions=True)


def _signal_all(workers: list, sig: int) -> None:
  for w in list(workers):
    w.signal_tree(sig)


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
    slot_quantum_s: float = QUANTUM_S,
  ):
    self.pool, self.compile_pool = pool, compile_pool
    self.slots = FairSlots(slots, slot_quantum_s)
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
    self.compiling: dict[str, asyncio.Future] = {}  # build key -> done, for compiles in flight

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
    """One build worker for ``job`` under one deadline: the request's ``timeout_s`` (at most
    ``build_timeout_s``) of running, counted from the moment it holds a compile slot (its suspensions,
    ``FairSlots``, do not count), bounds the compiles it asks for, the module's import (its
    extensions' static initialisers included) and ``ModelNew``'s instantiation. The slot is held until
    the module imported, never past the deadline; the worker is watched for memory and processes like
    a run worker."""
    t0 = time.monotonic()
    procs: list = []  # the build worker and its compile worker of the moment: what a suspension stops
    turn = Turn(
      lambda: _signal_all(procs, signal.SIGSTOP), lambda: _signal_all(procs, signal.SIGCONT)
    )
    if slotted:
      await self.slots.acquire(turn)
    worker = watch = tasks = None
    limit = min(timeout_s, self.build_timeout_s)
    budget = Budget(limit, turn if slotted else None)
    phase = "compiling the module"
    try:
      try:
        worker = await self.pool.take()
        procs.append(worker)
        await worker.wait_ready(min(120.0, budget.left()))
      except WorkerStartError as e:
        return BuildOutcome(FailureKind.INTERNAL_ERROR, f"build stage: no build worker: {e}")
      tasks = await asyncio.to_thread(
        JobTasks.open, self.pool.cgroups, worker.tree_pids(), self.pool.cfg.max_processes
      )
      await worker.chan.send(job)
      watch = asyncio.ensure_future(watch_resources(worker, tasks.polled(self.pool.limits)))
      report = None
      trusted: list[dict] = []  # the compile workers' events
      while report is None:
        try:
          msg = await _receive(worker, watch, budget, BuildProgress, BuildReport, CompileNeeded)
          if isinstance(msg, CompileNeeded):
            event = await self._compile_once(msg.params, budget, procs, turn if slotted else None)
            trusted.append(event)
            if watch.done():  # killed on a limit while its compile ran
              raise _LimitHit(watch.result())
            await worker.chan.send(CompileResult(event))
            continue
        except asyncio.TimeoutError:
          worker.kill("timeout")
          return self._failed(
            worker,
            FailureKind.TIMEOUT,
            f"{phase} hit the request's limit of {limit:.0f} s; the worker was killed",
            t0,
          )
        except _LimitHit as e:
          kind = (
            FailureKind.OUT_OF_MEMORY
            if worker.killed_by == "memory"
            else FailureKind.RESOURCE_LIMIT
          )
          return self._failed(worker, kind, f"{phase}: {e}", t0)
        except _CompileWorkerLost as e:
          return BuildOutcome(
            FailureKind.INTERNAL_ERROR, f"build stage: {e}", seconds=time.monotonic() - t0
          )
        except (ChannelClosed, ProtocolError, OSError) as e:
          rc = await worker.ended(grace_s=2.0)
          how = describe_exit(rc)
          return self._failed(
            worker,
            FailureKind.CRASH,
            f"the worker ended while {phase} ({how}; {type(e).__name__})",
            t0,
          )
        if isinstance(msg, BuildProgress):
          if slotted:
            self.slots.release(turn)
          phase = "instantiating ModelNew"
        else:
          report = msg
      broken = tasks_verdict(await asyncio.to_thread(tasks.counts), False, "cpu")
      outcome = self._reported(worker, report, trusted, t0)
      if broken is not None and outcome.kind is FailureKind.OK:
        outcome = dataclasses.replace(outcome, kind=FailureKind(broken[0]), reason=broken[1])
      return outcome
    finally:
      if watch is not None:
        watch.cancel()
      if slotted:
        self.slots.finish(turn)
      procs.clear()
      if worker is not None:
        worker.discard()
      if tasks is not None:
        tasks.close(self.pool.cgroups)

  @staticmethod
  def _failed(worker, kind: FailureKind, reason: str, t0: float) -> BuildOutcome:
    return BuildOutcome(
      kind, f"build stage: {reason}", logs=worker.read_log(), seconds=time.monotonic() - t0
    )

  def _reported(self, worker, report: BuildReport, trusted: list[dict], t0: float) -> BuildOutcome:
    """The outcome of a build worker that reported: the compile workers' events, and its cache hits."""
    # cache hits as the build worker saw them (harmless: name, key), the builds as compiled
    hits = [
      {k: v for k, v in ev.items() if k != "pch_request"}
      for ev in report.build_events
      if ev.get("cached") and not any(t.get("key") == ev.get("key") for t in trusted)
    ]
    for ev in hits:  # the build worker cannot mark its hits as used (the cache is read-only to it)
      if build_cache.is_entry_name(str(ev.get("key", ""))):
        build_cache.touch(os.path.join(self.build_root, ev["key"]))
    events = tuple(trusted) + tuple(hits)
    return BuildOutcome(
      report.kind,
      candidate_text(report.reason) if report.reason else "",
      events,
      bool(events) and all(ev.get("cached") for ev in events),
      logs=worker.read_log() if report.kind is not FailureKind.OK else "",
      seconds=time.monotonic() - t0,
    )

  async def _compile_once(
    self, params: dict, budget: Budget, procs: list, turn: Turn | None
  ) -> dict:
    """``compile``, but where another build is compiling the same extension, first wait for that
    (this build suspended without its slot, its budget standing still), then ask again: a cache hit
    unless that compile failed without a cached result."""
    key = build_cache.build_key(params, self.split_build)
    while (other := self.compiling.get(key)) is not None:
      if turn is not None:
        self.slots.pause(turn)
      await asyncio.shield(other)  # cancelled: run_job's finally ends the turn
      if turn is not None:
        await self.slots.acquire(turn)
    done = asyncio.get_running_loop().create_future()
    self.compiling[key] = done
    try:
      return await self.compile(params, budget, procs)
    finally:
      del self.compiling[key]
      done.set_result(None)

  async def compile(self, params: dict, budget: Budget | float, procs: list | None = None) -> dict:
    """One load_inline call built and published by a compile worker within ``budget`` (seconds of
    running, or a ``Budget``; its start-up included; the worker is killed then); its event (``error``
    set when the compiler failed or the arguments were refused). The compile worker joins ``procs``
    (what a suspension of the build that asked stops) while it runs."""
    if not isinstance(budget, Budget):
      budget = Budget(budget)
    procs = [] if procs is None else procs
    try:
      worker = await self.compile_pool.take()
    except WorkerStartError as e:
      raise _CompileWorkerLost(f"no compile worker: {e}") from e
    procs.append(worker)
    tag, report = uuid.uuid4().hex[:12], None
    try:
      await worker.wait_ready(min(120.0, budget.left()))
      job = BuildJob("", "", self.build_root, 0, self.split_build, self.use_pch, tmp_tag=tag)
      await worker.chan.send(dataclasses.replace(job, compile_request=params))
      never = asyncio.get_running_loop().create_future()  # a compile worker has no watchdog
      report = await _receive(worker, never, budget, BuildReport)
    except asyncio.TimeoutError:
      worker.kill("timeout")
      raise
    except (ChannelClosed, ProtocolError, WorkerStartError) as e:
      rc = await worker.ended(grace_s=2.0)
      raise _CompileWorkerLost(f"the compile worker ended ({describe_exit(rc)})") from e
    finally:
      if worker in procs:
        procs.remove(worker)
      worker.discard()
      if report is None:  # killed or lost mid-build: what it wrote stays unless removed here
        asyncio.get_running_loop().run_in_executor(
          None, build_cache.remove_tmp, self.build_root, tag
        )
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
