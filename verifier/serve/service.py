"""The verification pipeline, independent of gRPC: static check -> build stage (CPU) -> run stage (device).

Builds run in sandboxed CPU workers (``build_stage``) so devices only run candidates that are already
built. The run stage (``run_stage``) joins a fresh, confined candidate process with a long-lived checker
that owns the reference and the verdict. Request ids make retries idempotent (``request_table``);
reference timings are cached per (reference, device, timing options); GPU memory admission is learned per
reference (``admission``). Failures that are not the candidate's doing (a worker killed from outside, a
broken checker) are retried once and then reported as INTERNAL_ERROR; a candidate process killed by an
outside-looking signal after its code ran, on both attempts, is the candidate's CRASH
(``RunOutcome.suspect``). The static check reads candidate text in processes of its own under a deadline
(``static_worker``), never on the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import logging
import os
import shutil
import time

from verifier.api.contract import (
  LOG_LIMIT,
  FailureKind,
  Runtime,
  VerifyRequest,
  VerifyResult,
  truncate_log,
)
from verifier.build import artefact_check, fair_slots, pch
from verifier.build.build_stage import BuildOutcome, BuildStage
from verifier.ipc.records import RunJob, TimingCalibration
from verifier.sandbox import task_limits
from verifier.sandbox.pool import DevicePool, PoolConfig, WorkerPool
from verifier.serve import reward as rewards
from verifier.serve.admission import MemoryAdmission, admission_units
from verifier.serve.request_table import IdReused, RequestTable
from verifier.serve.run_stage import RunOutcome, run_once
from verifier.static.static_check import StaticVerdict
from verifier.static.static_worker import StaticCheckPool

log = logging.getLogger("verifier.serve.service")

__all__ = ["ServiceConfig", "VerifierService", "Metrics", "admission_units", "host_memory_mb"]


def host_memory_mb() -> int:
  """Physical memory of this host in MiB (``/proc/meminfo``)."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemTotal:"):
          return int(line.split()[1]) // 1024
  except (OSError, ValueError, IndexError):
    pass
  return 16384


def default_mem_mb() -> int:
  """Host memory a worker's process tree may use: half of this host's, at most 32 GiB."""
  return min(32768, max(1024, host_memory_mb() // 2))


def default_compile_workers() -> int:
  """Concurrent candidate builds: all CPUs but two (at least one). A split build on the precompiled
  header keeps about one core busy (main.cpp on the PCH, the kernels' .cu beside it), so half the
  CPUs left cores idle: on an H200 host (16 cores) 8 workers were build-bound at 50 DICE candidates
  a minute (docs/log.md, "Verifier: H200, session 6")."""
  return max(1, (os.cpu_count() or 2) - 2)


@dataclasses.dataclass
class ServiceConfig:
  device: str = "cuda"  # device used when a request does not name one
  gpus: tuple[str, ...] = ("0",)  # CUDA_VISIBLE_DEVICES index per run pool
  slots_per_gpu: int = 4  # concurrent reward-mode runs per GPU (timed runs take all)
  cpu_slots: int = 1  # concurrent runs of the CPU backend
  compile_workers: int = dataclasses.field(default_factory=default_compile_workers)
  cache_dir: str = os.path.join(os.path.expanduser("~"), ".cache", "dice_verifier", "builds")
  cache_max_gb: float = 100.0  # LRU eviction of build entries above this size (0: never)
  # below this much free disk under cache_dir, entries are evicted whatever their age (0: no floor)
  cache_min_free_gb: float = 2.0
  scratch_root: str = "/tmp/dice_verifier"
  mem_mb: int = dataclasses.field(default_factory=default_mem_mb)  # host memory per worker tree
  scratch_mb: int = 1024  # scratch quota per worker (a private tmpfs, on top of mem_mb)
  max_processes: int = 256  # tasks (processes and threads) a job may start beyond its runtime's
  # the CPU backend's clock for timed calls: "cpu" (the candidate's CPU time, check/cpu_clock.py) or
  # "wall" (the round trip, as on a GPU)
  cpu_timing_clock: str = "cpu"
  gpu_memory_fraction: float = 0.0  # caching-allocator cap per candidate process (0: none)
  build_timeout_s: float = (
    900.0  # cap on a build's deadline (the request's timeout_s, from its slot)
  )
  # a build that held a compile slot this long while another waits is suspended (fair_slots)
  compile_quantum_s: float = fair_slots.QUANTUM_S
  max_pending: int = 4096
  isolate_network: bool = True
  arch_list: str = ""  # TORCH_CUDA_ARCH_LIST for builds, e.g. "9.0"
  result_cache_size: int = 20000
  prewarm: bool = True
  run_prewarm: int = 0  # candidate workers kept starting per GPU (0: 3 x slots + 2)
  warm_timeout_s: float = 120.0  # start() waits up to this long for pre-started workers to be ready
  warm_profiler: bool = (
    True  # candidates start CUPTI before their job (needed by the strict preset)
  )
  checker_cache_mb: int = 4096  # tasks (inputs + golden outputs) a checker keeps in memory
  # CUDA candidates get the no-new-sockets filter too (after their CUDA context exists); the H200 GPU
  # tests pass with it (2026-12-01). Build, compile and CPU workers always have it.
  block_sockets_cuda: bool = True
  build_only: bool = False  # a compile host: no run pools; serves build() only
  split_build: bool = True  # kernels compiled apart from the torch headers (split_build.py)
  use_pch: bool = True  # main.cpp on a precompiled torch header kept in cache_dir (pch.py)
  pch_background: bool = True  # build a missing PCH after the first build (off for one-shot runs)
  # PCHs for at most this many flag sets in cache_dir, built one at a time: a candidate's own flags cost
  # a build worker and 0.1-1 GB each, so a stream of new ones must not take the host (builds beyond the
  # cap parse the headers as usual: same extension, slower)
  pch_max_flag_sets: int = 8
  static_workers: int = 2  # static-check processes (static_worker.py): candidate text is read there
  static_timeout_s: float = 10.0  # deadline of one static check (and at most the request's timeout)


@dataclasses.dataclass
class Metrics:
  started: float = dataclasses.field(default_factory=time.monotonic)
  completed: int = 0
  pending: int = 0
  in_build: int = 0
  in_run: int = 0
  build_cache_hits: int = 0
  deduplicated: int = 0
  oom_retries: int = 0
  infrastructure_retries: int = 0
  baselines_measured: int = 0
  cache_evicted: int = 0
  pch_refused: int = 0  # PCH requests past `pch_max_flag_sets`
  failure_kinds: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  run_phase_s: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  run_phase_n: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  build_s: list = dataclasses.field(default_factory=list)
  pch_builds: list = dataclasses.field(default_factory=list)
  transports: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  # jobs by how many tasks they held beyond their runtime's at the start (task_limits): what the
  # runtime itself starts later shows here (RUNTIME_TRANSIENT_TASKS)
  tasks_beyond_baseline: collections.Counter = dataclasses.field(
    default_factory=collections.Counter
  )

  def snapshot(self) -> dict:
    up = time.monotonic() - self.started
    return {
      "queue_depth": self.pending,
      "in_build": self.in_build,
      "in_run": self.in_run,
      "completed": self.completed,
      "candidates_per_minute": 60.0 * self.completed / max(up, 1e-9),
      "failure_kinds": dict(self.failure_kinds),
      "build_cache_hits": self.build_cache_hits,
      "deduplicated": self.deduplicated,
      "uptime_s": up,
      "oom_retries": self.oom_retries,
      "baselines_measured": self.baselines_measured,
      "cache_evicted": self.cache_evicted,
      "run_phase_mean_s": {k: self.run_phase_s[k] / self.run_phase_n[k] for k in self.run_phase_s},
    }


def _sha(*parts: str) -> str:
  h = hashlib.sha256()
  for p in parts:
    h.update(p.encode())
    h.update(b"\0")
  return h.hexdigest()


# Failures that are not the candidate's: their logs (the checker's, the service's paths) stay in the log.
HOST_SIDE_KINDS = frozenset(
  {
    FailureKind.OK,
    FailureKind.INTERNAL_ERROR,
    FailureKind.REFERENCE_ERROR,
    FailureKind.OVERLOADED,
    FailureKind.INVALID_REQUEST,
  }
)


LOGS_LABEL = "[output of the candidate's process and its compiler, head and tail]\n"


def returned_logs(kind: FailureKind, logs: str) -> str:
  """What of a worker's log goes back to the submitter: only for the candidate's own failures, capped
  (head and tail) and labelled. Workers cannot read the host beyond the toolchain (confine), so the
  log holds only what the candidate and its compiler printed."""
  if kind in HOST_SIDE_KINDS or not logs:
    return ""
  return LOGS_LABEL + truncate_log(logs, LOG_LIMIT - len(LOGS_LABEL))


def _oom(outcome: RunOutcome) -> bool:
  """An out-of-memory that may be the over-commitment of a shared GPU rather than the candidate's fault
  (the host-memory watchdog's kills are the candidate's own)."""
  if outcome.limit == "memory":
    return False
  report = outcome.report
  return outcome.kind is FailureKind.OUT_OF_MEMORY or bool(report and report.device_oom)


class VerifierService:
  def __init__(self, cfg: ServiceConfig):
    if cfg.cpu_timing_clock not in ("cpu", "wall"):
      raise ValueError(f"cpu_timing_clock must be 'cpu' or 'wall', got {cfg.cpu_timing_clock!r}")
    if cfg.pch_max_flag_sets < 0:
      raise ValueError(f"pch_max_flag_sets must be >= 0, got {cfg.pch_max_flag_sets}")
    self.cfg = cfg
    self.metrics = Metrics()
    self.build_stage: BuildStage | None = None
    self.run_pools: dict[str, list[DevicePool]] = {}
    self.requests = RequestTable(cfg.result_cache_size)
    self.admission = MemoryAdmission()
    self.baselines: dict[str, Runtime] = {}
    self.calibrations: dict[str, TimingCalibration] = {}  # the exchange's cost, per baseline key
    self.baseline_runs: dict[str, asyncio.Future] = {}  # reference timings being measured now
    self.new_builds = self.new_build_bytes = 0  # since the last cache eviction pass
    self.evicting: asyncio.Task | None = None
    self.pch_builds: dict[str, asyncio.Task] = {}  # precompiled-header builds, one per flag set
    self.pch_one_at_a_time = asyncio.Semaphore(1)
    self.static = StaticCheckPool(cfg.static_workers, cfg.static_timeout_s)
    self.cgroups: task_limits.CgroupTree | None = None  # a cgroup per job, where this host allows

  # ---- lifecycle -------------------------------------------------------------------------------
  def _pool_config(self, role: str, device: str, gpu: str, slots: int, prewarm: int) -> PoolConfig:
    c = self.cfg
    return PoolConfig(
      role=role,
      device=device,
      gpu_index=gpu,
      scratch_root=c.scratch_root,
      mem_mb=c.mem_mb,
      isolate_network=c.isolate_network,
      arch_list=c.arch_list,
      max_jobs=2,
      slots=slots,
      prewarm=prewarm if c.prewarm else 0,
      build_root=c.cache_dir,
      warm_profiler=c.warm_profiler,
      block_sockets_cuda=c.block_sockets_cuda,
      checker_cache_mb=c.checker_cache_mb,
      scratch_mb=c.scratch_mb,
      max_processes=c.max_processes,
      cpu_clock=c.cpu_timing_clock == "cpu",
    )

  async def start(self) -> None:
    c = self.cfg
    os.makedirs(c.cache_dir, exist_ok=True)
    await self.static.start()
    self.cgroups = task_limits.CgroupTree.create(
      task_limits.service_name(os.getpid(), f"{id(self):x}")
    )
    builds = WorkerPool(self._pool_config("build", "cpu", "", c.compile_workers, c.compile_workers))
    builds.use_cgroups(self.cgroups)
    compiles = WorkerPool(
      self._pool_config("compile", "cpu", "", c.compile_workers, c.compile_workers)
    )
    self.build_stage = BuildStage(
      builds,
      compiles,
      c.compile_workers,
      c.cache_dir,
      arch_list=c.arch_list,
      device=c.device,
      build_timeout_s=c.build_timeout_s,
      split_build=c.split_build,
      use_pch=c.use_pch,
      mem_mb=c.mem_mb,
      max_entries=c.result_cache_size,
      slot_quantum_s=c.compile_quantum_s,
    )
    if c.build_only:
      await asyncio.gather(builds.warm(), compiles.warm())
      return
    self.run_pools["cpu"] = [
      DevicePool(self._pool_config("candidate", "cpu", "", c.cpu_slots, c.cpu_slots + 1))
    ]
    if c.device == "cuda":
      prewarm = c.run_prewarm or 3 * c.slots_per_gpu + 2  # a CUDA worker takes seconds to start
      self.run_pools["cuda"] = [
        DevicePool(self._pool_config("candidate", "cuda", g, c.slots_per_gpu, prewarm))
        for g in c.gpus
      ]
    for p in (p for ps in self.run_pools.values() for p in ps):
      p.candidates.use_cgroups(self.cgroups)
    started = [p for ps in self.run_pools.values() for p in ps if p.cfg.device == c.device]
    await asyncio.gather(
      builds.warm(), compiles.warm(), *(p.start(c.warm_timeout_s) for p in started)
    )

  async def close(self) -> None:
    for t in self.pch_builds.values():
      t.cancel()
    await asyncio.gather(
      *self.pch_builds.values(), *([self.evicting] if self.evicting else []), return_exceptions=True
    )
    closing = [p.close() for ps in self.run_pools.values() for p in ps] + [self.static.close()]
    if self.build_stage is not None:
      closing += [self.build_stage.pool.close(), self.build_stage.compile_pool.close()]
    await asyncio.gather(*closing, return_exceptions=True)
    if self.cgroups is not None:
      self.cgroups.close()

  # ---- entry points ----------------------------------------------------------------------------
  async def verify(self, req: VerifyRequest) -> VerifyResult:
    t0 = time.monotonic()
    try:
      earlier, _ = self.requests.claim(req)
    except IdReused as e:
      return self._result(req, FailureKind.INVALID_REQUEST, str(e))
    if earlier is not None:
      self.metrics.deduplicated += 1
      return earlier if isinstance(earlier, VerifyResult) else await asyncio.shield(earlier)
    if self.metrics.pending >= self.cfg.max_pending:
      result = self._result(
        req,
        FailureKind.OVERLOADED,
        f"queue full ({self.cfg.max_pending} pending); retry later",
      )
      self.requests.fail(req, RuntimeError("overloaded"))
      return result
    self.metrics.pending += 1
    try:
      result = await self._process(req)
    except Exception as e:  # noqa: BLE001 - the service must answer every request
      log.exception("request %s failed inside the verifier", req.request_id)
      result = self._result(
        req, FailureKind.INTERNAL_ERROR, f"verifier error: {type(e).__name__}: {e}"
      )
    except BaseException as e:
      self.requests.fail(req, e)
      raise
    finally:
      self.metrics.pending -= 1
    self.metrics.completed += 1
    self.metrics.failure_kinds[result.failure_kind.value] += 1
    self.requests.answer(req, result)
    log.info(
      "request %s task %s: %s in %.1f s",
      req.request_id,
      req.task_id or "-",
      result.failure_kind.value,
      time.monotonic() - t0,
    )
    return result

  async def build(self, req: VerifyRequest) -> VerifyResult:
    """Static check and build stage only; the extension lands in ``cache_dir`` for a GPU host to use."""
    try:
      req.validate()
    except ValueError as e:
      return self._result(req, FailureKind.INVALID_REQUEST, str(e))
    verdict = await self._static_check(req)
    if verdict.kind is not FailureKind.OK:
      return self._result(req, verdict.kind, verdict.reason, warnings=verdict.warnings)
    build = await self._build(req)
    return VerifyResult(
      request_id=req.request_id,
      task_id=req.task_id,
      compiled=build.kind is FailureKind.OK,
      failure_kind=build.kind,
      deceptive=build.kind.deceptive,
      reason=build.reason,
      logs=returned_logs(build.kind, build.logs),
      compile_s=build.seconds,
      build_cached=build.cached,
      warnings=verdict.warnings,
    )

  # ---- stages ----------------------------------------------------------------------------------
  async def _static_check(self, req: VerifyRequest) -> StaticVerdict:
    """The static check, in a static-check process under its deadline (never on this event loop)."""
    o = req.options
    return await self.static.check(req.candidate_source, o.strictness, o.device, o.timeout_s)

  def _result(self, req: VerifyRequest, kind: FailureKind, reason: str = "", **kw) -> VerifyResult:
    kw.setdefault("compiled", kind.compiled)
    return VerifyResult(
      request_id=req.request_id,
      task_id=req.task_id,
      failure_kind=kind,
      deceptive=kind.deceptive,
      reason=reason,
      **kw,
    )

  async def _process(self, req: VerifyRequest) -> VerifyResult:
    try:
      req.validate()
    except ValueError as e:
      return self._result(req, FailureKind.INVALID_REQUEST, str(e))
    opts = req.options
    if self.cfg.build_only:
      return self._result(
        req, FailureKind.INVALID_REQUEST, "this is a build-only server: call Build, not Verify"
      )
    if opts.device not in self.run_pools or not self.run_pools[opts.device]:
      return self._result(
        req,
        FailureKind.INVALID_REQUEST,
        f"options.device is {opts.device!r} but this server has no GPUs",
      )
    verdict = await self._static_check(req)
    if verdict.kind is not FailureKind.OK:
      return self._result(req, verdict.kind, verdict.reason, warnings=verdict.warnings)

    build = await self._build(req)
    if build.kind is not FailureKind.OK:
      return self._result(
        req,
        build.kind,
        build.reason,
        logs=returned_logs(build.kind, build.logs),
        compile_s=build.seconds,
        warnings=verdict.warnings,
        compiled=False,
      )

    found = await asyncio.to_thread(
      artefact_check.check_build, self.cfg.cache_dir, build.events, opts.strict
    )
    if found is not None:
      return self._result(
        req, found.kind, found.reason, compile_s=build.seconds, warnings=verdict.warnings
      )

    pool = max(self.run_pools[opts.device], key=lambda p: p.free_slots)
    job = RunJob(
      job_id=req.request_id,
      reference_source=req.reference_source,
      candidate_source=req.candidate_source,
      options=opts,
      build_root=self.cfg.cache_dir,
      kernel_names=tuple(verdict.kernel_names),
      split_build=self.cfg.split_build,
      use_pch=self.cfg.use_pch,
      gpu_memory_fraction=self.cfg.gpu_memory_fraction,
    )
    self.metrics.in_run += 1
    try:
      outcome = await self._run(pool, job)
    finally:
      self.metrics.in_run -= 1
    return self._compose(req, verdict.warnings, build, outcome)

  async def _run(self, pool: DevicePool, job: RunJob) -> RunOutcome:
    """The run stage with its retries: once more after a failure that was not the candidate's doing."""
    first = outcome = await self._run_scheduled(pool, job)
    if outcome.infrastructure:
      self.metrics.infrastructure_retries += 1
      log.warning("request %s: %s; retrying once", job.job_id, outcome.reason)
      outcome = await self._run_scheduled(pool, job)
      if outcome.infrastructure and first.suspect and outcome.suspect:
        outcome = dataclasses.replace(
          outcome,
          kind=FailureKind.CRASH,
          infrastructure=False,
          reason="the candidate's process died the same way twice after its code ran: "
          + outcome.reason,
        )
      elif outcome.infrastructure:
        outcome = dataclasses.replace(
          outcome,
          kind=FailureKind.INTERNAL_ERROR,
          reason=f"infrastructure failure twice (not the candidate's doing): {outcome.reason}",
        )
    return outcome

  async def _run_scheduled(self, pool: DevicePool, job: RunJob) -> RunOutcome:
    opts = job.options
    ref_key = _sha(job.reference_source, pool.cfg.gpu_index)
    if opts.measure_performance:
      return await self._run_timed(pool, job, ref_key)
    units, owner = await self.admission.units(ref_key)
    try:
      outcome = await run_once(pool, job, units, ref_key)
    except BaseException:
      if owner:
        self.admission.learned(ref_key, 0, 0, pool.cfg.slots)
      raise
    report = outcome.report
    peak, total = (report.ref_peak_bytes, report.gpu_total_bytes) if report else (0, 0)
    if owner or peak:
      self.admission.learned(ref_key, peak, total, pool.cfg.slots)
    if units < pool.cfg.slots and _oom(outcome):
      self.metrics.oom_retries += 1
      log.info(
        "request %s: out of GPU memory on %d of %d slots (%s; reference peak %.1f GiB); "
        "again on the whole device",
        job.job_id,
        units,
        pool.cfg.slots,
        "first run of its reference" if owner else "estimate known",
        peak / 2**30,
      )
      outcome = await run_once(pool, job, pool.cfg.slots, ref_key)
    return outcome

  async def _run_timed(self, pool: DevicePool, job: RunJob, ref_key: str) -> RunOutcome:
    """A timed run owns the device. The reference is timed once per (reference, device, timing options):
    runs of the same reference that arrive while it is being measured wait for that baseline."""
    o = job.options
    base_key = _sha(
      ref_key, str(o.num_perf_trials), str(o.num_warmup), str(o.compile_baseline), str(o.seed)
    )
    pending = self.baseline_runs.get(base_key)
    if pending is not None:
      await asyncio.shield(pending)
    job = dataclasses.replace(
      job, baseline=self.baselines.get(base_key), calibration=self.calibrations.get(base_key)
    )
    owner = job.baseline is None
    if owner:
      pending = self.baseline_runs[base_key] = asyncio.get_running_loop().create_future()
    try:
      outcome = await run_once(pool, job, pool.cfg.slots, ref_key)
      report = outcome.report
      if report is not None and report.baseline_measured:
        self.metrics.baselines_measured += 1
        # Measured before any code of this candidate existed: kept whatever its verdict.
        if owner and report.baseline is not None:
          self.baselines[base_key] = report.baseline
      if report is not None and report.calibration_measured and report.calibration is not None:
        self.calibrations.setdefault(
          base_key, report.calibration
        )  # measured with no candidate code
      return outcome
    finally:
      if owner:
        self.baseline_runs.pop(base_key, None)
        pending.set_result(None)

  def _compose(self, req: VerifyRequest, static_warnings, build: BuildOutcome, outcome: RunOutcome):
    opts = req.options
    report = outcome.report
    phases = dict(report.phases if report else {})
    phases.update(outcome.startup_phases, worker_startup_wait=outcome.startup_wait_s)
    phases.update({f"tasks_{k}": float(v) for k, v in outcome.tasks.items()})
    if "baseline" in outcome.tasks:
      self.metrics.tasks_beyond_baseline[task_limits.tasks_beyond_baseline(outcome.tasks)] += 1
    for phase, sec in phases.items():
      self.metrics.run_phase_s[phase] += sec
      self.metrics.run_phase_n[phase] += 1
    if report is not None and report.transport:
      self.metrics.transports[report.transport] += 1
    speedup = report.speedup if report else 0.0
    kind, why = rewards.apply_min_speedup(
      outcome.kind, speedup, opts.min_speedup, opts.measure_performance
    )
    compiled = report.compiled if report and not report.candidate_gone else kind.compiled
    warnings = tuple(static_warnings) + tuple(outcome.sandbox_notes)
    warnings += tuple(report.warnings) if report else ()
    return VerifyResult(
      request_id=req.request_id,
      task_id=req.task_id,
      compiled=bool(compiled),
      correct=bool(report and report.correct and kind is not FailureKind.TIMING_MISMATCH),
      deceptive=kind.deceptive,
      reward=rewards.binary_reward(kind),
      shaped_reward=rewards.shaped_reward(
        kind,
        speedup,
        phases.get("timing_mean_speedup") if phases.get("timing_unmeasurable") == 1.0 else None,
      ),
      speedup=speedup if kind is FailureKind.OK else 0.0,
      candidate=(report.candidate if report else None) or Runtime(),
      baseline=(report.baseline if report else None) or Runtime(),
      failure_kind=kind,
      reason=why or outcome.reason,
      logs=returned_logs(kind, outcome.logs),
      strict_correct=bool(report and report.strict_correct),
      max_abs_diff=float(report.max_abs_diff) if report else 0.0,
      warnings=warnings,
      compile_s=build.seconds,
      run_s=outcome.check_s,
      build_cached=build.cached,
      device_name=report.device_name if report else "",
    )

  def _maybe_evict(self, build: BuildOutcome) -> None:
    """Trim the build cache to ``cache_max_gb`` and ``cache_min_free_gb`` (LRU, in a thread;
    build_cache.evict) every 32 new builds, every 1 GiB they added, and after any build while the disk
    is under its floor."""
    new = [ev for ev in build.events if not ev.get("cached") and not ev.get("error")]
    self.new_builds += len(new)
    self.new_build_bytes += sum(int(ev.get("bytes", 0)) for ev in new)
    if self.cfg.cache_max_gb <= 0 or (self.evicting and not self.evicting.done()):
      return
    floor = int(self.cfg.cache_min_free_gb * 2**30)
    if self.new_builds < 32 and self.new_build_bytes < 2**30:
      try:
        if not floor or shutil.disk_usage(self.cfg.cache_dir).free >= floor:
          return
      except OSError:
        return
    self.new_builds = self.new_build_bytes = 0

    async def run():
      from verifier.build import build_cache

      out = await asyncio.to_thread(
        build_cache.evict,
        self.cfg.cache_dir,
        int(self.cfg.cache_max_gb * 2**30),
        min_free_bytes=floor,
      )
      self.metrics.cache_evicted += out["removed"]

    self.evicting = asyncio.ensure_future(run())

  async def warm_pch(self) -> bool:
    """Builds the precompiled torch header of flag-less builds now rather than after the first of them
    (pch.seed_params): a compile worker builds the seed extension, then the PCH its build asks for. False
    when the PCH is off or the seed or the PCH failed to build (logged); True otherwise, also when the seed
    was already cached (its PCH was asked for then)."""
    if not self.cfg.use_pch or self.build_stage is None:
      return False
    t0 = time.monotonic()
    try:
      event = await self.build_stage.compile(
        pch.seed_params(self.cfg.device == "cuda"), self.cfg.build_timeout_s
      )
    except Exception as e:  # noqa: BLE001 - a warm-up that failed is logged, never fatal
      log.warning("PCH warm-up: the seed build failed: %s", e)
      return False
    if event.get("error"):
      log.warning("PCH warm-up: the seed build failed: %s", event["error"][:500])
      return False
    request = event.get("pch_request")
    if request is None:  # a cached seed, or one built on its ready PCH
      return True
    self._schedule_pch(request, background_only=False)
    await asyncio.shield(self.pch_builds[request["dir"]])
    ok = pch.ready(request["dir"])
    log.info("PCH warm-up: %s in %.1f s", "ready" if ok else "not built", time.monotonic() - t0)
    return ok

  def _schedule_pch(self, request: dict, background_only: bool = True) -> None:
    """Build a precompiled torch header in the background (once per flag set, one at a time, for at
    most `pch_max_flag_sets` flag sets in the cache; pch.py). The warm-up's (`background_only=False`)
    is never refused."""
    if background_only and not self.cfg.pch_background:
      return
    if request["dir"] in self.pch_builds or self.build_stage is None:
      return
    kept = pch.stored(self.cfg.cache_dir) | set(self.pch_builds)
    if background_only and len(kept - {request["dir"]}) >= self.cfg.pch_max_flag_sets:
      self.metrics.pch_refused += 1
      if self.metrics.pch_refused == 1:
        log.warning(
          "PCH for a new flag set not built: %d flag sets have one (pch_max_flag_sets); builds "
          "with other flags parse the torch headers each time",
          len(kept),
        )
      return

    async def run():
      async with self.pch_one_at_a_time:
        report = await self.build_stage.run_pch(request)
      outcome = "" if report is not None else "no report"
      self.metrics.pch_builds.append(
        {"dir": request["dir"], "outcome": outcome, **((report.pch or {}) if report else {})}
      )

    self.pch_builds[request["dir"]] = asyncio.ensure_future(run())

  async def _build(self, req: VerifyRequest) -> BuildOutcome:
    before = self.build_stage.flight.hits
    self.metrics.in_build += 1
    try:
      build = await self.build_stage.build(req)
    finally:
      self.metrics.in_build -= 1
    self.metrics.build_cache_hits += self.build_stage.flight.hits - before
    if not build.shared:
      for ev in build.events:
        if ev.get("pch_request"):
          self._schedule_pch(ev["pch_request"])
        if not ev.get("cached") and not ev.get("error"):
          self.metrics.build_s.append(
            {
              "seconds": ev.get("seconds", 0.0),
              "fast": bool(ev.get("fast")),
              "split": bool(ev.get("split")),
              "lean": bool(ev.get("lean")),
              "pch": bool(ev.get("pch")),
              "lean_error": ev.get("lean_error", "")[-300:],
              "split_error": ev.get("split_error", "")[-300:],
              "fast_error": ev.get("fast_error", "")[:300],
            }
          )
      self._maybe_evict(build)
    return build
