"""Pools of pre-started sandboxed workers: one per GPU (run stage) and one for CPU builds.

Every worker runs one job and exits, so a worker is always replaced after a CUDA error or a crash (and
after a clean run too: no candidate can leave patches behind for the next one). Start-up (python, torch
import, CUDA context) is hidden by keeping ``prewarm`` idle workers per device. A device has ``slots``
concurrent runs; a timed run takes all of them, so timing owns the GPU (reference doc section 4.4).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses

from verifier.sandbox import ForkServer, WorkerProcess


@dataclasses.dataclass
class PoolConfig:
  role: str  # "run" | "build"
  device: str  # "cuda" | "cpu"
  gpu_index: str = ""  # CUDA_VISIBLE_DEVICES value for run workers
  scratch_root: str = "/tmp/dice_verifier"
  mem_mb: int = 16384
  isolate_network: bool = True
  arch_list: str = ""
  max_jobs: int = 2
  slots: int = 1
  prewarm: int = 1
  fork_server: bool = (
    False  # run workers forked from a process that imported torch once (zygote.py)
  )


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


class WorkerPool:
  def __init__(self, cfg: PoolConfig):
    self.cfg = cfg
    self.slots = Slots(cfg.slots)
    self.idle: collections.deque[WorkerProcess] = collections.deque()
    self.starting: set[asyncio.Task] = set()
    self.closed = False
    self.jobs_done = 0
    self.crashes = 0
    self.fork_server = (
      ForkServer(
        role=cfg.role,
        device=cfg.device,
        gpu_index=cfg.gpu_index,
        scratch_root=cfg.scratch_root,
        mem_mb=cfg.mem_mb,
        isolate_network=cfg.isolate_network,
        arch_list=cfg.arch_list,
        max_jobs=cfg.max_jobs,
      )
      if cfg.fork_server
      else None
    )

  async def _start(self) -> WorkerProcess:
    c = self.cfg
    if self.fork_server is not None:
      worker = await self.fork_server.fork()
      if worker is not None:
        return worker
    return await WorkerProcess.start(
      role=c.role,
      device=c.device,
      gpu_index=c.gpu_index,
      scratch_root=c.scratch_root,
      mem_mb=c.mem_mb,
      isolate_network=c.isolate_network,
      arch_list=c.arch_list,
      max_jobs=c.max_jobs,
    )

  def _refill(self) -> None:
    while not self.closed and len(self.idle) + len(self.starting) < self.cfg.prewarm:
      task = asyncio.ensure_future(self._start())
      self.starting.add(task)
      task.add_done_callback(self._started)

  def _started(self, task: asyncio.Task) -> None:
    self.starting.discard(task)
    if task.cancelled() or task.exception() is not None:
      return
    if self.closed:
      task.result().discard()
    else:
      self.idle.append(task.result())

  async def warm(self, ready_timeout_s: float = 0.0) -> None:
    """Start the pre-started workers; with ``ready_timeout_s``, also wait (up to that long) until they have
    finished starting, so the first jobs do not wait for torch and CUDA start-up."""
    self._refill()
    if self.starting:
      await asyncio.gather(*self.starting, return_exceptions=True)
    deadline = asyncio.get_running_loop().time() + ready_timeout_s
    while (
      any(not w.ready() and w.alive() for w in self.idle)
      and asyncio.get_running_loop().time() < deadline
    ):
      await asyncio.sleep(0.1)

  async def _take(self) -> WorkerProcess:
    for w in [w for w in self.idle if not w.alive()]:
      self.idle.remove(w)
      w.discard()  # died while idle
    for w in self.idle:  # the oldest ready worker, else the oldest one still starting
      if w.ready():
        self.idle.remove(w)
        return w
    if self.idle:
      return self.idle.popleft()
    return await self._start()

  async def run_unslotted(self, job: dict, timeout_s: float) -> tuple[dict | None, str, str]:
    """A job outside the slot count (a short service task that must not queue behind candidates)."""
    worker = await self._take()
    self._refill()
    try:
      return await worker.run(job, timeout_s)
    finally:
      worker.discard()

  @property
  def free_slots(self) -> int:
    return self.slots.free

  async def run(
    self, job: dict, timeout_s: float, exclusive: bool = False, units: int = 1
  ) -> tuple[dict | None, str, str]:
    """Run one job on a fresh worker holding ``units`` slots (all of them when ``exclusive``)."""
    k = self.cfg.slots if exclusive else max(1, min(units, self.cfg.slots))
    await self.slots.acquire(k)
    try:
      worker = await self._take()
      self._refill()
      try:
        result, outcome, logs = await worker.run(job, timeout_s)
      finally:
        worker.discard()
      self.jobs_done += 1
      self.crashes += bool(outcome)
      return result, outcome, logs
    finally:
      await self.slots.release(k)

  async def close(self) -> None:
    self.closed = True
    await asyncio.gather(
      *self.starting, return_exceptions=True
    )  # spawning is quick; _started discards
    while self.idle:
      w = self.idle.popleft()
      w.discard()  # kills its process group
      try:
        await asyncio.wait_for(w.wait_exited(), 5)
      except asyncio.TimeoutError:
        pass
    if self.fork_server is not None:
      await self.fork_server.close()
