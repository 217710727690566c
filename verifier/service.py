"""The verification pipeline, independent of gRPC: static check -> build stage (CPU) -> run stage (GPU).

Builds run in their own pool of CPU workers so GPUs only run candidates that are already built; a build is
keyed by the hash of the candidate source and toolchain (identical candidates in a group build once, and
the ``load_inline``-level cache in ``build_cache`` shares extensions across candidates and hosts that
share ``cache_dir``). Request ids make retries idempotent: an id in flight or recently answered gets the
same result without new work. Reference timings are cached per (reference, device, timing options).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import math
import os
import time

from verifier import reward as rewards
from verifier.contract import FailureKind, Runtime, VerifyRequest, VerifyResult, truncate_log
from verifier.pool import PoolConfig, WorkerPool
from verifier.static_check import check_candidate


@dataclasses.dataclass
class ServiceConfig:
  device: str = "cuda"  # device used when a request does not name one
  gpus: tuple[str, ...] = ("0",)  # CUDA_VISIBLE_DEVICES index per run pool
  slots_per_gpu: int = 4  # concurrent reward-mode runs per GPU (timed runs take all)
  cpu_slots: int = 1  # concurrent runs of the CPU backend
  compile_workers: int = max(1, (os.cpu_count() or 2) // 2)
  cache_dir: str = os.path.join(os.path.expanduser("~"), ".cache", "dice_verifier", "builds")
  cache_max_gb: float = 100.0  # LRU eviction of build entries above this size (0: never)
  scratch_root: str = "/tmp/dice_verifier"
  mem_mb: int = 32768  # host memory per worker process group
  gpu_memory_fraction: float = 0.0  # caching-allocator cap per run worker (0: none)
  build_timeout_s: float = 900.0
  max_pending: int = 4096
  isolate_network: bool = True
  arch_list: str = ""  # TORCH_CUDA_ARCH_LIST for builds, e.g. "9.0"
  result_cache_size: int = 20000
  prewarm: bool = True
  run_prewarm: int = 0  # run workers kept starting per GPU (0: 3 x slots + 2). A run worker serves
  # one job; it took 16 s to start on a busy H200 host (torch, CUDA, CUPTI)
  fork_server: bool = (
    False  # run workers forked after one torch import (zygote.py; opt-in, see BUILD_NOTES)
  )
  warm_timeout_s: float = 120.0  # start() waits up to this long for pre-started workers to be ready
  build_only: bool = False  # a compile host: no GPU pools; serves build() only
  split_build: bool = True  # kernels compiled apart from the torch headers (split_build.py)
  use_pch: bool = True  # main.cpp on a precompiled torch header kept in cache_dir (pch.py)
  pch_background: bool = True  # build a missing PCH after the first build (off for one-shot runs)


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
  baselines_measured: int = 0
  cache_evicted: int = 0
  failure_kinds: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  run_phase_s: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  run_phase_n: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  build_s: list = dataclasses.field(default_factory=list)
  pch_builds: list = dataclasses.field(default_factory=list)

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


def _out_of_memory(res: dict | None, outcome: str) -> bool:
  if outcome.startswith("memory"):
    return False  # host-memory watchdog: the candidate's own doing
  if res is None:
    return False
  return res.get("kind") == FailureKind.OUT_OF_MEMORY.value or (
    res.get("kind") == FailureKind.REFERENCE_ERROR.value
    and "out of memory" in res.get("reason", "").lower()
  )


def admission_units(
  ref_peak_bytes: int,
  gpu_total_bytes: int,
  slots: int,
  factor: float = 3.0,
  overhead_bytes: int = 1 << 30,
) -> int:
  """GPU slots a run of this reference should hold: a run keeps the reference's inputs, outputs and model,
  the candidate's own and input clones alive at once, so it needs about ``factor`` times the reference's
  peak (measured by the worker after the golden forward) plus a CUDA context; a slot is 1/``slots`` of the
  device memory."""
  if ref_peak_bytes <= 0 or gpu_total_bytes <= 0 or slots <= 1:
    return 1
  need = factor * ref_peak_bytes + overhead_bytes
  return max(1, min(slots, math.ceil(need / (gpu_total_bytes / slots))))


def _sha(*parts: str) -> str:
  h = hashlib.sha256()
  for p in parts:
    h.update(p.encode())
    h.update(b"\0")
  return h.hexdigest()


class VerifierService:
  def __init__(self, cfg: ServiceConfig):
    self.cfg = cfg
    self.metrics = Metrics()
    self.build_pool: WorkerPool | None = None
    self.run_pools: dict[str, list[WorkerPool]] = {}
    self.inflight: dict[str, asyncio.Future] = {}
    self.answered: collections.OrderedDict[str, VerifyResult] = collections.OrderedDict()
    self.builds: collections.OrderedDict[str, asyncio.Future] = (
      collections.OrderedDict()
    )  # build verdicts by source
    self.new_builds = 0  # since the last cache eviction pass
    self.evicting: asyncio.Task | None = None
    self.baselines: dict[str, dict] = {}
    # Memory-aware admission: the first run of a reference measures its GPU peak; runs of the same
    # reference that arrive meanwhile wait for it, later ones hold slots in proportion (admission_units).
    self.ref_memory: dict[str, asyncio.Future] = {}
    self.baseline_runs: dict[str, asyncio.Future] = {}  # reference timings being measured now
    self.pch_builds: dict[str, asyncio.Task] = {}  # precompiled-header builds, one per flag set

  # ---- lifecycle -------------------------------------------------------------------------------
  def _pool(self, role: str, device: str, gpu: str, slots: int) -> WorkerPool:
    c = self.cfg
    return WorkerPool(
      PoolConfig(
        role=role,
        device=device,
        gpu_index=gpu,
        scratch_root=c.scratch_root,
        mem_mb=c.mem_mb,
        isolate_network=c.isolate_network,
        arch_list=c.arch_list,
        max_jobs=2,
        slots=slots,
        prewarm=self._prewarm(role, device, slots) if c.prewarm else 0,
        fork_server=c.fork_server and role == "run",
      )
    )

  def _prewarm(self, role: str, device: str, slots: int) -> int:
    if role == "build" or device == "cpu":
      return slots + (role == "run")
    return (
      self.cfg.run_prewarm or 3 * slots + 2
    )  # a CUDA run worker takes seconds to start (BUILD_NOTES)

  async def start(self) -> None:
    os.makedirs(self.cfg.cache_dir, exist_ok=True)
    self.build_pool = self._pool("build", self.cfg.device, "", self.cfg.compile_workers)
    if self.cfg.build_only:
      await self.build_pool.warm()
      return
    self.run_pools["cpu"] = [self._pool("run", "cpu", "", self.cfg.cpu_slots)]
    if self.cfg.device == "cuda":
      self.run_pools["cuda"] = [
        self._pool("run", "cuda", g, self.cfg.slots_per_gpu) for g in self.cfg.gpus
      ]
    pools = [self.build_pool] + [
      p for ps in self.run_pools.values() for p in ps if p.cfg.device == self.cfg.device
    ]
    await asyncio.gather(*(p.warm(self.cfg.warm_timeout_s) for p in pools))

  async def close(self) -> None:
    for t in self.pch_builds.values():
      t.cancel()
    await asyncio.gather(
      *self.pch_builds.values(), *([self.evicting] if self.evicting else []), return_exceptions=True
    )
    pools = ([self.build_pool] if self.build_pool else []) + [
      p for ps in self.run_pools.values() for p in ps
    ]
    await asyncio.gather(*(p.close() for p in pools))

  # ---- entry point -----------------------------------------------------------------------------
  async def verify(self, req: VerifyRequest) -> VerifyResult:
    if req.request_id in self.answered:
      self.metrics.deduplicated += 1
      return self.answered[req.request_id]
    if req.request_id in self.inflight:
      self.metrics.deduplicated += 1
      return await asyncio.shield(self.inflight[req.request_id])
    if self.metrics.pending >= self.cfg.max_pending:
      return VerifyResult(
        req.request_id,
        req.task_id,
        failure_kind=FailureKind.OVERLOADED,
        reason=f"queue full ({self.cfg.max_pending} pending); retry later",
      )
    fut = asyncio.get_running_loop().create_future()
    if req.request_id:
      self.inflight[req.request_id] = fut
    self.metrics.pending += 1
    try:
      result = await self._process(req)
    except Exception as e:  # noqa: BLE001 - the service must answer every request
      result = self._result(
        req, FailureKind.INTERNAL_ERROR, f"verifier error: {type(e).__name__}: {e}"
      )
    finally:
      self.metrics.pending -= 1
      self.inflight.pop(req.request_id, None)
    self.metrics.completed += 1
    self.metrics.failure_kinds[result.failure_kind.value] += 1
    if req.request_id:
      self.answered[req.request_id] = result
      while len(self.answered) > self.cfg.result_cache_size:
        self.answered.popitem(last=False)
    fut.set_result(result)
    return result

  async def build(self, req: VerifyRequest) -> VerifyResult:
    """Static check and build stage only; the extension lands in ``cache_dir`` for a GPU host to use."""
    try:
      req.validate()
    except ValueError as e:
      return self._result(req, FailureKind.INVALID_REQUEST, str(e))
    verdict = check_candidate(req.candidate_source, req.options.strict, req.options.device)
    if verdict.kind is not FailureKind.OK:
      return self._result(req, verdict.kind, verdict.reason, warnings=verdict.warnings)
    t0 = time.monotonic()
    build = await self._build(req)
    kind = FailureKind(build["kind"])
    return VerifyResult(
      request_id=req.request_id,
      task_id=req.task_id,
      compiled=kind is FailureKind.OK,
      failure_kind=kind,
      deceptive=kind.deceptive,
      reason=build.get("reason", ""),
      logs=build.get("logs", ""),
      compile_s=time.monotonic() - t0,
      build_cached=bool(build.get("cached")),
      warnings=verdict.warnings,
    )

  # ---- stages ----------------------------------------------------------------------------------
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
    if opts.device == "cuda" and "cuda" not in self.run_pools:
      return self._result(
        req, FailureKind.INVALID_REQUEST, "options.device is 'cuda' but this server has no GPUs"
      )
    verdict = check_candidate(req.candidate_source, opts.strict, opts.device)
    if verdict.kind is not FailureKind.OK:
      return self._result(req, verdict.kind, verdict.reason, warnings=verdict.warnings)

    # Build stage (CPU pool), shared by identical candidates.
    t0 = time.monotonic()
    build = await self._build(req)
    compile_s = time.monotonic() - t0
    if build["kind"] != FailureKind.OK.value:
      return self._result(
        req,
        FailureKind(build["kind"]),
        build["reason"],
        logs=build.get("logs", ""),
        compile_s=compile_s,
        warnings=verdict.warnings,
      )

    # Run stage (device pool).
    pools = self.run_pools[opts.device]
    pool = max(pools, key=lambda p: p.free_slots)
    base_key = _sha(
      req.reference_source,
      opts.device,
      pool.cfg.gpu_index,
      str(opts.num_perf_trials),
      str(opts.num_warmup),
      str(opts.compile_baseline),
      str(opts.seed),
    )
    job = {
      "reference_source": req.reference_source,
      "candidate_source": req.candidate_source,
      "options": opts.to_dict(),
      "build_root": self.cfg.cache_dir,
      "kernel_names": list(verdict.kernel_names),
      "baseline": None,
      "gpu_memory_fraction": self.cfg.gpu_memory_fraction,
      "split_build": self.cfg.split_build,
      "use_pch": self.cfg.use_pch,
    }
    self.metrics.in_run += 1
    try:
      res, outcome, logs = await self._run_admitted(
        pool, job, _sha(req.reference_source, pool.cfg.gpu_index), base_key, opts
      )
    finally:
      self.metrics.in_run -= 1
    if outcome:
      kind = (
        FailureKind.TIMEOUT
        if outcome.startswith("timeout")
        else FailureKind.OUT_OF_MEMORY
        if outcome.startswith("memory")
        else FailureKind.CRASH
      )
      return self._result(
        req,
        kind,
        outcome.split(": ", 1)[1],
        compiled=True,
        logs=logs,
        compile_s=compile_s,
        warnings=verdict.warnings,
      )
    kind = FailureKind(res["kind"])
    phases = dict(
      res.get("phases") or {},
      worker_startup_wait=res.get("startup_wait_s", 0.0),
      worker_startup=res.get("startup_s", 0.0),
      **(res.get("startup_phases") or {}),
    )
    for phase, sec in phases.items():
      self.metrics.run_phase_s[phase] += sec
      self.metrics.run_phase_n[phase] += 1
    cand, base = Runtime(**res.get("candidate", {})), Runtime(**res.get("baseline") or {})
    speedup = float(res.get("speedup", 0.0))
    kind2, why = rewards.apply_min_speedup(
      kind, speedup, opts.min_speedup, opts.measure_performance
    )
    reason = why or res.get("reason", "")
    warnings = tuple(verdict.warnings) + tuple(res.get("sandbox_notes", ()))
    return VerifyResult(
      request_id=req.request_id,
      task_id=req.task_id,
      compiled=bool(res.get("compiled")),
      correct=bool(res.get("correct")),
      deceptive=kind2.deceptive,
      reward=rewards.binary_reward(kind2),
      shaped_reward=rewards.shaped_reward(kind2, speedup),
      speedup=speedup,
      candidate=cand,
      baseline=base,
      failure_kind=kind2,
      reason=reason,
      logs=truncate_log(logs) if kind2 is not FailureKind.OK else "",
      strict_correct=bool(res.get("strict_correct")),
      max_abs_diff=float(res.get("max_abs_diff", 0.0)),
      warnings=warnings,
      compile_s=compile_s,
      run_s=float(res.get("run_s", 0.0)),
      build_cached=bool(build.get("cached")) or bool(res.get("build_cached")),
      device_name=str(res.get("device_name", "")),
    )

  async def _run_timed(
    self, pool: WorkerPool, job: dict, base_key: str, opts
  ) -> tuple[dict | None, str, str]:
    """A timed run owns the GPU. The reference is timed once per (reference, GPU, timing options): runs of
    the same reference that arrive while it is being measured wait for that baseline instead of re-timing it."""
    pending = self.baseline_runs.get(base_key)
    if pending is not None:
      await asyncio.shield(pending)
    job = dict(job, baseline=self.baselines.get(base_key))
    owner = job["baseline"] is None
    if owner:
      pending = self.baseline_runs[base_key] = asyncio.get_running_loop().create_future()
    try:
      res, outcome, logs = await pool.run(job, opts.timeout_s, exclusive=True)
      if not outcome and res.get("baseline_measured"):
        self.metrics.baselines_measured += 1
        if owner and res.get("kind") == FailureKind.OK.value:
          self.baselines[base_key] = res["baseline"]
      return res, outcome, logs
    finally:
      if owner:
        self.baseline_runs.pop(base_key, None)
        pending.set_result(None)

  async def _run_admitted(
    self, pool: WorkerPool, job: dict, mem_key: str, base_key: str, opts
  ) -> tuple[dict | None, str, str]:
    """Run stage with memory-aware admission (see ``self.ref_memory``) and one exclusive retry after an OOM
    that may be the over-commitment of a shared GPU rather than the candidate's fault."""
    if opts.measure_performance:
      return await self._run_timed(pool, job, base_key, opts)
    probe = self.ref_memory.get(mem_key)
    owner = probe is None
    if owner:
      probe = self.ref_memory[mem_key] = asyncio.get_running_loop().create_future()
    else:
      await asyncio.shield(probe)
    units = probe.result() if probe.done() else 1
    try:
      res, outcome, logs = await pool.run(job, opts.timeout_s, units=units)
    except BaseException:
      if owner and not probe.done():
        del self.ref_memory[mem_key]  # let the next run of this reference probe again
        probe.set_result(1)
      raise
    if owner:
      peak, total = (res or {}).get("ref_peak_bytes", 0), (res or {}).get("gpu_total_bytes", 0)
      if peak:
        probe.set_result(admission_units(peak, total, pool.cfg.slots))
      else:  # the reference never ran to its peak (e.g. a crash before): the next run probes again
        del self.ref_memory[mem_key]
        probe.set_result(1)
    if units < pool.cfg.slots and _out_of_memory(res, outcome):
      self.metrics.oom_retries += 1
      res, outcome, logs = await pool.run(job, opts.timeout_s, exclusive=True)
      peak = (res or {}).get("ref_peak_bytes", 0)
      if peak and mem_key not in self.ref_memory:
        learned = self.ref_memory[mem_key] = asyncio.get_running_loop().create_future()
        learned.set_result(admission_units(peak, res.get("gpu_total_bytes", 0), pool.cfg.slots))
    return res, outcome, logs

  def _maybe_evict(self, build: dict) -> None:
    """Every 32 new builds, trim the build cache to ``cache_max_gb`` (LRU, in a thread; build_cache.evict)."""
    self.new_builds += sum(
      1 for ev in build.get("builds", []) if not ev.get("cached") and not ev.get("error")
    )
    if (
      self.cfg.cache_max_gb <= 0
      or self.new_builds < 32
      or (self.evicting and not self.evicting.done())
    ):
      return
    self.new_builds = 0

    async def run():
      from verifier import build_cache

      out = await asyncio.to_thread(
        build_cache.evict, self.cfg.cache_dir, int(self.cfg.cache_max_gb * 2**30)
      )
      self.metrics.cache_evicted += out["removed"]

    self.evicting = asyncio.ensure_future(run())

  def _schedule_pch(self, request: dict) -> None:
    """Build a precompiled torch header in the background (once per flag set; pch.py)."""
    if not self.cfg.pch_background or request["dir"] in self.pch_builds or self.build_pool is None:
      return

    async def run():
      # Outside the build slots: queued behind a burst of candidates, it would come too late to help them.
      res, outcome, _ = await self.build_pool.run_unslotted(
        {"pch_request": request}, self.cfg.build_timeout_s
      )
      self.metrics.pch_builds.append({"dir": request["dir"], "outcome": outcome, **(res or {})})

    self.pch_builds[request["dir"]] = asyncio.ensure_future(run())

  async def _build(self, req: VerifyRequest) -> dict:
    key = _sha(req.candidate_source, self.cfg.arch_list, self.cfg.device)
    fut = self.builds.get(key)
    if fut is not None:
      self.metrics.build_cache_hits += 1
      return dict(await asyncio.shield(fut), cached=True)
    fut = asyncio.get_running_loop().create_future()
    self.builds[key] = fut
    self.metrics.in_build += 1
    try:
      job = {
        "reference_source": req.reference_source,
        "candidate_source": req.candidate_source,
        "options": req.options.to_dict(),
        "build_root": self.cfg.cache_dir,
        "split_build": self.cfg.split_build,
        "use_pch": self.cfg.use_pch,
      }
      res, outcome, logs = await self.build_pool.run(job, self.cfg.build_timeout_s)
      if outcome:
        kind = (
          FailureKind.TIMEOUT
          if outcome.startswith("timeout")
          else FailureKind.OUT_OF_MEMORY
          if outcome.startswith("memory")
          else FailureKind.CRASH
        )
        res = {
          "kind": kind.value,
          "reason": "build stage: " + outcome.split(": ", 1)[1],
          "logs": logs,
        }
      elif res["kind"] != FailureKind.OK.value:
        res["logs"] = logs
      for ev in (res or {}).get("builds", []):
        if ev.get("pch_request"):
          self._schedule_pch(ev["pch_request"])
        if not ev.get("cached") and not ev.get("error"):
          self.metrics.build_s.append(
            {
              "seconds": ev["seconds"],
              "fast": bool(ev.get("fast")),
              "split": bool(ev.get("split")),
              "pch": bool(ev.get("pch")),
              "split_error": ev.get("split_error", "")[:300],
              "fast_error": ev.get("fast_error", "")[:300],
            }
          )
      if res["kind"] not in (FailureKind.OK.value, FailureKind.COMPILE_ERROR.value):
        self.builds.pop(key, None)  # timeouts and crashes are not cached: a retry rebuilds
      fut.set_result(res)
      while (
        len(self.builds) > self.cfg.result_cache_size and next(iter(self.builds.values())).done()
      ):
        self.builds.popitem(last=False)
      self._maybe_evict(res)
      return res
    except BaseException as e:
      self.builds.pop(key, None)
      fut.set_exception(e)
      fut.exception()  # mark retrieved
      raise
    finally:
      self.metrics.in_build -= 1
