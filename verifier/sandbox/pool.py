"""Pools: pre-forked one-shot workers (candidates, builds or compiles) and long-lived checkers, per device.

Every worker runs one job and exits, so a worker is always replaced after a CUDA error or a crash (and
after a clean run too: no candidate can leave anything behind for the next one). Start-up (the fork, the
sandbox, the CUDA context, CUPTI) is hidden by keeping ``prewarm`` workers starting. A device has
``slots`` concurrent runs, each with its own checker; a timed run takes all slots, so timing owns the GPU
(as kernel verifiers such as KernelGYM and SandboxFusion isolate runs).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os

from verifier.sandbox.task_limits import CgroupTree
from verifier.sandbox.sandbox import (
  CheckerClient,
  ForkServerClient,
  Limits,
  Worker,
  WorkerStartError,
)


@dataclasses.dataclass
class PoolConfig:
  role: (
    str  # "candidate" | "build" (both run candidate code) | "compile" (runs none; writes the cache)
  )
  device: str  # "cuda" | "cpu"
  gpu_index: str = ""  # CUDA_VISIBLE_DEVICES value for candidates and checkers
  scratch_root: str = "/tmp/dice_verifier"
  mem_mb: int = 16384
  isolate_network: bool = True
  arch_list: str = ""
  max_jobs: int = 2  # MAX_JOBS (ninja) for builds
  slots: int = 1
  prewarm: int = 1
  build_root: str = (
    ""  # the build cache: writable for compile workers only, readable for the others
  )
  warm_profiler: bool = True  # candidates start CUPTI before their job (the runtime check needs it)
  block_sockets_cuda: bool = True  # seccomp socket filter for CUDA candidates too (others: always)
  checker_cache_mb: int = 2048
  checker_max_jobs: int = 500  # a checker is replaced after this many jobs (0: never)
  scratch_mb: int = 1024  # each worker's scratch quota (a private tmpfs: counts as host memory)
  max_processes: int = 256  # tasks a job may start (a cgroup, RLIMIT_NPROC or pid_max; 0: no limit)
  cpu_clock: bool = True  # the CPU backend times candidates by their CPU time (check/cpu_clock.py)


class Slots:
  """A counting semaphore where one acquirer may take several units (timed runs take all). While a
  multi-unit acquirer waits, single-unit acquirers queue behind it, so timed runs do not starve."""

  def __init__(self, n: int):
    self.total, self.free = n, n
    self.big_waiting = 0
    self.cond = asyncio.Condition()

  async def acquire(self, k: int) -> None:
    async with self.cond:
      if k > 1:
        self.big_waiting += 1
        try:
          await self.cond.wait_for(lambda: self.free >= k)
        finally:
          self.big_waiting -= 1
      else:
        await self.cond.wait_for(lambda: self.free >= k and self.big_waiting == 0)
      self.free -= k

  async def release(self, k: int) -> None:
    async with self.cond:
      self.free += k
      self.cond.notify_all()


# Confinement levels a pool steps down through when its workers cannot start (each step is reported).
CONFINEMENT_LEVELS = (
  ("full", True, True),
  ("without Landlock", True, False),
  ("without Landlock and the mount namespace", False, False),
)


class WorkerPool:
  """Workers of one role forked from one fork server, ``prewarm`` of them kept starting.

  Before prewarming, one worker must start (CUDA context, cuBLAS, the profiler) under full confinement; if
  it cannot, the pool steps down a level (``CONFINEMENT_LEVELS``) and says so in ``notes``, which every
  result of the pool carries, rather than failing every candidate."""

  def __init__(self, cfg: PoolConfig):
    self.cfg = cfg
    self.server = ForkServerClient(
      device=cfg.device,
      gpu_index=cfg.gpu_index,
      scratch_root=cfg.scratch_root,
      isolate_network=cfg.isolate_network,
      arch_list=cfg.arch_list,
      max_jobs=cfg.max_jobs,
    )
    self.idle: collections.deque[Worker] = collections.deque()
    self.starting: set[asyncio.Task] = set()
    self.closed = False
    self.start_failures = 0
    self.level = 0
    self.notes: list[str] = []
    self.cgroups: CgroupTree | None = None  # the service's, for a cgroup per job (task_limits)

  async def self_test(self, timeout_s: float = 300.0) -> None:
    """Start one worker under each confinement level until one becomes ready."""
    while True:
      name = CONFINEMENT_LEVELS[self.level][0]
      worker = None
      try:
        worker = await self.fork()
        await worker.wait_ready(timeout_s)
        return
      except WorkerStartError as e:
        log = worker.read_log()[-600:] if worker is not None else ""
        if self.level + 1 >= len(CONFINEMENT_LEVELS):
          self.notes.append(f"{self.cfg.role} workers do not start even {name}: {e} {log}")
          return
        self.level += 1
        self.notes.append(
          f"confinement degraded: {self.cfg.role} workers did not start with confinement {name} "
          f"({e}; log: {log.strip()[-300:]}); now {CONFINEMENT_LEVELS[self.level][0]}"
        )
      finally:
        if worker is not None:
          worker.discard()

  async def fork(self) -> Worker:
    c = self.cfg
    if c.role == "compile":
      writable, readable = (c.build_root,), ()
    else:  # candidate code never runs where the cache is writable (build_main)
      writable, readable = (), (c.build_root,)
    return await self.server.fork(
      c.role,
      writable=tuple(p for p in writable if p),
      readable=tuple(p for p in readable if p),
      mem_mb=c.mem_mb,
      warm_profiler=c.warm_profiler,
      mount_namespace=CONFINEMENT_LEVELS[self.level][1],
      landlock=CONFINEMENT_LEVELS[self.level][2],
      block_sockets=not (c.role == "candidate" and c.device == "cuda") or c.block_sockets_cuda,
      scratch_mb=c.scratch_mb,
      max_tasks=c.max_processes,
      nproc_limit=c.max_processes if self.cgroups is None and os.geteuid() != 0 else 0,
    )

  def use_cgroups(self, tree: CgroupTree | None) -> None:
    """Tasks of this pool's jobs capped by a cgroup of ``tree`` each (``task_limits``); the note every
    result carries says what caps them."""
    self.cgroups = tree
    limit = self.cfg.max_processes
    if tree is not None:
      how = f"a pids cgroup per job (cgroup v{tree.version}): the tasks it starts capped at {limit}"
    elif os.geteuid() != 0:
      how = f"RLIMIT_NPROC in each worker's own user namespace ({limit} + its runtime's)"
    else:
      how = f"its PID namespace's pid_max ({limit} + 300; no cgroup here: {CgroupTree.why})"
    self.notes.append(f"tasks (processes and threads) limited by the kernel: {how}")

  @property
  def limits(self) -> Limits:
    """What the service watches on each worker of this pool from outside."""
    return Limits(mem_mb=self.cfg.mem_mb, max_processes=self.cfg.max_processes)

  def _refill(self) -> None:
    while not self.closed and len(self.idle) + len(self.starting) < self.cfg.prewarm:
      task = asyncio.ensure_future(self.fork())
      self.starting.add(task)
      task.add_done_callback(self._started)

  def _started(self, task: asyncio.Task) -> None:
    self.starting.discard(task)
    if task.cancelled():
      return
    if task.exception() is not None:
      self.start_failures += 1
      return
    if self.closed:
      task.result().discard()
    else:
      self.idle.append(task.result())

  async def warm(self, ready_timeout_s: float = 0.0) -> None:
    """Start the pre-started workers; with ``ready_timeout_s``, also wait (up to that long) until they have
    finished starting, so the first jobs do not wait for torch and CUDA start-up."""
    if self.cfg.prewarm > 0:
      await self.self_test()
    self._refill()
    if self.starting:
      await asyncio.gather(*self.starting, return_exceptions=True)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ready_timeout_s
    while any(not w.ready() and w.alive() for w in self.idle) and loop.time() < deadline:
      await asyncio.sleep(0.05)

  async def take(self) -> Worker:
    """A worker, ready ones first (the oldest), else the oldest still starting, else a new fork."""
    for w in [
      w
      for w in self.idle
      if not w.alive() or (w.ready_task and w.ready_task.done() and not w.ready())
    ]:
      self.idle.remove(w)
      w.discard()  # died while idle
    try:
      for w in self.idle:
        if w.ready():
          self.idle.remove(w)
          return w
      if self.idle:
        return self.idle.popleft()
      return await self.fork()
    finally:
      self._refill()

  async def close(self) -> None:
    self.closed = True
    await asyncio.gather(*self.starting, return_exceptions=True)
    while self.idle:
      w = self.idle.popleft()
      w.discard()
      try:
        await asyncio.wait_for(w.wait_exited(), 5)
      except asyncio.TimeoutError:
        pass
    await self.server.close()


class CheckerPool:
  """``n`` long-lived checkers; a job prefers one that served the same reference lately (its cache)."""

  def __init__(self, cfg: PoolConfig, n: int):
    self.cfg, self.n = cfg, n
    self.free: list[CheckerClient] = []
    self.cond = asyncio.Condition()
    self.restarts = 0

  def _new(self) -> CheckerClient:
    c = self.cfg
    return CheckerClient(
      device=c.device,
      gpu_index=c.gpu_index,
      scratch_root=c.scratch_root,
      cache_mb=c.checker_cache_mb,
      max_jobs=c.checker_max_jobs,
    )

  async def start(self) -> None:
    checkers = [self._new() for _ in range(self.n)]
    await asyncio.gather(*(c.start() for c in checkers))
    self.free = checkers

  async def take(self, key: str) -> CheckerClient:
    async with self.cond:
      await self.cond.wait_for(lambda: bool(self.free))
      pick = next((c for c in self.free if key in c.recent), self.free[0])
      self.free.remove(pick)
    if not pick.alive():
      pick = await self._replace(pick)
    return pick

  async def _replace(self, checker: CheckerClient) -> CheckerClient:
    await checker.close()
    self.restarts += 1
    fresh = self._new()
    await fresh.start()
    return fresh

  async def give_back(self, checker: CheckerClient, key: str, healthy: bool) -> None:
    if healthy and checker.alive():
      checker.recent = ([key] + [k for k in checker.recent if k != key])[:2]
    else:
      try:
        checker = await self._replace(checker)
      except WorkerStartError:
        checker = self._new()  # started lazily by the next take()
    async with self.cond:
      self.free.append(checker)
      self.cond.notify_all()

  async def abandoned(self, checker: CheckerClient) -> None:
    """A checker whose job was abandoned mid-check (its channel mid-exchange): closed, and a fresh one,
    started by the next ``take``, takes its place (nothing is left starting when the service closes)."""
    await checker.close()
    async with self.cond:
      self.free.append(self._new())
      self.cond.notify_all()

  async def close(self) -> None:
    await asyncio.gather(*(c.close() for c in self.free), return_exceptions=True)
    self.free = []


class DevicePool:
  """One GPU (or the CPU backend): slots, candidate workers and checkers."""

  def __init__(self, cfg: PoolConfig):
    self.cfg = cfg
    self.slots = Slots(cfg.slots)
    self.candidates = WorkerPool(cfg)
    self.checkers = CheckerPool(cfg, cfg.slots)
    self.jobs_done = 0
    self.running: dict[str, tuple[Worker, CheckerClient]] = {}  # job id -> its worker and checker

  @property
  def free_slots(self) -> int:
    return self.slots.free

  async def start(self, ready_timeout_s: float) -> None:
    """On a GPU the checkers (unconfined, trusted) initialise CUDA before the first confined candidate
    worker does: the first ``cuInit`` on a fresh host creates the driver's device nodes
    (``/dev/nvidia-uvm`` through the setuid ``nvidia-modprobe``), which a worker cannot (read-only
    ``/dev``, no new privileges): its CUDA start failed with error 304 and the pool stepped down to no
    Landlock (H200, sessions 11 and 12, docs/performance.md)."""
    if self.cfg.device == "cuda":
      await self.checkers.start()
      await self.candidates.warm(ready_timeout_s)
      return
    await asyncio.gather(self.checkers.start(), self.candidates.warm(ready_timeout_s))

  async def close(self) -> None:
    await asyncio.gather(self.candidates.close(), self.checkers.close())
