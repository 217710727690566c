"""The run stage of one candidate: a fresh candidate process and a checker, joined for one job.

The service never speaks on the candidate's channel: it hands the socket to the checker, watches the
candidate process from outside (wall-clock limit, host memory of its whole PID namespace, how it ended)
and combines that with the checker's report into one ``RunOutcome``. Whose fault an abnormal end was is
decided here: a limit the service enforced (TIMEOUT, OUT_OF_MEMORY), a signal the candidate raised on
itself (CRASH), or a kill from outside / a failed checker (infrastructure: retried once by the service,
then INTERNAL_ERROR). Once the candidate's code has run in the process, the process's own failures are
the candidate's (issue 24): closing its channel or its exchange descriptors, breaking the runtime so that
the worker exits with INTERNAL_EXIT, vanishing, or living on after its channel closed all give CRASH; a
kill that looks external is retried once and is the candidate's if it comes again (``suspect``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import time

from verifier.api.contract import FailureKind
from verifier.ipc.channel import ChannelClosed, ProtocolError
from verifier.ipc.records import INTERNAL_EXIT, CheckReport, RunJob
from verifier.sandbox.pool import DevicePool
from verifier.sandbox.sandbox import (
  ACCOUNTING_NOTE,
  CheckerClient,
  Worker,
  WorkerStartError,
  watch_resources,
)
from verifier.sandbox.task_limits import JobTasks, tasks_verdict

LINGER = "linger"  # the service killed a worker that outlived its channel by LINGER_S
LINGER_S = 2.0
# Signals a candidate does not raise by crashing: a kill from outside (an operator, the OOM killer).
EXTERNAL_SIGNALS = {signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT}


@dataclasses.dataclass(frozen=True)
class RunOutcome:
  kind: FailureKind
  reason: str
  report: CheckReport | None
  logs: str = ""
  infrastructure: bool = False  # not the candidate's doing: retry once
  # infrastructure, but the candidate's code had run in the process that died: its own if it comes again
  suspect: bool = False
  limit: str = ""  # why the service killed the candidate: "timeout" | "memory" | LINGER | ""
  startup_wait_s: float = 0.0
  check_s: float = 0.0  # wall time of the check (the job sent to the checker until its report)
  startup_phases: dict = dataclasses.field(default_factory=dict)
  sandbox_notes: tuple[str, ...] = ()
  tasks: dict = dataclasses.field(default_factory=dict)  # the job's task counts (JobTasks.counts)


def _limit_fate(worker) -> tuple[FailureKind, str, bool] | None:
  """The verdict for a worker the service killed on a limit ``_fate`` does not know (processes)."""
  if worker.killed_by == "processes":
    return FailureKind.RESOURCE_LIMIT, "process limit exceeded; the worker was killed", False
  return None


def _fate(worker, rc: int | None, stage: str, started: bool) -> tuple[FailureKind, str, bool]:
  """Kind, reason and whether it was infrastructure, for a candidate process that ended mid-check
  (``started``: after the candidate's code may have run in it)."""
  if worker.killed_by == "timeout":
    return (
      FailureKind.TIMEOUT,
      f"wall-clock limit hit during {stage or 'start-up'}; the worker was killed",
      False,
    )
  if worker.killed_by == "memory":
    return FailureKind.OUT_OF_MEMORY, "host memory limit exceeded; the worker was killed", False
  if rc is not None and rc < 0 and worker.killed_by != LINGER:
    sig = signal.Signals(-rc)
    if sig in EXTERNAL_SIGNALS:
      after = " after the candidate's code ran" if started else ""
      return (
        FailureKind.INTERNAL_ERROR,
        f"the worker was killed from outside ({sig.name}) during {stage}{after}",
        True,
      )
    return FailureKind.CRASH, f"worker killed by {sig.name} during {stage}", False
  if not started:
    if worker.killed_by == LINGER:
      return FailureKind.INTERNAL_ERROR, f"the worker hung during {stage} before the job", True
    if rc is None:
      return FailureKind.INTERNAL_ERROR, f"the worker vanished during {stage}", True
    if rc == INTERNAL_EXIT:
      return FailureKind.INTERNAL_ERROR, f"the worker's own code failed during {stage}", True
  return FailureKind.CRASH, _broken_worker(worker, rc, stage), False


def _broken_worker(worker, rc: int | None, stage: str) -> str:
  """Why a candidate's process that ended (or lingered) without finishing the check is the candidate's."""
  if worker.killed_by == LINGER:
    return (
      f"the candidate's process closed its channel during {stage} but did not exit within "
      f"{LINGER_S:.0f} s; the worker was killed"
    )
  if rc is None:
    return f"the candidate's process vanished during {stage} after its code ran"
  if rc == INTERNAL_EXIT:
    return (
      f"the worker's runtime failed during {stage} after the candidate's code ran (exit status "
      f"{rc}): the candidate broke its own process (channel, exchange buffers or descriptors)"
    )
  return f"worker exited with status {rc} during {stage} without finishing the check"


async def _ended(worker) -> int | None:
  """How the worker ended: ``LINGER_S`` to finish on its own (a crash still unwinding), then the
  service kills it (``killed_by`` LINGER); its exit status (negative: the signal)."""
  try:
    await asyncio.wait_for(worker.wait_exited(), LINGER_S)
  except asyncio.TimeoutError:
    worker.kill(LINGER)
    await worker.wait_exited()
  return await worker.returncode()


# What a candidate whose tasks the kernel refused ends with when it does not shrug the refusal off
# (``fork`` or ``pthread_create`` failing with EAGAIN): the refusal is the verdict's reason.
REFUSALS_EXPLAIN = frozenset({FailureKind.RUNTIME_ERROR, FailureKind.CRASH, FailureKind.INIT_ERROR})


def _cpu_clock(tasks: JobTasks, worker) -> str:
  """Where the checker reads the candidate's CPU time (``verifier.check.cpu_clock``): its job's cgroup,
  else the threads of its process (the namespace's PID 2, a child of PID 1)."""
  if tasks.cgroup is not None:
    return tasks.cgroup.cpu_clock()
  pids = worker.tree_pids()
  return f"threads:{pids[2]}" if len(pids) > 2 else ""


@dataclasses.dataclass
class _Held:
  """What one attempt holds until it gives it back: dropped at once if the attempt ends by an exception
  (``_abandon``)."""

  worker: Worker | None = None
  checker: CheckerClient | None = None
  tasks: JobTasks | None = None
  futures: tuple = ()  # the check and the watchdog


def _abandon(pool: DevicePool, job: RunJob, held: _Held) -> None:
  """An attempt ended by an exception: cancelled (its client went away), closed (its task destroyed with
  its loop: GeneratorExit, where nothing can be awaited any more) or a fault. Its check and watchdog are
  cancelled, its worker and checker killed and its task cgroup released, all without awaiting."""
  pool.running.pop(job.job_id, None)
  for f in held.futures:
    if not f.done():
      with contextlib.suppress(RuntimeError):  # its loop is closed: nothing left to cancel it in
        f.cancel()
  if held.worker is not None:
    held.worker.discard()  # kills its PID namespace
  if held.tasks is not None:
    held.tasks.close(pool.candidates.cgroups)  # a cgroup still emptying is removed later
  if held.checker is not None:
    held.checker.kill()


_REFILLS: set[asyncio.Task] = set()  # refills started by closed attempts (a task needs a reference)


def _running_loop() -> asyncio.AbstractEventLoop | None:
  try:
    return asyncio.get_running_loop()
  except RuntimeError:
    return None


async def _refill(pool: DevicePool, held: _Held, units: int) -> None:
  """After ``_abandon`` with a loop still running: a fresh checker in the killed one's place, the
  slots given back."""
  if held.checker is not None:
    await pool.checkers.abandoned(held.checker)
  await pool.slots.release(units)


async def run_once(pool: DevicePool, job: RunJob, units: int, ref_key: str) -> RunOutcome:
  """One attempt: take a worker and a checker, run the check, watch the worker, combine. An attempt
  cancelled or closed at any point leaves no process behind (``_abandon``)."""
  await pool.slots.acquire(units)
  held = _Held()
  released = False
  try:
    return await _attempt(pool, job, ref_key, held)
  except GeneratorExit:
    _abandon(pool, job, held)
    released = True
    loop = _running_loop()
    if loop is None:  # its loop is gone: no other job will run
      pool.slots.free += units
    else:  # closed while its loop runs (its task collected): the refill runs on its own
      refill = loop.create_task(_refill(pool, held, units))
      _REFILLS.add(refill)
      refill.add_done_callback(_REFILLS.discard)
    raise
  except BaseException:
    _abandon(pool, job, held)
    released = True
    await asyncio.shield(_refill(pool, held, units))  # completes even if cancelled again
    raise
  finally:
    if not released:
      await pool.slots.release(units)


async def _attempt(pool: DevicePool, job: RunJob, ref_key: str, held: _Held) -> RunOutcome:
  opts = job.options
  t_wait = time.monotonic()
  try:
    held.worker = await pool.candidates.take()
    ready = await held.worker.wait_ready(opts.timeout_s + 120)
  except WorkerStartError as e:
    if held.worker is not None:
      held.worker.discard()
      held.worker = None
    return RunOutcome(
      FailureKind.INTERNAL_ERROR, f"no candidate worker: {e}", None, infrastructure=True
    )
  worker = held.worker
  startup_wait = time.monotonic() - t_wait
  checker = held.checker = await pool.checkers.take(ref_key)
  stage = {"name": "start"}
  pool.running[job.job_id] = (worker, checker)
  tree = pool.candidates.cgroups
  tasks = held.tasks = await asyncio.to_thread(
    JobTasks.open, tree, worker.tree_pids(), pool.candidates.cfg.max_processes
  )
  if pool.cfg.cpu_clock:
    job = dataclasses.replace(job, cpu_clock=_cpu_clock(tasks, worker))
  t_check = time.monotonic()
  sock = worker.chan.detach()
  job = dataclasses.replace(job, worker_pid=worker.sandbox_pid)  # the checker samples its tree
  check = asyncio.ensure_future(checker.check(job, sock, lambda name: stage.update(name=name)))
  watch = asyncio.ensure_future(watch_resources(worker, tasks.polled(pool.candidates.limits)))
  held.futures = (check, watch)
  done, _ = await asyncio.wait(
    {check, watch}, timeout=opts.timeout_s, return_when=asyncio.FIRST_COMPLETED
  )
  if check not in done:
    if not done:
      worker.kill("timeout")
    try:
      # The candidate is gone: the checker notices at once, unless it is itself stuck (in reference
      # code, or a hung device).
      await asyncio.wait_for(asyncio.shield(check), 30)
    except asyncio.TimeoutError:
      pass
  watch.cancel()
  report = None
  checker_error = ""
  if check.done() and not check.cancelled():
    try:
      report = check.result()
    except (ChannelClosed, ProtocolError, OSError) as e:
      checker_error = f"{type(e).__name__}: {e}"
  else:
    check.cancel()
    checker_error = f"no report {30} s after the candidate was stopped"
  pool.running.pop(job.job_id, None)
  counts = await asyncio.to_thread(tasks.counts)  # before the kill: threads still running count
  if report is None or report.candidate_gone:
    rc = await _ended(worker)  # it may still be unwinding a crash: let it finish
  else:
    worker.kill()
    await worker.wait_exited()
    rc = await worker.returncode()
  logs = await asyncio.to_thread(worker.read_log)  # written by the candidate: not on the loop
  held.worker = held.tasks = None
  tasks.close(tree)
  worker.discard()
  kind, reason, infra, healthy = _combine(
    report, checker_error, stage["name"], worker, rc, watch, counts, job
  )
  if not healthy:
    logs += "\n[checker]\n" + checker.read_log()[-2000:]
  held.checker = None
  await asyncio.shield(
    pool.checkers.give_back(checker, ref_key, healthy)
  )  # done even if cancelled now
  pool.jobs_done += 1
  return RunOutcome(
    kind,
    reason,
    report,
    limit=worker.killed_by,
    check_s=time.monotonic() - t_check,
    logs=logs,
    infrastructure=infra,
    suspect=infra and bool(report and report.candidate_gone and report.candidate_started),
    startup_wait_s=startup_wait,
    startup_phases=dict(ready.startup_phases),
    sandbox_notes=(*ready.sandbox_notes, *pool.candidates.notes, ACCOUNTING_NOTE),
    tasks=counts,
  )


def _combine(report, checker_error: str, stage: str, worker, rc, watch, counts: dict, job: RunJob):
  """The verdict of an attempt from the checker's report (None: the checker failed), how the worker
  ended and its task counts: (kind, reason, infrastructure, whether the checker stays healthy)."""
  opts = job.options
  healthy = True
  if report is None:
    healthy = False
    if stage == "reference":
      kind, reason, infra = (
        FailureKind.REFERENCE_ERROR,
        f"the reference did not finish within {opts.timeout_s:.0f} s",
        False,
      )
    else:
      kind, reason, infra = FailureKind.INTERNAL_ERROR, f"checker failed: {checker_error}", True
  elif report.candidate_gone:
    kind, reason, infra = _limit_fate(worker) or _fate(
      worker, rc, report.stage, report.candidate_started
    )
    if worker.killed_by in ("memory", "processes") and watch.done() and not watch.cancelled():
      reason = watch.result()  # what the watchdog measured
  else:
    kind, reason, infra = report.kind, report.reason, report.infrastructure
    healthy = not report.infrastructure
    broken = tasks_verdict(counts, opts.strict.forbid_threads_streams, job.options.device)
    refused = broken is not None and broken[0] == FailureKind.RESOURCE_LIMIT.value
    if broken is not None and (kind is FailureKind.OK or (refused and kind in REFUSALS_EXPLAIN)):
      kind, reason = FailureKind(broken[0]), broken[1]
  return kind, reason, infra, healthy
